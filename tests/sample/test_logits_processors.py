"""The sampler's seam: token bitmask, allowed ids, bad words, logit bias, custom processors."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from kvserve.sample.logits_processors import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_custom_processors,
    apply_logit_bias,
    apply_token_bitmask,
    banned_bad_word_ids,
    bitmask_width,
    unpack_token_bitmask,
)
from kvserve.sample.sampler import SamplingMetadata, sample
from kvserve.sampling_params import SamplingParams

NEG_INF = float("-inf")


def md_for(params: list[SamplingParams], **kw: object) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata(
        params=params,
        prompt_token_ids=[[5, 6]] * n,
        output_token_ids=[[7]] * n,
        generators=[None] * n,
        min_tokens_stop_ids=[[]] * n,
        **kw,  # type: ignore[arg-type]
    )


def packed(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """A packed int32 bitmask with exactly ``allowed[r]`` set in row r."""
    mask = torch.zeros(len(allowed), bitmask_width(vocab) * 32, dtype=torch.bool)
    for r, ids in enumerate(allowed):
        mask[r, ids] = True
    words = mask.view(len(allowed), -1, 32).long()  # [R, W, 32]
    shifts = torch.arange(32, dtype=torch.long)
    values = (words << shifts).sum(-1)  # [R, W] in [0, 2**32)
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def test_bitmask_matches_xgrammar_reference() -> None:
    vocab = 1000  # not a multiple of 32: the last word's high bits lie past the vocabulary
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_width(vocab)), generator=g)
    bitmask = bitmask.to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    ours = apply_token_bitmask(logits.clone(), bitmask)
    ref = logits.clone()
    xgrammar.apply_token_bitmask_inplace(ref, bitmask)
    assert torch.equal(ours, ref)
    assert torch.isinf(ours).sum() > 0


def test_unpack_is_exact() -> None:
    allowed = [[0, 31, 32, 63, 99], [5]]
    bits = unpack_token_bitmask(packed(allowed, 100), 100)  # [2, 100]
    assert bits[0].nonzero().squeeze(1).tolist() == [0, 31, 32, 63, 99]
    assert bits[1].nonzero().squeeze(1).tolist() == [5]


def test_allowed_token_ids_and_logit_bias() -> None:
    logits = torch.zeros(2, 8)
    out = apply_allowed_token_ids(logits.clone(), [[1, 3], [7]])
    assert torch.isfinite(out[0]).nonzero().squeeze(1).tolist() == [1, 3]
    assert torch.isfinite(out[1]).nonzero().squeeze(1).tolist() == [7]
    out = apply_logit_bias(torch.zeros(2, 4), [{1: 2.5, 3: -100.0}, {}])
    assert out.tolist() == [[0.0, 2.5, 0.0, -100.0], [0.0] * 4]


def test_bad_words_ban_the_last_token_after_the_prefix() -> None:
    words = [[9], [4, 5], [4, 5, 6]]
    assert banned_bad_word_ids(words, []) == [9]
    assert banned_bad_word_ids(words, [1, 4]) == [9, 5]
    assert banned_bad_word_ids(words, [4, 5]) == [9, 6]
    out = apply_bad_words(torch.zeros(1, 10), [words], [[2, 4]])
    assert torch.isinf(out[0]).nonzero().squeeze(1).tolist() == [5, 9]


def test_custom_processors_both_signatures() -> None:
    seen: list[tuple[list[int], list[int]]] = []

    def two(out: list[int], row: torch.Tensor) -> torch.Tensor:
        row[out[-1]] = 50.0
        return row

    def three(prompt: list[int], out: list[int], row: torch.Tensor) -> torch.Tensor:
        seen.append((prompt, out))
        return row * 2

    out = apply_custom_processors(torch.ones(1, 9), [[two, three]], [[1, 2]], [[3, 4]])
    assert out[0, 4].item() == 100.0 and out[0, 0].item() == 2.0
    assert seen == [([1, 2], [3, 4])]
    with pytest.raises(ValueError, match="logits processor returned"):
        apply_custom_processors(torch.ones(1, 9), [[lambda o, r: r[:3]]], [[1]], [[2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_with_bitmask_leaves_the_in_place_argmax(dtype: torch.dtype) -> None:
    """The C++ greedy argmax reads bf16 logits in place: a bitmask must still bind."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0], [0.0, 5.0, 1.0, 3.0]], dtype=dtype)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    mask = packed([[2, 3]], 4)
    res = sample(logits, md_for(params, token_bitmask=mask, token_bitmask_rows=[1]))
    assert res.sampled_token_ids == [1, 3]  # row 0 is unconstrained, row 1 may take 2 or 3
    assert torch.equal(logits, before)  # the caller's logits are never modified


