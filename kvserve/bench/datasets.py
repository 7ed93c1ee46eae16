"""Benchmark datasets: what each request sends and how long its answer should be.

Every loader returns a list of :class:`SampleRequest`. Text datasets (ShareGPT-format files and
the packaged chatterbot English corpus) live here; the synthetic ones (random token prompts and
shared-prefix groups) live in :mod:`kvserve.bench.synthetic`. Token lengths are always measured
with the tokenizer the caller passes, so they match what the served model will see (up to the
special tokens the server adds, which the server's ``usage`` then reports exactly).
"""

from __future__ import annotations

import importlib.util
import json
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class SampleRequest:
    """One benchmark request before it is sent.

    ``prompt`` is always the text form (used by ``/v1/completions``); ``chat_messages``, when
    set, is what ``/v1/chat/completions`` sends instead (otherwise the prompt becomes a single
    user message).
    """

    prompt: str
    prompt_len: int  # tokens in `prompt`, counted by the benchmark's tokenizer
    expected_output_len: int  # max_tokens to ask for (exact with ignore_eos, a cap without)
    chat_messages: list[dict[str, str]] | None = None
    reference_output: str | None = None  # the dataset's own answer, when it has one
    metadata: dict[str, Any] = field(default_factory=dict)


T = TypeVar("T")  # a sample: a SampleRequest, or a multi-turn Conversation

# Pruning limits of vLLM's `is_valid_sequence` (from its original ShareGPT sampler).
DEFAULT_MIN_LEN = 4
DEFAULT_MAX_PROMPT_LEN = 1024
DEFAULT_MAX_TOTAL_LEN = 2048


def is_valid_sequence(
    prompt_len: int,
    output_len: int,
    min_len: int = DEFAULT_MIN_LEN,
    max_prompt_len: int = DEFAULT_MAX_PROMPT_LEN,
    max_total_len: int = DEFAULT_MAX_TOTAL_LEN,
    check_output_len: bool = True,
) -> bool:
    """True when a (prompt, output) pair is kept: neither too short nor too long.

    Very short pairs say nothing about serving cost and very long ones would be cut by the
    model's context, so both distort a benchmark; the limits are parameters so that models with
    longer contexts can keep more of the data.
    """
    if prompt_len < min_len:
        return False
    if check_output_len and output_len < min_len:
        return False
    if prompt_len > max_prompt_len:
        return False
    return prompt_len + output_len <= max_total_len


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Tokens in ``text`` as the model would see it (with the tokenizer's own special tokens)."""
    return len(tokenizer(text).input_ids)


def fill_to(
    samples: list[T], num_requests: int, rng: random.Random, oversample: bool, name: str
) -> list[T]:
    """Cut to ``num_requests``, or repeat random samples to reach it (as vLLM does)."""
    if len(samples) >= num_requests:
        return samples[:num_requests]
    if not samples:
        raise ValueError(f"the {name} dataset has no usable samples.")
    if not oversample:
        warnings.warn(
            f"the {name} dataset has only {len(samples)} usable samples, fewer than "
            f"{num_requests}; running with {len(samples)}.",
            stacklevel=3,
        )
        return samples
    warnings.warn(
        f"the {name} dataset has only {len(samples)} usable samples; repeating random ones "
        f"to reach {num_requests}.",
        stacklevel=3,
    )
    extra = [rng.choice(samples) for _ in range(num_requests - len(samples))]
    return samples + extra


def sample_sharegpt(
    path: str | Path,
    num_requests: int,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    output_len: int | None = None,
    min_len: int = DEFAULT_MIN_LEN,
    max_prompt_len: int = DEFAULT_MAX_PROMPT_LEN,
    max_total_len: int = DEFAULT_MAX_TOTAL_LEN,
    oversample: bool = True,
) -> list[SampleRequest]:
    """Sample ``num_requests`` prompts from a ShareGPT-format JSON file.

    The first turn is the prompt and the second turn's token length is the expected output
    length (or ``output_len`` when given, in which case the short-output rule is skipped since
    the dataset's answer no longer matters). Entries with fewer than two turns are skipped, the
    rest shuffled with ``seed`` and pruned with :func:`is_valid_sequence`.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file holds a JSON list of conversations.")
    pairs: list[tuple[str, str]] = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, answer = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(answer, str):
            pairs.append((prompt, answer))
    rng = random.Random(seed)
    rng.shuffle(pairs)

    samples: list[SampleRequest] = []
    # Tokenize lazily: the real ShareGPT file has ~90k conversations and we need only a few.
    for prompt, answer in pairs:
        if len(samples) >= num_requests:
            break
        prompt_len = count_tokens(tokenizer, prompt)
        answer_len = count_tokens(tokenizer, answer)
        out_len = answer_len if output_len is None else output_len
        keep = is_valid_sequence(
            prompt_len,
            out_len,
            min_len=min_len,
            max_prompt_len=max_prompt_len,
            max_total_len=max_total_len,
            check_output_len=output_len is None,
        )
        if keep:
            samples.append(SampleRequest(prompt, prompt_len, out_len, reference_output=answer))
    return fill_to(samples, num_requests, rng, oversample, "ShareGPT")


def chatterbot_data_dir() -> Path:
    """The English data folder of the installed ``chatterbot-corpus`` package."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the chatterbot-corpus package is not installed (pip install it).")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "english"


