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

All requests are verified at once as tensors (issue 35: no host sync but the one read of the
results): the proposals are padded to ``[N, K]``, acceptance is a cumulative product over the
accept flags, and the token after the accepted prefix is a residual draw at every position and
a bonus draw, of which the right one is gathered. Each sampled request still draws its k
uniforms and then one noise vector from its generator, in request order, exactly as the
per-request loop did, so seeded (and engine-seeded) requests keep their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.sample.host_io import read_back, to_device
from kvserve.sample.logits_processors import has_seam
from kvserve.sample.logprobs import DeviceLogprobs, logprobs_on_device, logprobs_on_host
from kvserve.sample.sampler import (
    SamplingMetadata,
    _check_rows,
    _has_penalty,
    _min_tokens_active,
    _process_logits,
    dead_rows,
    log_uniform_noise,
    raise_if_dead,
    target_probs,
)
from kvserve.sample.top_k_top_p import put_rows
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
    proposal distributions (used as float32), or None for a deterministic proposal (one-hot
    q)."""
    return verify_on_device(logits, md, drafts, draft_probs).to_host(md.params)


@dataclass(frozen=True)
class _Layout:
    """Where each request's positions sit: N requests, K = the longest proposal."""

    starts: list[int]  # per request: its first logits row
    lengths: list[int]  # per request: k_i
    rows: torch.Tensor  # long [N, K + 1]: logits row of position j (past k_i: row k_i again)
    drafts: torch.Tensor  # long [N, K]: the proposals, 0 past k_i
    valid: torch.Tensor  # bool [N, K]: j < k_i

    @staticmethod
    def build(drafts: Sequence[Sequence[int]], device: torch.device) -> _Layout:
        lengths = [len(d) for d in drafts]
        width = max(lengths, default=0)
        starts, rows, padded, valid = [], [], [], []
        start = 0
        for d in drafts:
            k = len(d)
            starts.append(start)
            rows.append([start + min(j, k) for j in range(width + 1)])
            padded.append([*d, *([0] * (width - k))])
            valid.append([j < k for j in range(width)])
            start += k + 1
        return _Layout(
            starts,
            lengths,
            to_device(rows, torch.long, device).reshape(len(drafts), width + 1),
            to_device(padded, torch.long, device).reshape(len(drafts), width),
            to_device(valid, torch.bool, device).reshape(len(drafts), width),
        )


@dataclass
class DeviceVerification:
    """Verification results on the device; ``to_host`` is the call's one read."""

    tokens: torch.Tensor  # long [N, K + 1]: per request, its first counts[i] are the output
    counts: torch.Tensor  # long [N]: accepted proposals + 1
    layout: _Layout
    dead: torch.Tensor | None  # bool [R]: logits rows where no token is allowed
    logprobs: DeviceLogprobs | None  # over the N * (K + 1) positions of ``tokens``

    def to_host(self, params: Sequence[SamplingParams]) -> SpecSamplerOutput:
        extra = [] if self.dead is None else [self.dead]
        lp = [] if self.logprobs is None else self.logprobs.tensors()
        values = read_back([self.tokens, self.counts, *extra, *lp])
        if self.dead is not None:
            raise_if_dead([-1 if d else 0 for d in values[2]])
        width = self.tokens.shape[1]
        flat = [int(t) for t in values[0]]
        counts = [int(c) for c in values[1]]
        accepted = [flat[i * width : i * width + c] for i, c in enumerate(counts)]
        if self.logprobs is None:
            return SpecSamplerOutput(accepted)
        row_params = [params[r] for r in _flat_rows(self.layout)]
        lps, tops, ranks = logprobs_on_host(self.logprobs, values[-4:], flat, row_params)
        out = SpecSamplerOutput(accepted, [], [], [])
        assert out.logprobs is not None and out.top_logprobs is not None and out.ranks is not None
        for i, c in enumerate(counts):
            out.logprobs.append(lps[i * width : i * width + c])
            out.top_logprobs.append(tops[i * width : i * width + c])
            out.ranks.append(ranks[i * width : i * width + c])
        return out


