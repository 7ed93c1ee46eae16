"""Why experiment 9's throughput rises under priority scheduling: the queue's order sets the
run's tail.

At rate inf all of a run's requests wait at once and ``max_num_seqs`` of them run at a time;
with ``ignore_eos`` every request runs exactly its sample's length. The run ends when its
last request does, and a long request admitted late leaves the batch nearly empty while it
finishes alone. This replays that as list scheduling: ``max_num_seqs`` lanes, each free lane
takes the next request in queue order, one decode step per token (prefill left out), and
prints the makespan in decode steps under FCFS (arrival order) and under priority order
(the lab's ``--priority-mix`` classes, then arrival order)::

    python benchmarks/study/makespan.py        # experiment 9's samples, seed 0
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections.abc import Sequence
from pathlib import Path


def makespan(lengths: Sequence[int], order: Sequence[int], lanes: int) -> int:
    """Decode steps until the last request ends when ``lanes`` run at a time, each free lane
    taking the next of ``order`` (indices into ``lengths``)."""
    if lanes < 1:
        raise ValueError("lanes must be positive")
    free = [0] * lanes  # the step at which each lane is next free
    end = 0
    for i in order:
        start = heapq.heappop(free)
        heapq.heappush(free, start + lengths[i])
        end = max(end, start + lengths[i])
    return end


def priority_order(priorities: Sequence[int]) -> list[int]:
    """The queue of a priority scheduler with everything waiting: class, then arrival."""
    return sorted(range(len(priorities)), key=lambda i: (priorities[i], i))


def main(argv: list[str] | None = None) -> int:
    repo = Path(__file__).resolve().parents[2]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from transformers import AutoTokenizer

    from benchmarks.study.experiments import model_folder
    from benchmarks.study.second_wave import Exp9Config
    from benchmarks.study.workloads import chatterbot_samples
    from kvserve.bench import priority

    cfg = Exp9Config()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(model_folder(None))
    samples = chatterbot_samples(tokenizer, cfg.num_prompts, args.seed, cfg.max_output_len)
    lengths = [s.expected_output_len for s in samples]
    mix = priority.parse_priority_mix(cfg.priority_mix)
    classes = priority.assign_priorities(mix, len(samples), args.seed)
    fcfs = makespan(lengths, range(len(lengths)), cfg.max_num_seqs)
    prio = makespan(lengths, priority_order(classes), cfg.max_num_seqs)
    floor = -(-sum(lengths) // cfg.max_num_seqs)
    print(f"{len(lengths)} requests, {sum(lengths)} output tokens, {cfg.max_num_seqs} lanes: "
          f"at least {floor} decode steps")  # fmt: skip
    print(f"FCFS: {fcfs} steps; priority: {prio} steps; FCFS / priority = {fcfs / prio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
