"""Scheduler unit tests on fake token streams (no model): exact blocks, counts and order."""

from __future__ import annotations

import random

import pytest

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.sampling_params import SamplingParams

EOS = 1


def make(num_blocks: int, block_size: int = 4, swap: int = 0, **sched: object) -> Scheduler:
    cache = CacheConfig(block_size=block_size, num_kv_blocks=num_blocks)
    return Scheduler(
        SchedulerConfig(**sched),
        cache,  # type: ignore[arg-type]
        KVCacheManager(num_blocks, block_size, swap),
    )


def req(rid: str, prompt_len: int, max_tokens: int, ignore_eos: bool = True) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(rid, list(range(2, 2 + prompt_len)), params, max_tokens, [EOS])


def fake_step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    sampled = {r.request_id: [token] for r in out.scheduled if out.samples(r)}
    _, finished = s.update_from_output(out, sampled)
    s.kv.check_integrity()
    return out, finished


def test_prefill_then_decode_counts_and_blocks() -> None:
    s = make(num_blocks=10)
    s.add_request(req("a", 6, 3))
    s.add_request(req("b", 4, 3))
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}
    assert out.block_tables == {"a": [0, 1], "b": [2]}
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.block_tables == {"a": [0, 1], "b": [2, 3]}  # b's 5th token opens block 3
    _, finished = fake_step(s)
    assert [r.request_id for r in finished] == ["a", "b"]
    assert [r.output_token_ids for r in finished] == [[7, 7, 7], [7, 7, 7]]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in finished)
    assert s.kv.pool.num_free_blocks == 10


def test_chunked_prefill_within_token_budget() -> None:
    s = make(num_blocks=10, max_num_batched_tokens=4)
    s.add_request(req("a", 10, 2))
    s.add_request(req("b", 2, 2))
    counts = []
    for _ in range(4):
        out, _ = fake_step(s)
        counts.append(dict(out.num_scheduled_tokens))
    # a's prompt in chunks of 4, 4, then 2 + b's 2; the step after decodes both.
    assert counts == [{"a": 4}, {"a": 4}, {"a": 2, "b": 2}, {"a": 1, "b": 1}]


def test_max_num_seqs_limits_the_batch() -> None:
    s = make(num_blocks=20, max_num_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 2, 2))
    out, _ = fake_step(s)
    assert [r.request_id for r in out.scheduled] == ["0", "1"]
    assert s.stats.num_waiting == 1
    fake_step(s)  # 0 and 1 finish
    out, _ = fake_step(s)
    assert [r.request_id for r in out.scheduled] == ["2"]


def test_preempts_newest_with_recompute() -> None:
    s = make(num_blocks=3, block_size=2)
    s.add_request(req("old", 2, 4))
    s.add_request(req("new", 2, 4))
    out, _ = fake_step(s)  # both prefill: old [0], new [1]
    assert out.block_tables == {"old": [0], "new": [1]}
    out, _ = fake_step(s)  # old grows to [0, 2]; new cannot grow: it is preempted
    assert out.preempted_req_ids == ["new"]
    assert out.num_scheduled_tokens == {"old": 1}
    assert s.stats.num_preemptions == 1
    new = s.waiting.peek()
    assert new.request_id == "new" and new.num_computed_tokens == 0
    assert new.output_token_ids == [7]  # kept, recomputed with the prompt later


def test_preempt_with_swap_keeps_computed_tokens() -> None:
    s = make(num_blocks=3, block_size=2, swap=4, preemption_mode="swap")
    s.add_request(req("old", 2, 4))
    s.add_request(req("new", 2, 4))
    fake_step(s)
    out, _ = fake_step(s)
    assert out.blocks_to_swap_out == [(1, 0)]
    assert s.stats.num_swapped == 1
    swapped = s.swapped.peek()
    assert swapped.num_computed_tokens == 2 and swapped.status is RequestStatus.SWAPPED


def test_reserve_never_preempts_and_reserves_all_blocks() -> None:
    s = make(num_blocks=5, block_size=2, kv_policy="reserve")
    s.add_request(req("a", 2, 4))  # 6 tokens -> 3 blocks reserved up front
    s.add_request(req("b", 2, 4))
    out, _ = fake_step(s)
    assert out.block_tables == {"a": [0, 1, 2]}
    assert s.stats.num_waiting == 1
    for _ in range(3):
        fake_step(s)
    out, _ = fake_step(s)
    assert out.block_tables == {"b": [3, 4, 2]}  # a freed tail first: 2, 1, 0
    assert s.stats.num_preemptions == 0


