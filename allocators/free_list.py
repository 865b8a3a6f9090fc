"""Paged allocation from a free list: any free block will do.

Blocks are taken from the head of a FIFO queue and returned to its tail, so the
block freed longest ago is reused first (LRU reuse): a block's stale KV lives as
long as possible, which helps debugging and mirrors vLLM's free-block queue.

Forks share blocks by reference count. The one block an ``allocate`` may write
into without having created it is the partial last block (slots
``[num_tokens, ...)``); it is copied first when another table or a prefix cache
also refers to it::

    parent  [7][3][5..]          fork          parent [7][3][5..]   child [7][3][5..]
    child allocate(+1) -> copies ((5, 9),)      parent [7][3][5..]   child [7][3][9..]
"""

from __future__ import annotations

from collections import deque

from allocators.base import BlockAllocator, blocks_for


class FreeListAllocator(BlockAllocator):
    """Paged allocator: O(1) allocate and free per block, LRU reuse, copy-on-write forks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._free: deque[int] = deque(range(num_blocks))

    def _take(self) -> int:
        """A free block, held by the caller."""
        block = self._free.popleft()
        self._hold(block)
        return block

    def _needs_copy(self, block: int) -> bool:
        """Whether writing into ``block`` would change KV someone else reads."""
        return self._ref[block] > 1

    def _grow(self, seq_id: str, table: list[int], old: int, new: int) -> list | None:
        bs = self.block_size
        # Only a partially written last block can be both in the table and in the write range.
        cow = old % bs != 0 and self._needs_copy(table[old // bs])
        fresh = blocks_for(new, bs) - len(table)
        # Count everything first: a failed allocate must change nothing.
        if fresh + cow > self.num_free_blocks():
            return None
        table = self._tables.setdefault(seq_id, table)
        copies = []
        if cow:
            i = old // bs
            src, dst = table[i], self._take()
            table[i] = dst
            # Drop only after taking: a cached source must not be evicted into its own copy.
            self._drop(src)
            self._cow_copies += 1
            copies.append((src, dst))
        table.extend(self._take() for _ in range(fresh))
        return copies

    def _after_trim(self, seq_id: str, dropped: list[int]) -> None:
        for block in reversed(dropped):
            self._drop(block)

    def _fork(self, parent_id: str, child_id: str) -> list | None:
        table = list(self._tables[parent_id])
        for block in table:
            self._hold(block)
        self._tables[child_id] = table
        return []

    def _free_seq(self, seq_id: str) -> None:
        # Tail first, so the prefix (the part most likely to be shared again) is freed last
        # and stays in the cache longest where a subclass caches.
        for block in reversed(self._tables[seq_id]):
            self._drop(block)

    def _on_unreferenced(self, block: int) -> None:
        self._free.append(block)

    def _free_blocks(self) -> set[int]:
        return set(self._free)

    def _check_placement(self) -> None:
        assert len(self._free) == len(set(self._free)), "a block is twice in the free list"
