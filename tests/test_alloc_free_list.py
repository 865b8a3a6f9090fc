"""Free-list allocator: LRU reuse and copy-on-write forks."""

from __future__ import annotations

from allocators.free_list import FreeListAllocator


def test_blocks_are_reused_least_recently_freed_first() -> None:
    alloc = FreeListAllocator(num_blocks=4, block_size=2)
    assert alloc.allocate("a", 8).block_table == (0, 1, 2, 3)
    alloc.trim("a", 2)  # frees 3, 2, 1 (tail first)
    assert alloc.allocate("b", 2).block_table == (3,)
    alloc.free("a")  # then 0
    assert alloc.allocate("c", 6).block_table == (2, 1, 0)
    alloc.check()


def test_fork_then_writes_copy_the_shared_partial_block_once() -> None:
    alloc = FreeListAllocator(num_blocks=8, block_size=4)
    parent = alloc.allocate("p", 6).block_table
    alloc.fork("p", "c")
    child = alloc.allocate("c", 7)
    assert child.copies == ((parent[1], child.block_table[1]),)
    assert child.block_table[0] == parent[0] and child.block_table[1] != parent[1]
    # The parent is now the only holder of its block: it writes in place.
    assert alloc.allocate("p", 7).copies == ()
    assert alloc.stats().cow_copies == 1
    alloc.check()


def test_a_full_shared_block_is_not_copied() -> None:
    alloc = FreeListAllocator(num_blocks=8, block_size=4)
    alloc.allocate("p", 8)
    alloc.fork("p", "c")
    assert alloc.allocate("c", 9).copies == ()