def verify_on_device(
    logits: torch.Tensor,
    md: SamplingMetadata,
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> DeviceVerification:
    """``rejection_sample`` up to the read of its results: no host sync."""
    _check_rows(logits, md)
    params = md.params
    changes = any(has_seam(p) or _has_penalty(p) for p in params) or _min_tokens_active(md)
    x = logits.to(torch.float32, copy=True)  # [R, V]
    want_logprobs = any(p.logprobs is not None for p in params)
    raw_logprobs = torch.log_softmax(x, dim=-1) if want_logprobs else None  # [R, V]
    x = _process_logits(x, md)
    layout = _Layout.build(drafts, x.device)
    # Greedy requests: the target's argmax at every position; the proposals are accepted
    # while they equal it, so the output is that argmax up to the first disagreement.
    tokens = x.max(dim=-1).indices[layout.rows]  # [N, K + 1]
    agree = (layout.drafts == tokens[:, :-1]) & layout.valid  # [N, K]
    counts = agree.long().cumprod(dim=1).sum(dim=1) + 1  # [N]
    sampled = [i for i, start in enumerate(layout.starts) if not params[start].greedy]
    if sampled:
        s_tokens, s_counts = _verify_sampled(x, md, layout, sampled, draft_probs)
        tokens = put_rows(tokens, sampled, s_tokens)
        counts = put_rows(counts, sampled, s_counts)
    logprobs = None
    if raw_logprobs is not None:
        flat_rows = layout.rows.reshape(-1)  # [N * (K + 1)]
        row_params = [params[r] for r in _flat_rows(layout)]
        logprobs = logprobs_on_device(raw_logprobs[flat_rows], tokens.reshape(-1), row_params)
    dead = dead_rows(x) if changes else None
    return DeviceVerification(tokens, counts, layout, dead, logprobs)


def _flat_rows(layout: _Layout) -> list[int]:
    """``layout.rows`` flattened, computed on the host."""
    width = layout.rows.shape[1]
    return [
        s + min(j, k)
        for s, k in zip(layout.starts, layout.lengths, strict=True)
        for j in range(width)
    ]


def _verify_sampled(
    x: torch.Tensor,
    md: SamplingMetadata,
    layout: _Layout,
    sampled: list[int],
    draft_probs: Sequence[torch.Tensor | None] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for the requests ``sampled`` (indices into the layout) on the
    processed logits ``x`` ``[R, V]``. Returns their tokens ``[S, K + 1]`` and counts ``[S]``."""
    params, device = md.params, x.device
    width = layout.drafts.shape[1]  # K
    rows = layout.rows[to_device(sampled, torch.long, device)]  # [S, K + 1]
    # The distributions of every position of these requests (row-local, so the same values
    # as request by request), arranged [S, K + 1, V].
    row_params = [params[layout.starts[i]] for i in sampled for _ in range(width + 1)]
    p = target_probs(x[rows.reshape(-1)], row_params, md.resolved_sync_free(device))
    p = p.reshape(len(sampled), width + 1, -1)  # [S, K + 1, V]
    d = layout.drafts[to_device(sampled, torch.long, device)]  # [S, K]
    valid = layout.valid[to_device(sampled, torch.long, device)]  # [S, K]
    uniforms, log_noise = _draws(md, layout, sampled, p)  # [S, K] float32, [S, V]
    p_d = p[:, :width].gather(2, d.unsqueeze(2)).squeeze(2)  # [S, K]
    # q one-hot on the proposal: q(d) = 1 and the residual is p without d.
    q_d = torch.ones_like(p_d)  # [S, K]
    residual = p[:, :width].clone().scatter_(2, d.unsqueeze(2), 0.0)  # [S, K, V]
    with_q = [
        s for s, i in enumerate(sampled) if draft_probs is not None and draft_probs[i] is not None
    ]
    if with_q:
        assert draft_probs is not None
        q = torch.zeros((len(with_q), width, p.shape[2]), dtype=p.dtype, device=device)
        for m, s in enumerate(with_q):
            qi = draft_probs[sampled[s]]
            assert qi is not None
            q[m, : qi.shape[0]] = qi.to(device=device, dtype=p.dtype)
        idx = to_device(with_q, torch.long, device)  # [Sq]
        q_d[idx] = q.gather(2, d[idx].unsqueeze(2)).squeeze(2)
        residual[idx] = (p[idx, :width] - q).clamp_(min=0.0)
    # p <= q everywhere means p == q: nothing to correct, draw from p itself
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p[:, :width])
    # Accept while u < p(d) / q(d), in float64 as the per-request loop compared them.
    accept = (q_d > 0) & (uniforms.double() < p_d.double() / q_d.double()) & valid  # [S, K]
    n_acc = accept.long().cumprod(dim=1).sum(dim=1)  # [S]
    # The token after the accepted prefix: the residual draw at a rejected position, the
    # bonus draw from p_k when all k were accepted (the exponential race, one noise vector).
    k = to_device([layout.lengths[i] for i in sampled], torch.long, device)  # [S]
    recovered = residual.div_(log_noise.unsqueeze(1)).argmin(dim=-1)  # [S, K]
    p_k = p[torch.arange(len(sampled), device=device), k]  # [S, V]
    bonus = p_k.div(log_noise).argmin(dim=-1)  # [S]
    nxt = torch.cat([recovered, bonus.unsqueeze(1)], dim=1).scatter_(
        1, k.unsqueeze(1), bonus.unsqueeze(1)
    )  # [S, K + 1]: position k_i holds the bonus
    last = nxt.gather(1, n_acc.unsqueeze(1))  # [S, 1]
    pad = torch.zeros((len(sampled), 1), dtype=d.dtype, device=device)  # [S, 1]
    out = torch.cat([d, pad], dim=1).scatter_(1, n_acc.unsqueeze(1), last)
    return out, n_acc + 1  # [S, K + 1], [S]


def _draws(
    md: SamplingMetadata, layout: _Layout, sampled: list[int], p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sampled request's k uniforms, then one log-uniform noise vector, from its generator
    (or the default one), request after request: the order the per-request loop drew them in.
    Returns ``[S, K]`` (padded with 1: never accepted) and ``[S, V]``."""
    width, vocab_size = p.shape[1] - 1, p.shape[2]
    uniforms, noise = [], []
    for i in sampled:
        gen = md.generators[layout.starts[i]] or md.default_generator
        u = torch.rand(layout.lengths[i], generator=gen, device=p.device)  # [k]
        pad = torch.ones(width - layout.lengths[i], dtype=u.dtype, device=p.device)
        uniforms.append(torch.cat([u, pad]))
        like = torch.empty((1, vocab_size), dtype=p.dtype, device=p.device)
        noise.append(log_uniform_noise(like, [gen], gen))  # [1, V]
    return torch.stack(uniforms), torch.cat(noise)
