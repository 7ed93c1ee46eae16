"""What quantized weights cost in quality (issue 16): perplexity and greedy agreement.

The built-in SmolLM2-135M-Instruct (or ``--model``) runs offline through ``kvserve.LLM`` once per
configuration:

* ``float32``, ``bfloat16``: the folder's weights in that dtype (the built-in folder holds the
  float32 values of its shipped Q4_1 GGUF, so float32 is that file's exact arithmetic);
* ``int8``, ``int4``: linears quantized at load (``quantization=``), their inputs quantized
  to int8 per 32 values (``quantization_activations="int8"``, the default on VNNI CPUs);
* ``gguf``: the built-in's Q4_1 GGUF with its tensors kept quantized (built-in model only),
  int8 activations likewise;
* ``int8-a16``, ``int4-a16``, ``gguf-a16``: the same weights with bf16 activations
  (``quantization_activations="none"``);
* ``int8-lmhead``, ``int4-lmhead``, ``gguf-lmhead``: as ``int8``/``int4``/``gguf`` with the LM
  head quantized too (``quantization_lm_head=True``: int8 per row; the built-in GGUF's own
  Q8_0 table, which its LM head is tied to).

Perplexity: the English chatterbot corpus' answers (its second lines, each once, in file order,
joined by newlines), tokenized and cut into ``--window``-token windows, the first
``--num-tokens`` tokens. Each window is one prompt with ``prompt_logprobs=0, max_tokens=1``:
every position but the window's first is scored by the model's log-probability of the actual
token (PPL = exp of the negative mean). Windows do not overlap, so every window starts cold.

Greedy agreement: the corpus' questions (first lines, each once), each as one user turn through
the chat template, greedy, at most ``--max-tokens`` new tokens (ending at EOS as usual); per
configuration the fraction of answers token-for-token identical to bfloat16's and the mean
length of the identical prefix (in tokens; an identical answer counts its whole length).

Writes ``benchmarks/results/quant_quality-<model>-<date>.json`` and prints a markdown table.

    python benchmarks/quant_quality.py                                     # all configurations
    python benchmarks/quant_quality.py --configs float32,bfloat16 --num-prompts 64   # quicker
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `benchmarks` importable

# name -> LLM keyword arguments; bfloat16 is the reference of the agreement columns
CONFIGS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    **{
        f"{method}{suffix}": {
            "dtype": "bfloat16", "quantization": method, "quantization_activations": acts,
        }
        for suffix, acts in (("", "int8"), ("-a16", "none"))
        for method in ("int8", "int4", "gguf")
    },
    **{
        f"{method}-lmhead": {
            "dtype": "bfloat16", "quantization": method, "quantization_activations": "int8",
            "quantization_lm_head": True,
        }
        for method in ("int8", "int4", "gguf")
    },
}  # fmt: skip
REFERENCE = "bfloat16"


def parse_configs(text: str) -> list[str]:
    """A comma list of configuration names; ``bfloat16`` is added (the reference)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configurations {unknown or [text]}; choose from {', '.join(CONFIGS)}"
        )
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    return list(dict.fromkeys(names))


def held_text() -> str:
    """The corpus' answers, each once, in file order, one per line."""
    from kvserve.bench.datasets import load_chatterbot_conversations

    answers = dict.fromkeys(a.strip() for _, a in load_chatterbot_conversations())
    return "\n".join(a for a in answers if a)


def windows(token_ids: Sequence[int], window: int, num_tokens: int) -> list[list[int]]:
    """Consecutive non-overlapping ``window``-token pieces of the first ``num_tokens`` tokens
    (a shorter tail is dropped: every window scores ``window - 1`` tokens)."""
    if window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {window}")
    usable = min(num_tokens, len(token_ids)) // window * window
    if usable == 0:
        raise ValueError(f"the held text has {len(token_ids)} tokens, fewer than one window")
    return [list(token_ids[i : i + window]) for i in range(0, usable, window)]


def perplexity(prompt_logprobs: Sequence[Sequence[Any]], prompts: Sequence[list[int]]) -> dict:
    """PPL over every scored position: ``prompt_logprobs[w][i]`` maps token id -> Logprob for
    window ``w``'s position ``i`` (None at ``i = 0``), the prompt's own token among them."""
    total, count = 0.0, 0
    for lps, ids in zip(prompt_logprobs, prompts, strict=True):
        if len(lps) != len(ids) or lps[0] is not None:
            raise ValueError(f"expected {len(ids)} prompt logprobs led by None, got {len(lps)}")
        for i in range(1, len(ids)):
            total += lps[i][ids[i]].logprob
            count += 1
    return {"perplexity": math.exp(-total / count), "scored_tokens": count}


