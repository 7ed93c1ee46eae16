"""Batched token sampler: one call per engine step over the logits of every request in the batch.

The math lives in small pure functions over tensors (``logits_processors.py`` for what changes
logits; ``apply_top_k_top_p``, ``apply_min_p``, ``random_sample`` here) so each step can be
tested on its own; ``sample`` strings them together with vLLM's semantics and order:

1. the grammar's token bitmask (structured outputs) on its rows;
2. logprobs (when asked) come from these logits, like vLLM's default
   ``logprobs_mode="raw_logprobs"`` (vLLM applies the bitmask in the runner, before them);
3. the seam: allowed_token_ids, bad_words, logit_bias, each request's own logits processors;
4. min_tokens mask -> repetition / frequency / presence penalties;
5. greedy rows (temperature < 1e-5) take the argmax of the processed logits;
6. the other rows: divide by temperature -> top-k -> top-p -> min-p -> softmax -> sample with the
   exponential race ``argmax(probs / Exponential(1))``, which lets a seeded row draw its noise from
   its own ``torch.Generator`` and so stay reproducible whatever else is in the batch.

No host sync inside a call but the one read of its results (issue 35): ``sample_on_device``
decides every branch from the host-side ``SamplingParams`` (which rows filter, penalise,
sample), moves host data with non-blocking copies (``host_io``) and leaves ids, logprobs and
the "no token allowed" flags on the device; ``DeviceSample.to_host`` reads them all at once
(``tests/sample/test_no_host_sync.py`` fails on any other read). A seeded row draws the same
noise, so its tokens are those the per-row code gave before.

Every helper tensor is built only for the rows (and only in the steps) that need it, and the common
benchmark case - an all-greedy batch with nothing of 1-4 - is a single argmax, done by a C++ kernel
that reads bf16 logits in place: anything that changes logits (a bitmask included) leaves that path
and works on a float32 copy, so the caller's logits are never modified.
Other cost choices, each explained where it is made: penalties gather/scatter only the seen ids;
top-k alone is a partial ``topk``; top-p first tries a partial ``topk`` of 1024 candidates and
sorts the whole row only when the nucleus does not fit in them; the Exponential(1) noise is drawn
as ``-log(U)``, which is much faster than ``exponential_`` on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvserve.ops import cpu_kernels
from kvserve.sample.custom_processors import LogitsProcessor
from kvserve.sample.host_io import as_float32, read_back, to_device
from kvserve.sample.logits_processors import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_custom_processors,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    apply_token_bitmask_rows,
    has_seam,
    token_counts,
)
from kvserve.sample.logprobs import DeviceLogprobs, logprobs_on_device, logprobs_on_host
from kvserve.sample.top_k_top_p import (
    apply_min_p,
    apply_top_k_top_p,
    put_rows,
    take_rows,
    top_k_top_p_rows,
)
from kvserve.sampling_params import SamplingParams

__all__ = [
    "DeviceSample",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_top_k_top_p",
    "random_sample",
    "sample",
    "sample_on_device",
    "token_counts",
]


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
    # Structured outputs: int32 [G, ceil(V / 32)] packed allowed-token bits (xgrammar's layout),
    # one row per constrained logits row, and the logits row each bitmask row applies to.
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: list[int] = field(default_factory=list)
    # the engine's custom batch-level processors, already told this call's rows
    batch_processors: list[LogitsProcessor] = field(default_factory=list)
    # Never read a device tensor before the results (one read per call). None: everywhere but
    # on the CPU, where a read waits for nothing and top-p's value-dependent shortcut (a
    # partial topk, a full sort only for rows it does not decide) is ~7x cheaper; True on the
    # CPU runs the accelerator's code (the no-sync test does).
    sync_free: bool | None = None

    def resolved_sync_free(self, device: torch.device) -> bool:
        return device.type != "cpu" if self.sync_free is None else self.sync_free

    def row(self, i: int) -> SamplingMetadata:
        """Row ``i`` as a one-row ``SamplingMetadata`` (per-row retries)."""
        mask, rows = None, []
        if i in self.token_bitmask_rows and self.token_bitmask is not None:
            j = self.token_bitmask_rows.index(i)
            mask, rows = self.token_bitmask[j : j + 1], [0]  # [1, W]
        return SamplingMetadata(
            params=[self.params[i]],
            prompt_token_ids=[self.prompt_token_ids[i]],
            output_token_ids=[self.output_token_ids[i]],
            generators=[self.generators[i]],
            min_tokens_stop_ids=[self.min_tokens_stop_ids[i]],
            default_generator=self.default_generator,
            token_bitmask=mask,
            token_bitmask_rows=rows,
            sync_free=self.sync_free,
        )


@dataclass
class SamplerOutput:
    """What ``sample`` returns: one entry per row of the logits."""

    sampled_token_ids: list[int]  # per row: the chosen token id
    # per row: raw logprob of the sampled token; None when no row asked for logprobs
    sampled_logprobs: list[float] | None
    # per row: {token_id: raw logprob} of the top `params.logprobs` tokens plus the sampled one,
    # None for rows that did not ask; the whole field is None when no row asked
    top_logprobs: list[dict[int, float] | None] | None
    # per row: 1-based rank of the sampled token in the raw logprobs (vLLM's: the number of
    # tokens at least as likely); None when no row asked for logprobs
    sampled_ranks: list[int] | None = None


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


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
    # Exponential(1) by inverse CDF, -log(U): on CPU uniform_ + log_ is ~4x faster than
    # exponential_. U < 1 so the noise is never 0 (no 0/0 NaN for masked tokens); U == 0 gives
    # an infinite draw, which only zeroes that token's score.
    return probs.div_(log_uniform_noise(probs, generators, default_generator)).argmin(dim=-1)


def log_uniform_noise(
    like: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``log(U)`` for ``U ~ Uniform[0, 1)`` shaped like ``like`` ``[N, V]``: a seeded row draws
    from its own generator, the others share one draw from ``default_generator``.

    With L = log(U) <= 0 the Exponential(1) noise is E = -L, and argmax(p / E) == argmin(p / L):
    dividing by L directly saves a [N, V] negation pass.
    """
    num_rows, vocab_size = like.shape
    noise = torch.empty_like(like)  # [N, V]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == num_rows:
        noise.uniform_(generator=default_generator)
    elif unseeded:
        draw = torch.empty(
            (len(unseeded), vocab_size), dtype=like.dtype, device=like.device
        ).uniform_(generator=default_generator)  # [U, V]
        noise[to_device(unseeded, torch.long, like.device)] = draw
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].uniform_(generator=generator)
    return noise.log_()  # [N, V]


