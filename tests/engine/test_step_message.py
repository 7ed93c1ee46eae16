"""The step message is plain data: every ``SchedulerOutput`` of a run with many features on
pickles without a live object, and a runner fed only the unpickled copies keeps exactly the
scheduler's tokens, block tables and computed counts and produces the same outputs."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.core.request import Request
from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.grammar import StructuredOutputRequest
from kvserve.worker.runner_output import ModelRunnerOutput
from tests.engine.utils import random_prompts

LIVE = (Request, StructuredOutputRequest, torch.Generator)
PROMPTS = [p * 2 for p in random_prompts([5, 9, 13, 7], seed=3)] + random_prompts([21], seed=4)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2),
    SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=20,
        min_tokens=5,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={7: 3.0},
        ignore_eos=True,
        n=2,
    ),
    SamplingParams(temperature=0, max_tokens=18, frequency_penalty=0.4, ignore_eos=True),
]


class _LiveObjectFinder(pickle.Pickler):
    """Pickles like ``pickle.dumps`` but fails on any live engine object."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, LIVE):
            raise AssertionError(f"a live {type(obj).__name__} is in the step message")
        return NotImplemented


def plain_dumps(sched: SchedulerOutput) -> bytes:
    buf = io.BytesIO()
    _LiveObjectFinder(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(sched)
    return buf.getvalue()


def engine(path: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(build_engine_config(
        str(path), dtype="float32", block_size=4, max_num_batched_tokens=24, **kw
    ))  # fmt: skip


def drive(e: LLMEngine) -> dict[str, Any]:
    """Every prompt with its params (a family of n = 2 included) plus two embedding
    requests, to the end, checking KV integrity after every step."""
    for i, (p, sp) in enumerate(zip(PROMPTS, [*PARAMS, PARAMS[0]], strict=True)):
        e.add_request(f"g{i}", {"prompt_token_ids": p}, sp)
    for i, p in enumerate(random_prompts([6, 30], seed=9)):
        e.add_request(f"e{i}", {"prompt_token_ids": p}, PoolingParams())
    done: dict[str, Any] = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                if isinstance(out, RequestOutput):
                    done[out.request_id] = (
                        [c.token_ids for c in out.outputs],
                        [[next(iter(d)) for d in c.logprobs or []] for c in out.outputs],
                        out.prompt_logprobs,
                    )
                else:
                    done[out.request_id] = out.outputs.embedding
        e.kv.check_integrity()
    return done


def through_pickle(e: LLMEngine, steps: list[int]) -> None:
    """The engine's runner gets each step's message only as unpickled plain data; after
    applying it, the runner's own state must equal the scheduler's requests."""
    runner = e.runner
    assert runner is not None
    execute = runner.execute

    def execute_plain(sched: SchedulerOutput, swap: bool = True) -> ModelRunnerOutput:
        copy = pickle.loads(plain_dumps(sched))
        assert copy.scheduled == [] and copy.block_tables == {}  # the scheduler's view stays
        out = execute(copy, swap)
        for req in sched.scheduled:
            st = runner.input_batch.requests[req.request_id]
            assert st.all_token_ids == req.all_token_ids
            assert st.output_token_ids == req.output_token_ids
            assert st.block_ids == sched.block_tables[req.request_id]
            assert st.num_computed_tokens == req.num_computed_tokens
        steps[0] += 1
        steps[1] += len(sched.scheduled_new_reqs)
        return out

    runner.execute = execute_plain  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "features",
    [
        {"num_kv_blocks": 30, "preemption_mode": "swap"},
        {"num_kv_blocks": 30, "preemption_mode": "recompute"},
        {"num_kv_blocks": 300, "speculative_config": {"method": "ngram",
                                                      "num_speculative_tokens": 3}},
    ],
    ids=["swap", "recompute", "ngram"],
)  # fmt: skip
def test_the_runner_needs_only_the_plain_message(tiny_llama: Path, features: Any) -> None:
    expected = drive(engine(tiny_llama, **features))
    e = engine(tiny_llama, **features)
    steps = [0, 0]
    through_pickle(e, steps)
    assert drive(e) == expected
    assert steps[1] == len(PROMPTS) + 1 + 2  # each request arrived once as new (n = 2: two)
    assert steps[0] > steps[1]
    if "speculative_config" not in features:
        assert e.stats()["num_preemptions"] > 0
    else:
        assert e.stats()["spec_decode_num_accepted_tokens"] > 0
    e.step()  # an empty step tells the runner the last finished ids
    runner = e.runner
    assert runner is not None
    assert len(runner.input_batch) == 0 and len(runner.pooler) == 0  # nothing leaks
