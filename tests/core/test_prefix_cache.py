"""Prefix caching on fake tokens: exact block ids, hit counts and integrity after every step."""

from __future__ import annotations

import pytest

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.block_pool import BlockPool, hash_block_tokens
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler
from kvserve.sampling_params import SamplingParams
from tests.core.test_scheduler import EOS, fake_step

BS = 4
SYSTEM = list(range(100, 108))  # two full blocks


def make(num_blocks: int, **sched: object) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    return Scheduler(SchedulerConfig(**sched), CacheConfig(block_size=BS), kv)  # type: ignore[arg-type]


def req(rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, max_tokens, [EOS])


def run_to_end(s: Scheduler, token: int = 7) -> None:
    while s.has_unfinished_requests():
        fake_step(s, token)


def test_hashes_chain_and_extra_keys() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora", 1)) != a


def test_shared_system_prompt_while_running_and_after() -> None:
    s = make(num_blocks=12)
    s.add_request(req("a", [*SYSTEM, 1, 2]))
    out, _ = fake_step(s)
    assert out.block_tables == {"a": [0, 1, 2]} and out.num_scheduled_tokens == {"a": 10}
    s.add_request(req("b", [*SYSTEM, 3, 4, 5]))
    out, _ = fake_step(s)
    # b finds a's two full blocks (8 tokens) and computes only its last 3 tokens.
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert out.block_tables["b"] == [0, 1, 3]
    assert s.kv.pool.ref_count(0) == s.kv.pool.ref_count(1) == 2
    assert s.requests["b"].num_cached_tokens == 8
    assert (s.stats.prefix_cache_queries, s.stats.prefix_cache_hits) == (10 + 11, 8)
    run_to_end(s)
    # Both finished: every block is free, the full ones still findable.
    assert s.kv.pool.num_free_blocks == 12
    s.add_request(req("c", [*SYSTEM, 9]))
    out, _ = fake_step(s)
    # a freed block 2; b grew into 4 and freed 4, 3 (tail first); 5 is the LRU head.
    assert out.block_tables == {"c": [0, 1, 5]} and out.num_scheduled_tokens == {"c": 1}
    assert s.stats.prefix_cache_hits == 16


def test_the_last_token_is_always_computed() -> None:
    s = make(num_blocks=12)
    s.add_request(req("a", SYSTEM))
    run_to_end(s)
    s.add_request(req("b", SYSTEM))  # the whole prompt is cached: its last block is not used
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"b": 4} and out.block_tables["b"][0] == 0
    assert s.requests["b"].num_cached_tokens == 4


def test_multi_turn_chat_hits_the_previous_answer() -> None:
    s = make(num_blocks=20)
    turn1 = list(range(10, 16))  # 6 tokens
    s.add_request(req("t1", turn1, max_tokens=6))
    run_to_end(s)  # 6 outputs (7s): 12 tokens, 11 computed -> blocks of 0..7 are full
    history = turn1 + [7] * 6
    s.add_request(req("t2", [*history, 20, 21, 22]))
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"t2": 15 - 8}
    assert s.requests["t2"].num_cached_tokens == 8


def test_eviction_is_lru_and_tail_first() -> None:
    s = make(num_blocks=6)
    s.add_request(req("a", list(range(1, 13)), max_tokens=1))  # 3 full blocks: 0, 1, 2
    run_to_end(s)
    # Freed tail first: the queue is 3, 4, 5 (never used), then 2, 1, 0.
    s.add_request(req("b", list(range(50, 66)), max_tokens=1))  # 4 blocks: evicts block 2
    out, _ = fake_step(s)
    assert out.block_tables == {"b": [3, 4, 5, 2]}
    assert s.kv.pool.num_evictions == 1
    s.kv.check_integrity()
    c = req("c", [*list(range(1, 13)), 99], max_tokens=1)
    s.add_request(c)
    out, _ = fake_step(s)
    # a's head blocks 0 and 1 survived; its tail block 2 was evicted and is recomputed.
    assert c.num_cached_tokens == 8
    assert out.block_tables["c"][:2] == [0, 1] and out.num_scheduled_tokens == {"c": 5}


def test_revived_block_leaves_the_free_queue() -> None:
    pool = BlockPool(3)
    b = pool.allocate(1)
    assert b == [0]
    pool.cache_block(0, 1234)
    pool.free(b)
    assert pool.is_free(0) and pool.cached_block(1234) == 0
    pool.touch([0])
    assert pool.ref_count(0) == 1 and pool.num_free_blocks == 2
    assert pool.allocate(2) == [1, 2]  # 0 is not handed out again
    pool.check_integrity()
    with pytest.raises(RuntimeError, match="holds no cached content"):
        BlockPool(2).touch([0])  # a free block with no hash has nothing to revive