def test_bitmask_binds_sampled_rows_and_raw_logprobs() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 64, generator=g)
    allowed = [[4, 9, 17]]
    params = [SamplingParams(temperature=1.0, logprobs=2, seed=s) for s in (1, 2)]
    for _ in range(20):
        md = md_for(params, token_bitmask=packed(allowed, 64), token_bitmask_rows=[0])
        md.generators = [torch.Generator().manual_seed(s) for s in (1, 2)]
        res = sample(logits, md)
        assert res.sampled_token_ids[0] in allowed[0]
        top = res.top_logprobs[0] if res.top_logprobs else None
        assert top is not None and set(top) <= set(allowed[0])
        # the constrained row's logprobs are renormalised over the allowed tokens
        lp = torch.log_softmax(logits[0, allowed[0]], dim=-1)
        assert top[res.sampled_token_ids[0]] == pytest.approx(
            lp[allowed[0].index(res.sampled_token_ids[0])].item(), abs=1e-6
        )
        params = [SamplingParams(temperature=1.0, logprobs=2, seed=s) for s in (3, 4)]


def test_sampled_ranks_follow_vllm() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0]])
    res = sample(logits, md_for([SamplingParams(temperature=0.0, logprobs=0)]))
    assert res.sampled_token_ids == [1]
    assert res.sampled_ranks == [2]  # two tokens are at least as likely (a tie)


def test_logit_bias_minus_100_keeps_the_argmax_out() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0]], dtype=torch.bfloat16)
    p = SamplingParams(temperature=0.0, logit_bias={1: -100})
    assert sample(logits, md_for([p])).sampled_token_ids == [2]
    p = SamplingParams(temperature=0.0, allowed_token_ids=[0])
    assert sample(logits, md_for([p])).sampled_token_ids == [0]


def test_metadata_row_keeps_its_bitmask_row() -> None:
    params = [SamplingParams(temperature=0.0)] * 3
    mask = packed([[2], [0]], 4)
    md = md_for(params, token_bitmask=mask, token_bitmask_rows=[0, 2])
    assert md.row(1).token_bitmask is None
    row2 = md.row(2)
    assert row2.token_bitmask_rows == [0]
    assert row2.token_bitmask is not None and torch.equal(row2.token_bitmask, mask[1:2])
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 3)
    assert sample(logits, md).sampled_token_ids == [2, 3, 0]


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_bitmask_kernel_equals_the_reference(vocab: int) -> None:
    from kvserve.ops import cpu_kernels
    from kvserve.sample.logits_processors import apply_token_bitmask_rows

    if not cpu_kernels.available():
        pytest.skip("the CPU kernels did not build")
    g = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_width(vocab)), generator=g)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, :5] = -1  # all allowed
    bitmask[1, 2:9] = 0  # all forbidden
    logits = torch.randn(5, vocab, generator=g)
    rows = [4, 0, 2]
    ref = logits.clone()
    ref[rows] = apply_token_bitmask(ref[rows], bitmask)
    ours = logits.clone()
    cpu_kernels.apply_token_bitmask(ours, bitmask, rows)
    assert torch.equal(ours, ref)
    assert torch.equal(apply_token_bitmask_rows(logits.clone(), bitmask, rows), ref)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # other rows untouched
