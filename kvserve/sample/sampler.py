"""Batched token sampler: one call per engine step over the logits of every request in the batch.

The math lives in small pure functions over tensors (``apply_min_tokens``, ``apply_penalties``,
``apply_top_k_top_p``, ``apply_min_p``, ``random_sample``) so each step can be tested on its own;
``sample`` strings them together with vLLM's semantics and order:

1. logprobs (when asked) come from the *raw* model logits, like vLLM's default
   ``logprobs_mode="raw_logprobs"``;
2. min_tokens mask -> repetition / frequency / presence penalties;
3. greedy rows (temperature < 1e-5) take the argmax of the penalised logits;
4. the other rows: divide by temperature -> top-k -> top-p -> min-p -> softmax -> sample with the
   exponential race ``argmax(probs / Exponential(1))``, which lets a seeded row draw its noise from
   its own ``torch.Generator`` and so stay reproducible whatever else is in the batch.

Every helper tensor is built only for the rows (and only in the steps) that need it, and the common
benchmark case - an all-greedy batch without penalties, min_tokens or logprobs - is a single argmax.
Other cost choices, each explained where it is made: penalties gather/scatter only the seen ids;
top-k alone is a partial ``topk``; top-p first tries a partial ``topk`` of 1024 candidates and
sorts the whole row only when the nucleus does not fit in them; the Exponential(1) noise is drawn
as ``-log(U)``, which is much faster than ``exponential_`` on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.model import cpu_kernels
from kvserve.sampling_params import SamplingParams

__all__ = [
    "SamplerOutput",
    "SamplingMetadata",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_top_k_top_p",
    "random_sample",
    "sample",
    "token_counts",
]

_NEG_INF = float("-inf")
# How many of the most likely tokens top-p inspects before falling back to a full sort.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingMetadata:
    """Per-row inputs of one sampler call; every list has one entry per row of the logits."""

    params: list[SamplingParams]  # per row: the request's sampling parameters
    # per row: prompt token ids; the repetition penalty covers prompt + output (HF semantics)
    prompt_token_ids: list[list[int]]
    # per row: tokens generated so far (presence/frequency/repetition penalties, min_tokens)
    output_token_ids: list[list[int]]
    # per row: a generator seeded with params.seed when it is set (kept by the engine across
    # steps, so the row's random stream continues), else None
    generators: list[torch.Generator | None]
    # per row: token ids masked to -inf while len(output) < params.min_tokens
    # (EOS unless ignore_eos, plus params.stop_token_ids; the engine fills it)
    min_tokens_stop_ids: list[list[int]]
    # noise source for the unseeded rows (engine-level seed); None -> torch's default RNG
    default_generator: torch.Generator | None = None


@dataclass
class SamplerOutput:
    """What ``sample`` returns: one entry per row of the logits."""

    sampled_token_ids: list[int]  # per row: the chosen token id
    # per row: raw logprob of the sampled token; None when no row asked for logprobs
    sampled_logprobs: list[float] | None
    # per row: {token_id: raw logprob} of the top `params.logprobs` tokens plus the sampled one,
    # None for rows that did not ask; the whole field is None when no row asked
    top_logprobs: list[dict[int, float] | None] | None


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _pad_ids(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Right-pad ragged id lists with ``pad`` into a ``[N, L]`` long tensor (L >= 1)."""
    width = max(1, max((len(r) for r in rows), default=0))
    padded = [list(r) + [pad] * (width - len(r)) for r in rows]
    ids = torch.tensor(padded, dtype=torch.long, device=device)  # [N, L]
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
    ids = torch.tensor(padded, dtype=torch.long, device=device)  # [N, L]
    empty = torch.tensor([not r for r in valid], dtype=torch.bool, device=device)  # [N]
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
        index = (
            torch.tensor(rows, dtype=torch.long, device=logits.device),  # [M]
            torch.tensor(cols, dtype=torch.long, device=logits.device),  # [M]
        )
        logits.index_put_(index, torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device))
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Apply repetition, then frequency, then presence penalties (vLLM order and semantics).

    ``logits`` is float ``[N, V]`` (may be modified in place); the penalty tensors are ``[N]``.
    Repetition (HF/CTRL): for tokens seen in prompt or output, positive logits are divided by
    the penalty and negative ones multiplied. Frequency: subtract ``freq * count`` of the token
    in the output. Presence: subtract ``presence`` once for every token present in the output.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    dtype = logits.dtype
    # Only the seen ids are touched: gather their logits, penalise, scatter back. That costs
    # [N, L] work instead of several [N, V] passes; duplicate ids write identical values.
    if bool((repetition_penalties != 1.0).any()):
        seen_ids, empty = _ids_padded_by_repeat(
            [list(p) + list(o) for p, o in zip(prompt_token_ids, output_token_ids, strict=True)],
            vocab_size,
            device,
        )  # [N, Ls], [N]
        rep = repetition_penalties.to(device=device, dtype=dtype)  # [N]
        rep = torch.where(empty, torch.ones_like(rep), rep).unsqueeze(1)  # [N, 1]
        seen = logits.gather(1, seen_ids)  # [N, Ls]
        logits.scatter_(1, seen_ids, torch.where(seen > 0, seen / rep, seen * rep))
    freq = frequency_penalties.to(device=device, dtype=dtype).unsqueeze(1)  # [N, 1]
    presence = presence_penalties.to(device=device, dtype=dtype).unsqueeze(1)  # [N, 1]
    if bool((freq != 0.0).any() or (presence != 0.0).any()):
        out_ids, _ = _ids_padded_by_repeat(output_token_ids, vocab_size, device)  # [N, Lo]
        # Empty rows are padded with id 0, whose count is 0 there: subtracting 0 is a no-op.
        counts = token_counts(output_token_ids, vocab_size, device).gather(1, out_ids)  # [N, Lo]
        # Two subtractions in vLLM's order, so the result is bit-identical to the dense form.
        values = logits.gather(1, out_ids) - freq * counts - presence * (counts > 0)  # [N, Lo]
        logits.scatter_(1, out_ids, values)
    return logits


