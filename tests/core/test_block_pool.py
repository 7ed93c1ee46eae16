"""Block pool and KV cache manager: exact block ids, ref counts and integrity."""

from __future__ import annotations

import pytest

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_manager import KVCacheManager, blocks_for


def test_allocate_in_order_and_none_when_full() -> None:
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(1) is None
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_free_returns_blocks_fifo() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [0, 1] and b == [2, 3]
    pool.free([1, 0])
    assert pool.allocate(1) == [1]  # freed first, reused first
    pool.free(b)
    assert pool.allocate(3) == [0, 2, 3]
    pool.check_integrity()


def test_refcounts_and_double_free() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(1)
    assert ids == [0]
    pool.incref(ids)
    assert pool.ref_count(0) == 2
    pool.free(ids)
    assert pool.num_free_blocks == 2  # still held once
    pool.free(ids)
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(ids)
    with pytest.raises(RuntimeError, match="incref of free block"):
        pool.incref([1])


def test_allocation_failure_takes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1


def test_integrity_detects_owner_mismatch() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(2)
    assert ids is not None
    pool.check_integrity({"a": ids})
    with pytest.raises(AssertionError, match="owners"):
        pool.check_integrity({"a": ids[:1]})


def test_blocks_for() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_manager_grows_requests_by_blocks() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("b", 4) == [2]
    assert kv.allocate_slots("a", 8) == []  # still fits in its two blocks
    assert kv.allocate_slots("a", 9) == [3]
    assert kv.block_ids("a") == [0, 1, 3]
    assert kv.allocate_slots("b", 13) is None  # needs 3 more, only 2 free
    assert kv.block_ids("b") == [2]  # a failed grow keeps what it had
    kv.free("a")
    assert kv.allocate_slots("b", 13) == [4, 5, 3]  # a was freed tail first: 3, 1, 0
    kv.check_integrity()


def test_manager_swap_out_and_in() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, num_swap_blocks=3)
    kv.allocate_slots("a", 5)  # blocks 0, 1, 2
    assert kv.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    assert kv.pool.num_free_blocks == 4
    assert kv.num_swapped_blocks("a") == 3
    kv.allocate_slots("b", 4)  # takes 3, then 2 (a's blocks were freed tail first)
    assert kv.block_ids("b") == [3, 2]
    assert kv.swap_in("a") is None  # only 2 free
    kv.free("b")  # queue: 1, 0, then b's tail first: 2, 3
    assert kv.swap_in("a") == [(0, 1), (1, 0), (2, 2)]
    assert kv.block_ids("a") == [1, 0, 2]
    assert kv.swap_pool is not None and kv.swap_pool.num_free_blocks == 3
    kv.check_integrity()
