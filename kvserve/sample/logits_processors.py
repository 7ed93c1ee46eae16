"""Logits processors: what changes a row's logits before temperature and sampling.

Pure functions over ``[N, V]`` float32 logits, each touching only the rows that need it (the
sampler passes those rows' slice), in the order ``sample`` applies them:

1. ``apply_token_bitmask``: the grammar's allowed tokens (structured outputs), one int32 bit
   per token as xgrammar packs it; applied before the raw logprobs, as vLLM applies its grammar
   bitmask in the runner before the sampler, so a forbidden token has logprob -inf;
2. ``apply_allowed_token_ids``, ``apply_bad_words``, ``apply_logit_bias``, then each request's
   own callables (``apply_custom_processors``);
3. ``apply_min_tokens`` and ``apply_penalties`` (vLLM order and semantics).

A row's processors never see another row, so one request's bias or grammar cannot leak into
its batch neighbours' tokens. Nothing here waits for the device: ids and values come from the
host (``host_io.to_device``), and which processors run is decided from the requests'
``SamplingParams`` (per-request callables are user code and may sync on their own).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvserve.sample.host_io import tensor_to_device, to_device
from kvserve.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# Bits per word of a packed token bitmask (xgrammar's int32 layout: bit j of word w is token
# 32 * w + j, set = allowed).
BITS_PER_WORD = 32


def bitmask_width(vocab_size: int) -> int:
    """Words per row of a packed token bitmask covering ``vocab_size`` tokens."""
    return -(-vocab_size // BITS_PER_WORD)


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[R, W]`` packed bitmask -> bool ``[R, V]``, True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [R, V]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) every token whose bit is clear; ``logits`` ``[R, V]`` (in place), ``bitmask``
    int32 ``[R, W]`` with ``W * 32 >= V`` (bits past the vocabulary are ignored)."""
    bitmask = tensor_to_device(bitmask, logits.device)  # [R, W]
    allowed = unpack_token_bitmask(bitmask, logits.shape[1])  # [R, V]
    return logits.masked_fill_(~allowed, _NEG_INF)


def apply_token_bitmask_rows(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
) -> torch.Tensor:
    """``apply_token_bitmask`` on the rows ``rows`` of ``logits`` ``[B, V]``, in place.

    On CPU float32 a C++ loop reads the packed words directly (skipping all-allowed words;
    < 1 ms for 32 rows of 49152 tokens, against ~20 ms for this reference's bit unpacking);
    elsewhere the reference, tested equal to it.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        from kvserve.ops import cpu_kernels

        if cpu_kernels.available():
            cpu_kernels.apply_token_bitmask(logits, bitmask, rows)
            return logits
    index = to_device(rows, torch.long, logits.device)  # [G]
    logits[index] = apply_token_bitmask(logits[index], bitmask)
    return logits


def apply_allowed_token_ids(logits: torch.Tensor, allowed: Sequence[Sequence[int]]) -> torch.Tensor:
    """Keep only each row's allowed ids (vLLM's ``allowed_token_ids``); ``logits`` ``[R, V]``,
    modified in place. Ids outside the vocabulary are refused by the engine before this."""
    device = logits.device
    rows = [i for i, ids in enumerate(allowed) for _ in ids]
    cols = [t for ids in allowed for t in ids]
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=device)  # [R, V]
    if rows:  # one scatter for every row (an empty list allows nothing, as before)
        index = (to_device(rows, torch.long, device), to_device(cols, torch.long, device))
        keep.index_put_(index, torch.ones((), dtype=torch.bool, device=device))
    return logits.masked_fill_(~keep, _NEG_INF)


def banned_bad_word_ids(
    bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]
) -> list[int]:
    """The token ids to ban at the next position: a bad word's last token when the output
    already ends with the word's other tokens (a one-token word is always banned). vLLM's rule."""
    banned = []
    for word in bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or list(output_token_ids[-len(prefix) :]) == prefix:
            banned.append(word[-1])
    return banned


def apply_bad_words(
    logits: torch.Tensor,
    bad_words_token_ids: Sequence[Sequence[Sequence[int]]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Mask (-inf) each row's banned bad-word tokens; ``logits`` ``[R, V]``, in place."""
    rows: list[int] = []
    cols: list[int] = []
    for i, (words, out) in enumerate(zip(bad_words_token_ids, output_token_ids, strict=True)):
        ids = [t for t in banned_bad_word_ids(words, out) if 0 <= t < logits.shape[1]]
        rows.extend([i] * len(ids))
        cols.extend(ids)
    if rows:
        _fill_neg_inf(logits, rows, cols)
    return logits


