"""Speculative decoding end to end: greedy outputs equal plain decoding token for token, with
n-gram and draft-model proposers, under preemption and prefix caching, with KV integrity
checked after every step; proposals are really verified (accepted and rejected ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.spec.truncated_draft import write_truncated_draft
from tests.engine.conftest import TinyModels
from tests.engine.utils import random_prompts, run_engine_checked

# Prompts that repeat themselves, so that n-gram lookup finds matches (random tiny models
# also fall into loops of their own, which it then predicts).
BASE = random_prompts([6, 9, 4, 12, 7], seed=21)
PROMPTS = [p * 3 for p in BASE] + random_prompts([5, 30], seed=22)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def engine(path: Path, spec: dict[str, Any] | None = None, **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 300)
    return LLMEngine(
        build_engine_config(str(path), dtype="float32", block_size=4, speculative_config=spec, **kw)
    )


def check_verified(e: LLMEngine) -> None:
    """Both accepted and rejected proposals happened (the test exercised verification)."""
    s = e.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    assert s["spec_decode_num_draft_tokens"] > s["spec_decode_num_accepted_tokens"]
    assert sum(s["spec_decode_accepted_per_pos"]) == s["spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def plain(tiny_models: TinyModels) -> dict[str, dict[str, list[int]]]:
    return {
        arch: run_engine_checked(engine(path), PROMPTS, GREEDY)
        for arch, (path, _) in tiny_models.items()
    }


def test_ngram_greedy_equals_plain(
    tiny_models: TinyModels, plain: dict[str, dict[str, list[int]]]
) -> None:
    drafted = accepted = 0
    for arch, (path, _) in tiny_models.items():
        e = engine(path, NGRAM)
        assert run_engine_checked(e, PROMPTS, GREEDY) == plain[arch], arch
        s = e.stats()
        assert s["num_generation_tokens"] == 40 * len(PROMPTS)
        assert s["spec_decode_num_accepted_tokens"] > 0, arch
        drafted += s["spec_decode_num_draft_tokens"]
        accepted += s["spec_decode_num_accepted_tokens"]
    assert drafted > accepted  # some proposals were rejected too


@pytest.fixture(scope="module")
def other_draft(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's first layer alone: a draft that agrees with it part of the time."""
    return write_truncated_draft(tiny_llama, tmp_path_factory.mktemp("draft"), 1)


