"""Tests for the batched sampler: exact token ids, exact tensors, and seeded statistics."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

import kvserve.sample.top_k_top_p as top_k_top_p_module
from kvserve.sample.sampler import (
    SamplerOutput,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    random_sample,
    sample,
    token_counts,
)
from kvserve.sampling_params import SamplingParams

NEG_INF = float("-inf")

# A hand-made distribution over 6 tokens for the statistical tests; index = token id.
PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
# Draws per statistical case: the standard error of a frequency is at most 0.0035, so the
# tolerance below sits more than 4 standard errors out (and the draws are seeded anyway).
NUM_DRAWS = 20_000
FREQ_TOL = 0.015


def make_md(
    params: Sequence[SamplingParams],
    *,
    prompts: Sequence[list[int]] | None = None,
    outputs: Sequence[list[int]] | None = None,
    stop_ids: Sequence[list[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    default_seed: int | None = 0,
) -> SamplingMetadata:
    """Metadata with empty histories, fresh per-request generators and a seeded default RNG."""
    n = len(params)
    if generators is None:
        generators = [
            torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params
        ]
    return SamplingMetadata(
        params=list(params),
        prompt_token_ids=[list(p) for p in prompts]
        if prompts is not None
        else [[] for _ in params],
        output_token_ids=[list(o) for o in outputs]
        if outputs is not None
        else [[] for _ in params],
        generators=list(generators),
        min_tokens_stop_ids=[list(s) for s in stop_ids]
        if stop_ids is not None
        else [[] for _ in range(n)],
        default_generator=None
        if default_seed is None
        else torch.Generator().manual_seed(default_seed),
    )


def draw_counts(params: SamplingParams, logits_row: torch.Tensor, seed: int = 0) -> Counter[int]:
    """Token counts of NUM_DRAWS independent samples of one distribution (one batched call)."""
    logits = logits_row.unsqueeze(0).expand(NUM_DRAWS, -1).contiguous()  # [N, V]
    out = sample(logits, make_md([params] * NUM_DRAWS, default_seed=seed))
    return Counter(out.sampled_token_ids)


def reference_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p`` (one ascending sort), as the reference."""
    vocab_size = logits.shape[1]
    k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))  # [N]
    logits_sort, logits_idx = logits.sort(dim=-1)  # [N, V]
    kth = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))  # [N, 1]
    logits_sort = logits_sort.masked_fill(logits_sort < kth, NEG_INF)
    probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    drop = probs_sum <= 1 - top_p.unsqueeze(1)  # [N, V]
    drop[:, -1] = False
    logits_sort = logits_sort.masked_fill(drop, NEG_INF)
    return logits.scatter(1, logits_idx, logits_sort)


# --------------------------------------------------------------------------------------------
# greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax_and_logits_untouched(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1)).to(dtype)  # [B, V]
    before = logits.clone()
    out = sample(logits, make_md([SamplingParams(temperature=0.0)] * 16))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.sampled_logprobs is None
    assert out.top_logprobs is None
    assert torch.equal(logits, before)


def test_greedy_fast_path_matches_slow_path() -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(2))  # [B, V]
    fast = sample(logits, make_md([SamplingParams(temperature=0.0)] * 8))
    # Asking for logprobs on one row forces the general path for the whole batch.
    slow_params = [SamplingParams(temperature=0.0)] * 7 + [
        SamplingParams(temperature=0, logprobs=1)
    ]
    slow = sample(logits, make_md(slow_params))
    assert fast.sampled_token_ids == slow.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_next_to_sampled_rows() -> None:
    vocab = 50
    # Nearly flat logits, so the sampled rows really spread out, with a clear argmax per row.
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(3)) * 0.1  # [B, V]
    logits[torch.arange(8), torch.arange(8) * 5] = 1.0
    params = [
        SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.5)
        for i in range(8)
    ]
    sampled_rows: dict[int, set[int]] = {i: set() for i in range(1, 8, 2)}
    for seed in range(25):
        out = sample(logits, make_md(params, default_seed=seed))
        for i in range(0, 8, 2):
            assert out.sampled_token_ids[i] == i * 5
        for i in sampled_rows:
            sampled_rows[i].add(out.sampled_token_ids[i])
    # 25 draws from an almost uniform distribution over 50 tokens give far more than 8 ids.
    assert all(len(ids) > 8 for ids in sampled_rows.values())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=1.0, top_k=1, top_p=0.5, min_p=0.5),
    ],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "all"],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    # randn has no ties, so "keep only the max" is a single token.
    logits = torch.randn(16, 600, generator=torch.Generator().manual_seed(4)) * 2  # [B, V]
    expected = logits.argmax(dim=-1).tolist()
    for seed in range(3):
        assert (
            sample(logits, make_md([params] * 16, default_seed=seed)).sampled_token_ids == expected
        )