def _rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """The rows ``idx`` of ``x``: ``x`` itself when that is all of them, else a copy."""
    if len(idx) == x.shape[0]:
        return x
    return x[torch.tensor(idx, dtype=torch.long, device=x.device)]


def _put_rows(x: torch.Tensor, idx: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Write ``rows`` back into the rows ``idx`` of ``x`` (the inverse of ``_rows``)."""
    if len(idx) == x.shape[0]:
        return rows
    x[torch.tensor(idx, dtype=torch.long, device=x.device)] = rows
    return x


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) logits below each row's k-th largest; ``top_k`` is long ``[N]`` in [1, V]."""
    # Only the k-th largest value per row is needed: a partial topk is much cheaper than a sort.
    largest = logits.topk(int(top_k.max()), dim=-1).values  # [N, k_max], descending
    kth = largest.gather(1, (top_k - 1).unsqueeze(1))  # [N, 1]
    return logits.masked_fill_(logits < kth, _NEG_INF)


def _apply_top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's top-p over a full ascending sort; ``logits`` ``[N, V]``, ``top_p`` ``[N]``."""
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # [N, V], [N, V]
    cum_probs = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)  # [N, V]
    # Ascending order: drop the low tail whose total mass stays within 1 - p.
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)  # [N, V]
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, sorted_idx, sorted_logits)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches p; ``logits`` ``[N, V]``.

    A token is kept iff the mass of the tokens ranked above it is below p (the same rule as
    vLLM's ascending-cumsum form). The nucleus of a real LM distribution is almost always among
    its few hundred most likely tokens, so a partial topk over ``_TOP_P_CANDIDATES`` candidates
    usually decides it exactly; rows whose candidates hold less than p of the mass fall back to
    the full sort. On [64, 49152] float32 (2 cores) the topk costs ~30 ms against ~200 ms.
    """
    vocab_size = logits.shape[1]
    top_p = top_p.to(device=logits.device, dtype=logits.dtype)
    num_candidates = min(vocab_size, _TOP_P_CANDIDATES)
    cand_logits, cand_idx = logits.topk(num_candidates, dim=-1)  # [N, C], descending
    # softmax (a row-local kernel) rather than logsumexp, whose reduction order can depend on
    # the batch size: a seeded row must see bit-identical probabilities in any batch.
    cand_probs = logits.softmax(dim=-1).gather(1, cand_idx)  # [N, C]
    cum_probs = cand_probs.cumsum(dim=-1)  # [N, C]
    mass_above = torch.cat(
        [torch.zeros_like(cum_probs[:, :1]), cum_probs[:, :-1]], dim=1
    )  # [N, C]: mass of the candidates ranked strictly above each one
    keep = mass_above < top_p.unsqueeze(1)  # [N, C]
    keep[:, 0] = True  # the most likely token always survives
    # The first token outside the candidates (and so every later one) is dropped iff the
    # candidates already hold p of the mass; with all of the vocabulary as candidates it always is.
    covered = (
        torch.ones_like(top_p, dtype=torch.bool)
        if num_candidates == vocab_size
        else cum_probs[:, -1] >= top_p
    )  # [N]
    out = torch.full_like(logits, _NEG_INF)  # [N, V]
    out.scatter_(1, cand_idx, cand_logits.masked_fill_(~keep, _NEG_INF))
    if not bool(covered.all()):
        rows = (~covered).nonzero().squeeze(1)  # [U]
        out[rows] = _apply_top_p_sorted(logits[rows], top_p[rows])
    return out


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (-inf) tokens outside the top-k, then outside the top-p nucleus (vLLM semantics).

    ``logits`` is float ``[N, V]`` (may be modified in place; use the returned tensor);
    ``top_k`` is long ``[N]`` with 0 (or >= V) meaning disabled; ``top_p`` is float ``[N]``
    with 1.0 meaning disabled. Ties with the k-th largest logit are kept. Top-p then keeps the
    smallest set of most likely tokens whose mass (renormalised after top-k) reaches p, and
    always at least the most likely token.
    """
    vocab_size = logits.shape[1]
    if top_k is not None:
        top_k = top_k.to(device=logits.device, dtype=torch.long)
        top_k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))  # [N]
        # Only rows that really filter, so one large k does not slow down the others.
        rows = (top_k < vocab_size).nonzero().squeeze(1).tolist()
        if rows:
            filtered = _apply_top_k(_rows(logits, rows), top_k[rows])  # [K, V]
            logits = _put_rows(logits, rows, filtered)
    if top_p is not None:
        # A row with p = 1 keeps everything; running it through top-p would only cost a sort.
        rows = (top_p < 1.0).nonzero().squeeze(1).tolist()
        if rows:
            filtered = _apply_top_p(_rows(logits, rows), top_p[rows])  # [P, V]
            logits = _put_rows(logits, rows, filtered)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) tokens whose probability is below ``min_p * p(most likely token)``.

    ``logits`` is float ``[N, V]`` (modified in place and returned); ``min_p`` is ``[N]``.
    """
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = min_p.to(device=logits.device, dtype=probs.dtype).unsqueeze(1) * probs.amax(
        dim=-1, keepdim=True
    )  # [N, 1]
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def random_sample(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row by the exponential race: ``argmax(probs / Exponential(1))``.

    ``probs`` is float ``[N, V]`` (overwritten). Rows with a generator draw their noise from it,
    row by row, so a seeded request's tokens do not depend on its batch neighbours; the other
    rows share one batched draw from ``default_generator``. Returns long ``[N]``.
    """
    num_rows, vocab_size = probs.shape
    # Exponential(1) by inverse CDF, -log(U): on CPU uniform_ + log_ is ~4x faster than
    # exponential_. U < 1 so the noise is never 0 (no 0/0 NaN for masked tokens); U == 0 gives
    # an infinite draw, which only zeroes that token's score.
    noise = torch.empty_like(probs)  # [N, V]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == num_rows:
        noise.uniform_(generator=default_generator)
    elif unseeded:
        draw = torch.empty(
            (len(unseeded), vocab_size), dtype=probs.dtype, device=probs.device
        ).uniform_(generator=default_generator)  # [U, V]
        noise[torch.tensor(unseeded, dtype=torch.long, device=probs.device)] = draw
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].uniform_(generator=generator)
    # With L = log(U) <= 0 the noise is E = -L, and argmax(probs / E) == argmin(probs / L):
    # dividing by L directly saves a [N, V] negation pass.
    return probs.div_(noise.log_()).argmin(dim=-1)  # [N]


