"""Peak resident memory (VmHWM) of kvserve with bf16, int8, int4 and GGUF weights.

Each setting runs alone in a fresh process, as ``benchmarks/quantization.py`` starts its
servers (the same KV cache: 64 slots of 256 tokens, ``--kv-cache-memory 369098752``):

* ``serve`` (default): ``kvserve serve`` is started, waited for, sent one 16-token
  completion, and its peak and current RSS read from ``/proc/<pid>/status``;
* ``load``: a child process only calls ``load_model`` (what ``serve`` loads: bf16, prepacked,
  fused ops) and prints its peak RSS after the load, the weights without the KV cache and the
  warm-up.

The model is the TinyLlama-shaped random Llama of ``benchmarks/quantization.py`` (its GGUFs
come from ``benchmarks/peers/llamacpp.py``; a GGUF's float32 folder is converted on first use,
outside the measured run)::

    python benchmarks/load_memory.py                        # serve, every setting
    python benchmarks/load_memory.py --mode load --settings int4,gguf-q4_0
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from benchmarks.peers import llamacpp  # noqa: E402
from benchmarks.quantization import memory_mib  # noqa: E402

SETTINGS = {  # key -> (--quantization, GGUF type served or None, --quantization-lm-head)
    "bf16": (None, None, False),
    "int8": ("int8", None, False),
    "int4": ("int4", None, False),
    "int4-lmhead": ("int4", None, True),
    "gguf-q8_0": ("gguf", "Q8_0", False),
    "gguf-q4_0": ("gguf", "Q4_0", False),
    "gguf-q4_0-lmhead": ("gguf", "Q4_0", True),
    "gguf-q4_k_m-lmhead": ("gguf", "Q4_K_M", True),
    "gguf-q5_k_m-lmhead": ("gguf", "Q5_K_M", True),
}
SERVE_FLAGS = ["--max-num-seqs", "64", "--max-model-len", "256",
               "--kv-cache-memory", "369098752"]  # fmt: skip


def model_source(model: Path, setting: str) -> Path:
    """The folder, or the GGUF file, that ``setting`` serves."""
    gguf_type = SETTINGS[setting][1]
    if gguf_type is None:
        return model
    return llamacpp.bench_models_dir() / "gguf" / model.name / f"model-{gguf_type}.gguf"


def serve_peak(source: Path, setting: str, threads: int, log_dir: Path) -> dict[str, Any]:
    """Start ``kvserve serve`` on ``source``, send one request, read its memory, stop it."""
    import httpx

    from kvserve.bench.sweep import ServerProcess, free_port

    port = free_port()
    method, _, lm_head = SETTINGS[setting]
    cmd = [
        sys.executable, "-m", "kvserve.cli", "serve", str(source), "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
        "--num-threads", str(threads), *SERVE_FLAGS, "--no-access-log",
        *(["--quantization", method] if method else []),
        # explicit both ways: unset, a GGUF's own head is kept quantized (lm_head.py)
        *(["--quantization-lm-head" if lm_head else "--no-quantization-lm-head"]
          if method else []),
    ]  # fmt: skip
    proc = ServerProcess(cmd, log_dir / f"{setting}.log")
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc.start()
    try:
        proc.wait_healthy(url, 900.0)
        ready_s = time.monotonic() - t0
        body = {"model": "m", "prompt": "hello", "max_tokens": 16, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0, trust_env=False)
        r.raise_for_status()
        assert proc.proc is not None
        return {"command": cmd, "ready_s": ready_s, **memory_mib(proc.proc.pid)}
    finally:
        proc.stop()


def load_peak(source: Path, setting: str) -> dict[str, Any]:
    """``load_model`` alone in a child process (``--child``); its peak RSS after the load."""
    cmd = [sys.executable, __file__, "--child", setting, "--model", str(source)]
    t0 = time.monotonic()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {"command": cmd, "ready_s": time.monotonic() - t0, **json.loads(out.splitlines()[-1])}


def child(source: Path, setting: str) -> None:
    """Load the model as ``serve`` would (bf16, prepacked, fused ops) and print memory."""
    import torch

    from kvserve.config import Quantization
    from kvserve.model.builtin import resolve_model
    from kvserve.model.loader import load_model
    from kvserve.quantization.apply import QuantOptions

    method, gguf_type, lm_head = SETTINGS[setting]
    folder, _ = resolve_model(source)  # a GGUF: its converted folder (cached)
    gguf = str(source) if gguf_type else None
    quant = QuantOptions(Quantization(method), None, gguf, lm_head=lm_head) if method else None
    before = memory_mib(os.getpid())["peak_rss_mib"]
    model = load_model(folder, torch.bfloat16, "cpu", 256, prepack=True, fused_ops=True,
                       quant=quant)  # fmt: skip
    print(json.dumps({"start_rss_mib": before, **memory_mib(os.getpid())}))
    del model  # alive until its RSS is read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path,
                    default=llamacpp.bench_models_dir() / "tinyllama-random")  # fmt: skip
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma list of settings")
    ap.add_argument("--mode", choices=("serve", "load"), default="serve")
    ap.add_argument("--threads", type=int, default=1, help="server threads")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model, args.child)
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for setting in args.settings.split(","):
            source = model_source(args.model, setting)
            if SETTINGS[setting][1]:
                from kvserve.model.builtin import resolve_model

                resolve_model(source)  # convert once, outside the measured process
            if args.mode == "serve":
                row = serve_peak(source, setting, args.threads, Path(logs))
            else:
                row = load_peak(source, setting)
            rows.append({"setting": setting, **row})
            print(f"{setting}: peak RSS {row['peak_rss_mib']:.0f} MiB, RSS "
                  f"{row['rss_mib']:.0f} MiB, {row['ready_s']:.0f} s", flush=True)  # fmt: skip
    print("\n| setting | peak RSS MiB | RSS after MiB |\n|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['peak_rss_mib']:.0f} | {r['rss_mib']:.0f} |")
    date = datetime.date.today().isoformat()
    out = args.out or REPO / "benchmarks" / "results" / f"load_memory-{args.mode}-{date}.json"
    record = {"benchmark": "load_memory", "mode": args.mode, "date": date,
              "model": str(args.model), "rows": rows}  # fmt: skip
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
