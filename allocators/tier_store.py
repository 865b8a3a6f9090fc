"""One lower KV tier's block slots (host memory or disk, ``allocators.tiers``): which item
each slot holds, which are free, and which goes first when the tier is full.

Slots are handed out as the free list does: never-used ones in id order, then recycled ones
in the order they were freed. The victim is the occupant the ``priority`` ranks first
(smallest; ties go to the lower slot) among those ``eligible`` now: the radix allocator's
eviction policies, over its tree nodes. Entries sit in a heap and go stale instead of being
removed (a slot freed or refilled since); an entry whose item's priority moved is pushed
again with the new one, and an ineligible one waits aside until a victim is found::

    slots  0 1 2 3 4          heap (priority, slot, stamp)     victim: first live, eligible
           a b . c .          (3,0,0) (5,3,4) (7,1,1) (9,2,2)*   * stale: slot 2 freed
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class TierStore(Generic[T]):
    """``capacity`` slots of one tier; ``priority(item)`` orders victims (smallest first)."""

    def __init__(self, capacity: int, priority: Callable[[T], int]) -> None:
        self.capacity = capacity
        self._priority = priority
        self._fresh = 0  # slots from here up were never used
        self._free: deque[int] = deque()  # recycled slots, freed longest ago first
        self._held: dict[int, T] = {}
        self._stamp: dict[int, int] = {}  # slot -> the stamp of its live heap entry
        self._heap: list[tuple[int, int, int]] = []  # (priority, slot, stamp)
        self._next_stamp = 0

    def __len__(self) -> int:
        return len(self._held)

    def __getitem__(self, slot: int) -> T:
        return self._held[slot]

    def items(self) -> Iterator[tuple[int, T]]:
        """Every occupied slot and its item, in slot order."""
        return iter(sorted(self._held.items()))

    def full(self) -> bool:
        return len(self._held) == self.capacity

    def put(self, item: T) -> int:
        """A free slot, now holding ``item`` (the caller made sure one is free)."""
        if self._free:
            slot = self._free.popleft()
        else:
            slot, self._fresh = self._fresh, self._fresh + 1
        self._held[slot] = item
        self._push(slot, self._priority(item))
        return slot

    def release(self, slot: int) -> T:
        """Free ``slot``; returns what it held."""
        del self._stamp[slot]
        self._free.append(slot)
        return self._held.pop(slot)

    def victim(self, eligible: Callable[[int, T], bool]) -> int | None:
        """The occupied slot whose item goes first among the ``eligible`` ones (still held:
        the caller moves or drops it), or None if none is eligible."""
        heap, aside, found = self._heap, [], None
        while heap:
            prio, slot, stamp = heap[0]
            if self._stamp.get(slot) != stamp:
                heapq.heappop(heap)  # stale
                continue
            item = self._held[slot]
            now = self._priority(item)
            if now != prio:  # touched since it was pushed: rank it anew
                heapq.heappop(heap)
                self._push(slot, now)
                continue
            if eligible(slot, item):
                found = slot
                break
            aside.append(heapq.heappop(heap))
        for entry in aside:
            heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._held) + 64:  # mostly stale: keep the live entries
            heap[:] = [e for e in heap if self._stamp.get(e[1]) == e[2]]
            heapq.heapify(heap)
        return found

    def _push(self, slot: int, priority: int) -> None:
        self._stamp[slot] = stamp = self._next_stamp
        self._next_stamp += 1
        heapq.heappush(self._heap, (priority, slot, stamp))

    def check(self) -> None:
        """Raise ``AssertionError`` if the slots' bookkeeping is off."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is twice in the free list"
        assert not free & self._held.keys(), "a slot both free and held"
        assert free | self._held.keys() == set(range(self._fresh)), "slots lost"
        assert self._fresh <= self.capacity and self._stamp.keys() == self._held.keys()
        live = {slot for _, slot, stamp in self._heap if self._stamp.get(slot) == stamp}
        assert live == self._held.keys(), "a held slot is no victim candidate"
