"""The block pool: the one owner of KV block ref counts, the free queue and block hashes.

Everything else (the KV cache manager, the scheduler) sees only block ids.

Prefix caching (vLLM's automatic prefix caching): a full, computed block can be given a
``BlockHash`` (``hash_block_tokens``: its parent block's hash chained with its token ids).
When its last owner frees it, the block keeps its hash and stays findable (ref count 0, in the
free queue) until it is handed out for new content, which drops the hash. Freed blocks join
the queue's tail and allocation takes from its head, so the free queue is an LRU list: the
blocks freed longest ago are evicted first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = int  # 128 bits of SHA-256: a collision (wrong K/V served) is out of reach


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()
) -> BlockHash:
    """The hash of a full block: its parent's hash, its token ids and any extra keys (an
    adapter id, a multimodal hash) that change what the same tokens compute."""
    h = hashlib.sha256()
    h.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest()[:16], "little")


class BlockPool:
    """Fixed number of blocks; ``allocate`` takes from the free queue's head, ``free`` returns
    to its tail, and cached free blocks can be revived in O(1)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Free ids in LRU order. An OrderedDict is a doubly linked list with a hash index (in
        # C): popping the head, appending and removing any id (a cache hit) are all O(1), where
        # a deque's remove is O(n). Reuse in freeing order keeps allocation deterministic
        # (tests assert exact ids).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[BlockHash | None] = [None] * num_blocks  # block -> its hash
        self._cached: dict[BlockHash, int] = {}  # hash -> the block holding that content
        self.num_evictions = 0  # cached blocks handed out for new content

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a known hash (in use or free)."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (cached free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks (ref count 1) from the LRU end, dropping any hash they held, or
        ``None``, taking nothing, when too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in ids:
            self._ref_counts[b] = 1
            h = self._hash_of[b]
            if h is not None:  # new content is coming: the old one is no longer findable
                self._hash_of[b] = None
                del self._cached[h]
                self.num_evictions += 1
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more owner for each block; a free (cached) block is revived out of the queue."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                if self._hash_of[b] is None:
                    raise RuntimeError(f"touch of free block {b}, which holds no cached content")
                del self._free[b]
            self._ref_counts[b] += 1

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks in use with one more owner."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero join the free queue's tail
        in the order given (callers free a request tail-first: shared heads stay longest)."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise RuntimeError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- prefix cache ---------------------------------------------------------------------------
    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding this content, in use or free, or None."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a full, computed block in use findable by its hash. If another block already
        holds the same content, the first one stays the one found."""
        if self._ref_counts[block_id] < 1:
            raise RuntimeError(f"cache_block of free block {block_id}")
        if self._hash_of[block_id] is not None or block_hash in self._cached:
            return
        self._hash_of[block_id] = block_hash
        self._cached[block_hash] = block_id

    def is_free(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def reset_prefix_cache(self) -> int:
        """Forget every hash (``LLM.reset_prefix_cache``); returns how many were dropped."""
        n = len(self._cached)
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        return n

    def check_integrity(self, owners: dict[str, list[int]] | None = None) -> None:
        """Raise if free + used != total, ref counts disagree with the free queue / owners, or
        the hash index disagrees with the blocks' hashes."""
        free = self._free
        for b, rc in enumerate(self._ref_counts):
            if (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: ref count {rc} but free={b in free}")
        used = sum(1 for rc in self._ref_counts if rc > 0)
        if used + len(free) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {used} != total {self.num_blocks}")
        for h, b in self._cached.items():
            if self._hash_of[b] != h:
                raise AssertionError(f"hash index names block {b}, which holds another hash")
        if sum(h is not None for h in self._hash_of) != len(self._cached):
            raise AssertionError("a block holds a hash the index does not know")
        if owners is not None:
            counts = [0] * self.num_blocks
            for ids in owners.values():
                for b in ids:
                    counts[b] += 1
            if counts != self._ref_counts:
                raise AssertionError("ref counts differ from the blocks the owners hold")