def _sample_random_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None,
    sync_free: bool,
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and sampling for non-greedy rows.

    ``logits`` is float32 ``[R, V]`` and is not modified. Returns the sampled ids, long ``[R]``.
    """
    probs = target_probs(logits, params, sync_free)  # [R, V]
    return random_sample(probs, generators, default_generator)  # [R]


def target_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams], sync_free: bool = False
) -> torch.Tensor:
    """The distribution non-greedy rows sample from: temperature, top-k, top-p, min-p, softmax.

    ``logits`` is float32 ``[R, V]`` and is not modified. Returns float32 ``[R, V]``. Every
    branch is decided from ``params``; ``sync_free`` as in ``SamplingMetadata``.
    """
    device = logits.device
    temperature = to_device([p.temperature for p in params], logits.dtype, device)  # [R]
    # Out of place on purpose: ``logits`` may be the caller's tensor; everything after this
    # works in place on the fresh result.
    logits = logits / temperature.unsqueeze(1)  # [R, V]

    # The sort (or topk) is the expensive part, so run it only on the rows that filter.
    filter_rows = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if filter_rows:
        need_k = any(params[j].top_k > 0 for j in filter_rows)
        need_p = any(params[j].top_p < 1.0 for j in filter_rows)
        top_k = [params[j].top_k for j in filter_rows] if need_k else None  # [F]
        # p as the float32 kernel compares it (a p just below 1 rounds to 1: no filter)
        top_p = as_float32([params[j].top_p for j in filter_rows]) if need_p else None  # [F]
        filtered = top_k_top_p_rows(
            take_rows(logits, filter_rows), top_k, top_p, sync_free=sync_free
        )  # [F, V]
        logits = put_rows(logits, filter_rows, filtered)

    min_p_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if min_p_rows:
        min_p = to_device([params[j].min_p for j in min_p_rows], logits.dtype, device)  # [M]
        filtered = apply_min_p(take_rows(logits, min_p_rows), min_p)  # [M, V]
        logits = put_rows(logits, min_p_rows, filtered)
    return logits.softmax(dim=-1)  # [R, V]


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


def _check_rows(logits: torch.Tensor, md: SamplingMetadata) -> None:
    batch_size = logits.shape[0]
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
    if md.token_bitmask is not None and md.token_bitmask.shape[0] != len(md.token_bitmask_rows):
        raise ValueError("SamplingMetadata.token_bitmask and token_bitmask_rows differ in rows.")


def _apply_seam(x: torch.Tensor, md: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    """allowed_token_ids, bad_words, logit_bias and custom processors on ``rows`` of ``x``."""
    params = md.params
    sub = take_rows(x, rows)  # [S, V]
    allowed = [j for j, i in enumerate(rows) if params[i].allowed_token_ids]
    if allowed:
        ids = [params[rows[j]].allowed_token_ids or [] for j in allowed]
        sub = put_rows(sub, allowed, apply_allowed_token_ids(take_rows(sub, allowed), ids))
    words = [j for j, i in enumerate(rows) if params[i].bad_words_token_ids]
    if words:
        ids = [params[rows[j]].bad_words_token_ids for j in words]
        outs = [md.output_token_ids[rows[j]] for j in words]
        sub = put_rows(sub, words, apply_bad_words(take_rows(sub, words), ids, outs))
    biased = [j for j, i in enumerate(rows) if params[i].logit_bias]
    if biased:
        biases = [params[rows[j]].logit_bias or {} for j in biased]
        sub = put_rows(sub, biased, apply_logit_bias(take_rows(sub, biased), biases))
    custom = [j for j, i in enumerate(rows) if params[i].logits_processors]
    if custom:
        fns = [params[rows[j]].logits_processors or [] for j in custom]
        prompts = [md.prompt_token_ids[rows[j]] for j in custom]
        outs = [md.output_token_ids[rows[j]] for j in custom]
        processed = apply_custom_processors(take_rows(sub, custom), fns, prompts, outs)
        sub = put_rows(sub, custom, processed)
    return put_rows(x, rows, sub)


def _process_logits(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Steps 3-4 of the module docstring on the float32 logits ``x`` ``[B, V]`` (in place)."""
    params = md.params
    seam_rows = [i for i, p in enumerate(params) if has_seam(p)]
    if seam_rows:
        x = _apply_seam(x, md, seam_rows)
    for proc in _active_processors(md):
        x = proc.apply(x)  # [B, V]
    if _min_tokens_active(md):
        apply_min_tokens(x, params, md.output_token_ids, md.min_tokens_stop_ids)
    penalty_rows = [i for i, p in enumerate(params) if _has_penalty(p)]
    if penalty_rows:
        # float32 as the kernel holds them, so the flags below match the tensors exactly
        rep, freq, pres = (
            as_float32([getattr(params[i], attr) for i in penalty_rows])
            for attr in ("repetition_penalty", "frequency_penalty", "presence_penalty")
        )
        penalised = apply_penalties(
            take_rows(x, penalty_rows),
            [md.prompt_token_ids[i] for i in penalty_rows],
            [md.output_token_ids[i] for i in penalty_rows],
            to_device(rep, torch.float32, x.device),  # [P]
            to_device(freq, torch.float32, x.device),  # [P]
            to_device(pres, torch.float32, x.device),  # [P]
            repetition=any(v != 1.0 for v in rep),
            additive=any(v != 0.0 for v in freq + pres),
        )  # [P, V]
        x = put_rows(x, penalty_rows, penalised)
    return x