def _sample_random_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and sampling for non-greedy rows.

    ``logits`` is float32 ``[R, V]`` and is not modified. Returns the sampled ids, long ``[R]``.
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    # Out of place on purpose: ``logits`` may be the caller's tensor; everything after this
    # works in place on the fresh result.
    logits = logits / temperature.unsqueeze(1)  # [R, V]

    # The sort (or topk) is the expensive part, so run it only on the rows that filter.
    filter_rows = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if filter_rows:
        need_k = any(params[j].top_k > 0 for j in filter_rows)
        need_p = any(params[j].top_p < 1.0 for j in filter_rows)
        # k >= V keeps every token (the same as disabled): clamp before building the tensor, so
        # a huge k (2**63 from a client) cannot overflow int64.
        vocab_size = logits.shape[1]
        top_k = (
            torch.tensor(
                [min(params[j].top_k, vocab_size) for j in filter_rows],
                dtype=torch.long,
                device=device,
            )
            if need_k
            else None
        )  # [F]
        top_p = (
            torch.tensor([params[j].top_p for j in filter_rows], dtype=logits.dtype, device=device)
            if need_p
            else None
        )  # [F]
        filtered = apply_top_k_top_p(_rows(logits, filter_rows), top_k, top_p)  # [F, V]
        logits = _put_rows(logits, filter_rows, filtered)

    min_p_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if min_p_rows:
        min_p = torch.tensor(
            [params[j].min_p for j in min_p_rows], dtype=logits.dtype, device=device
        )  # [M]
        filtered = apply_min_p(_rows(logits, min_p_rows), min_p)  # [M, V]
        logits = _put_rows(logits, min_p_rows, filtered)

    probs = logits.softmax(dim=-1)  # [R, V]
    return random_sample(probs, generators, default_generator)  # [R]


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row (``[B, V]`` -> ``[B]``), as ``argmax``.

    On CPU a C++ kernel reads bf16 logits in place (~10x faster than widening them to
    float32 first); elsewhere ``max(dim).indices``, ~3x faster than ``argmax`` on CPU.
    """
    if (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and cpu_kernels.available()
    ):
        return cpu_kernels.argmax_rows(logits)
    return logits.float().max(dim=-1).indices


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """Pick one token per row of ``logits`` (``[B, V]``, any float dtype; never modified)."""
    params = md.params
    batch_size, vocab_size = logits.shape
    for name in (
        "params",
        "prompt_token_ids",
        "output_token_ids",
        "generators",
        "min_tokens_stop_ids",
    ):
        if len(getattr(md, name)) != batch_size:
            rows = len(getattr(md, name))
            raise ValueError(f"SamplingMetadata.{name} has {rows} rows, logits have {batch_size}.")

    penalty_rows = [i for i, p in enumerate(params) if _has_penalty(p)]
    min_tokens_active = any(
        stop_ids and len(out) < p.min_tokens
        for p, out, stop_ids in zip(
            params, md.output_token_ids, md.min_tokens_stop_ids, strict=True
        )
    )
    want_logprobs = any(p.logprobs is not None for p in params)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]

    if (
        len(greedy_rows) == batch_size
        and not penalty_rows
        and not min_tokens_active
        and not want_logprobs
    ):
        # Hot path (greedy benchmarks): the first maximum of each row, as argmax.
        return SamplerOutput(greedy_ids(logits).tolist(), None, None)

    raw_logprobs = (
        torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
    )  # [B, V] float32
    # min_tokens and the penalties work in place, so they get a private copy; otherwise x may
    # alias the caller's float32 logits, which is safe because the rest never writes to x
    # (greedy rows only read it, sampled rows start with an out-of-place temperature division).
    in_place = min_tokens_active or bool(penalty_rows)
    x = logits.to(torch.float32, copy=in_place)  # [B, V]

    if min_tokens_active:
        apply_min_tokens(x, params, md.output_token_ids, md.min_tokens_stop_ids)

    if penalty_rows:

        def per_row(attr: str) -> torch.Tensor:
            values = [getattr(params[i], attr) for i in penalty_rows]
            return torch.tensor(values, dtype=torch.float32, device=x.device)  # [P]

        penalised = apply_penalties(
            _rows(x, penalty_rows),
            [md.prompt_token_ids[i] for i in penalty_rows],
            [md.output_token_ids[i] for i in penalty_rows],
            per_row("repetition_penalty"),
            per_row("frequency_penalty"),
            per_row("presence_penalty"),
        )  # [P, V]
        x = _put_rows(x, penalty_rows, penalised)

    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        sampled = x.max(dim=-1).indices  # [B]
    else:
        sampled = torch.empty(batch_size, dtype=torch.long, device=x.device)  # [B]
        if greedy_rows:
            greedy_idx = torch.tensor(greedy_rows, dtype=torch.long, device=x.device)
            sampled[greedy_idx] = x[greedy_idx].max(dim=-1).indices
        random_tokens = _sample_random_rows(
            _rows(x, random_rows),
            [params[i] for i in random_rows],
            [md.generators[i] for i in random_rows],
            md.default_generator,
        )  # [R]
        if len(random_rows) == batch_size:
            sampled = random_tokens
        else:
            sampled[torch.tensor(random_rows, dtype=torch.long, device=x.device)] = random_tokens
    token_ids: list[int] = sampled.tolist()

    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None)

    sampled_logprobs: list[float] = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    top_logprobs: list[dict[int, float] | None] = [None] * batch_size
    ask_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    k_max = min(vocab_size, max(params[i].logprobs or 0 for i in ask_rows))
    top_values: list[list[float]] = [[] for _ in ask_rows]
    top_ids: list[list[int]] = [[] for _ in ask_rows]
    if k_max > 0:
        # One topk for all asking rows; each row then keeps its own first n.
        values, ids = _rows(raw_logprobs, ask_rows).topk(k_max, dim=-1)  # [A, k_max] x 2
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(ask_rows):
        n = min(vocab_size, params[i].logprobs or 0)
        entry = dict(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        entry.setdefault(token_ids[i], sampled_logprobs[i])
        top_logprobs[i] = entry
    return SamplerOutput(token_ids, sampled_logprobs, top_logprobs)
