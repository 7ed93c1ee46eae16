"""Priority scheduling on fake tokens: exact admission order, victims, budgets and places."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.request import Request, RequestStatus
from kvserve.core.request_queue import FCFSQueue, PriorityQueue
from kvserve.core.scheduler import Scheduler
from kvserve.sampling_params import SamplingParams
from tests.core.test_scheduler import EOS, fake_step, make


def preq(rid: str, prompt_len: int, max_tokens: int, priority: int, arrival: float) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = list(range(2, 2 + prompt_len))
    return Request(rid, ids, params, max_tokens, [EOS], arrival_time=arrival, priority=priority)


def admission_order(s: Scheduler, steps: int) -> list[str]:
    order: list[str] = []
    for _ in range(steps):
        out, _ = fake_step(s)
        order += [r.request_id for r in out.scheduled if r.request_id not in order]
    return order


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", ["a", "b", "c", "d"]), ("priority", ["b", "d", "c", "a"])],
)
def test_admission_order(policy: str, expected: list[str]) -> None:
    s = make(num_blocks=20, max_num_seqs=1, scheduling_policy=policy)
    prios = {"a": 2, "b": 0, "c": 1, "d": 0}
    for t, (rid, prio) in enumerate(prios.items()):
        # One-token requests: each finishes in the step that admits it.
        s.add_request(preq(rid, 3, 1, prio if policy == "priority" else 0, float(t)))
    assert admission_order(s, 4) == expected
    assert not s.has_unfinished_requests()


def test_victim_is_lowest_priority_and_gives_its_budget_back() -> None:
    s = make(num_blocks=3, block_size=2, scheduling_policy="priority")
    s.add_request(preq("lo", 2, 10, 9, 1.0))
    fake_step(s)  # lo prefills into [0]
    s.add_request(preq("hi", 2, 10, 0, 2.0))
    out, _ = fake_step(s)  # lo grows into [0, 1]; hi prefills into [2]
    assert out.block_tables == {"lo": [0, 1], "hi": [2]}
    assert [r.request_id for r in s.running] == ["lo", "hi"]
    # lo (scheduled first this step) has room; hi needs a block: lo is the victim, not hi.
    out, _ = fake_step(s)
    assert out.preempted_req_ids == ["lo"]
    assert out.num_scheduled_tokens == {"hi": 1}
    assert [r.request_id for r in out.scheduled] == ["hi"]
    assert out.block_tables == {"hi": [2, 1]}  # lo freed [0, 1] tail first: 1 comes back first
    lo = s.waiting.peek()
    assert lo.request_id == "lo" and lo.num_computed_tokens == 0
    assert lo.status is RequestStatus.WAITING


def test_fcfs_victim_is_the_newest_even_if_it_is_the_one_growing() -> None:
    s = make(num_blocks=3, block_size=2)
    s.add_request(preq("lo", 2, 10, 0, 1.0))
    fake_step(s)
    s.add_request(preq("hi", 2, 10, 0, 2.0))
    fake_step(s)
    out, _ = fake_step(s)
    assert out.preempted_req_ids == ["hi"]
    assert out.num_scheduled_tokens == {"lo": 1}


def test_waiting_request_preempts_lower_priority_with_budget_given_back() -> None:
    # Budget 6: the two decodes take 2, so without the give-back hi's 5-token prompt would
    # be cut to a 4-token chunk; with lo2's token returned it gets 5.
    s = make(
        num_blocks=40, block_size=4, max_num_seqs=2, max_num_batched_tokens=6,
        scheduling_policy="priority",
    )  # fmt: skip
    s.add_request(preq("lo1", 2, 20, 5, 1.0))
    s.add_request(preq("lo2", 2, 20, 5, 2.0))
    fake_step(s)
    s.add_request(preq("hi", 5, 20, 0, 3.0))
    out, _ = fake_step(s)
    assert out.preempted_req_ids == ["lo2"]  # same priority as lo1, but newer
    assert out.num_scheduled_tokens == {"lo1": 1, "hi": 5}
    assert [r.request_id for r in s.running] == ["lo1", "hi"]
    assert [r.request_id for r in s.waiting] == ["lo2"]


def test_threshold_keeps_near_priorities_from_preempting() -> None:
    s = make(
        num_blocks=40, max_num_seqs=1, scheduling_policy="priority",
        priority_scheduling_preemption_threshold=3,
    )  # fmt: skip
    s.add_request(preq("run", 2, 20, 5, 1.0))
    fake_step(s)
    s.add_request(preq("near", 2, 20, 3, 2.0))  # 2 better: below the threshold
    out, _ = fake_step(s)
    assert out.preempted_req_ids == [] and list(out.num_scheduled_tokens) == ["run"]
    s.add_request(preq("far", 2, 20, 2, 3.0))  # 3 better: preempts
    out, _ = fake_step(s)
    assert out.preempted_req_ids == ["run"]
    assert list(out.num_scheduled_tokens) == ["far"]


def test_preempted_request_keeps_its_place_in_line() -> None:
    s = make(num_blocks=40, max_num_seqs=1, scheduling_policy="priority")
    s.add_request(preq("lo", 2, 2, 5, 1.0))
    fake_step(s)  # lo runs
    s.add_request(preq("hi", 2, 2, 0, 2.0))
    out, _ = fake_step(s)
    assert out.preempted_req_ids == ["lo"]
    s.add_request(preq("lo_later", 2, 2, 5, 3.0))  # same priority, arrived after lo
    s.add_request(preq("mid", 2, 2, 3, 4.0))  # better priority, arrived last
    order = admission_order(s, 8)
    assert order == ["hi", "mid", "lo", "lo_later"]
    assert s.stats.num_preemptions == 1


def test_no_preemption_for_priority_under_reserve() -> None:
    s = make(num_blocks=40, max_num_seqs=1, kv_policy="reserve", scheduling_policy="priority")
    s.add_request(preq("lo", 2, 3, 5, 1.0))
    fake_step(s)
    s.add_request(preq("hi", 2, 3, 0, 2.0))
    out, _ = fake_step(s)
    assert out.preempted_req_ids == [] and list(out.num_scheduled_tokens) == ["lo"]


def test_queues_order_and_remove() -> None:
    reqs = [preq(r, 1, 1, p, t) for r, p, t in [("x", 1, 1.0), ("y", 0, 2.0), ("z", 1, 0.5)]]
    pq, fq = PriorityQueue(), FCFSQueue()
    for r in reqs:
        pq.add(r)
        fq.add(r)
    pq.remove(reqs[2])
    assert [pq.pop().request_id for _ in range(len(pq))] == ["y", "x"]
    fq.prepend(fq.pop())
    assert [r.request_id for r in fq] == ["x", "y", "z"] and reqs[0] in fq
    with pytest.raises(ValueError, match="not in the queue"):
        pq.remove(reqs[0])


def test_config_rejects_bad_policy_values() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(scheduling_policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 1"):
        SchedulerConfig(priority_scheduling_preemption_threshold=0)
