"""``kvserve bench throughput``: offline engine throughput, no server in the way.

All prompts are handed to ``kvserve.LLM.generate`` at once and the wall time of that call is
measured, as in ``vllm bench throughput``. Token totals are counted from what the engine
actually returned (``prompt_token_ids`` and each completion's ``token_ids``), not from the
dataset's expected lengths, so early EOS cannot inflate the numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvserve.bench import options
from kvserve.bench.datasets import SampleRequest, get_samples
from kvserve.bench.tokenizer import load_tokenizer
from kvserve.engine.arg_utils import EngineArgs

# --seed and --tokenizer are the dataset's flags (options.add_dataset_args). --seed seeds the
# engine too; --tokenizer is only the dataset's, the engine reads the model folder's.
DATASET_FLAGS = frozenset({"seed", "tokenizer"})


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """Every option of ``bench throughput``."""
    EngineArgs.add_cli_args(parser.add_argument_group("engine"), exclude=DATASET_FLAGS)
    r = parser.add_argument_group("run")
    r.add_argument("--num-warmups", type=int, default=0, help="Untimed warm-up prompts.")
    r.add_argument("--disable-tqdm", action="store_true")
    r.add_argument("--output-json", default=None, help="Write the results here.")
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--top-p", type=float, default=1.0)
    options.add_dataset_args(parser)
    options.add_output_mode_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments: the model and the engine options that differ from
    their defaults (checked here, before the dataset is built)."""
    return EngineArgs.from_cli_args(args, exclude=frozenset({"tokenizer"})).llm_kwargs()


def count_tokens(outputs: Sequence[Any]) -> tuple[int, int]:
    """(prompt tokens, generated tokens) over ``RequestOutput``s, all completions included."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return prompt, generated


_COUNTERS = (
    "num_preemptions",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def _counters(llm: Any) -> dict[str, int | None]:
    """The engine's totals the run reports as deltas (None: an engine without them)."""
    stats = llm.stats() if hasattr(llm, "stats") else None
    stats = stats if isinstance(stats, dict) else {}
    return {k: None if stats.get(k) is None else int(stats[k]) for k in _COUNTERS}


def _deltas(before: dict[str, int | None], after: dict[str, int | None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _COUNTERS:
        b, a = before[key], after[key]
        out[key] = a - b if a is not None and b is not None else None
    drafts, tokens = out["spec_decode_num_drafts"], out["spec_decode_num_draft_tokens"]
    accepted = out["spec_decode_num_accepted_tokens"]
    out["spec_decode_acceptance_rate"] = accepted / tokens if tokens else None
    out["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return out


def measure_generate(
    llm: Any, prompts: list[str], params: list[Any], use_tqdm: bool
) -> dict[str, Any]:
    """Time one ``generate`` call over all prompts; return vLLM's throughput keys and more."""
    before = _counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    after = _counters(llm)
    prompt_tokens, output_tokens = count_tokens(outputs)
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": total,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        **_deltas(before, after),
    }


def sampling_params_for(
    samples: list[SampleRequest], args: argparse.Namespace, params_cls: Callable[..., Any]
) -> list[Any]:
    """One SamplingParams per sample with the run's output-length mode."""
    ignore_eos = options.resolve_ignore_eos(args)
    return [
        params_cls(
            n=1,
            temperature=args.temperature,
            top_p=args.top_p,
            ignore_eos=ignore_eos,
            max_tokens=args.max_tokens or s.expected_output_len,
        )
        for s in samples
    ]


def run_throughput(
    args: argparse.Namespace, llm_factory: Callable[..., Any] | None = None
) -> dict[str, Any]:
    """Entry point of ``bench throughput``. ``llm_factory`` replaces ``kvserve.LLM`` (tests)."""
    try:
        from kvserve import LLM, SamplingParams
    except ImportError as e:
        if llm_factory is None:
            raise RuntimeError(f"kvserve.LLM is not available in this build ({e}).") from e
        from kvserve.sampling_params import SamplingParams
    options.apply_general_lengths(args)
    llm_kwargs = engine_kwargs(args)
    tokenizer = load_tokenizer(args.tokenizer, args.model)
    samples = get_samples(args, tokenizer)
    llm = (llm_factory or LLM)(**llm_kwargs)
    prompts = [s.prompt for s in samples]
    params = sampling_params_for(samples, args, SamplingParams)
    if args.num_warmups > 0:
        k = min(args.num_warmups, len(prompts))
        llm.generate(prompts[:k], params[:k], use_tqdm=False)
    result = measure_generate(llm, prompts, params, use_tqdm=not args.disable_tqdm)
    result["ignore_eos"] = options.resolve_ignore_eos(args)
    result["settings"] = options.jsonable_args(args)
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {result['total_prompt_tokens']}")
    print(f"Total num output tokens:  {result['total_output_tokens']}")
    print(f"Preemptions:              {result['num_preemptions']}")
    if result["spec_decode_num_drafts"]:
        print(
            f"Spec decode acceptance:   {100 * result['spec_decode_acceptance_rate']:.1f}% of "
            f"{result['spec_decode_num_draft_tokens']} proposed tokens, mean acceptance length "
            f"{result['spec_decode_mean_acceptance_length']:.2f}"
        )
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"Saved the result to {args.output_json}")
    return result
