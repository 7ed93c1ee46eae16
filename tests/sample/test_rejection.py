"""The rejection sampler keeps the target's distribution exactly, and greedy verification
gives the target's own argmax tokens."""

from __future__ import annotations

import pytest
import torch

from kvserve.sample.rejection import expand_for_verification, rejection_sample
from kvserve.sample.sampler import SamplingMetadata
from kvserve.sampling_params import SamplingParams

V = 6
# Chi-square critical value for V - 1 = 5 degrees of freedom at p = 0.001 (statistical
# tables); with fixed seeds the test is deterministic, the margin guards against a real bias.
CHI2_5DF_P001 = 20.52


def one_row(params: SamplingParams, gen: torch.Generator | None = None) -> SamplingMetadata:
    return SamplingMetadata(
        params=[params],
        prompt_token_ids=[[0]],
        output_token_ids=[[]],
        generators=[gen],
        min_tokens_stop_ids=[[]],
    )


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_accepts_while_equal_then_takes_the_argmax() -> None:
    logits = torch.full((4, V), -1.0)
    for row, best in enumerate([3, 5, 2, 4]):
        logits[row, best] = 1.0
    md = one_row(SamplingParams(temperature=0.0))
    for draft, want in [
        ([3, 5, 2], [3, 5, 2, 4]),  # all accepted, plus the bonus token
        ([3, 1, 2], [3, 5]),  # rejected at position 1: the target's token there
        ([0, 5, 2], [3]),
    ]:
        out = rejection_sample(logits, expand_for_verification(md, [draft]), [draft])
        assert out.token_ids == [want]
        assert out.logprobs is None


def test_logprobs_per_accepted_token() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g)
    best = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0.0, logprobs=2)
    draft = [best[0], (best[1] + 1) % V]
    out = rejection_sample(logits, expand_for_verification(one_row(params), [draft]), [draft])
    assert out.token_ids == [[best[0], best[1]]]
    lp = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.ranks is not None and out.top_logprobs is not None
    assert out.logprobs[0] == pytest.approx([lp[0, best[0]].item(), lp[1, best[1]].item()])
    assert out.ranks[0] == [1, 1]
    assert [len(t or {}) for t in out.top_logprobs[0]] == [2, 2]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_sampled_output_keeps_the_target_distribution(with_draft_probs: bool) -> None:
    """Chi-square over seeded draws: the first output token follows p0 whatever the draft
    proposes, and the second (when the first proposal was accepted) follows p1. The draft
    distribution q is deliberately far from the target."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 1.5  # [k + 1, V], temperature 1
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 2.0, dim=-1)  # [k, V]
    rng = torch.Generator().manual_seed(2)
    md = expand_for_verification(one_row(SamplingParams(temperature=1.0), rng), [[0, 0]])
    first, second = torch.zeros(V), torch.zeros(V)
    accepted_first = 0
    trials = 6000
    for _ in range(trials):
        if with_draft_probs:
            draft = [int(torch.multinomial(q[j], 1, generator=rng)) for j in range(2)]
            out = rejection_sample(logits, md, [draft], [q])
        else:
            draft = [2, 4]  # a fixed n-gram-like proposal: q one-hot on it
            out = rejection_sample(logits, md, [draft])
        tokens = out.token_ids[0]
        first[tokens[0]] += 1
        if len(tokens) > 1:
            assert tokens[0] == draft[0]
            accepted_first += 1
            second[tokens[1]] += 1
    assert chi_square(first, p[0]) < CHI2_5DF_P001
    assert chi_square(second, p[1]) < CHI2_5DF_P001
    # the acceptance rate of the first proposal is its expected sum_x min(p0, q0)
    expected = torch.minimum(p[0], q[0]).sum().item() if with_draft_probs else p[0, 2].item()
    assert accepted_first / trials == pytest.approx(expected, abs=0.03)


def test_a_biased_sampler_fails_the_chi_square() -> None:
    """The test above can fail: accepting every proposal gives the draft's distribution."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=-1)
    counts = torch.zeros(V)
    counts[2] = 6000  # what "always accept [2, 4]" would give
    assert chi_square(counts, p) > CHI2_5DF_P001


def test_seeded_requests_are_reproducible() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=g)
    draft = [1, 2, 3, 4]

    def run(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        md = expand_for_verification(one_row(SamplingParams(temperature=0.8, seed=seed), gen),
                                     [draft])  # fmt: skip
        return [rejection_sample(logits, md, [draft]).token_ids[0] for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_expanded_rows_see_the_proposals_as_output() -> None:
    """Penalties and min_tokens at position j see the proposals before j."""
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, min_tokens=2)
    md = SamplingMetadata(
        params=[params],
        prompt_token_ids=[[0]],
        output_token_ids=[[4]],
        generators=[None],
        min_tokens_stop_ids=[[1]],
    )
    exp = expand_for_verification(md, [[3, 5]])
    assert exp.output_token_ids == [[4], [4, 3], [4, 3, 5]]
    assert exp.min_tokens_stop_ids == [[1], [], []]  # 1 output token < 2: EOS masked
    logits = torch.zeros(3, V)
    logits[:, 3] = 3.0  # token 3 leads EOS by 1, less than the presence penalty of 2
    logits[:, 1] = 2.0  # EOS second
    out = rejection_sample(logits, exp, [[3, 5]])
    # row 0: 3 is allowed (not seen yet) -> accept 3; row 1: 3 is penalised, EOS now leads
    assert out.token_ids == [[3, 1]]