def test_preempted_request_comes_back_onto_its_own_blocks() -> None:
    s = make(num_blocks=5)
    s.add_request(req("old", list(range(1, 9)), max_tokens=4))  # 8 tokens: blocks 0, 1
    new = req("new", list(range(20, 28)), max_tokens=6)  # blocks 2, 3
    s.add_request(new)
    fake_step(s)
    out, _ = fake_step(s)  # old grows into 4; new needs a 5th block: preempted (recompute)
    assert out.preempted_req_ids == ["new"]
    assert s.kv.pool.is_free(2) and s.kv.pool.is_free(3)  # free, but still cached
    while "new" not in out.num_scheduled_tokens:
        out, _ = fake_step(s)
    # It came back when old finished, onto its own two prompt blocks: 9 tokens to recompute,
    # 8 of them found, so only its one output token runs again.
    assert out.num_scheduled_tokens == {"new": 1}
    assert out.block_tables["new"] == [2, 3, 4]
    assert s.stats.num_preemptions == 1 and s.stats.prefix_cache_hits == 8
    run_to_end(s)
    assert new.output_token_ids == [7] * 6


def test_reserve_counts_only_the_blocks_still_needed() -> None:
    s = make(num_blocks=5, kv_policy="reserve")
    s.add_request(req("a", SYSTEM, max_tokens=4))  # 12 tokens: 3 blocks reserved
    fake_step(s)
    s.add_request(req("b", SYSTEM, max_tokens=4))
    out, _ = fake_step(s)
    # b shares a's first block (the last prompt token is always computed) and needs 2 more:
    # without the hit it would need 3 and could not start.
    assert out.block_tables["b"] == [0, 3, 4]
    assert s.requests["b"].num_cached_tokens == 4
    run_to_end(s)


def test_n_siblings_compute_the_prompt_once() -> None:
    s = make(num_blocks=20)
    for i in range(3):
        s.add_request(req(f"p#{i}", [*SYSTEM, 1, 2, 3], max_tokens=4))
    out, _ = fake_step(s)
    # The first child computes the prompt; its siblings wait one step for its blocks...
    assert out.num_scheduled_tokens == {"p#0": 11}
    out, _ = fake_step(s)
    # ...then find them: 8 of 11 prompt tokens cached each.
    assert out.num_scheduled_tokens == {"p#0": 1, "p#1": 3, "p#2": 3}
    assert out.block_tables["p#1"][:2] == out.block_tables["p#2"][:2] == [0, 1]
    assert s.kv.pool.ref_count(0) == 3
    run_to_end(s)


def test_reset_prefix_cache_forgets_everything() -> None:
    s = make(num_blocks=12)
    s.add_request(req("a", [*SYSTEM, 1]))
    run_to_end(s)
    assert s.kv.reset_prefix_cache() == 2
    s.add_request(req("b", [*SYSTEM, 1]))
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"b": 9}
    s.kv.check_integrity()


def test_caching_off_finds_nothing() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    r = req("x", [*SYSTEM, 1])
    assert kv.get_computed_blocks(r) == []


def test_adapters_share_no_block() -> None:
    """The same prompt under two adapters and the base model: three sets of blocks, and a
    second request on an adapter hits only that adapter's blocks."""
    from kvserve.lora.request import LoRARequest

    s = make(num_blocks=30)
    one, two = LoRARequest("one", 1, "/a/one"), LoRARequest("two", 2, "/a/two")
    prompt = [*SYSTEM, 1, 2]  # two full blocks and a bit

    def lreq(rid: str, lora: LoRARequest | None) -> Request:
        r = req(rid, prompt)
        r.lora_request = lora
        return r

    for rid, lora in (("base", None), ("one", one), ("two", two)):
        s.add_request(lreq(rid, lora))
    out, _ = fake_step(s)
    tables = out.block_tables
    assert tables == {"base": [0, 1, 2], "one": [3, 4, 5], "two": [6, 7, 8]}
    hashes = {rid: s.kv.block_hashes(s.requests[rid], 8) for rid in tables}
    assert len({h for hs in hashes.values() for h in hs}) == 6  # no hash shared
    s.add_request(lreq("one-again", one))
    out, _ = fake_step(s)
    assert out.block_tables["one-again"][:2] == [3, 4]  # adapter one's blocks, no other's
    assert s.requests["one-again"].num_cached_tokens == 8