def test_min_p_one_keeps_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 0.0, 3.0, 2.0]])
    kept = apply_min_p(logits.clone(), torch.tensor([1.0]))
    assert torch.equal(kept, torch.tensor([[NEG_INF, 3.0, NEG_INF, 3.0, NEG_INF]]))


# --------------------------------------------------------------------------------------------
# top-k / top-p / min-p / temperature: exact allowed sets and seeded frequencies


def _renormalised(weights: Sequence[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


STAT_CASES = {
    "plain": (SamplingParams(temperature=1.0), PROBS),
    "top_k=3": (SamplingParams(top_k=3), _renormalised(PROBS[:3])),
    # mass above token 1 is 0.4 < 0.6, above token 2 it is 0.65 >= 0.6
    "top_p=0.6": (SamplingParams(top_p=0.6), _renormalised(PROBS[:2])),
    # threshold 0.2 * 0.4 = 0.08 keeps tokens 0-3
    "min_p=0.2": (SamplingParams(min_p=0.2), _renormalised(PROBS[:4])),
    # top-k first: renormalised [.444, .278, .167, .111], so top-p 0.7 stops after two tokens
    # (top-p 0.7 alone would keep three)
    "top_k=4,top_p=0.7": (SamplingParams(top_k=4, top_p=0.7), _renormalised(PROBS[:2])),
    # top-p first keeps {0, 1, 2}, then min-p (threshold 0.12) keeps them all; min-p first would
    # renormalise to [.5, .3125, .1875] and top-p would then keep only {0, 1}
    "top_p=0.7,min_p=0.3": (SamplingParams(top_p=0.7, min_p=0.3), _renormalised(PROBS[:3])),
    "temperature=2": (SamplingParams(temperature=2.0), _renormalised([p**0.5 for p in PROBS])),
    "temperature=0.5": (SamplingParams(temperature=0.5), _renormalised([p**2 for p in PROBS])),
    "temperature=0.5,top_k=2": (
        SamplingParams(temperature=0.5, top_k=2),
        _renormalised([p**2 for p in PROBS[:2]]),
    ),
}


@pytest.mark.parametrize("case", list(STAT_CASES))
def test_filtered_sampling_frequencies(case: str) -> None:
    params, expected = STAT_CASES[case]
    # Any constant shift of the logits must not matter.
    logits = torch.tensor([math.log(p) + 3.0 for p in PROBS])  # [V]
    counts = draw_counts(params, logits, seed=11)
    allowed = {t for t, p in enumerate(expected) if p > 0}
    assert set(counts) == allowed
    for token, p in enumerate(expected):
        assert abs(counts[token] / NUM_DRAWS - p) < FREQ_TOL, (token, counts[token], p)


def test_temperature_changes_the_distribution() -> None:
    logits = torch.tensor([math.log(p) for p in PROBS])  # [V]
    top_share = [
        draw_counts(SamplingParams(temperature=t), logits, seed=5)[0] / NUM_DRAWS
        for t in (0.5, 1.0, 2.0)
    ]
    # p(top) is 0.615, 0.4 and 0.264 at these temperatures.
    assert top_share[0] > top_share[1] + 0.15 > top_share[2] + 0.25


def test_very_low_temperature_picks_argmax() -> None:
    # Gaps of at least 0.05 become 50 nats at T=1e-3 (still above the greedy cut-off 1e-5).
    rows = [torch.randperm(200, generator=torch.Generator().manual_seed(s)) for s in range(16)]
    logits = torch.stack(rows).float() * 0.05  # [B, V]
    params = [SamplingParams(temperature=1e-3)] * 16
    assert not params[0].greedy
    for seed in range(5):
        out = sample(logits, make_md(params, default_seed=seed))
        assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_ties_and_clamps_large_k() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 99]), None)
    expected = torch.tensor([[NEG_INF, 2.0, 2.0, 2.0, NEG_INF], [1.0, 2.0, 3.0, 4.0, 5.0]])
    assert torch.equal(out, expected)


