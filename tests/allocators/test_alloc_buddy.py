"""Buddy allocator: power-of-two aligned regions, split, merge, in-place doubling."""

from __future__ import annotations

from allocators.base import NO_COPIES
from allocators.buddy import BuddyAllocator


def test_regions_are_power_of_two_and_aligned_to_their_size() -> None:
    alloc = BuddyAllocator(num_blocks=32, block_size=1)
    for seq, n in (("a", 3), ("b", 1), ("c", 5), ("d", 2)):
        alloc.allocate(seq, n)
    for seq in "abcd":
        start, size = alloc.block_table(seq)[0], alloc.held_slots(seq)
        assert size & (size - 1) == 0 and start % size == 0, seq
    assert alloc.block_table("c") == [8, 9, 10, 11, 12]
    alloc.check()


def test_allocate_splits_and_free_merges_back() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=1)
    alloc.allocate("a", 1)  # 16 -> 8 + 4 + 2 + 1 + [1 used]
    assert alloc.free_regions == [(1, 1), (2, 2), (4, 4), (8, 8)]
    assert alloc.free("a") == 1
    assert alloc.free_regions == [(0, 16)]
    assert alloc.unusable_free_blocks(16) == 0  # one free region of 16 again


def test_growth_doubles_in_place_when_the_buddy_is_free() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=1)
    alloc.allocate("a", 2)
    assert alloc.blocks_needed("a", 7) == 6  # region 2 -> 8
    assert alloc.allocate("a", 7) is NO_COPIES
    assert alloc.block_table("a") == list(range(7))
    assert alloc.held_slots("a") == 8 and alloc.free_regions == [(8, 8)]  # region [0, 8)


def test_growth_relocates_when_the_buddy_is_taken() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=1)
    alloc.allocate("a", 2)  # [0, 2)
    alloc.allocate("b", 2)  # [2, 4): a's buddy
    assert alloc.blocks_needed("a", 3) == 2  # a region of 4 taken, the old 2 given back
    free = alloc.num_free_blocks()
    result = alloc.allocate("a", 3)
    assert free - alloc.num_free_blocks() == 2
    assert alloc.block_table("a") == [4, 5, 6] and result.copies == ((0, 4), (1, 5))
    assert alloc.stats().relocations == 1
    alloc.check()


def test_an_upper_buddy_relocates_even_when_the_blocks_after_it_are_free() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=1)
    for seq in "abcd":
        alloc.allocate(seq, 2)  # [0, 2) [2, 4) [4, 6) [6, 8)
    alloc.free("c")  # [4, 6) is free, but b = [2, 4) is the upper half of [0, 4)
    result = alloc.allocate("b", 3)  # a region of 4 must start at a multiple of 4
    assert result.copies == ((2, 8), (3, 9))
    assert alloc.block_table("b") == [8, 9, 10]
    alloc.check()


def test_internal_waste_shows_as_reserved_above_used() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=4)
    alloc.allocate("a", 17)  # 5 blocks -> a region of 8
    stats = alloc.stats()
    assert (stats.used_slots, stats.reserved_slots) == (17, 32)
    assert alloc.held_slots("a") == 32 and alloc.reclaimable_blocks("a") == 8
    assert alloc.dump().splitlines()[1] == "XXXXXrrr........"


def test_trim_gives_back_upper_halves() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=1)
    alloc.allocate("a", 7)  # region [0, 8)
    alloc.trim("a", 2)  # region [0, 2): [4, 8) and [2, 4) are free again
    assert alloc.held_slots("a") == 2 and alloc.num_free_blocks() == 14
    assert alloc.free_regions == [(2, 2), (4, 4), (8, 8)]
    alloc.check()


def test_non_power_of_two_arena_is_tiled_by_aligned_chunks() -> None:
    alloc = BuddyAllocator(num_blocks=24, block_size=1)
    assert alloc.free_regions == [(0, 16), (16, 8)]
    assert alloc.max_seq_tokens == 16  # the largest chunk
    assert not alloc.can_allocate("a", 17)
    assert alloc.allocate("a", 17) is None  # no region of 32
    alloc.allocate("b", 9)
    assert alloc.block_table("b") == list(range(9))
    alloc.check()


def test_unusable_free_blocks_are_those_in_free_regions_too_small() -> None:
    alloc = BuddyAllocator(num_blocks=16, block_size=1)
    alloc.allocate("a", 1)  # free regions: 1 at 1, 2 at 2, 4 at 4, 8 at 8
    assert alloc.unusable_free_blocks(1) == 0
    assert alloc.unusable_free_blocks(2) == 1  # the region of 1
    assert alloc.unusable_free_blocks(3) == 3  # a region of 4 is needed: 1 + 2 too small
    assert alloc.unusable_free_blocks(5) == 7  # a region of 8: 1 + 2 + 4
    assert alloc.unusable_free_blocks(9) == 15  # a region of 16: none is free


def test_adjacent_free_regions_that_are_not_buddies_do_not_combine() -> None:
    alloc = BuddyAllocator(num_blocks=8, block_size=1)
    for seq in "abcd":
        alloc.allocate(seq, 2)  # [0, 2) [2, 4) [4, 6) [6, 8)
    alloc.free("b")
    alloc.free("c")  # [2, 6) is free, but 2's buddy is 0 and 4's is 6
    assert alloc.unusable_free_blocks(4) == 4
    assert alloc.blocks_needed("e", 4) == 4 == alloc.num_free_blocks()
    assert not alloc.can_allocate("e", 4)
    assert alloc.allocate("e", 4) is None


def test_a_sequence_of_no_tokens_finds_every_free_block_usable() -> None:
    # A 0-token sequence needs no region (allocate("z", 0) always succeeds), so no free
    # block is too small for it, as ContiguousAllocator answers.
    alloc = BuddyAllocator(num_blocks=24, block_size=1)  # free: 16 at 0, 8 at 16
    assert alloc.allocate("z", 0) is NO_COPIES
    assert alloc.unusable_free_blocks(0) == 0


def test_an_idle_arena_of_192_blocks_has_no_external_fragmentation() -> None:
    """192 = 128 + 64: two free regions, but any request of up to 64 blocks fits one of
    them (the old 1 - largest run / free measure said 0.333)."""
    alloc = BuddyAllocator(num_blocks=192, block_size=16)
    assert alloc.unusable_free_blocks(16) == 0
    assert alloc.unusable_free_blocks(64 * 16) == 0
    assert alloc.unusable_free_blocks(65 * 16) == 64  # needs the 128 region: the 64 cannot
