"""Synthetic datasets: random-token prompts and shared-prefix groups.

Prompts are built from random token ids, decoded to text and re-encoded, because the server
receives text: N random ids rarely decode and re-encode to exactly N tokens (byte-level BPE
merges across boundaries, invalid UTF-8 becomes replacement characters...). We repair the text
until it re-encodes to the target length when that is possible and always report the length
the text really has, so the recorded ``prompt_len`` is never a wish.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kvserve.bench.datasets import SampleRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Defaults of vLLM's random and prefix-repetition datasets.
DEFAULT_RANDOM_INPUT_LEN = 1024
DEFAULT_RANDOM_OUTPUT_LEN = 128
DEFAULT_PREFIX_LEN = 256
DEFAULT_SUFFIX_LEN = 256
DEFAULT_NUM_GROUPS = 10
DEFAULT_PREFIX_OUTPUT_LEN = 128
_MAX_REPAIR_ROUNDS = 10  # coarse pad/truncate rounds
_FINE_WINDOW = 8  # tokens fixed one at a time at the end
_MAX_APPEND_TRIES = 64


def allowed_token_ids(tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """Every token id except special ones (BOS/EOS/pad would change how the model behaves)."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    assert isinstance(text, str)  # one sequence in, one string out
    return text


def _canonical(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    """The ids the server will actually see for the text of ``ids``."""
    return _encode(tokenizer, _decode(tokenizer, ids))


def text_of_length(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: list[int],
    target_len: int,
    rng: np.random.Generator,
    allowed: np.ndarray,
) -> tuple[str, int]:
    """Decode ``token_ids`` and repair the text until it re-encodes to ``target_len`` tokens.

    Coarse rounds pad with random tokens or truncate while far from the target; the last
    tokens are then fixed one at a time (cut back to a prefix that re-encodes to itself, then
    append single tokens that keep it so), because a cut can split a multi-byte character and
    a random append can merge with its neighbour. Returns the text and its real token length
    (without special tokens), which can still differ from the target for unlucky tokenizers.
    """
    ids = _canonical(tokenizer, list(token_ids))
    for _ in range(_MAX_REPAIR_ROUNDS):
        if abs(len(ids) - target_len) <= _FINE_WINDOW:
            break
        if len(ids) > target_len:
            ids = ids[:target_len]
        else:
            extra = allowed[rng.integers(0, len(allowed), size=target_len - len(ids))]
            ids = ids + extra.tolist()
        ids = _canonical(tokenizer, ids)
    if len(ids) > target_len:
        for k in range(target_len, max(-1, target_len - 2 * _FINE_WINDOW), -1):
            if _canonical(tokenizer, ids[:k]) == ids[:k]:
                ids = ids[:k]
                break
    for _ in range(_MAX_APPEND_TRIES):
        if len(ids) >= target_len:
            break
        candidate = [*ids, int(allowed[rng.integers(0, len(allowed))])]
        if _canonical(tokenizer, candidate) == candidate:
            ids = candidate
    text = _decode(tokenizer, ids)
    return text, len(_encode(tokenizer, text))


def random_text(
    tokenizer: PreTrainedTokenizerBase, length: int, rng: np.random.Generator, allowed: np.ndarray
) -> str:
    """Text of about ``length`` random tokens (see :func:`text_of_length`); "" for 0."""
    if length <= 0:
        return ""
    ids = allowed[rng.integers(0, len(allowed), size=length)].tolist()
    return text_of_length(tokenizer, ids, length, rng, allowed)[0]


def length_range(mean_len: int, range_ratio: float) -> tuple[int, int]:
    """[floor(L*(1-r)), ceil(L*(1+r))], vLLM's --random-range-ratio interval (inclusive)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    return math.floor(mean_len * (1 - range_ratio)), math.ceil(mean_len * (1 + range_ratio))


def sample_random(
    num_requests: int,
    tokenizer: PreTrainedTokenizerBase,
    input_len: int = DEFAULT_RANDOM_INPUT_LEN,
    output_len: int = DEFAULT_RANDOM_OUTPUT_LEN,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random tokens with fixed or uniformly ranged input and output lengths.

    The special tokens the tokenizer adds (a BOS...) count towards ``input_len``, as in vLLM,
    so that the server sees ``input_len`` prompt tokens.
    """
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    num_special = int(tokenizer.num_special_tokens_to_add())
    in_low, in_high = length_range(max(0, input_len - num_special), range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    in_low, in_high = max(in_low, 1), max(in_high, 1)
    out_low, out_high = max(out_low, 1), max(out_high, 1)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    samples = []
    for in_len, out_len in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        ids = allowed[rng.integers(0, len(allowed), size=in_len)].tolist()
        text, real_len = text_of_length(tokenizer, ids, in_len, rng, allowed)
        samples.append(SampleRequest(text, real_len + num_special, out_len))
    return samples


def sample_shared_prefix(
    num_requests: int,
    tokenizer: PreTrainedTokenizerBase,
    prefix_len: int = DEFAULT_PREFIX_LEN,
    suffix_len: int = DEFAULT_SUFFIX_LEN,
    num_groups: int = DEFAULT_NUM_GROUPS,
    output_len: int = DEFAULT_PREFIX_OUTPUT_LEN,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_groups`` long shared system prompts of ``prefix_len`` tokens, each request adding
    its own ``suffix_len``-token suffix; requests are spread evenly over the groups and then
    shuffled, so that a prefix cache sees interleaved groups as in real traffic.

    For chat endpoints the prefix is the system message and the suffix the user message.
    """
    if num_groups < 1:
        raise ValueError(f"--prefix-num-groups must be positive, got {num_groups}.")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    prefixes = [random_text(tokenizer, prefix_len, rng, allowed) for _ in range(num_groups)]
    samples = []
    for i in range(num_requests):
        group = i % num_groups
        suffix = random_text(tokenizer, suffix_len, rng, allowed)
        prompt = prefixes[group] + suffix
        samples.append(
            SampleRequest(
                prompt=prompt,
                prompt_len=len(tokenizer(prompt).input_ids),
                expected_output_len=output_len,
                chat_messages=[
                    {"role": "system", "content": prefixes[group]},
                    {"role": "user", "content": suffix},
                ],
                metadata={"prefix_group": group},
            )
        )
    order = rng.permutation(num_requests)
    return [samples[i] for i in order]
