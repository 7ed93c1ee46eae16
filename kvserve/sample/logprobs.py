"""Sampled-token logprobs, ranks and top-n, computed on the device and finished on the host.

``logprobs_on_device`` leaves every tensor on the device; the sampler reads them back together
with the sampled ids in its one read (``host_io.read_back``), and ``logprobs_on_host`` turns
the values into the per-row lists and dicts of ``SamplerOutput``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.sample.host_io import to_device
from kvserve.sample.top_k_top_p import take_rows
from kvserve.sampling_params import SamplingParams

HostLogprobs = tuple[list[float], list[dict[int, float] | None], list[int]]


@dataclass
class DeviceLogprobs:
    """The logprob results of one sampler call, still on the device."""

    sampled: torch.Tensor  # float32 [B]: raw logprob of each row's sampled token
    ranks: torch.Tensor  # long [B]: vLLM's rank, the number of tokens at least as likely
    # float32 [A, k]: the asking rows' most likely logprobs, k the largest n asked (a row
    # asking fewer is padded with -inf past its own n)
    top_values: torch.Tensor
    top_ids: torch.Tensor  # long [A, k]: and their token ids
    ask_rows: list[int]  # the A rows that asked for logprobs (host)

    def tensors(self) -> list[torch.Tensor]:
        return [self.sampled, self.ranks, self.top_values, self.top_ids]


def logprobs_on_device(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, params: Sequence[SamplingParams]
) -> DeviceLogprobs:
    """``raw_logprobs`` float32 ``[B, V]``, ``sampled`` long ``[B]``; at least one row of
    ``params`` asks for logprobs."""
    vocab_size = raw_logprobs.shape[1]
    chosen = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    # vLLM's rank: how many tokens are at least as likely as the sampled one.
    ranks = (raw_logprobs >= chosen).sum(dim=-1)  # [B]
    ask_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    ns = [min(vocab_size, params[i].logprobs or 0) for i in ask_rows]
    asking = take_rows(raw_logprobs, ask_rows)  # [A, V]
    values, ids = _top_n(asking, ns)
    return DeviceLogprobs(chosen.squeeze(1), ranks, values, ids, ask_rows)


def _top_n(asking: torch.Tensor, ns: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``ns[j]`` most likely logprobs and ids, ``[A, max(ns)]`` each (a row asking
    fewer is padded). One ``topk`` per distinct n, never one of the largest n for all: among
    tied values (common with bf16 logits) ``topk`` picks other ids for another k (measured:
    the top 2 of 49152 bf16-rounded logprobs differed between k = 2 and k = 5 or 20 in 21 of
    200 rows), so a row's top-n would depend on what its neighbours ask (batch-invariant
    mode, docs/server.md)."""
    width = max(ns, default=0)
    if width == 0:
        empty = torch.empty((len(ns), 0), dtype=torch.long, device=asking.device)
        return asking.new_empty((len(ns), 0)), empty  # [A, 0] x 2
    if len(set(ns)) == 1:
        return asking.topk(width, dim=-1)  # [A, n] x 2
    values = asking.new_full((len(ns), width), float("-inf"))  # [A, width]
    ids = torch.zeros((len(ns), width), dtype=torch.long, device=asking.device)
    for n in sorted(set(ns) - {0}):
        sel = [j for j, m in enumerate(ns) if m == n]
        v, i = take_rows(asking, sel).topk(n, dim=-1)  # [S, n] x 2
        index = to_device(sel, torch.long, asking.device)  # [S]
        values[index, :n] = v
        ids[index, :n] = i
    return values, ids


def logprobs_on_host(
    device: DeviceLogprobs,
    values: Sequence[list[float]],
    token_ids: list[int],
    params: Sequence[SamplingParams],
) -> HostLogprobs:
    """``values``: what ``read_back(device.tensors())`` gave, in that order. Returns the
    sampled tokens' logprobs, each asking row's top-n dict (with its sampled token) and the
    ranks."""
    sampled_logprobs, ranks_f, top_v, top_i = values
    width = device.top_values.shape[1]
    top_logprobs: list[dict[int, float] | None] = [None] * len(token_ids)
    for j, i in enumerate(device.ask_rows):
        n = min(width, params[i].logprobs or 0)
        ids = [int(t) for t in top_i[j * width : j * width + n]]
        entry = dict(zip(ids, top_v[j * width : j * width + n], strict=True))
        entry.setdefault(token_ids[i], sampled_logprobs[i])
        top_logprobs[i] = entry
    return sampled_logprobs, top_logprobs, [int(r) for r in ranks_f]