def test_top_k_top_p_matches_vllm_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = 3000  # above the partial-topk candidate count, so both top-p routes run
    gen = torch.Generator().manual_seed(6)
    # Peaked rows have their nucleus among the top candidates; flat rows need the full sort.
    scales = torch.tensor([6.0, 0.05, 3.0, 0.2, 8.0, 0.01, 4.0, 1.0] * 3).unsqueeze(1)  # [N, 1]
    logits = torch.randn(24, vocab, generator=gen) * scales  # [N, V]
    top_k = torch.tensor([0, 0, 5, 0, 50, 2000, 0, 0] * 3)  # [N]
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.99, 1.0, 0.3, 0.95, 1.0] * 2 + [1.0] * 8)  # [N]

    sorted_p: list[float] = []
    original = top_k_top_p_module._apply_top_p_sorted

    def counting(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        sorted_p.extend(p.tolist())
        return original(x, p)

    monkeypatch.setattr(top_k_top_p_module, "_apply_top_p_sorted", counting)
    ours = apply_top_k_top_p(logits.clone(), top_k, top_p)
    assert torch.equal(ours, reference_top_k_top_p(logits, top_k, top_p))
    # Exactly the flat rows without top-k (1, 3, 9, 11: p = 0.9, 0.99, 0.9, 0.99), whose top
    # 1024 tokens hold only ~40% of the mass, need the full sort; the others are decided by
    # the partial topk (row 5 too: top-k 2000 on a flat row, but p = 0.3 is within reach).
    assert sorted_p == pytest.approx([0.9, 0.99, 0.9, 0.99])


# --------------------------------------------------------------------------------------------
# penalties and min_tokens


def test_token_counts_exact() -> None:
    counts = token_counts([[1, 1, 3], [], [0, 9]], vocab_size=5)  # 9 is outside the vocab
    expected = torch.tensor(
        [[0, 2, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32
    )
    assert torch.equal(counts, expected)


def test_penalties_match_hand_computation() -> None:
    row = [2.0, -1.0, 3.0, 0.5, -2.0, 1.0]
    logits = torch.tensor([row] * 4)  # [4, 6]
    prompts = [[0, 1], [5, 9], [0], []]  # 9 is past the vocab: ignored
    outputs = [[1, 2, 2], [], [3, 3], [4, 4, 4]]
    rep = torch.tensor([2.0, 2.0, 1.0, 1.0])
    freq = torch.tensor([0.5, 0.5, 0.0, -0.5])
    presence = torch.tensor([0.25, 0.25, 0.0, 1.0])
    out = apply_penalties(logits.clone(), prompts, outputs, rep, freq, presence)
    expected = torch.tensor(
        [
            # seen {0, 1, 2}: 2/2, -1*2 - 0.5*1 - 0.25, 3/2 - 0.5*2 - 0.25
            [1.0, -2.75, 0.25, 0.5, -2.0, 1.0],
            # only the prompt token 5 is seen; no output, so no frequency/presence
            [2.0, -1.0, 3.0, 0.5, -2.0, 0.5],
            # no penalty at all
            row,
            # token 4: -2 + 0.5*3 - 1
            [2.0, -1.0, 3.0, 0.5, -1.5, 1.0],
        ]
    )
    assert torch.equal(out, expected)


def test_repetition_penalty_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 50, generator=gen) * 3  # [B, V], both signs
    input_ids = torch.randint(0, 50, (4, 12), generator=gen)  # [B, L], with repeats
    hf = RepetitionPenaltyLogitsProcessor(penalty=1.3)(input_ids, logits.clone())
    prompts = input_ids[:, :7].tolist()
    outputs = input_ids[:, 7:].tolist()
    ours = apply_penalties(
        logits.clone(), prompts, outputs, torch.full((4,), 1.3), torch.zeros(4), torch.zeros(4)
    )
    assert torch.equal(ours, hf)
    assert not torch.equal(ours, logits)
    # And through the sampler: greedy rows take the argmax of the penalised logits.
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 4
    out = sample(logits, make_md(params, prompts=prompts, outputs=outputs))
    assert out.sampled_token_ids == hf.argmax(dim=-1).tolist()


def test_a_tiny_repetition_penalty_makes_no_nan() -> None:
    """5e-324 is a valid penalty (positive), but 0 in float32: -inf * 0 was NaN, which argmax
    picked over the grammar's mask, and x / 1e-38 overflowed to inf (NaN in softmax)."""
    logits = torch.tensor([[5.0, NEG_INF, 3.0, -1.0], [NEG_INF, NEG_INF, NEG_INF, NEG_INF]])
    out = apply_penalties(
        logits.clone(), [[0, 1, 3], [0, 1]], [[], []], torch.tensor([5e-324, 5e-324]),
        torch.zeros(2), torch.zeros(2),
    )  # fmt: skip
    big = torch.finfo(torch.float32).max
    tiny = torch.finfo(torch.float32).tiny
    # 5 / tiny overflows: clamped to the largest float32; -1 * tiny stays negative.
    assert torch.equal(out[0], torch.tensor([big, NEG_INF, 3.0, -1.0 * tiny]))
    assert torch.equal(out[1], logits[1])  # masked stays masked, no NaN
    # Sampled (temperature 1) over the penalised row: the finite maximum wins, no NaN.
    params = [SamplingParams(temperature=1.0, repetition_penalty=5e-324, seed=0)]
    picked = sample(logits[:1], make_md(params, prompts=[[0, 1, 3]], outputs=[[]]))
    assert picked.sampled_token_ids == [0]


@pytest.mark.parametrize(
    ("params", "outputs", "expected"),
    [
        (SamplingParams(temperature=0.0), [1], 1),
        (SamplingParams(temperature=0.0, frequency_penalty=2.0), [1], 2),
        (SamplingParams(temperature=0.0, presence_penalty=2.0), [1], 2),
        # frequency scales with the count: 3 - 0.6 > 2 but 3 - 1.2 < 2
        (SamplingParams(temperature=0.0, frequency_penalty=0.6), [1], 1),
        (SamplingParams(temperature=0.0, frequency_penalty=0.6), [1, 1], 2),
        # presence does not: 3 - 0.6 > 2 however often the token was generated
        (SamplingParams(temperature=0.0, presence_penalty=0.6), [1, 1, 1], 1),
        # prompt tokens do not count for frequency/presence
        (SamplingParams(temperature=0.0, presence_penalty=2.0), [], 1),
    ],
)
def test_presence_frequency_move_argmax(
    params: SamplingParams, outputs: list[int], expected: int
) -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    out = sample(logits, make_md([params], prompts=[[1, 1]], outputs=[outputs]))
    assert out.sampled_token_ids == [expected]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    eos, stop = 7, 6
    logits_row = torch.tensor([0.0, 0.5, 0.2, 0.1, 0.3, 0.4, 4.0, 5.0])  # EOS dominates
    n = 2000
    logits = logits_row.expand(n, -1).contiguous()  # [n, V]
    params = [SamplingParams(temperature=1.0, min_tokens=3)] * n
    for produced in range(5):
        md = make_md(
            params,
            outputs=[[1] * produced] * n,
            stop_ids=[[eos, stop]] * n,
            default_seed=produced,
        )
        counts = Counter(sample(logits, md).sampled_token_ids)
        if produced < 3:
            assert counts[eos] == 0 and counts[stop] == 0
            assert set(counts) == {0, 1, 2, 3, 4, 5}
        else:
            # p(EOS) = 0.70 and p(stop) = 0.26 once unmasked
            assert abs(counts[eos] / n - 0.70) < 0.05
            assert abs(counts[stop] / n - 0.26) < 0.05


def test_min_tokens_greedy() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]] * 3)  # token 3 is EOS
    params = [SamplingParams(temperature=0.0, min_tokens=2)] * 3
    md = make_md(params, outputs=[[], [5], [5, 5]], stop_ids=[[3], [3], [3]])
    assert sample(logits, md).sampled_token_ids == [2, 2, 3]
    # Without stop ids from the engine (e.g. ignore_eos and no stop_token_ids) nothing is masked.
    md = make_md(params, outputs=[[], [5], [5, 5]], stop_ids=[[], [], []])
    assert sample(logits, md).sampled_token_ids == [3, 3, 3]


