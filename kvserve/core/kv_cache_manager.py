"""Maps requests to the KV blocks that hold their tokens, on the device and in CPU swap space."""

from __future__ import annotations

from kvserve.core.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Per-request block lists over a device ``BlockPool`` and an optional CPU swap pool."""

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self._blocks: dict[str, list[int]] = {}  # request id -> device block ids, in order
        self._swapped: dict[str, list[int]] = {}  # request id -> CPU swap block ids, in order

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, req_id: str) -> list[int]:
        return self._blocks.get(req_id, [])

    def allocate_slots(self, req_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's blocks to hold ``num_total_tokens``; new ids, or None if no room."""
        held = self._blocks.setdefault(req_id, [])
        need = blocks_for(num_total_tokens, self.block_size) - len(held)
        if need <= 0:
            return []
        new = self.pool.allocate(need)
        if new is None:
            if not held:
                del self._blocks[req_id]
            return None
        held.extend(new)
        return new

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def free(self, req_id: str) -> None:
        """Release the request's device blocks (and swap blocks, if it was swapped out)."""
        blocks = self._blocks.pop(req_id, None)
        if blocks:
            self.pool.free(blocks)
        swapped = self._swapped.pop(req_id, None)
        if swapped and self.swap_pool is not None:
            self.swap_pool.free(swapped)

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
        self.pool.free(blocks)
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