def test_draft_model_greedy_equals_plain(
    tiny_models: TinyModels,
    plain: dict[str, dict[str, list[int]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Each architecture with its own first layer as the draft (agrees part of the time),
    and the tiny Llama as its own draft (agrees always)."""
    for arch, (target, _) in tiny_models.items():
        drafts = [write_truncated_draft(target, tmp_path_factory.mktemp(f"{arch}-d"), 1)]
        drafts += [target] if arch == "llama" else []
        for draft in drafts:
            spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
            e = engine(target, spec)
            assert run_engine_checked(e, PROMPTS, GREEDY) == plain[arch], (arch, draft)
            s = e.stats()
            if draft == target:  # the target as its own draft: every proposal is accepted
                assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
                assert s["spec_decode_num_draft_tokens"] > 0
            else:
                assert s["spec_decode_num_accepted_tokens"] > 0, arch


@pytest.mark.parametrize(
    ("policy", "mode"), [("preempt", "recompute"), ("preempt", "swap"), ("reserve", "recompute")]
)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_small_cache_same_outputs(
    tiny_models: TinyModels,
    plain: dict[str, dict[str, list[int]]],
    other_draft: Path,
    policy: str,
    mode: str,
    method: str,
) -> None:
    spec = dict(NGRAM) if method == "ngram" else {
        "method": "draft_model", "model": str(other_draft), "num_speculative_tokens": 3,
    }  # fmt: skip
    # 30 blocks x 4 tokens for 7 requests needing up to 130 tokens each (and the lookahead).
    e = engine(tiny_models["llama"][0], spec, num_kv_blocks=40, kv_policy=policy,
               preemption_mode=mode, max_num_seqs=4)  # fmt: skip
    assert run_engine_checked(e, PROMPTS, GREEDY) == plain["llama"]
    check_verified(e)
    if policy == "preempt":
        assert e.stats()["num_preemptions"] > 0


def test_prefix_caching_with_speculation(
    tiny_models: TinyModels, plain: dict[str, dict[str, list[int]]]
) -> None:
    e = engine(tiny_models["llama"][0], NGRAM)
    first = run_engine_checked(e, PROMPTS, GREEDY)
    again = run_engine_checked(e, PROMPTS, GREEDY)  # every prompt is cached now
    assert first == again == plain["llama"]
    assert e.stats()["prefix_cache_hits"] > 0
    off = engine(tiny_models["llama"][0], NGRAM, enable_prefix_caching=False)
    assert run_engine_checked(off, PROMPTS, GREEDY) == plain["llama"]


def test_eos_and_max_tokens_inside_accepted_runs(tiny_llama: Path) -> None:
    """Stop tokens and max_tokens end a request inside a speculative run, exactly where plain
    decoding ends it (the tokens after are dropped)."""
    ref = engine(tiny_llama)
    ref_out = run_engine_checked(ref, PROMPTS, GREEDY)
    # The token each request produces at its 10th step becomes a stop token.
    for i, prompt in enumerate(PROMPTS):
        stop = ref_out[str(i)][9]
        want = ref_out[str(i)][: ref_out[str(i)].index(stop) + 1]
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
        for spec in (None, NGRAM):
            got = run_engine_checked(engine(tiny_llama, spec), [prompt], params)
            assert got["0"] == want
    for max_tokens in (1, 2, 5, 13):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        e = engine(tiny_llama, NGRAM)
        got = run_engine_checked(e, PROMPTS, params)
        assert got == {k: v[:max_tokens] for k, v in ref_out.items()}


def test_seeded_sampling_is_reproducible(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=11, ignore_eos=True)
    runs = [run_engine_checked(engine(tiny_llama, NGRAM), PROMPTS, params) for _ in range(2)]
    assert runs[0] == runs[1]
    unseeded = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    assert run_engine_checked(engine(tiny_llama, NGRAM), PROMPTS, unseeded) != runs[0]


def test_logprobs_and_n_with_speculation(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2, n=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    outs = [
        LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=300,
            speculative_config=spec).generate(prompts, params, use_tqdm=False)
        for spec in (None, NGRAM)
    ]  # fmt: skip
    for a, b in zip(*outs, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            assert ca.logprobs is not None and cb.logprobs is not None
            assert len(cb.logprobs) == 20
            for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert list(la) == list(lb)  # same tokens, same order
                for t in la:
                    assert lb[t].logprob == pytest.approx(la[t].logprob, abs=1e-4)
                    assert lb[t].rank == la[t].rank
            assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "at least 1"),
        ('{"method": "medusa"}', "'medusa' is not a valid SpecMethod"),
        ('{"method": "ngram", "lookahead": 3}', "unknown keys ['lookahead']"),
        ('{"method": "draft_model"}', "needs 'model'"),
        ("{not json", "is not JSON"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min <="),
    ],
)
def test_bad_speculative_config(tiny_llama: Path, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        LLM(str(tiny_llama), speculative_config=spec)
    assert message in str(err.value)


def test_draft_with_another_vocabulary_is_refused(
    tiny_llama: Path, builtin_model_dir: Path
) -> None:
    spec = {"method": "draft_model", "model": str(builtin_model_dir)}
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(str(tiny_llama), speculative_config=spec)


def test_builtin_model_greedy_equals_plain(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The built-in model on chatterbot prompts and one that copies its input: plain, n-gram
    and a draft of its own first 4 layers give the same tokens (stop strings included)."""
    from kvserve.bench.datasets import load_chatterbot_conversations

    draft = write_truncated_draft(builtin_model_dir, tmp_path_factory.mktemp("d"), 4)
    questions = [q for q, _ in load_chatterbot_conversations()[:5]]
    prompts = [[{"role": "user", "content": q}] for q in questions]
    prompts.append(
        [
            {
                "role": "user",
                "content": "Repeat exactly: the cat sat on the mat, "
                "then the dog sat on the log, then the cat sat on the mat again.",
            }
        ]
    )
    params = SamplingParams(temperature=0, max_tokens=32, stop=["dog sat"])
    specs: list[dict[str, Any] | None] = [
        None,
        NGRAM,
        {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
    ]
    outs = []
    for spec in specs:
        llm = LLM(
            str(builtin_model_dir), dtype="float32", num_kv_blocks=400, speculative_config=spec
        )
        res = llm.chat(prompts, params, use_tqdm=False)
        outs.append([(o.outputs[0].token_ids, o.outputs[0].text) for o in res])
        if spec is not None:
            assert llm.stats()["spec_decode_num_drafts"] > 0
    assert outs[1] == outs[0]
    assert outs[2] == outs[0]
    assert outs[0][-1][1] == "The cat sat on the mat, then the "  # the stop string cut the copy
