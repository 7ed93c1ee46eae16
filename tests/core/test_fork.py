"""Forking a request (beam search): shared blocks, copy-on-write, pruning; exact block ids,
ref counts and integrity, in the KV cache manager and through the scheduler's steps."""

from __future__ import annotations

import pytest

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from tests.core.test_scheduler import fake_step, make, req


def test_fork_shares_every_block() -> None:
    kv = KVCacheManager(8, 4)
    assert kv.allocate_slots("p", 6) == [0, 1]
    assert kv.fork("p", "c") == [0, 1]
    assert [kv.pool.ref_count(b) for b in (0, 1)] == [2, 2]
    assert kv.pool.num_used_blocks == 2
    kv.check_integrity()
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.fork("p", "c")


def test_copy_on_write_copies_only_shared_written_blocks() -> None:
    kv = KVCacheManager(8, 4)
    kv.allocate_slots("p", 6)
    kv.fork("p", "c")
    assert kv.copy_on_write("p", 6) == [(1, 2)]  # position 6 is in block 1, shared
    assert kv.block_ids("p") == [0, 2] and kv.block_ids("c") == [0, 1]
    assert [kv.pool.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert kv.copy_on_write("c", 6) == []  # block 1 is now c's alone: written in place
    assert kv.copy_on_write("p", 8) == []  # a new block: nothing shared to copy
    kv.check_integrity()
    kv.free("p")  # a prune: only the survivor's references remain
    assert [kv.pool.ref_count(b) for b in (0, 1, 2)] == [1, 1, 0]
    kv.check_integrity()


def test_copy_on_write_without_room_changes_nothing() -> None:
    kv = KVCacheManager(2, 4)
    kv.allocate_slots("p", 6)
    kv.fork("p", "c")
    assert kv.copy_on_write("p", 6) is None
    assert kv.block_ids("p") == kv.block_ids("c") == [0, 1]
    kv.check_integrity()


def _fork(parent: Request, cid: str, token: int) -> Request:
    child = Request(cid, parent.prompt_token_ids, parent.params, parent.max_tokens, [])
    child.output_token_ids = [*parent.output_token_ids[:-1], token]
    child.all_token_ids = [*parent.prompt_token_ids, *child.output_token_ids]
    child.num_computed_tokens = parent.num_computed_tokens
    return child


def test_scheduler_fork_then_copy_in_the_step_message() -> None:
    s = make(num_blocks=6)
    parent = req("p", 6, 5)
    s.add_request(parent)
    fake_step(s)  # the prefill: blocks 0 and 1 (positions 0-5), token 7 appended
    child = _fork(parent, "c", 9)
    s.fork_request(parent, child)
    assert [r.request_id for r in s.running] == ["p", "c"]
    assert s.kv.block_ids("c") == [0, 1]
    out, _ = fake_step(s)
    assert out.blocks_to_copy == [(1, 2)]  # p writes position 6 first: its own copy
    assert out.block_tables == {"p": [0, 2], "c": [0, 1]}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c"]  # the runner meets the fork
    assert out.scheduled_new_reqs[0].num_computed_tokens == 6
    assert child.all_token_ids[-2:] == [9, 7]  # its own token, then the step's
    s.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)  # pruned
    assert s.kv.pool.num_used_blocks == 2
    s.kv.check_integrity()


def test_copy_without_room_preempts() -> None:
    # 3 blocks: the prefill takes 2, the fork shares them; the first write needs a copy
    # (block 2), the second request's next block then finds none and preemption frees room
    s = make(num_blocks=3)
    parent = req("p", 6, 5)
    s.add_request(parent)
    fake_step(s)
    s.fork_request(parent, _fork(parent, "c", 9))
    fake_step(s)
    fake_step(s)  # position 7 still in the copied / own block: no new block
    out, _ = fake_step(s)  # position 8: both need a new block; only one is free
    assert out.preempted_req_ids == ["c"]
    assert s.kv.block_ids("p") == [0, 2, 1]  # c's block 1 came back; block 0 is p's alone
    assert s.kv.pool.ref_count(0) == 1
    s.kv.check_integrity()
