"""The step message's per-request entries: everything once, then only the difference, and
the runner's ``InputBatch`` rebuilt from them equals the scheduler's view at every step."""

from __future__ import annotations

import pickle

import torch

from kvserve.core.request import Request
from kvserve.core.runner_views import RunnerViews
from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch


def step(views: RunnerViews, batch: InputBatch, req: Request, blocks: list[int]) -> SchedulerOutput:
    """One message about ``req`` holding ``blocks``, applied to the runner's batch through a
    pickle round trip; the runner's copy must then equal the scheduler's."""
    out = SchedulerOutput([req], {req.request_id: 1}, {req.request_id: blocks})
    views.describe(out, req, blocks)
    rows = batch.update(pickle.loads(pickle.dumps(out)))
    (st,) = rows.scheduled
    assert st.block_ids == blocks
    assert st.all_token_ids == req.all_token_ids
    assert st.num_computed_tokens == req.num_computed_tokens
    return out


def test_only_the_difference_is_sent_after_the_first_step() -> None:
    views, batch = RunnerViews(), InputBatch(torch.device("cpu"))
    req = Request("a", [5, 6, 7], SamplingParams(seed=3), 10, [1])
    out = step(views, batch, req, [4, 9])
    (new,) = out.scheduled_new_reqs
    assert new.prompt_token_ids == [5, 6, 7] and new.block_ids == [4, 9]
    assert batch.requests["a"].generator is not None  # seeded: the runner's own generator
    assert len(out.scheduled_cached_reqs) == 0

    req.num_computed_tokens = 3
    req.append_output_token(8)
    c = step(views, batch, req, [4, 9, 2]).scheduled_cached_reqs
    assert (c.new_token_ids, c.new_block_ids, c.num_block_ids) == ([[8]], [[2]], [3])
    assert (
        c.resumed_from_preemption == [False]
        and not step(views, batch, req, [4, 9, 2]).scheduled_new_reqs
    )

    # Rejected proposals released the last block, and a new one was taken: cut, then append.
    c = step(views, batch, req, [4, 9, 6]).scheduled_cached_reqs
    assert (c.new_block_ids, c.num_block_ids) == ([[6]], [3])
    c = step(views, batch, req, [4]).scheduled_cached_reqs  # a pure cut
    assert (c.new_block_ids, c.num_block_ids) == ([[]], [1])

    views.preempted("a")  # swapped out and back in: other device blocks, whole table
    c = step(views, batch, req, [11, 12]).scheduled_cached_reqs
    assert c.resumed_from_preemption == [True] and c.new_block_ids == [[11, 12]]


def test_finished_requests_leave_the_runner() -> None:
    views, batch = RunnerViews(), InputBatch(torch.device("cpu"))
    req = Request("a", [5, 6], SamplingParams(), 4, [1])
    step(views, batch, req, [0])
    views.forget("a")
    batch.update(SchedulerOutput([], {}, {}, finished_req_ids={"a"}))
    assert len(views) == 0 and len(batch) == 0
    out = step(views, batch, req, [3])  # the same id again is a new request
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]