def load_chatterbot_dialogues(data_dir: Path | None = None) -> list[list[str]]:
    """Every English chatterbot conversation with at least two lines, in file order; the
    lines alternate between the two speakers (user, bot, user, ...)."""
    folder = data_dir or chatterbot_data_dir()
    dialogues: list[list[str]] = []
    for path in sorted(folder.glob("*.yml")):
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
        for conv in doc.get("conversations") or []:
            # A few entries are malformed (a bare string); YAML also turns "42" into an int.
            if not isinstance(conv, list) or len(conv) < 2:
                continue
            lines: list[str] = []
            for line in conv:
                text = str(line).strip() if isinstance(line, (str, int, float)) else ""
                if not text:
                    break  # a hole would shift who speaks: keep what came before it
                lines.append(text)
            if len(lines) >= 2:
                dialogues.append(lines)
    return dialogues


def load_chatterbot_conversations(data_dir: Path | None = None) -> list[tuple[str, str]]:
    """(first line, second line) of every English chatterbot conversation, in file order."""
    return [(d[0], d[1]) for d in load_chatterbot_dialogues(data_dir)]


def sample_chatterbot(
    num_requests: int,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    output_len: int | None = None,
    max_output_len: int | None = None,
    oversample: bool = True,
) -> list[SampleRequest]:
    """Sample prompts from the packaged chatterbot English corpus (a real chat dataset).

    The first line of a conversation is the prompt (also sent as one user message for chat
    endpoints) and the second line is the reference answer. The expected output length is the
    answer's token length, or ``output_len`` when given, capped at ``max_output_len``.
    """
    pairs = load_chatterbot_conversations()
    rng = random.Random(seed)
    rng.shuffle(pairs)
    samples: list[SampleRequest] = []
    for prompt, answer in pairs[:num_requests]:
        out_len = output_len if output_len is not None else count_tokens(tokenizer, answer)
        if max_output_len is not None:
            out_len = min(out_len, max_output_len)
        samples.append(
            SampleRequest(
                prompt=prompt,
                prompt_len=count_tokens(tokenizer, prompt),
                expected_output_len=max(1, out_len),
                chat_messages=[{"role": "user", "content": prompt}],
                reference_output=answer,
            )
        )
    return fill_to(samples, num_requests, rng, oversample, "chatterbot")


DATASET_NAMES: Sequence[str] = ("sharegpt", "chatterbot", "random", "prefix", "multi_turn")
# vLLM's name for the shared-prefix dataset, accepted so that vLLM command lines work.
DATASET_ALIASES = {
    "prefix_repetition": "prefix",
    "prefix-repetition": "prefix",
    "multi-turn": "multi_turn",
}


def canonical_name(name: str) -> str:
    """The dataset name behind an alias."""
    return DATASET_ALIASES.get(name, name)


def get_samples(args: Any, tokenizer: PreTrainedTokenizerBase) -> list[SampleRequest]:
    """Build the dataset named by ``args.dataset_name`` from parsed ``bench`` CLI arguments."""
    from kvserve.bench import synthetic  # local: synthetic imports SampleRequest from here

    name = canonical_name(args.dataset_name)
    n, seed = args.num_prompts, args.seed
    if name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json.")
        return sample_sharegpt(
            args.dataset_path,
            n,
            tokenizer,
            seed=seed,
            output_len=args.sharegpt_output_len,
            min_len=args.sharegpt_min_len,
            max_prompt_len=args.sharegpt_max_prompt_len,
            max_total_len=args.sharegpt_max_total_len,
            oversample=not args.no_oversample,
        )
    if name == "chatterbot":
        return sample_chatterbot(
            n,
            tokenizer,
            seed=seed,
            output_len=args.chatterbot_output_len,
            max_output_len=args.chatterbot_max_output_len,
            oversample=not args.no_oversample,
        )
    if name == "random":
        return synthetic.sample_random(
            n,
            tokenizer,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            seed=seed,
        )
    if name == "prefix":
        return synthetic.sample_shared_prefix(
            n,
            tokenizer,
            prefix_len=args.prefix_len,
            suffix_len=args.prefix_suffix_len,
            num_groups=args.prefix_num_groups,
            output_len=args.prefix_output_len,
            seed=seed,
        )
    if name == "multi_turn":
        # Its requests depend on the server's answers: see kvserve.bench.multi_turn.
        raise ValueError("multi_turn replays conversations against a server: use bench serve.")
    raise ValueError(f"unknown dataset {args.dataset_name!r}; choose from {list(DATASET_NAMES)}.")