def _fill_neg_inf(logits: torch.Tensor, rows: list[int], cols: list[int]) -> None:
    """``logits[rows[m], cols[m]] = -inf`` for every m, one scatter; ``logits`` ``[R, V]``."""
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(cols, torch.long, device))  # [M] x 2
    logits.index_put_(index, torch.full((), _NEG_INF, dtype=logits.dtype, device=device))


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float]]) -> torch.Tensor:
    """Add each row's ``{token id: bias}`` to its logits (OpenAI's ``logit_bias``); in place."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, bias in enumerate(biases):
        for tid, value in bias.items():
            rows.append(i)
            cols.append(tid)
            values.append(value)
    if rows:
        dev = logits.device
        index = (to_device(rows, torch.long, dev), to_device(cols, torch.long, dev))  # [M] x 2
        logits.index_put_(index, to_device(values, logits.dtype, dev), True)
    return logits


def _num_args(fn: Callable[..., Any]) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: the two-argument form
        return 2


def apply_custom_processors(
    logits: torch.Tensor,
    processors: Sequence[Sequence[Callable[..., Any]]],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Run each row's own callables on its ``[V]`` logits, in order (vLLM's per-request
    ``logits_processors``: ``fn(output_ids, logits)`` or ``fn(prompt_ids, output_ids, logits)``,
    returning the new logits). ``logits`` ``[R, V]`` is updated in place and returned."""
    for i, fns in enumerate(processors):
        row = logits[i]  # [V]
        for fn in fns:
            if _num_args(fn) >= 3:
                new = fn(list(prompt_token_ids[i]), list(output_token_ids[i]), row)
            else:
                new = fn(list(output_token_ids[i]), row)
            if not isinstance(new, torch.Tensor) or new.shape != row.shape:
                got = f"{type(new).__name__} {getattr(new, 'shape', '')}"
                raise ValueError(
                    f"a logits processor returned {got}; it must return a tensor of shape "
                    f"{tuple(row.shape)}"
                )
            row = new.to(logits.dtype)
        logits[i] = row
    return logits


def has_seam(p: SamplingParams) -> bool:
    """True when the request changes its logits before sampling (bias, ids, words, callables)."""
    return bool(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids or p.logits_processors)


def _pad_ids(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Right-pad ragged id lists with ``pad`` into a ``[N, L]`` long tensor (L >= 1)."""
    width = max(1, max((len(r) for r in rows), default=0))
    padded = [list(r) + [pad] * (width - len(r)) for r in rows]
    ids = to_device(padded, torch.long, device)  # [N, L]
    # Ids past the logits' vocab (embedding table larger than lm_head, as HF allows) cannot be
    # generated, so they go to the padding bin and are dropped like the padding itself.
    return ids.clamp_(max=pad)


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Occurrences of each token id per row, as float32 ``[N, V]`` (scatter_add, no vocab loop)."""
    device = torch.device(device)
    ids = _pad_ids(token_ids, vocab_size, device)  # [N, L]; padding = vocab_size
    # One extra column catches the padding so it never lands on a real token.
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]  # [N, V]


