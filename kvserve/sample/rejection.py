"""Verifying speculative tokens: exact rejection sampling over the target's k + 1 positions.

A request that proposed ``d_1..d_k`` gets k + 1 logits rows from one target forward: row j is
the target's distribution ``p_j`` for the token after the request's tokens and ``d_1..d_j``.
The output keeps the target's distribution exactly (Leviathan et al. 2023; vLLM's
``RejectionSampler``):

- greedy rows: accept ``d_{j+1}`` while it equals ``argmax p_j``; the first row that disagrees
  gives its argmax (so the tokens are those plain greedy decoding would give);
- sampled rows: accept ``d_{j+1}`` with probability ``min(1, p_j(d) / q_j(d))``; at the first
  rejection draw from the residual ``max(p_j - q_j, 0)`` (normalised) and stop. Proposers that
  propose deterministically (n-gram lookup, a greedy draft) have ``q_j`` one-hot on ``d``,
  so the test is ``u < p_j(d)`` and the residual is ``p_j`` without ``d``;
- when every proposal is accepted, a bonus token is drawn from ``p_k``.

``p_j`` is the distribution plain sampling would use at that position: the same bitmask-free
processing chain (``sampler._process_logits`` with the proposals as output history, so
penalties and min_tokens see the tokens before each position) and the same temperature /
top-k / top-p / min-p. A seeded request draws its uniforms and residual noise from its own
generator, in a fixed order, so it stays reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.sample.logits_processors import has_seam
from kvserve.sample.sampler import (
    SamplerOutput,
    SamplingMetadata,
    _check_rows,
    _check_some_token_allowed,
    _has_penalty,
    _logprobs_output,
    _min_tokens_active,
    _process_logits,
    random_sample,
    target_probs,
)
from kvserve.sampling_params import SamplingParams


@dataclass
class SpecSamplerOutput:
    """Per request: its accepted tokens (1..k + 1) and, when asked, their logprobs."""

    token_ids: list[list[int]]  # per request: accepted proposals, then one target token
    # per request, per accepted token: its raw logprob / top-n dict / rank; None when no
    # request asked for logprobs
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[dict[int, float] | None]] | None = None
    ranks: list[list[int]] | None = None


def expand_for_verification(
    md: SamplingMetadata, drafts: Sequence[Sequence[int]]
) -> SamplingMetadata:
    """Per-request metadata ``md`` (one row each) -> one row per verified position: row j of
    a request sees its output plus ``d_1..d_j`` (penalties, bad_words, min_tokens)."""
    rows: dict[str, list] = {k: [] for k in ("params", "prompt", "out", "gens", "stop")}
    for i, draft in enumerate(drafts):
        p = md.params[i]
        for j in range(len(draft) + 1):
            out = [*md.output_token_ids[i], *draft[:j]]
            rows["params"].append(p)
            rows["prompt"].append(md.prompt_token_ids[i])
            rows["out"].append(out)
            rows["gens"].append(md.generators[i])
            stop = md.min_tokens_stop_ids[i]
            rows["stop"].append(stop if len(out) < p.min_tokens else [])
    return SamplingMetadata(
        params=rows["params"],
        prompt_token_ids=rows["prompt"],
        output_token_ids=rows["out"],
        generators=rows["gens"],
        min_tokens_stop_ids=rows["stop"],
        default_generator=md.default_generator,
    )


def rejection_sample(
    logits: torch.Tensor,
    md: SamplingMetadata,
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> SpecSamplerOutput:
    """Accepted tokens per request. ``logits`` ``[sum(k_i + 1), V]`` (never modified), row
    after row per request; ``md`` one row per logits row (``expand_for_verification``);
    ``drafts[i]`` the k_i proposals of request i; ``draft_probs[i]`` float ``[k_i, V]`` its
    proposal distributions, or None for a deterministic proposal (one-hot q)."""
    _check_rows(logits, md)
    params = md.params
    changes = any(has_seam(p) or _has_penalty(p) for p in params) or _min_tokens_active(md)
    x = logits.to(torch.float32, copy=True)  # [R, V]
    want_logprobs = any(p.logprobs is not None for p in params)
    raw_logprobs = torch.log_softmax(x, dim=-1) if want_logprobs else None  # [R, V]
    x = _process_logits(x, md)
    if changes:
        _check_some_token_allowed(x)
    greedy_ids: list[int] = x.max(dim=-1).indices.tolist()  # [R]
    random_rows = [r for r, p in enumerate(params) if not p.greedy]
    probs = None
    if random_rows:
        probs = torch.zeros_like(x)  # [R, V]; only the sampled requests' rows are filled
        index = torch.tensor(random_rows, dtype=torch.long, device=x.device)
        probs[index] = target_probs(x[index], [params[r] for r in random_rows])
    accepted: list[list[int]] = []
    row = 0
    for i, draft in enumerate(drafts):
        if params[row].greedy:
            accepted.append(_accept_greedy(draft, greedy_ids[row : row + len(draft) + 1]))
        else:
            assert probs is not None
            q = None if draft_probs is None else draft_probs[i]
            gen = md.generators[row] or md.default_generator
            accepted.append(_accept_sampled(draft, probs[row : row + len(draft) + 1], q, gen))
        row += len(draft) + 1
    if raw_logprobs is None:
        return SpecSamplerOutput(accepted)
    return _spec_logprobs(raw_logprobs, accepted, drafts, params)


def _accept_greedy(draft: Sequence[int], target: list[int]) -> list[int]:
    """Proposals while they equal the target's argmax, then the target's own token."""
    out: list[int] = []
    for d, t in zip(draft, target, strict=False):
        if d != t:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def _accept_sampled(
    draft: Sequence[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    gen: torch.Generator | None,
) -> list[int]:
    """Speculative sampling for one request: ``p`` ``[k + 1, V]`` target probabilities,
    ``q`` ``[k, V]`` proposal probabilities (None: one-hot on the proposals)."""
    k = len(draft)
    uniforms: list[float] = torch.rand(k, generator=gen, device=p.device).tolist()  # [k]
    d = torch.tensor(list(draft), dtype=torch.long, device=p.device)  # [k]
    pos = torch.arange(k, device=p.device)
    p_d: list[float] = p[pos, d].tolist()  # [k] target probability of each proposal
    q_d: list[float] = [1.0] * k if q is None else q[pos, d].tolist()
    out: list[int] = []
    for j in range(k):
        if q_d[j] > 0 and uniforms[j] < p_d[j] / q_d[j]:
            out.append(draft[j])
            continue
        if q is None:
            residual = p[j].clone()  # [V]
            residual[draft[j]] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)  # [V]
        if not bool(residual.sum() > 0):
            residual = p[j].clone()  # p <= q everywhere means p == q: nothing to correct
        out.append(_draw(residual, gen))
        return out
    out.append(_draw(p[k].clone(), gen))  # every proposal accepted: a bonus token from p_k
    return out


def _draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token with probability proportional to ``weights`` ``[V]`` (unnormalised)."""
    return int(random_sample(weights.unsqueeze(0), [gen], gen)[0])  # the exponential race


def _spec_logprobs(
    raw_logprobs: torch.Tensor,
    accepted: list[list[int]],
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
) -> SpecSamplerOutput:
    """Each accepted token's logprob, rank and top-n from its own position's raw logits."""
    rows: list[int] = []
    tokens: list[int] = []
    row = 0
    for draft, toks in zip(drafts, accepted, strict=True):
        rows.extend(range(row, row + len(toks)))
        tokens.extend(toks)
        row += len(draft) + 1
    index = torch.tensor(rows, dtype=torch.long, device=raw_logprobs.device)
    chosen = torch.tensor(tokens, dtype=torch.long, device=raw_logprobs.device)
    res: SamplerOutput = _logprobs_output(
        raw_logprobs[index], chosen, tokens, [params[r] for r in rows]
    )
    out = SpecSamplerOutput(accepted, [], [], [])
    start = 0
    for toks in accepted:
        end = start + len(toks)
        assert out.logprobs is not None and out.top_logprobs is not None and out.ranks is not None
        out.logprobs.append((res.sampled_logprobs or [])[start:end])
        out.top_logprobs.append((res.top_logprobs or [])[start:end])
        out.ranks.append((res.sampled_ranks or [])[start:end])
        start = end
    return out
