"""Property: no request, however malformed, kills the engine or changes another's output.

Hypothesis draws sampling parameters and prompt token ids from valid, extreme and malformed
values (huge and negative integers, booleans, NaN and infinities, wrong types). Each drawn
request is either refused at the door with a ``ValueError`` or runs beside two innocent
requests (one greedy, one seeded); the engine must never raise from ``step()``, the innocent
outputs must be exactly what they are alone, and the KV cache must be intact after every step.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from tests.engine.utils import TINY, random_prompts

VOCAB = TINY["vocab_size"]
INNOCENT = [
    (random_prompts([11], seed=5)[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    (
        random_prompts([7], seed=6)[0],
        SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=6, ignore_eos=True),
    ),
]

huge_ints = st.sampled_from([2**63, 2**63 - 1, 2**64, -(2**63) - 1, -1, 0, 10**30])
bad_values = st.sampled_from([True, False, None, "7", [], math.nan, math.inf, -math.inf])


def mostly(valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` 7 times in 8 (so that many requests get past the door and run), else ``odd``."""
    return st.integers(0, 7).flatmap(lambda k: valid if k else odd)


def ints(lo: int, hi: int) -> st.SearchStrategy[Any]:
    return mostly(st.integers(lo, hi), st.one_of(huge_ints, bad_values))


def floats(lo: float, hi: float) -> st.SearchStrategy[Any]:
    extreme = st.sampled_from([0.0, -0.0, 1e-300, 1e300, 5e-324, math.nan, math.inf])
    return mostly(st.floats(lo, hi), st.one_of(extreme, bad_values))


token_ids = mostly(st.integers(0, VOCAB - 1), st.one_of(st.integers(-3, VOCAB + 3), huge_ints))
# Extreme values the door accepts on purpose: they must be honoured, not crash a step.
legal_extremes = st.fixed_dictionaries(
    {},
    optional={
        "top_k": st.sampled_from([2**63 - 1, VOCAB, VOCAB + 1, 1]),
        "logprobs": st.sampled_from([VOCAB, VOCAB * 4, 0]),
        "seed": st.sampled_from([2**63 - 1, -(2**63), 0]),
        "repetition_penalty": st.sampled_from([1e300, 1e-300, 2.0]),
        "temperature": st.sampled_from([1e-300, 1e-5, 1e300]),
        "top_p": st.sampled_from([5e-324, 1e-9, 1.0]),
        "min_p": st.sampled_from([1.0, 1e-300]),
        "min_tokens": st.sampled_from([8]),
        "stop_token_ids": st.sampled_from([[0, 1, VOCAB - 1]]),
    },
)

PARAMS = st.tuples(
    st.fixed_dictionaries(
        {},
        optional={
            "n": ints(1, 3),
            "temperature": floats(0.0, 2.0),
            "top_p": floats(0.0, 1.0),
            "top_k": ints(-1, VOCAB * 2),
            "min_p": floats(0.0, 1.0),
            "presence_penalty": floats(-2.0, 2.0),
            "frequency_penalty": floats(-2.0, 2.0),
            "repetition_penalty": floats(0.0, 3.0),
            "seed": ints(0, 2**32),
            "max_tokens": ints(1, 8),
            "min_tokens": ints(0, 8),
            "logprobs": ints(0, 5),
            "stop_token_ids": st.lists(token_ids, max_size=3),
            "ignore_eos": st.booleans(),
        },
    ),
    legal_extremes,
).map(lambda pair: {**pair[0], **pair[1]})


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=48, block_size=4)


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[list[int]]:
    return [
        llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in INNOCENT
    ]


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(fields=PARAMS, prompt=st.lists(token_ids, min_size=0, max_size=12))
def test_no_request_hurts_the_engine_or_others(
    llm: LLM, expected: list[list[int]], fields: dict[str, Any], prompt: list[Any]
) -> None:
    engine = llm.engine
    try:
        params = SamplingParams(**fields)
        engine.add_request("fuzz", {"prompt_token_ids": prompt}, params)
        event("accepted")
    except ValueError:
        event("refused at the door")  # with a clear message: fine
    for i, (p, sp) in enumerate(INNOCENT):
        engine.add_request(f"innocent{i}", {"prompt_token_ids": p}, dataclasses.replace(sp))
    outs: dict[str, list[int]] = {}
    while len(outs) < len(INNOCENT):
        for out in engine.step():  # must never raise
            if out.finished and out.request_id.startswith("innocent"):
                assert out.error is None
                outs[out.request_id] = out.outputs[0].token_ids
        engine.kv.check_integrity()
    engine.abort_request("fuzz")  # a long fuzz request need not run to its end
    assert [outs[f"innocent{i}"] for i in range(len(INNOCENT))] == expected
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.has_unfinished_requests()
