"""The block pool: the one owner of KV block ref counts and the free queue.

Everything else (the KV cache manager, the scheduler) sees only block ids.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Fixed number of blocks; ``allocate`` takes from the free queue's head, ``free`` returns."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # FIFO of free ids: blocks are reused in the order they were freed, which keeps
        # allocation deterministic (tests assert exact ids).
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks (ref count 1), or ``None``, taking nothing, when too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._ref_counts[b] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks with one more owner."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go back to the free queue."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise RuntimeError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_integrity(self, owners: dict[str, list[int]] | None = None) -> None:
        """Raise if free + used != total, or ref counts disagree with the free queue / owners."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free queue")
        for b, rc in enumerate(self._ref_counts):
            if (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: ref count {rc} but free={b in free}")
        used = sum(1 for rc in self._ref_counts if rc > 0)
        if used + len(free) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {used} != total {self.num_blocks}")
        if owners is not None:
            counts = [0] * self.num_blocks
            for ids in owners.values():
                for b in ids:
                    counts[b] += 1
            if counts != self._ref_counts:
                raise AssertionError("ref counts differ from the blocks the owners hold")
