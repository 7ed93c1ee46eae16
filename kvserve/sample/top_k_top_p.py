"""Top-k, top-p and min-p: the filters that run after temperature on sampled rows.

Pure functions over float ``[N, V]`` logits with vLLM's semantics, and the row helpers the
sampler uses to run any step on only the rows that need it. The sampler's step path calls the
``*_rows`` forms, which take the per-row settings as host lists (from the requests'
``SamplingParams``), so no decision waits for a device tensor; the tensor-argument forms are
the public API (and the tests' reference), which read their arguments back first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.sample.host_io import to_device

_NEG_INF = float("-inf")
# How many of the most likely tokens top-p inspects before falling back to a full sort.
_TOP_P_CANDIDATES = 1024


def take_rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """The rows ``idx`` of ``x``: ``x`` itself when that is all of them, else a copy."""
    if len(idx) == x.shape[0]:
        return x
    return x[to_device(idx, torch.long, x.device)]


def put_rows(x: torch.Tensor, idx: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Write ``rows`` back into the rows ``idx`` of ``x`` (the inverse of ``_rows``)."""
    if len(idx) == x.shape[0]:
        return rows
    x[to_device(idx, torch.long, x.device)] = rows
    return x


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Mask (-inf) logits below each row's k-th largest; ``top_k`` is long ``[N]`` in [1, V],
    ``k_max`` its largest value (known on the host)."""
    # Only the k-th largest value per row is needed: a partial topk is much cheaper than a sort.
    largest = logits.topk(k_max, dim=-1).values  # [N, k_max], descending
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


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, sync_free: bool) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches p; ``logits`` ``[N, V]``.

    A token is kept iff the mass of the tokens ranked above it is below p (the same rule as
    vLLM's ascending-cumsum form). The nucleus of a real LM distribution is almost always among
    its few hundred most likely tokens, so a partial topk over ``_TOP_P_CANDIDATES`` candidates
    usually decides it exactly; rows whose candidates hold less than p of the mass fall back to
    the full sort. On [64, 49152] float32 (2 cores) the topk costs ~30 ms against ~200 ms.
    Knowing which rows fall back means reading ``covered``: free on the CPU, a host sync on
    an accelerator; so with ``sync_free`` every token is a candidate (one full descending sort,
    the same formula) and no row falls back.
    """
    vocab_size = logits.shape[1]
    top_p = top_p.to(device=logits.device, dtype=logits.dtype)
    num_candidates = vocab_size if sync_free else min(vocab_size, _TOP_P_CANDIDATES)
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
    out = torch.full_like(logits, _NEG_INF)  # [N, V]
    out.scatter_(1, cand_idx, cand_logits.masked_fill_(~keep, _NEG_INF))
    if num_candidates == vocab_size:
        return out  # every token was a candidate: nothing outside them to decide
    # The first token outside the candidates (and so every later one) is dropped iff the
    # candidates already hold p of the mass.
    covered = cum_probs[:, -1] >= top_p  # [N]
    if not bool(covered.all()):  # only without sync_free, i.e. on the CPU
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
    always at least the most likely token. Reads ``top_k`` and ``top_p`` back to the host
    (the sampler's step path calls ``top_k_top_p_rows`` instead).
    """
    ks = None if top_k is None else [int(k) for k in top_k.tolist()]
    ps = None if top_p is None else [float(p) for p in top_p.tolist()]
    return top_k_top_p_rows(logits, ks, ps, sync_free=False)


def top_k_top_p_rows(
    logits: torch.Tensor,
    top_k: Sequence[int] | None,
    top_p: Sequence[float] | None,
    *,
    sync_free: bool,
) -> torch.Tensor:
    """``apply_top_k_top_p`` with each row's k and p as host values (``top_p`` as the logits'
    dtype holds them: the sampler rounds to float32 first); ``sync_free`` keeps every step on
    the device (see ``_apply_top_p``). ``logits`` float ``[N, V]``, modified in place."""
    vocab_size = logits.shape[1]
    if top_k is not None:
        # k <= 0 or k >= V keeps every token; clamping first keeps a huge k (2**63) harmless.
        ks = [vocab_size if k <= 0 else min(k, vocab_size) for k in top_k]
        # Only rows that really filter, so one large k does not slow down the others.
        rows = [i for i, k in enumerate(ks) if k < vocab_size]
        if rows:
            k_rows = [ks[i] for i in rows]
            k_tensor = to_device(k_rows, torch.long, logits.device)  # [K]
            filtered = _apply_top_k(take_rows(logits, rows), k_tensor, max(k_rows))  # [K, V]
            logits = put_rows(logits, rows, filtered)
    if top_p is not None:
        # A row with p = 1 keeps everything; running it through top-p would only cost a sort.
        rows = [i for i, p in enumerate(top_p) if p < 1.0]
        if rows:
            p_tensor = to_device([top_p[i] for i in rows], logits.dtype, logits.device)  # [P]
            filtered = _apply_top_p(take_rows(logits, rows), p_tensor, sync_free)  # [P, V]
            logits = put_rows(logits, rows, filtered)
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
