"""One offline throughput run of one engine, in its own process; prints a JSON line.

Run by ``run_peers.py`` (with the vLLM venv's python for ``--engine vllm``): it must not
import kvserve unless it measures kvserve, since the vLLM venv does not have it.

    python benchmarks/peers/worker.py --engine kvserve --model DIR --num-requests 64
"""

from __future__ import annotations

import argparse
import json
import random
import time

# kvserve's per-phase step time (seconds, accumulated), reported with the result.
STEP_BREAKDOWN: dict[str, float] = {}


def prompts_for(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n)]


def run_kvserve(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, int]:
    from kvserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype="bfloat16",
        max_num_seqs=max(len(prompts), 1),
        kv_cache_memory=args.kv_cache,
        max_num_batched_tokens=4096,
        model_impl=args.model_impl,
    )
    # Token ids only, no text: as the vLLM run (detokenize=False), so both do the same work.
    params = SamplingParams(
        temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
    )
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], warm, use_tqdm=False)
    if args.stop_at_eos:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    STEP_BREAKDOWN.update(llm.stats()["step_time"])
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, int]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_num_seqs=max(len(prompts), 1),
        max_model_len=2048,
    )
    params = SamplingParams(
        temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
    )
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]], warm, use_tqdm=False)
    if args.stop_at_eos:  # EOS from the model's generation_config.json, as kvserve reads it
        params = SamplingParams(temperature=0, max_tokens=args.output_len, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts)  # equal lengths: one static batch, no padding
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=4, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - t0
    return elapsed, int((out.shape[1] - ids.shape[1]) * out.shape[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["kvserve", "vllm", "hf"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-requests", type=int, required=True)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--kv-cache", default="2GiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts-file", default=None, help="JSON list of token id lists to use")
    ap.add_argument("--stop-at-eos", action="store_true", help="outputs end at EOS")
    ap.add_argument(
        "--model-impl", default="auto", choices=["auto", "kvserve", "transformers"],
        help="kvserve only: native class or the transformers backend",
    )  # fmt: skip
    args = ap.parse_args()
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = json.load(f)[: args.num_requests]
    else:
        prompts = prompts_for(args.num_requests, args.prompt_len, args.vocab, args.seed)
    if args.engine == "hf" and (args.stop_at_eos or args.prompts_file):
        raise SystemExit("the transformers baseline runs only the fixed-length random workload")
    fn = {"kvserve": run_kvserve, "vllm": run_vllm, "hf": run_hf}[args.engine]
    elapsed, tokens = fn(args, prompts)
    print(
        "RESULT "
        + json.dumps(
            {
                "engine": args.engine,
                "model_impl": args.model_impl if args.engine == "kvserve" else None,
                "num_requests": args.num_requests,
                "elapsed": elapsed,
                "output_tokens": tokens,
                "stop_at_eos": args.stop_at_eos,
                "output_tok_s": tokens / elapsed,
                "step_time": STEP_BREAKDOWN or None,
            }
        )
    )


if __name__ == "__main__":
    main()