def _active_processors(md: SamplingMetadata) -> list[LogitsProcessor]:
    """Custom processors that can change this call's tokens (argmax-invariant ones are skipped
    when every row is greedy, as vLLM allows)."""
    if all(p.greedy for p in md.params):
        return [p for p in md.batch_processors if not p.is_argmax_invariant()]
    return md.batch_processors


def _min_tokens_active(md: SamplingMetadata) -> bool:
    return any(
        stop_ids and len(out) < p.min_tokens
        for p, out, stop_ids in zip(
            md.params, md.output_token_ids, md.min_tokens_stop_ids, strict=True
        )
    )


def _pick_tokens(x: torch.Tensor, md: SamplingMetadata, sync_free: bool) -> torch.Tensor:
    """Argmax for greedy rows, temperature/top-k/top-p/min-p sampling for the others; ``x`` is
    float32 ``[B, V]`` and is not modified. Returns long ``[B]``."""
    params = md.params
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return x.max(dim=-1).indices  # [B]
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    sampled = torch.empty(x.shape[0], dtype=torch.long, device=x.device)  # [B]
    if greedy_rows:
        greedy_idx = to_device(greedy_rows, torch.long, x.device)  # [G]
        sampled[greedy_idx] = x[greedy_idx].max(dim=-1).indices
    random_tokens = _sample_random_rows(
        take_rows(x, random_rows),
        [params[i] for i in random_rows],
        [md.generators[i] for i in random_rows],
        md.default_generator,
        sync_free,
    )  # [R]
    if len(random_rows) == x.shape[0]:
        return random_tokens
    sampled[to_device(random_rows, torch.long, x.device)] = random_tokens
    return sampled