def agreement(outputs: Sequence[list[int]], reference: Sequence[list[int]]) -> dict[str, float]:
    """Fraction of outputs identical to the reference's and the mean identical-prefix length."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    same, prefix = 0, 0
    for out, ref in zip(outputs, reference, strict=True):
        n = 0
        while n < min(len(out), len(ref)) and out[n] == ref[n]:
            n += 1
        same += out == ref
        prefix += n
    k = max(len(outputs), 1)
    return {"identical_fraction": same / k, "mean_identical_prefix": prefix / k}


def chat_prompts(tokenizer: Any, limit: int) -> list[list[int]]:
    """The corpus' questions, each once, as one user turn in the chat template (token ids)."""
    from kvserve.bench.datasets import load_chatterbot_conversations

    questions = list(dict.fromkeys(q.strip() for q, _ in load_chatterbot_conversations()))
    questions = [q for q in questions if q][: limit or None]
    out = []
    for q in questions:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def run_config(
    name: str, args: argparse.Namespace, ppl_prompts: list[list[int]], chat: list[list[int]]
) -> dict[str, Any]:
    """Load one configuration, score the windows, generate the greedy answers."""
    from kvserve import LLM, SamplingParams

    kwargs = dict(CONFIGS[name])
    if args.quantization_group_size and kwargs.get("quantization") in ("int8", "int4"):
        kwargs["quantization_group_size"] = args.quantization_group_size
    t0 = time.monotonic()
    try:
        llm = LLM(args.model, max_num_seqs=args.max_num_seqs, num_threads=args.threads, **kwargs)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:  # not built yet?
        print(f"  {name}: could not load: {e}", flush=True)
        return {"config": name, "llm_kwargs": kwargs, "error": f"{type(e).__name__}: {e}"}
    load_s = time.monotonic() - t0
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in ppl_prompts], score, use_tqdm=False)
    ppl = perplexity([o.prompt_logprobs for o in outs], ppl_prompts)
    ppl_s = time.monotonic() - t0
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    t0 = time.monotonic()
    gen = llm.generate([{"prompt_token_ids": p} for p in chat], greedy, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in gen]
    result = {"config": name, "llm_kwargs": kwargs, "load_s": load_s, "perplexity_s": ppl_s}
    result.update(ppl, generate_s=time.monotonic() - t0, output_token_ids=tokens)
    del llm
    gc.collect()
    print(
        f"  {name}: PPL {ppl['perplexity']:.3f} over {ppl['scored_tokens']} tokens; "
        f"load {load_s:.0f} s, scoring {ppl_s:.0f} s, generation {result['generate_s']:.0f} s",
        flush=True,
    )
    return result


def markdown(results: Sequence[dict[str, Any]]) -> str:
    ref = next(r for r in results if r["config"] == REFERENCE)
    lines = [
        "| configuration | perplexity | vs bfloat16 | identical to bfloat16 | "
        "mean identical prefix (tokens) | mean answer length |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error'][:80]} | | | | |")
            continue
        agree = agreement(r["output_token_ids"], ref["output_token_ids"])
        r.update(agree)
        mean_len = sum(map(len, r["output_token_ids"])) / max(len(r["output_token_ids"]), 1)
        lines.append(
            f"| {r['config']} | {r['perplexity']:.3f} | "
            f"{r['perplexity'] / ref['perplexity'] - 1:+.2%} | "
            f"{agree['identical_fraction']:.1%} | {agree['mean_identical_prefix']:.1f} | "
            f"{mean_len:.1f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: built-in)")
    ap.add_argument("--configs", type=parse_configs, default=parse_configs(",".join(CONFIGS)))
    ap.add_argument("--num-tokens", type=int, default=4096, help="held-text tokens scored")
    ap.add_argument("--window", type=int, default=256, help="tokens per perplexity window")
    ap.add_argument("--num-prompts", type=int, default=0, help="chat prompts (0: all)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per answer, at most")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantization-group-size", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.machine import machine_info
    from kvserve.bench.serve import save_result
    from kvserve.model.builtin import resolve_model

    args = build_parser().parse_args(argv)
    gguf = any(CONFIGS[c].get("quantization") == "gguf" for c in args.configs)
    if gguf and args.model is not None and not args.model.endswith(".gguf"):
        raise ValueError("configuration gguf needs a .gguf --model (or the built-in model)")
    from transformers import AutoTokenizer

    folder, name = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.encode(held_text(), add_special_tokens=False, verbose=False)  # one long text
    ppl_prompts = windows(ids, args.window, args.num_tokens)
    chat = chat_prompts(tokenizer, args.num_prompts)
    print(f"{name}: {len(ppl_prompts)} windows of {args.window} tokens, {len(chat)} chat prompts")
    t0 = time.monotonic()
    results = [run_config(c, args, ppl_prompts, chat) for c in args.configs]
    if "error" in next(r for r in results if r["config"] == REFERENCE):
        raise RuntimeError("the bfloat16 reference failed to load")
    table = markdown(results)
    print()
    print(table)
    date = datetime.date.today().isoformat()
    out = args.out or REPO / "benchmarks" / "results" / f"quant_quality-{name}-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    doc = {
        "benchmark": "quant_quality", "machine": machine_info(), "model": name,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_time_s": time.monotonic() - t0, "settings": settings,
        "held_text": {"source": "chatterbot-corpus english answers", "total_tokens": len(ids)},
        "chat_prompt_token_ids": chat, "results": results, "markdown": table,
    }  # fmt: skip
    save_result(doc, out)
    print(f"\nSaved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
