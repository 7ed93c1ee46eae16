"""Command-line options shared by ``bench serve``, ``bench sweep`` and ``bench throughput``.

Names and defaults follow ``vllm bench serve`` wherever it has the option (``--dataset-name``,
``--num-prompts``, ``--random-input-len``, ``--request-rate``, ``--max-concurrency``,
``--goodput``, ``--save-result``...), so command lines and scripts carry over.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvserve.bench import datasets, multi_turn, synthetic


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """Dataset choice, sizes and the tokenizer."""
    g = parser.add_argument_group("dataset")
    g.add_argument(
        "--dataset-name",
        default="random",
        choices=[*datasets.DATASET_NAMES, *datasets.DATASET_ALIASES],
        help="sharegpt (needs --dataset-path), chatterbot (packaged English chat corpus), "
        "random (random-token prompts), prefix (shared-prefix groups) or multi_turn "
        "(conversations replayed turn by turn on the chat endpoint; bench serve only).",
    )
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file.")
    g.add_argument("--num-prompts", type=int, default=100, help="Requests in the benchmark.")
    g.add_argument("--seed", type=int, default=0, help="Seeds dataset sampling and arrivals.")
    g.add_argument("--tokenizer", default=None, help="Local tokenizer folder (see docs).")
    g.add_argument(
        "--no-oversample",
        action="store_true",
        help="Run with fewer prompts than --num-prompts when the dataset has too few, instead "
        "of repeating random samples.",
    )
    g.add_argument("--input-len", type=int, default=None, help="Sets --random-input-len.")
    g.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="Sets every dataset's output length (--random-output-len, --sharegpt-output-len, "
        "--chatterbot-output-len, --prefix-output-len, --multi-turn-output-len).",
    )
    _add_per_dataset_args(parser)
    _add_multi_turn_args(parser)


def _add_multi_turn_args(parser: argparse.ArgumentParser) -> None:
    """Options of the multi_turn workload (see kvserve.bench.multi_turn)."""
    g = parser.add_argument_group("multi_turn")
    g.add_argument(
        "--multi-turn-source",
        choices=multi_turn.SOURCES,
        default="synthetic",
        help="synthetic (random-token turns) or chatterbot (the corpus's conversations with "
        "two user turns or more).",
    )
    g.add_argument(
        "--multi-turn-num-conversations",
        type=int,
        default=None,
        help="Conversations (default: --num-prompts); requests = conversations x turns.",
    )
    g.add_argument(
        "--multi-turn-num-turns",
        type=int,
        default=None,
        help=f"User turns per conversation (synthetic default {multi_turn.DEFAULT_NUM_TURNS}; "
        "chatterbot: the conversation's own, capped by this).",
    )
    g.add_argument(
        "--multi-turn-system-prompt-len",
        type=int,
        default=multi_turn.DEFAULT_SYSTEM_PROMPT_LEN,
        help="Tokens of one random system prompt shared by every conversation (0: none).",
    )
    g.add_argument(
        "--multi-turn-user-len",
        type=int,
        default=multi_turn.DEFAULT_USER_LEN,
        help="Tokens of each synthetic user turn.",
    )
    g.add_argument(
        "--multi-turn-output-len",
        type=int,
        default=multi_turn.DEFAULT_OUTPUT_LEN,
        help="max_tokens of each turn (exact with --ignore-eos, the synthetic default).",
    )


def _add_per_dataset_args(parser: argparse.ArgumentParser) -> None:
    """Options of one dataset each (vLLM's names where it has them)."""
    g = parser.add_argument_group("dataset-specific")
    g.add_argument("--random-input-len", type=int, default=synthetic.DEFAULT_RANDOM_INPUT_LEN)
    g.add_argument("--random-output-len", type=int, default=synthetic.DEFAULT_RANDOM_OUTPUT_LEN)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Lengths are uniform in [L*(1-r), L*(1+r)]; 0 gives fixed lengths.",
    )
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--sharegpt-min-len", type=int, default=datasets.DEFAULT_MIN_LEN)
    g.add_argument("--sharegpt-max-prompt-len", type=int, default=datasets.DEFAULT_MAX_PROMPT_LEN)
    g.add_argument("--sharegpt-max-total-len", type=int, default=datasets.DEFAULT_MAX_TOTAL_LEN)
    g.add_argument("--chatterbot-output-len", type=int, default=None, help="Fixed output len.")
    g.add_argument(
        "--chatterbot-max-output-len", type=int, default=None, help="Cap on the answer's len."
    )
    g.add_argument(
        "--prefix-len",
        "--prefix-repetition-prefix-len",
        dest="prefix_len",
        type=int,
        default=synthetic.DEFAULT_PREFIX_LEN,
        help="Tokens of each group's shared system prompt.",
    )
    g.add_argument(
        "--prefix-suffix-len",
        "--prefix-repetition-suffix-len",
        dest="prefix_suffix_len",
        type=int,
        default=synthetic.DEFAULT_SUFFIX_LEN,
    )
    g.add_argument(
        "--prefix-num-groups",
        "--prefix-repetition-num-prefixes",
        dest="prefix_num_groups",
        type=int,
        default=synthetic.DEFAULT_NUM_GROUPS,
    )
    g.add_argument(
        "--prefix-output-len",
        "--prefix-repetition-output-len",
        dest="prefix_output_len",
        type=int,
        default=synthetic.DEFAULT_PREFIX_OUTPUT_LEN,
    )


