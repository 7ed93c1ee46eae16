"""What continuous batching buys over static batching, on the built-in model in bfloat16.

The same requests (chatterbot prompts through the chat template, output lengths drawn
uniformly in [16, 256] and enforced with ignore_eos) go through
- kvserve: ``LLM.generate`` with ``max_num_seqs`` requests in flight, joining and leaving the
  batch at every step;
- transformers: ``generate`` in static batches (left-padded); a batch runs until its longest
  member is done, so the short ones waste their slots.
Both count only the useful output tokens (each request's own length) per second.

    python benchmarks/continuous_vs_static.py [--num-requests 64] [--max-num-seqs 64]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.bench.datasets import load_chatterbot_conversations
from kvserve.engine.llm_engine import load_tokenizer
from kvserve.model.builtin import builtin_model_path


def make_workload(n: int, seed: int, lo: int, hi: int) -> tuple[list[list[dict]], list[int]]:
    rng = random.Random(seed)
    convs = load_chatterbot_conversations()
    picks = rng.sample(convs, n)
    messages = [[{"role": "user", "content": prompt}] for prompt, _ in picks]
    return messages, [rng.randint(lo, hi) for _ in range(n)]


def run_kvserve(prompts: list[list[int]], lens: list[int], max_num_seqs: int) -> float:
    llm = LLM(dtype="bfloat16", max_num_seqs=max_num_seqs, kv_cache_memory="2GiB")
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == lens
    print("kvserve step breakdown (s):", json.dumps(llm.stats()["step_time"]))
    return elapsed


def run_static(prompts: list[list[int]], lens: list[int], batch: int, pad_id: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(builtin_model_path(), dtype=torch.bfloat16)
    model.eval()
    elapsed = 0.0
    for start in range(0, len(prompts), batch):
        chunk, chunk_lens = prompts[start : start + batch], lens[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        longest = max(chunk_lens)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
        elapsed += time.perf_counter() - t0
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--static-batch", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both engines")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    messages, lens = make_workload(args.num_requests, args.seed, args.min_len, args.max_len)
    tok = load_tokenizer(builtin_model_path())
    prompts = [
        tok.encode(
            tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for m in messages
    ]
    useful = sum(lens)
    print(
        f"{len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, "
        f"useful output tokens {useful}"
    )
    t_kv = run_kvserve(prompts, lens, args.max_num_seqs)
    print(
        f"kvserve (continuous, max_num_seqs={args.max_num_seqs}): {t_kv:.1f} s, "
        f"{useful / t_kv:.1f} useful output tok/s"
    )
    if not args.skip_static:
        t_hf = run_static(prompts, lens, args.static_batch, tok.pad_token_id or 2)
        print(
            f"transformers (static batches of {args.static_batch}): {t_hf:.1f} s, "
            f"{useful / t_hf:.1f} useful output tok/s"
        )
        print(f"speed-up: {t_hf / t_kv:.2f}x")


if __name__ == "__main__":
    main()
