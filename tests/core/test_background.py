"""Background (Batch API) requests on fake tokens: they sit out every step that computes an
online prompt, wait behind online requests, and never deadlock; exact steps and blocks."""

from __future__ import annotations

from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler
from kvserve.sampling_params import SamplingParams
from tests.core.test_scheduler import EOS, fake_step, make


def breq(rid: str, prompt_len: int, max_tokens: int, background: bool) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = list(range(2, 2 + prompt_len))
    return Request(rid, ids, params, max_tokens, [EOS], background=background)


def steps(s: Scheduler, n: int) -> list[dict[str, int]]:
    return [fake_step(s)[0].num_scheduled_tokens for _ in range(n)]


def test_background_rows_sit_out_online_prefill_steps() -> None:
    s = make(num_blocks=40, max_num_batched_tokens=8)
    s.add_request(breq("b1", 3, 20, True))
    s.add_request(breq("b2", 3, 20, True))
    assert steps(s, 2) == [{"b1": 3, "b2": 3}, {"b1": 1, "b2": 1}]
    # A 12-token online prompt: two chunks (8 + 4) with no background row beside them, then
    # its decode rows share the steps with the batch again.
    s.add_request(breq("on", 12, 3, False))
    assert steps(s, 2) == [{"on": 8}, {"on": 4}]
    b1 = s.requests["b1"]
    assert b1.num_computed_tokens == 4 and b1.num_output_tokens == 2  # paused, not preempted
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"on": 1, "b1": 1, "b2": 1}
    # the fifth tokens of b1, b2 took blocks after the online request's (scheduled first)
    assert out.block_tables == {"on": [2, 3, 4, 5], "b1": [0, 6], "b2": [1, 7]}


def test_waiting_background_goes_after_online_even_when_first() -> None:
    s = make(num_blocks=40, max_num_batched_tokens=64)
    s.add_request(breq("b", 4, 5, True))
    s.add_request(breq("on", 4, 5, False))  # arrives later, admitted first
    assert steps(s, 3) == [{"on": 4}, {"on": 1, "b": 4}, {"on": 1, "b": 1}]


def test_online_decode_does_not_hold_background_back() -> None:
    s = make(num_blocks=40)
    s.add_request(breq("on", 4, 6, False))
    fake_step(s)
    s.add_request(breq("b", 4, 6, True))
    assert steps(s, 2) == [{"on": 1, "b": 4}, {"on": 1, "b": 1}]


def test_background_row_that_cannot_grow_preempts_but_not_a_request_admitted_now() -> None:
    # 4 blocks of 2: b fills 2 with its prompt; a waiting background request c takes the
    # other 2 in the step where b needs a third: b may not take c's (admitted this step), so
    # b preempts itself and c runs; no deadlock, every request finishes.
    s = make(num_blocks=4, block_size=2)
    s.add_request(breq("b", 4, 4, True))
    assert steps(s, 1) == [{"b": 4}]
    s.add_request(breq("c", 4, 1, True))
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"c": 4} and out.preempted_req_ids == ["b"]
    assert out.block_tables == {"c": [2, 3]}
    for _ in range(12):
        fake_step(s)
    assert not s.has_unfinished_requests()
    assert s.kv.pool.num_free_blocks == 4


def test_online_only_schedule_is_unchanged() -> None:
    s = make(num_blocks=40, max_num_batched_tokens=8)
    s.add_request(breq("x", 3, 3, False))
    s.add_request(breq("y", 7, 3, False))
    assert steps(s, 3) == [{"x": 3, "y": 5}, {"x": 1, "y": 2}, {"x": 1, "y": 1}]