def add_output_mode_args(parser: argparse.ArgumentParser) -> None:
    """How long answers are: fixed (ignore_eos) or until EOS with max_tokens as a cap."""
    g = parser.add_argument_group("output length")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Fixed output lengths: send ignore_eos and max_tokens = the expected length. "
        "Default: on for random/prefix/synthetic multi_turn, off (generate until EOS) for "
        "sharegpt/chatterbot/chatterbot multi_turn.",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="max_tokens for every request instead of each sample's expected output length.",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling fields added to each request body only when given (server defaults else)."""
    g = parser.add_argument_group("sampling")
    for name, kind in (
        ("temperature", float),
        ("top-p", float),
        ("top-k", int),
        ("min-p", float),
        ("frequency-penalty", float),
        ("presence-penalty", float),
        ("repetition-penalty", float),
    ):
        g.add_argument(f"--{name}", type=kind, default=None)
    g.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help="JSON object merged into every request body, e.g. '{\"top_k\": 5}'.",
    )


def apply_general_lengths(args: argparse.Namespace) -> None:
    """Map vLLM's general --input-len/--output-len onto the dataset-specific options."""
    if getattr(args, "input_len", None) is not None:
        args.random_input_len = args.input_len
    if getattr(args, "output_len", None) is not None:
        args.random_output_len = args.output_len
        args.sharegpt_output_len = args.output_len
        args.chatterbot_output_len = args.output_len
        args.prefix_output_len = args.output_len
        args.multi_turn_output_len = args.output_len


def resolve_ignore_eos(args: argparse.Namespace) -> bool:
    """--ignore-eos as given, else the dataset's default (synthetic data has no natural end)."""
    if args.ignore_eos is not None:
        return bool(args.ignore_eos)
    name = datasets.canonical_name(args.dataset_name)
    if name == "multi_turn":
        return getattr(args, "multi_turn_source", "synthetic") == "synthetic"
    return name in ("random", "prefix")


def sampling_body(args: argparse.Namespace) -> dict[str, Any]:
    """Request-body fields from the sampling options (only those given) and --extra-body."""
    fields = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    )
    body = {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
    if getattr(args, "extra_body", None):
        if not isinstance(args.extra_body, dict):
            raise ValueError("--extra-body must be a JSON object.")
        body.update(args.extra_body)
    return body


def jsonable_args(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of the run for the result file; secrets and callables left out."""
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if key in ("api_key", "header") or callable(value):
            continue
        if isinstance(value, float) and value == float("inf"):
            value = "inf"
        out[key] = value
    return out