NO_MUTATION_CASES = {
    # min_tokens and penalties: the sampler must work on a private copy
    "penalties": [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=2, logprobs=2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, seed=3, presence_penalty=1.0),
        SamplingParams(temperature=1.3),
    ],
    # no in-place step before sampling: the working tensor aliases the float32 input
    "filters only": [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.1, min_p=0.1, seed=4),
        SamplingParams(temperature=0.0, logprobs=1),
    ],
    "all sampled": [SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1)] * 4,
}


@pytest.mark.parametrize("case", list(NO_MUTATION_CASES))
def test_sample_never_modifies_logits(case: str) -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(8))  # [B, V]
    before = logits.clone()
    md = make_md(
        NO_MUTATION_CASES[case], prompts=[[1, 2]] * 4, outputs=[[3]] * 4, stop_ids=[[0]] * 4
    )
    sample(logits, md)
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------------------------
# seeds


def _seeded_run(
    steps: torch.Tensor,  # [T, V]: the logits the target row sees at each step
    target: SamplingParams,
    with_neighbours: bool,
) -> list[int]:
    """Tokens of the target request over T steps, alone or in a changing batch."""
    gen = torch.Generator().manual_seed(target.seed) if target.seed is not None else None
    neighbour_gen = torch.Generator().manual_seed(7)
    vocab = steps.shape[1]
    tokens: list[int] = []
    noise = torch.Generator().manual_seed(123)
    for t, row in enumerate(steps):
        if not with_neighbours:
            md = make_md([target], outputs=[tokens], generators=[gen], default_seed=t)
            tokens.append(sample(row.unsqueeze(0), md).sampled_token_ids[0])
            continue
        others = [
            (SamplingParams(temperature=1.0), None),  # unseeded
            (SamplingParams(temperature=0.8, seed=7, top_k=10, min_p=0.05), neighbour_gen),
            (SamplingParams(temperature=0.0), None),  # greedy
            (SamplingParams(temperature=1.2, top_p=0.5, presence_penalty=1.0), None),
        ][: 1 + t % 4]  # the batch size changes from step to step
        position = t % (len(others) + 1)  # and so does the target's row
        params = [p for p, _ in others]
        gens = [g for _, g in others]
        params.insert(position, target)
        gens.insert(position, gen)
        logits = torch.randn(len(params), vocab, generator=noise) * 2  # [B, V]
        logits[position] = row
        md = make_md(
            params,
            outputs=[tokens if i == position else [1, 2] for i in range(len(params))],
            generators=gens,
            default_seed=1000 + t,
        )
        tokens.append(sample(logits, md).sampled_token_ids[position])
    return tokens


