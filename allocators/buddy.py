"""Buddy allocation: power-of-two regions, aligned to their size, split and merged.

A region of ``2**k`` blocks starts at a multiple of ``2**k``; its buddy is the
region at ``start ^ 2**k``. Allocating splits a larger free region in halves;
freeing merges a region with its free buddy, repeatedly::

    order 3  [........]          allocate 3 blocks -> order 2 region at 0
    order 2  [XXX.][....]        (1 slot of internal waste per block_size)
    grow to 5 blocks: buddy 4-7 is free -> merge in place into [0, 8)

``num_blocks`` need not be a power of two: the arena is managed as the largest
aligned power-of-two chunks that tile it (24 blocks = 16 at 0 + 8 at 16), which
never merge with each other. Internal waste shows as ``reserved_slots`` above
``used_slots``; ``unusable_free_blocks`` counts the free *regions* too small for a
request, since a buddy allocator cannot place across two adjacent regions that are
not buddies. The largest chunk bounds the longest sequence (``max_seq_tokens``).
"""

from __future__ import annotations

import heapq

from allocators.contiguous import RegionAllocator, RegionState


def _merged(free_at: list[set[int]], start: int, order: int) -> tuple[int, int]:
    """A freed region of ``2**order`` blocks at ``start``, merged with its free buddies
    (removed from ``free_at``) for as long as they are free: the region that results."""
    while order + 1 < len(free_at) and start ^ (1 << order) in free_at[order]:
        free_at[order].remove(start ^ (1 << order))
        start &= ~(1 << order)
        order += 1
    return start, order


class BuddyAllocator(RegionAllocator):
    """Power-of-two aligned regions with O(log n) split and merge per operation."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.max_seq_tokens = (1 << (num_blocks.bit_length() - 1)) * block_size
        orders = num_blocks.bit_length()
        # Per order: the set is the truth; the heap yields the lowest address, lazily
        # skipping starts that were merged or taken since they were pushed.
        self._free_at: list[set[int]] = [set() for _ in range(orders)]
        self._heaps: list[list[int]] = [[] for _ in range(orders)]
        start = 0
        for order in reversed(range(orders)):
            if num_blocks & (1 << order):
                self._add(start, order)
                start += 1 << order

    @property
    def free_regions(self) -> list[tuple[int, int]]:
        """The free regions as ``(start, size in blocks)``, by address: how the free space
        is split, which ``unusable_free_blocks`` sums and ``dump`` does not show."""
        return sorted(
            (start, 1 << order) for order, starts in enumerate(self._free_at) for start in starts
        )

    def _add(self, start: int, order: int) -> None:
        self._free_at[order].add(start)
        heapq.heappush(self._heaps[order], start)

    def _pop_lowest(self, order: int) -> int:
        heap, free = self._heaps[order], self._free_at[order]
        while heap[0] not in free:
            heapq.heappop(heap)
        start = heapq.heappop(heap)
        free.remove(start)
        return start

    def _region_size(self, s: RegionState, table_blocks: int) -> int:
        return 1 << (table_blocks - 1).bit_length() if table_blocks else 0

    def _order_with_room(self, order: int) -> int | None:
        """The smallest order >= ``order`` that has a free region."""
        return next((o for o in range(order, len(self._free_at)) if self._free_at[o]), None)

    def _can_place(self, size: int) -> bool:
        return self._order_with_room(size.bit_length() - 1) is not None

    def _place(self, size: int) -> int | None:
        order = size.bit_length() - 1
        larger = self._order_with_room(order)
        if larger is None:
            return None
        start = self._pop_lowest(larger)
        while larger > order:  # keep the lower half, free the upper one
            larger -= 1
            self._add(start + (1 << larger), larger)
        return start

    def _can_extend(self, start: int, size: int, new_size: int) -> bool:
        # Doubling in place needs this region to be the lower buddy and its buddy free,
        # at every order up to the new size.
        s = size
        while s < new_size:
            if start % (2 * s) or start + s not in self._free_at[s.bit_length() - 1]:
                return False
            s *= 2
        return True

    def _extend(self, start: int, size: int, new_size: int) -> None:
        s = size
        while s < new_size:
            self._free_at[s.bit_length() - 1].remove(start + s)
            s *= 2

    def _give_back(self, start: int, size: int) -> None:
        self._add(*_merged(self._free_at, start, size.bit_length() - 1))

    def _shrink(self, start: int, size: int, new_size: int) -> None:
        if not new_size:
            self._release(start, size)
            return
        while size > new_size:  # give back upper halves until the region fits
            size //= 2
            self._release(start + size, size)

    def _free_blocks(self) -> set[int]:
        return {
            block
            for order, starts in enumerate(self._free_at)
            for start in starts
            for block in range(start, start + (1 << order))
        }

    def unusable_free_blocks(self, num_tokens: int, seq_id: str | None = None) -> int:
        # Free regions never combine across buddies: only one at least as large can serve.
        size = self._region_blocks(num_tokens, seq_id)
        if not size:
            return 0  # an empty sequence needs no region
        order = size.bit_length() - 1
        return sum(len(starts) << o for o, starts in enumerate(self._free_at[:order]))

    def _check_placement(self) -> None:
        super()._check_placement()
        for start, size in ((s.start, s.size) for s in self._seqs.values() if s.size):
            assert size & (size - 1) == 0 and start % size == 0, f"unaligned {start}+{size}"
        for order, starts in enumerate(self._free_at):
            for start in starts:
                assert start % (1 << order) == 0, f"free region {start} unaligned at {order}"
                assert start ^ (1 << order) not in starts, f"free buddies {start} not merged"
