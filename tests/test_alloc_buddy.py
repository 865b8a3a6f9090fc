"""Buddy allocator: power-of-two aligned regions, split, merge, in-place doubling."""

from __future__ import annotations

from allocators.buddy import BuddyAllocator


def test_regions_are_power_of_two_and_aligned_to_their_size() -> None:
    alloc = BuddyAllocator(num_blocks=32, block_size=1)
    for seq, n in (("a", 3), ("b", 1), ("c", 5), ("d", 2)):
        alloc.allocate(seq, n)
    for seq, (start, size) in alloc._region.items():
        assert size & (size - 1) == 0 and start % size == 0, seq
    assert alloc.block_table("c") == [8, 9, 10, 11, 12]
    alloc.check()


def test_allocate_splits_and_free_merges_back() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=1)
    alloc.allocate("a", 1)  # 16 -> 8 + 4 + 2 + 1 + [1 used]
    assert sorted(len(s) for s in alloc._free_at) == [0, 1, 1, 1, 1]
    alloc.free("a")
    assert alloc._free_at[4] == {0} and not any(alloc._free_at[:4])
    assert alloc.stats().external_fragmentation == 0


def test_growth_doubles_in_place_when_the_buddy_is_free() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=1)
    alloc.allocate("a", 2)
    result = alloc.allocate("a", 7)
    assert result.block_table == tuple(range(7)) and result.copies == ()
    assert alloc._region["a"] == (0, 8)


def test_growth_relocates_when_the_buddy_is_taken() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=1)
    alloc.allocate("a", 2)  # [0, 2)
    alloc.allocate("b", 2)  # [2, 4): a's buddy
    result = alloc.allocate("a", 3)
    assert result.block_table == (4, 5, 6) and result.copies == ((0, 4), (1, 5))
    assert alloc.stats().relocations == 1
    alloc.check()


def test_internal_waste_shows_as_reserved_above_used() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=4)
    alloc.allocate("a", 17)  # 5 blocks -> a region of 8
    stats = alloc.stats()
    assert (stats.used_slots, stats.reserved_slots) == (17, 32)
    assert alloc.dump().splitlines()[1] == "XXXXXrrr........"


def test_non_power_of_two_arena_is_tiled_by_aligned_chunks() -> None:
    alloc = BuddyAllocator(num_blocks=24, block_size=1)
    assert alloc._free_at[4] == {0} and alloc._free_at[3] == {16}
    assert alloc.allocate("a", 17) is None  # no region of 32
    assert alloc.allocate("b", 9).block_table == tuple(range(9))
    alloc.check()