def _ids_padded_by_repeat(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids in ``[0, V)`` as ``[N, L]``, each short row padded by repeating its first id.

    A repeated id gathers and scatters back the same value as the original, so the padding
    needs no extra column and no mask. Returns the ids and a bool ``[N]`` marking rows with no
    valid id at all (padded with 0; callers must make those rows a no-op).
    """
    valid = [[t for t in r if 0 <= t < vocab_size] for r in rows]
    width = max(1, max((len(r) for r in valid), default=0))
    padded = [r + [r[0] if r else 0] * (width - len(r)) for r in valid]
    ids = to_device(padded, torch.long, device)  # [N, L]
    empty = to_device([not r for r in valid], torch.bool, device)  # [N]
    return ids, empty


def apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    min_tokens_stop_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Mask (-inf) each row's stop ids while it has fewer than ``min_tokens`` output tokens.

    ``logits`` is ``[N, V]`` and is modified in place (and returned).
    """
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, out, stop_ids) in enumerate(
        zip(params, output_token_ids, min_tokens_stop_ids, strict=True)
    ):
        if len(out) < p.min_tokens and stop_ids:
            rows.extend([i] * len(stop_ids))
            cols.extend(stop_ids)
    if rows:
        _fill_neg_inf(logits, rows, cols)
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    *,
    repetition: bool | None = None,
    additive: bool | None = None,
) -> torch.Tensor:
    """Apply repetition, then frequency, then presence penalties (vLLM order and semantics).

    ``logits`` is float ``[N, V]`` (may be modified in place); the penalty tensors are ``[N]``.
    ``repetition`` / ``additive``: whether any row has a repetition penalty / a frequency or
    presence penalty, as the caller knows from its host-side parameters (the sampler does);
    None reads the penalty tensors back to find out.
    Repetition (HF/CTRL): for tokens seen in prompt or output, positive logits are divided by
    the penalty and negative ones multiplied. Frequency: subtract ``freq * count`` of the token
    in the output. Presence: subtract ``presence`` once for every token present in the output.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    dtype = logits.dtype
    # Only the seen ids are touched: gather their logits, penalise, scatter back. That costs
    # [N, L] work instead of several [N, V] passes; duplicate ids write identical values.
    if repetition is None:
        repetition = bool((repetition_penalties != 1.0).any())
    if repetition:
        seen_ids, empty = _ids_padded_by_repeat(
            [list(p) + list(o) for p, o in zip(prompt_token_ids, output_token_ids, strict=True)],
            vocab_size,
            device,
        )  # [N, Ls], [N]
        # A tiny penalty (any positive float is valid, 5e-324 too) must stay positive in
        # ``dtype`` (5e-324 is 0 in float32, and a masked -inf times 0 is NaN, which argmax
        # picks) and its quotients finite (x / 1e-38 overflows to inf, and softmax of inf is
        # NaN): the penalty is clamped to the dtype's smallest normal, the result to its max.
        finfo = torch.finfo(dtype)
        rep = repetition_penalties.to(device=device, dtype=dtype).clamp_min(finfo.tiny)  # [N]
        rep = torch.where(empty, torch.ones_like(rep), rep).unsqueeze(1)  # [N, 1]
        seen = logits.gather(1, seen_ids)  # [N, Ls]
        penalised = torch.where(seen > 0, seen / rep, seen * rep).clamp_max(finfo.max)
        logits.scatter_(1, seen_ids, penalised)
    freq = frequency_penalties.to(device=device, dtype=dtype).unsqueeze(1)  # [N, 1]
    presence = presence_penalties.to(device=device, dtype=dtype).unsqueeze(1)  # [N, 1]
    if additive is None:
        additive = bool((freq != 0.0).any() or (presence != 0.0).any())
    if additive:
        out_ids, _ = _ids_padded_by_repeat(output_token_ids, vocab_size, device)  # [N, Lo]
        # Empty rows are padded with id 0, whose count is 0 there: subtracting 0 is a no-op.
        counts = token_counts(output_token_ids, vocab_size, device).gather(1, out_ids)  # [N, Lo]
        # Two subtractions in vLLM's order, so the result is bit-identical to the dense form.
        values = logits.gather(1, out_ids) - freq * counts - presence * (counts > 0)  # [N, Lo]
        logits.scatter_(1, out_ids, values)
    return logits
