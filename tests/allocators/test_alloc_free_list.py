"""Free-list allocator: LRU reuse and copy-on-write forks."""

from __future__ import annotations

from allocators.base import NO_COPIES
from allocators.free_list import FreeListAllocator


def test_blocks_are_reused_least_recently_freed_first() -> None:
    alloc = FreeListAllocator(num_blocks=4, block_size=2)
    alloc.allocate("a", 8)
    assert alloc.block_table("a") == [0, 1, 2, 3]
    alloc.trim("a", 2)  # frees 3, 2, 1 (tail first)
    alloc.allocate("b", 2)
    assert alloc.block_table("b") == [3]
    assert alloc.free("a") == 1  # then 0
    alloc.allocate("c", 6)
    assert alloc.block_table("c") == [2, 1, 0]
    alloc.check()


def test_blocks_never_used_come_first_in_id_order_then_freed_ones_in_order() -> None:
    # The order of a queue that held every block, 0 first, from the start.
    alloc = FreeListAllocator(num_blocks=6, block_size=2)
    alloc.allocate("a", 4)
    assert alloc.free("a") == 2  # 1, then 0 (tail first): they wait behind 2..5
    alloc.allocate("b", 6)
    assert alloc.block_table("b") == [2, 3, 4]
    alloc.allocate("c", 6)
    assert alloc.block_table("c") == [5, 1, 0]
    alloc.check()


def test_fork_then_writes_copy_the_shared_partial_block_once() -> None:
    alloc = FreeListAllocator(num_blocks=8, block_size=4)
    alloc.allocate("p", 6)
    parent = list(alloc.block_table("p"))
    assert alloc.fork("p", "c") is NO_COPIES  # sharing copies nothing
    result = alloc.allocate("c", 7)
    child = alloc.block_table("c")
    assert result.copies == ((parent[1], child[1]),)
    assert child[0] == parent[0] and child[1] != parent[1]
    # The parent is now the only holder of its block: it writes in place.
    assert alloc.allocate("p", 7) is NO_COPIES
    assert alloc.block_table("p") == parent
    assert alloc.stats().cow_copies == 1
    alloc.check()


def test_a_full_shared_block_is_not_copied() -> None:
    alloc = FreeListAllocator(num_blocks=8, block_size=4)
    alloc.allocate("p", 8)
    alloc.fork("p", "c")
    assert alloc.allocate("c", 9) is NO_COPIES  # slot 8 opens a new block of c's own
    assert alloc.stats().cow_copies == 0


def test_copy_on_write_on_a_full_arena_fails_as_forecast() -> None:
    alloc = FreeListAllocator(num_blocks=2, block_size=4)
    alloc.allocate("p", 6)  # both blocks
    alloc.fork("p", "c")
    # c's next slot is in shared block 1: the copy needs a block, and none is free.
    assert alloc.blocks_needed("c", 7) == 1 and not alloc.can_allocate("c", 7)
    assert alloc.allocate("c", 7) is None
    assert alloc.free("p") == 0  # c still holds both blocks
    # c is now block 1's only holder: it writes in place, no block needed.
    assert alloc.blocks_needed("c", 7) == 0 and alloc.can_allocate("c", 7)
    assert alloc.allocate("c", 7) is NO_COPIES
    alloc.check()