def test_finish_requests_frees_blocks_everywhere() -> None:
    s = make(num_blocks=6)
    s.add_request(req("a", 5, 10))
    s.add_request(req("b", 5, 10))
    fake_step(s)
    s.add_request(req("c", 5, 10))
    done = s.finish_requests(["a", "c", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a", "c"]
    assert s.kv.pool.num_free_blocks == 4
    assert [r.request_id for r in s.running] == ["b"] and not s.waiting


def test_eos_stops_unless_ignored() -> None:
    s = make(num_blocks=6)
    s.add_request(req("a", 2, 5, ignore_eos=False))
    s.add_request(req("b", 2, 5, ignore_eos=True))
    _, finished = fake_step(s, token=EOS)
    assert [(r.request_id, r.status) for r in finished] == [("a", RequestStatus.FINISHED_STOPPED)]


@pytest.mark.parametrize(
    ("policy", "mode"), [("preempt", "recompute"), ("preempt", "swap"), ("reserve", "recompute")]
)
def test_randomized_workload_keeps_integrity(policy: str, mode: str) -> None:
    rng = random.Random(1234)
    s = make(
        num_blocks=24,
        block_size=4,
        swap=16,
        kv_policy=policy,
        preemption_mode=mode,
        max_num_seqs=6,
        max_num_batched_tokens=32,
    )
    added = finished = aborted = 0
    for step in range(3000):
        if step >= 300 and not s.has_unfinished_requests():
            break
        if step < 300 and rng.random() < 0.4:
            s.add_request(req(f"r{added}", rng.randint(1, 30), rng.randint(1, 40)))
            added += 1
        if s.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(s.requests))
            aborted += len(s.finish_requests([victim], RequestStatus.FINISHED_ABORTED))
        out, done = fake_step(s, token=rng.randint(2, 100))
        finished += len(done)
        used = sum(len(s.kv.block_ids(r.request_id)) for r in s.running)
        assert used == s.kv.pool.num_used_blocks  # only running requests hold device blocks
        assert out.total_num_scheduled_tokens <= 32 and len(s.running) <= 6
    assert added == finished + aborted
    assert added > 100 and aborted > 0
    assert not s.has_unfinished_requests()
    assert s.kv.pool.num_free_blocks == 24
    if policy == "reserve":
        assert s.stats.num_preemptions == 0
    else:
        assert s.stats.num_preemptions > 0


def make_spec(num_blocks: int, k: int = 3, **spec: object) -> Scheduler:
    from kvserve.config import SpeculativeConfig

    cache = CacheConfig(block_size=4, num_kv_blocks=num_blocks)
    return Scheduler(
        SchedulerConfig(),
        cache,
        KVCacheManager(num_blocks, 4),
        SpeculativeConfig(num_speculative_tokens=k, **spec),  # type: ignore[arg-type]
    )


def test_spec_tokens_are_scheduled_then_rolled_back() -> None:
    s = make_spec(num_blocks=10)
    s.add_request(req("a", 6, 10))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 6} and out.propose
    s.update_from_output(out, {"a": [7]}, {"a": [8, 9, 10]})
    a = s.requests["a"]
    assert a.spec_token_ids == [8, 9, 10] and a.num_tokens_with_spec == 10
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}  # the last token and three proposals
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    assert out.block_tables == {"a": [0, 1, 2]}  # positions 6..9 reach block 2
    assert out.samples(a) and out.num_spec_tokens(a) == 3
    updated, finished = s.update_from_output(out, {"a": [8, 5]}, {"a": [6]})
    assert updated == [a] and finished == [] and a.num_new_tokens == 2
    assert a.output_token_ids == [7, 8, 5]
    assert a.num_computed_tokens == 8  # 6 + 4 - the 2 rejected proposals
    assert a.num_tokens == 9 and a.spec_token_ids == [6]
    st = s.stats
    assert (st.spec_decode_num_drafts, st.spec_decode_num_draft_tokens) == (1, 3)
    assert st.spec_decode_num_accepted_tokens == 1
    assert st.spec_decode_accepted_per_pos == [1, 0, 0]
    assert st.num_generation_tokens == 3
    s.kv.check_integrity()


def test_rejected_slots_are_released() -> None:
    s = make_spec(num_blocks=10)
    s.add_request(req("a", 5, 10))
    s.update_from_output(s.schedule(), {"a": [7]}, {"a": [8, 9, 10]})
    out = s.schedule()
    assert out.block_tables == {"a": [0, 1, 2]}  # positions 5..8
    s.update_from_output(out, {"a": [4]})  # every proposal rejected
    assert s.requests["a"].num_computed_tokens == 6
    assert s.kv.block_ids("a") == [0, 1]  # block 2 held only rejected positions
    assert s.kv.pool.num_free_blocks == 8
    s.kv.check_integrity()


