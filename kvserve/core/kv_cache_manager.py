"""Maps requests to the KV blocks that hold their tokens, on the device and in CPU swap space.

Beam search forks a request: the child shares every block of its parent (one more reference
each, ``fork``); a step that writes into a block another request also holds first gives the
writer a private copy (``copy_on_write``: a fresh block and a ``(src, dst)`` copy for the
runner). Only a fork's last, partial block is ever written, so that is the only one copied.

With prefix caching on, it also finds a request's longest cached prefix (whole blocks, looked
up by their chained hashes) and registers each block once it is full and computed; the block
pool keeps the hashes and the ref counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from kvserve.core.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Per-request block lists over a device ``BlockPool`` and an optional CPU swap pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_swap_blocks: int = 0,
        enable_caching: bool = False,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self.enable_caching = enable_caching
        self._blocks: dict[str, list[int]] = {}  # request id -> device block ids, in order
        self._swapped: dict[str, list[int]] = {}  # request id -> CPU swap block ids, in order
        # request id -> hashes of its full blocks so far (a memo: tokens are only appended, so
        # a block's hash never changes); kept across preemption, dropped when it finishes
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks registered

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, req_id: str) -> list[int]:
        return self._blocks.get(req_id, [])

    # -- prefix cache -------------------------------------------------------------------------
    def block_hashes(self, req: Request, num_tokens: int) -> list[BlockHash]:
        """Hashes of the full blocks among the request's first ``num_tokens`` tokens."""
        bs = self.block_size
        hashes = self._hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], req.cache_keys))
        return hashes[: num_tokens // bs]

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The cached blocks that hold the longest prefix of the request's tokens, in whole
        blocks and never the last token (its row must be computed to give logits). Takes no
        reference: pass them to ``allocate_slots``."""
        if not self.enable_caching:
            return []
        hit: list[int] = []
        for h in self.block_hashes(req, req.num_tokens - 1):
            block = self.pool.cached_block(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's blocks that are now full and computed, so that later
        requests with the same prefix find them."""
        if not self.enable_caching:
            return
        rid = req.request_id
        full = req.num_computed_tokens // self.block_size
        start = self._num_cached.get(rid, 0)
        if full <= start:
            return
        blocks = self._blocks[rid]
        hashes = self.block_hashes(req, full * self.block_size)
        for i in range(start, full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached[rid] = full

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (running requests register theirs again as they go)."""
        self._num_cached.clear()
        return self.pool.reset_prefix_cache()

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(
        self, req_id: str, num_total_tokens: int, computed: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the request's blocks to hold ``num_total_tokens``, starting from the cache-hit
        blocks ``computed`` (a request that holds no blocks yet); returns the new ids, or None,
        taking nothing, if there is no room."""
        held = self._blocks.get(req_id, [])
        if computed and held:
            raise ValueError(f"request {req_id} already holds blocks; no cache hit applies")
        need = max(0, blocks_for(num_total_tokens, self.block_size) - len(held) - len(computed))
        if not self.can_allocate(need, computed):
            return None
        if computed:
            self.pool.touch(computed)
            held = list(computed)
            self._num_cached[req_id] = len(computed)  # found by their hashes: registered
        new = self.pool.allocate(need)
        assert new is not None  # room was checked above
        self._blocks[req_id] = held + new
        return new

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Free the request's trailing blocks beyond its first ``num_tokens`` tokens (slots
        that held only rejected speculative tokens). Such blocks were never full and
        computed, so none of them is in the prefix cache."""
        blocks = self._blocks.get(req_id)
        keep = blocks_for(num_tokens, self.block_size)
        if blocks and len(blocks) > keep:
            self.pool.free(reversed(blocks[keep:]))
            self._blocks[req_id] = blocks[:keep]  # a new list: a step's block tables keep theirs

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """Give ``child_id`` (holding nothing) its parent's device blocks, shared: one more
        reference each, no copy. Returns the child's table."""
        if child_id in self._blocks or child_id in self._swapped:
            raise ValueError(f"request {child_id} already holds blocks; it cannot be forked into")
        blocks = list(self._blocks[parent_id])
        self.pool.incref(blocks)
        self._blocks[child_id] = blocks
        if parent_id in self._hashes:  # the same tokens so far: the same full-block hashes
            self._hashes[child_id] = list(self._hashes[parent_id])
        if parent_id in self._num_cached:
            self._num_cached[child_id] = self._num_cached[parent_id]
        return list(blocks)

    def copy_on_write(self, req_id: str, first_token: int) -> list[tuple[int, int]] | None:
        """Make the request's blocks from the one holding ``first_token`` on its own before a
        step writes them: each block another request also holds is replaced by a fresh copy.
        Returns the ``(src, dst)`` copies for the runner (usually none), or None, changing
        nothing, when too few blocks are free."""
        blocks = self._blocks.get(req_id, [])
        shared = [
            i
            for i in range(first_token // self.block_size, len(blocks))
            if self.pool.ref_count(blocks[i]) > 1
        ]
        if not shared:
            return []
        fresh = self.pool.allocate(len(shared))
        if fresh is None:
            return None
        table = list(blocks)  # a new list: a step's block tables keep theirs
        for i, dst in zip(shared, fresh, strict=True):
            table[i] = dst
        self.pool.free([blocks[i] for i in shared])  # still held by the others
        self._blocks[req_id] = table
        if req_id in self._num_cached:  # a copied block is not the registered one
            self._num_cached[req_id] = min(self._num_cached[req_id], shared[0])
        return [(blocks[i], table[i]) for i in shared]

    def can_allocate(self, num_blocks: int, computed: Sequence[int] = ()) -> bool:
        """Room for ``num_blocks`` new blocks after reviving the free ones among ``computed``."""
        revived = sum(1 for b in computed if self.pool.is_free(b))
        return num_blocks + revived <= self.pool.num_free_blocks

    def free(self, req_id: str, keep_hashes: bool = False) -> None:
        """Release the request's device blocks, tail first (so a shared head stays cached
        longest), and its swap blocks. ``keep_hashes``: it will come back (preemption)."""
        blocks = self._blocks.pop(req_id, None)
        if blocks:
            self.pool.free(reversed(blocks))
        swapped = self._swapped.pop(req_id, None)
        if swapped and self.swap_pool is not None:
            self.swap_pool.free(swapped)
        self._num_cached.pop(req_id, None)
        if not keep_hashes:
            self._hashes.pop(req_id, None)

    def swap_out(self, req_id: str) -> list[tuple[int, int]] | None:
        """Move the request's blocks to swap space: ``(device, cpu)`` pairs, or None if full."""
        blocks = self._blocks.get(req_id, [])
        if self.swap_pool is None:
            return None
        cpu = self.swap_pool.allocate(len(blocks))
        if cpu is None:
            return None
        self._swapped[req_id] = cpu
        del self._blocks[req_id]
        self.pool.free(reversed(blocks))
        self._num_cached.pop(req_id, None)  # its new device blocks register again
        return list(zip(blocks, cpu, strict=True))

    def swap_in(self, req_id: str) -> list[tuple[int, int]] | None:
        """Bring swapped blocks back: ``(cpu, device)`` pairs, or None if the device is full."""
        assert self.swap_pool is not None
        cpu = self._swapped[req_id]
        dev = self.pool.allocate(len(cpu))
        if dev is None:
            return None
        del self._swapped[req_id]
        self._blocks[req_id] = dev
        self.swap_pool.free(cpu)
        return list(zip(cpu, dev, strict=True))

    def num_swapped_blocks(self, req_id: str) -> int:
        return len(self._swapped.get(req_id, []))

    def check_integrity(self) -> None:
        """free + used == total and ref counts equal ownership, on both pools."""
        self.pool.check_integrity(self._blocks)
        if self.swap_pool is not None:
            self.swap_pool.check_integrity(self._swapped)