@pytest.mark.parametrize(
    "extra",
    [{}, {"top_p": 0.9, "top_k": 40}, {"min_p": 0.02, "frequency_penalty": 0.5}],
    ids=["plain", "top-k/top-p", "min-p/penalty"],
)
def test_seed_reproducible_alone_or_batched(extra: dict[str, float]) -> None:
    vocab = 1500  # above the top-p candidate count
    gen = torch.Generator().manual_seed(9)
    # Alternate peaked and flat steps so top-p takes both the partial-topk and the sort route.
    scales = torch.tensor([3.0, 0.05] * 6).unsqueeze(1)  # [T, 1]
    steps = torch.randn(12, vocab, generator=gen) * scales  # [T, V]
    target = SamplingParams(temperature=0.9, seed=1234, **extra)
    alone = _seeded_run(steps, target, with_neighbours=False)
    assert _seeded_run(steps, target, with_neighbours=True) == alone
    assert _seeded_run(steps, target, with_neighbours=False) == alone
    other_seed = SamplingParams(temperature=0.9, seed=4321, **extra)
    assert _seeded_run(steps, other_seed, with_neighbours=False) != alone


def test_default_generator_makes_unseeded_rows_reproducible() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(10))  # [B, V]
    params = [SamplingParams(temperature=1.0)] * 6
    first = sample(logits, make_md(params, default_seed=5)).sampled_token_ids
    assert sample(logits, make_md(params, default_seed=5)).sampled_token_ids == first
    assert sample(logits, make_md(params, default_seed=6)).sampled_token_ids != first