def test_stops_inside_an_accepted_run_drop_the_rest() -> None:
    s = make_spec(num_blocks=10)
    s.add_request(req("eos", 4, 10, ignore_eos=False))
    s.add_request(req("len", 4, 3))
    s.update_from_output(
        s.schedule(), {"eos": [7], "len": [7]}, {"eos": [8, EOS, 9], "len": [8, 9, 10]}
    )
    assert s.requests["len"].spec_token_ids == [8]  # room for 3 - 1 - 1 proposals
    out = s.schedule()
    assert out.num_scheduled_tokens == {"eos": 4, "len": 2}
    _, finished = s.update_from_output(out, {"eos": [8, EOS, 9, 3], "len": [8, 5]})
    by_id = {r.request_id: r for r in finished}
    assert by_id["eos"].output_token_ids == [7, 8, EOS]
    assert by_id["eos"].status is RequestStatus.FINISHED_STOPPED
    assert by_id["len"].output_token_ids == [7, 8, 5]
    assert by_id["len"].status is RequestStatus.FINISHED_LENGTH
    assert s.kv.pool.num_free_blocks == 10
    s.kv.check_integrity()


def test_disable_by_batch_size_skips_speculation() -> None:
    s = make_spec(num_blocks=20, disable_by_batch_size=1)
    s.add_request(req("a", 4, 10))
    out = s.schedule()
    assert out.propose  # one running request: speculate
    s.update_from_output(out, {"a": [7]}, {"a": [8, 9]})
    s.add_request(req("b", 4, 10))
    out = s.schedule()  # b joins: a's proposals were made for this step, none after it
    assert not out.propose and out.scheduled_spec_decode_tokens == {"a": [8, 9]}
    assert out.num_scheduled_tokens == {"a": 3, "b": 4}
    s.update_from_output(out, {"a": [8, 9, 3], "b": [7]}, {"a": [1, 2], "b": [3]})
    assert s.requests["a"].spec_token_ids == [] == s.requests["b"].spec_token_ids
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and not out.propose


def test_preemption_drops_proposals() -> None:
    s = make_spec(num_blocks=3)
    s.add_request(req("a", 4, 8))
    s.add_request(req("b", 4, 8))
    s.update_from_output(s.schedule(), {"a": [7], "b": [7]}, {"a": [8, 9], "b": [8, 9]})
    out = s.schedule()  # a needs a 3rd block for its proposals, b a 4th: b is preempted
    assert out.preempted_req_ids == ["b"]
    assert s.requests["b"].spec_token_ids == []
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9]}
    s.kv.check_integrity()


def test_stop_early_in_a_run_caches_only_whole_token_blocks() -> None:
    """EOS as the first of 4 new tokens: the positions after it were computed but hold no
    token of the request, so no block past its tokens is hashed into the prefix cache."""
    from kvserve.config import SpeculativeConfig

    s = Scheduler(
        SchedulerConfig(),
        CacheConfig(block_size=4, num_kv_blocks=10),
        KVCacheManager(10, 4, enable_caching=True),
        SpeculativeConfig(num_speculative_tokens=3),
    )
    s.add_request(req("a", 5, 10, ignore_eos=False))
    s.update_from_output(s.schedule(), {"a": [7]}, {"a": [EOS, 8, 9]})
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}  # positions 5..8 reach block 2
    _, finished = s.update_from_output(out, {"a": [EOS, 8, 9, 10]})
    assert finished[0].output_token_ids == [7, EOS]
    assert finished[0].num_computed_tokens == 6  # not 9: only its 7 tokens minus the newest
    assert s.kv.pool.num_cached_blocks == 1  # block 0 ([2, 3, 4, 5]); block 1 holds 3 tokens
    s.kv.check_integrity()


def test_distinct_adapters_per_step_capped_at_max_loras() -> None:
    """max_loras=2, three adapters: the third adapter's request waits (those behind it with
    a running adapter or none go ahead) until an adapter's requests finish."""
    from kvserve.lora.request import LoRARequest

    s = Scheduler(
        SchedulerConfig(), CacheConfig(block_size=4, num_kv_blocks=40),
        KVCacheManager(40, 4), max_loras=2,
    )  # fmt: skip
    loras = {i: LoRARequest(f"a{i}", i, f"/adapters/{i}") for i in (1, 2, 3)}

    def lreq(rid: str, lora: int | None, max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        lr = None if lora is None else loras[lora]
        return Request(rid, [2, 3, 4], params, max_tokens, [EOS], lora_request=lr)

    for r in (lreq("a", 1, 2), lreq("b", 2, 4), lreq("c", 3, 2), lreq("d", 1, 2),
              lreq("base", None, 2)):  # fmt: skip
        s.add_request(r)
    out, _ = fake_step(s)
    assert [r.request_id for r in out.scheduled] == ["a", "b", "d", "base"]
    assert [r.request_id for r in s.waiting] == ["c"]  # kept its place
    _, finished = fake_step(s)  # a, d (adapter 1) and base finish
    assert sorted(r.request_id for r in finished) == ["a", "base", "d"]
    out, _ = fake_step(s)  # adapter 1 has no request left: adapter 3 gets its slot
    assert [r.request_id for r in out.scheduled] == ["b", "c"]
    assert {r.lora_int_id for r in out.scheduled} == {2, 3}