class NoTokenAllowedError(ValueError):
    """A row's own constraints exclude every token (the runner fails that request alone)."""


# The start of NoTokenAllowedError's message: the server answers such a failure with a 400.
NO_TOKEN_ALLOWED = "no token is allowed"


def dead_rows(x: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: rows of the processed logits ``[B, V]`` that are -inf everywhere (the
    request's grammar, allowed_token_ids, bad_words and min_tokens contradict each other, for
    example min_tokens beyond the point where the grammar can only end). Left on the device:
    the caller marks those rows' ids -1 and ``raise_if_dead`` reports them after the read."""
    return torch.isneginf(x.amax(dim=-1))  # [B]


def raise_if_dead(token_ids: Sequence[int]) -> None:
    """Raise ``NoTokenAllowedError`` for the rows whose id came back as -1 (``dead_rows``)."""
    rows = [i for i, t in enumerate(token_ids) if t < 0]
    if rows:
        raise NoTokenAllowedError(
            f"{NO_TOKEN_ALLOWED} at this position (rows {rows}): the request's structured "
            "output grammar, allowed_token_ids, bad_words and min_tokens together exclude "
            "every token"
        )


@dataclass
class DeviceSample:
    """A sampler call's results, still on the device; ``to_host`` is the call's one read."""

    token_ids: torch.Tensor  # long [B]; -1 where no token is allowed
    logprobs: DeviceLogprobs | None = None
    checked: bool = False  # True: nothing changed the logits, no row can be dead

    def to_host(self, params: Sequence[SamplingParams]) -> SamplerOutput:
        if self.logprobs is None:
            token_ids: list[int] = self.token_ids.tolist()
            if not self.checked:
                raise_if_dead(token_ids)
            return SamplerOutput(token_ids, None, None)
        values = read_back([self.token_ids, *self.logprobs.tensors()])
        token_ids = [int(t) for t in values[0]]
        raise_if_dead(token_ids)
        lps, tops, ranks = logprobs_on_host(self.logprobs, values[1:], token_ids, params)
        return SamplerOutput(token_ids, lps, tops, ranks)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """Pick one token per row of ``logits`` (``[B, V]``, any float dtype; never modified)."""
    return sample_on_device(logits, md).to_host(md.params)


def sample_on_device(logits: torch.Tensor, md: SamplingMetadata) -> DeviceSample:
    """``sample`` up to the read of its results: no host sync (on any device when
    ``md.sync_free``; per-request logits-processor callables are user code)."""
    _check_rows(logits, md)
    params = md.params
    want_logprobs = any(p.logprobs is not None for p in params)
    changes_logits = (
        md.token_bitmask is not None
        or any(has_seam(p) or _has_penalty(p) for p in params)
        or _min_tokens_active(md)
        or bool(_active_processors(md))
    )
    if all(p.greedy for p in params) and not changes_logits and not want_logprobs:
        # Hot path (greedy benchmarks): the first maximum of each row, as argmax.
        return DeviceSample(greedy_ids(logits), checked=True)

    # Whatever changes logits works in place, so it gets a private float32 copy; otherwise x
    # may alias the caller's float32 logits, which is safe because the rest never writes to x
    # (greedy rows only read it, sampled rows start with an out-of-place temperature division).
    x = logits.to(torch.float32, copy=changes_logits)  # [B, V]
    if md.token_bitmask is not None and md.token_bitmask_rows:
        apply_token_bitmask_rows(x, md.token_bitmask, md.token_bitmask_rows)
    raw_logprobs = torch.log_softmax(x, dim=-1) if want_logprobs else None  # [B, V] float32
    x = _process_logits(x, md)
    sampled = _pick_tokens(x, md, md.resolved_sync_free(x.device))  # [B]
    logprobs = None
    if raw_logprobs is not None:
        logprobs = logprobs_on_device(raw_logprobs, sampled, params)
    if changes_logits:
        # A dead row's pick is meaningless (no crash: NaN/-inf only), so it is marked instead
        # of checked here, which would read the device.
        sampled = sampled.masked_fill(dead_rows(x), -1)  # [B]
    return DeviceSample(sampled, logprobs)
