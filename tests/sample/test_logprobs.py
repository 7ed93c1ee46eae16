"""Sampled-token logprobs (``kvserve/sample/logprobs.py``): each row's top-n is the row's own,
whatever n the other rows of its batch ask (bf16 logits tie often, and ``topk`` of another k
picks other ids among ties)."""

from __future__ import annotations

import torch

from kvserve.sample.logprobs import logprobs_on_device
from kvserve.sampling_params import SamplingParams


def test_top_n_does_not_depend_on_the_other_rows_n() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 49152, generator=g).bfloat16().float()  # many ties
    raw = torch.log_softmax(logits, dim=-1)  # [40, V]
    sampled = raw.argmax(dim=-1)  # [40]
    ns = [1 + i % 5 for i in range(40)]
    params = [SamplingParams(logprobs=n) for n in ns]
    batch = logprobs_on_device(raw, sampled, params)
    assert batch.top_values.shape == (40, 5)
    for i, n in enumerate(ns):
        alone = logprobs_on_device(raw[i : i + 1], sampled[i : i + 1], [params[i]])
        assert torch.equal(batch.top_ids[i, :n], alone.top_ids[0])
        assert torch.equal(batch.top_values[i, :n], alone.top_values[0])
        assert torch.equal(batch.top_values[i, n:], torch.full((5 - n,), float("-inf")))
    assert batch.sampled.tolist() == raw.max(dim=-1).values.tolist()
