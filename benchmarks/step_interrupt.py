"""How long an online request waits for a batch-only step in flight (issue 36), in process.

Runs the built-in model with ``--rows`` background (Batch API) requests decoding, then, for
``--arrivals`` steps, sets the engine's ``StepInterrupt`` flag from another thread at a random
moment of the step (as ``AsyncLLMEngine`` does when it queues an online request) and measures
the time from that moment to the step's return. ``--off`` only records the moment (the flag is
never set): the wait before the change. ``--eager`` runs the Python layers instead of the C++
decode loop.

    python benchmarks/step_interrupt.py --threads 2
    python benchmarks/step_interrupt.py --threads 2 --off
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import threading
import time

from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--arrivals", type=int, default=30)
    p.add_argument("--off", action="store_true", help="never set the flag")
    p.add_argument("--eager", action="store_true", help="the Python layers, not the C++ loop")
    args = p.parse_args()
    engine = LLMEngine(build_engine_config(None, enforce_eager=args.eager,
                                           num_threads=args.threads))  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=4 * args.arrivals + 40, ignore_eos=True)
    for i in range(args.rows):
        request = engine.processor.process({"prompt_token_ids": list(range(10 + i, 40 + i))},
                                           sp, 0)  # fmt: skip
        engine.add_validated(str(i), dataclasses.replace(request, background=True))
    for _ in range(3):  # the prefill, then decode steps only
        engine.step()
    full = []
    for _ in range(args.arrivals):
        t0 = time.perf_counter()
        engine.step()
        full.append(time.perf_counter() - t0)
    step = statistics.median(full)
    pick = random.Random(0)
    waits = []
    for _ in range(args.arrivals):
        at: dict[str, float] = {}
        delay = pick.uniform(0, step)

        def arrive(delay: float = delay, at: dict[str, float] = at) -> None:
            time.sleep(delay)
            at["t"] = time.perf_counter()
            if not args.off:
                engine.step_interrupt.set()

        thread = threading.Thread(target=arrive)
        thread.start()
        engine.step()
        end = time.perf_counter()
        thread.join()
        engine.step_interrupt.clear()
        waits.append(max(0.0, end - at["t"]))  # 0: it arrived after the step ended
    loop = engine.runner.model.decode_loop is not None  # type: ignore[union-attr]
    print(f"C++ decode loop: {loop}; step median {step * 1e3:.1f} ms; arrival -> step end "
          f"median {statistics.median(waits) * 1e3:.2f} ms, max {max(waits) * 1e3:.2f} ms; "
          f"steps given up {engine.scheduler.stats.num_background_steps_interrupted}")  # fmt: skip


if __name__ == "__main__":
    main()