def test_random_sample_never_picks_zero_probability() -> None:
    probs = torch.zeros(5000, 10)  # [N, V]
    probs[:, 3] = 0.5
    probs[:, 8] = 0.5
    gens: list[torch.Generator | None] = [None] * 5000
    gens[17] = torch.Generator().manual_seed(1)
    counts = Counter(random_sample(probs, gens, torch.Generator().manual_seed(0)).tolist())
    assert set(counts) == {3, 8}
    assert abs(counts[3] / 5000 - 0.5) < 0.03


# --------------------------------------------------------------------------------------------
# logprobs


def test_logprobs_are_raw_and_top_n_has_the_right_ids() -> None:
    gen = torch.Generator().manual_seed(12)
    # Distinct multiples of 1/4 are exact in bfloat16, so the ranking has no ties.
    perms = [torch.randperm(40, generator=gen) for _ in range(5)]
    logits = (torch.stack(perms).float() * 0.25 - 5.0).to(torch.bfloat16)  # [B, V]
    raw = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    ranked = raw.argsort(dim=-1, descending=True)  # [B, V]
    top3_row0 = ranked[0, :3].tolist()
    params = [
        # greedy, but min_tokens masks the 3 best raw tokens: sampled is 4th, outside the top 3
        SamplingParams(temperature=0.0, logprobs=3, min_tokens=1, repetition_penalty=1.7),
        # greedy without processing: the sampled token is the top-1, inside the top 3
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7, presence_penalty=1.5),  # did not ask
        SamplingParams(temperature=0.6, logprobs=0, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, logprobs=2, seed=3),
    ]
    md = make_md(
        params,
        prompts=[top3_row0] * 5,
        outputs=[[], ranked[1, :2].tolist(), [1], [2], []],
        stop_ids=[top3_row0, [], [], [], []],
    )
    out: SamplerOutput = sample(logits, md)
    tokens = out.sampled_token_ids
    assert out.sampled_logprobs is not None and out.top_logprobs is not None

    # Logprobs come from the raw logits, whatever penalties/temperature did to the sampling.
    for i, token in enumerate(tokens):
        assert out.sampled_logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-6)

    assert tokens[0] == ranked[0, 3].item()
    assert list(out.top_logprobs[0]) == [*top3_row0, tokens[0]]
    assert tokens[1] == ranked[1, 0].item()
    assert list(out.top_logprobs[1]) == ranked[1, :3].tolist()
    assert out.top_logprobs[2] is None
    assert list(out.top_logprobs[3]) == [tokens[3]]
    top2 = ranked[4, :2].tolist()
    expected4 = top2 if tokens[4] in top2 else [*top2, tokens[4]]
    assert list(out.top_logprobs[4]) == expected4
    for i, entry in enumerate(out.top_logprobs):
        for token, logprob in (entry or {}).items():
            assert logprob == pytest.approx(raw[i, token].item(), abs=1e-6)


def test_no_logprobs_requested_gives_none() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(13))  # [B, V]
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
    ]
    out = sample(logits, make_md(params, stop_ids=[[0], [0], [0]]))
    assert out.sampled_logprobs is None and out.top_logprobs is None
    assert len(out.sampled_token_ids) == 3


def test_metadata_length_mismatch_is_rejected() -> None:
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="generators"):
        md = make_md([SamplingParams()] * 2)
        md.generators = [None]
        sample(logits, md)
