"""BlockPool: the physical KV blocks, their reference counts and the free queue.

A block is in exactly one of three states:
  * free     - ref 0, not cached: sits in the free queue, can be handed out at once;
  * idle     - ref 0, cached: owned by the prefix cache, reusable on a hit, evictable;
  * used     - ref > 0: held by one or more requests (it may also be cached).
The pool only knows about `free` and `used`; which blocks are cached (and the
order in which idle ones are evicted) is the prefix cache's business. That
split keeps the pool trivial and lets two cache designs share it.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Ref counts plus an O(1) queue of uncached free blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        # Uncached free blocks carry no content worth keeping, so their order does
        # not matter; a deque gives O(1) push/pop. `_in_free` makes membership O(1).
        self._free: deque[int] = deque(range(num_blocks))
        self._in_free = bytearray([1]) * num_blocks
        self._num_used = 0

    @property
    def num_free(self) -> int:
        """Uncached free blocks (idle cached blocks are not counted here)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with ref > 0."""
        return self._num_used

    def is_free(self, block_id: int) -> bool:
        return bool(self._in_free[block_id])

    def pop_free(self) -> int:
        """Take an uncached free block and give it one reference."""
        block_id = self._free.popleft()
        self._in_free[block_id] = 0
        self.ref_cnt[block_id] = 1
        self._num_used += 1
        return block_id

    def push_free(self, block_ids: list[int]) -> None:
        """Return unreferenced, uncached blocks to the free queue."""
        for b in block_ids:
            assert self.ref_cnt[b] == 0, f"block {b} freed with ref {self.ref_cnt[b]}"
            assert not self._in_free[b], f"block {b} freed twice"
            self._in_free[b] = 1
            self._free.append(b)

    def incref(self, block_id: int) -> int:
        """Add a reference; returns the new count (1 means it just became used)."""
        assert not self._in_free[block_id], f"block {block_id} is in the free queue"
        self.ref_cnt[block_id] += 1
        if self.ref_cnt[block_id] == 1:
            self._num_used += 1
        return self.ref_cnt[block_id]

    def decref(self, block_id: int) -> int:
        """Drop a reference; returns the new count (0 means the caller must place it)."""
        assert self.ref_cnt[block_id] > 0, f"block {block_id} released with ref 0"
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 0:
            self._num_used -= 1
        return self.ref_cnt[block_id]

    def check_integrity(self) -> None:
        free = list(self._free)
        assert len(free) == len(set(free)), "a block sits twice in the free queue"
        assert sum(self._in_free) == len(free), "free-queue membership bitmap is stale"
        for b in free:
            assert self._in_free[b], f"free block {b} not marked free"
            assert self.ref_cnt[b] == 0, f"free block {b} has ref {self.ref_cnt[b]}"
        assert all(r >= 0 for r in self.ref_cnt), "negative ref count"
        used = sum(1 for r in self.ref_cnt if r > 0)
        assert used == self._num_used, f"used counter {self._num_used} != {used} blocks with ref > 0"
