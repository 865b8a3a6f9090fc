"""Contiguous allocator: first fit, runs, growth in place or relocation, reserve policies."""

from __future__ import annotations

import copy

import pytest

from allocators.base import NO_COPIES
from allocators.contiguous import ContiguousAllocator


def runs(alloc: ContiguousAllocator, *seqs: str) -> list[list[int]]:
    return [list(alloc.block_table(s)) for s in seqs]


def fragmented() -> ContiguousAllocator:
    """Ten 1-slot blocks laid out X..X...X.. (free runs of 2, 3 and 2)."""
    alloc = ContiguousAllocator(num_blocks=10, block_size=1)
    for seq, n in (("a", 1), ("b", 2), ("c", 1), ("d", 3), ("e", 1)):
        alloc.allocate(seq, n)
    alloc.free("b")
    alloc.free("d")
    assert alloc.dump().splitlines()[1] == "X..X...X.."
    return alloc


def test_first_fit_takes_the_lowest_free_run_that_fits() -> None:
    alloc = ContiguousAllocator(num_blocks=10, block_size=1)
    for seq, n in (("a", 2), ("b", 3), ("c", 2)):
        alloc.allocate(seq, n)
    alloc.free("a")
    alloc.free("c")  # free runs: [0, 2) and [5, 10)
    alloc.allocate("d", 3)
    alloc.allocate("e", 2)
    assert runs(alloc, "d", "e") == [[5, 6, 7], [0, 1]]


def test_grows_in_place_when_the_next_blocks_are_free() -> None:
    alloc = ContiguousAllocator(num_blocks=8, block_size=2)
    alloc.allocate("a", 3)
    assert alloc.allocate("a", 8) is NO_COPIES
    assert runs(alloc, "a") == [[0, 1, 2, 3]]
    assert alloc.stats().relocations == 0


def test_relocates_to_a_disjoint_run_and_reports_the_copies() -> None:
    alloc = ContiguousAllocator(num_blocks=8, block_size=2)
    alloc.allocate("a", 4)
    alloc.allocate("b", 2)  # blocks a: 0-1, b: 2
    # a moves to a run of 3 and gives its 2 blocks back: a net drop of 1.
    assert alloc.blocks_needed("a", 6) == 1
    free = alloc.num_free_blocks()
    result = alloc.allocate("a", 6)
    assert free - alloc.num_free_blocks() == 1
    assert result.copies == ((0, 3), (1, 4))
    stats = alloc.stats()
    assert (stats.relocations, stats.relocated_blocks) == (1, 2)
    assert runs(alloc, "a", "b") == [[3, 4, 5], [2]]
    alloc.check()


def test_growth_without_a_long_enough_run_fails_and_changes_nothing() -> None:
    alloc = ContiguousAllocator(num_blocks=6, block_size=1)
    for seq in "abc":
        alloc.allocate(seq, 2)
    alloc.free("b")  # 2 free in the middle, none after c
    before = alloc.dump()
    assert not alloc.can_allocate("a", 5)
    assert alloc.allocate("a", 5) is None
    assert alloc.dump() == before


def test_enough_free_blocks_but_no_run_long_enough_cannot_allocate() -> None:
    alloc = fragmented()
    # A 4-block sequence needs 4 of the 7 free blocks, but the longest free run is 3.
    assert alloc.blocks_needed("f", 4) == 4 <= alloc.num_free_blocks() == 7
    assert not alloc.can_allocate("f", 4)
    assert alloc.allocate("f", 4) is None
    assert alloc.can_allocate("f", 3)


def test_unusable_free_blocks_are_those_in_runs_too_short() -> None:
    alloc = fragmented()  # free runs of 2, 3 and 2
    assert alloc.unusable_free_blocks(1) == 0  # every run holds 1 block
    assert alloc.unusable_free_blocks(3) == 4  # the two runs of 2
    assert alloc.unusable_free_blocks(4) == 7  # no run of 4
    assert ContiguousAllocator(num_blocks=4, block_size=1).unusable_free_blocks(4) == 0


def test_four_free_holes_that_each_fit_the_next_request_are_not_fragmentation() -> None:
    """Holes of 4 blocks at 4, 12, 20, 28 (the old 1 - largest run / free measure said 0.75
    of them were fragmented): a 4-block request fits any, a 5-block one none."""
    alloc = ContiguousAllocator(num_blocks=32, block_size=1)
    for i in range(8):
        alloc.allocate(f"s{i}", 4)
    for i in (1, 3, 5, 7):
        alloc.free(f"s{i}")
    assert alloc.num_free_blocks() == 16
    assert alloc.unusable_free_blocks(4) == 0
    assert alloc.unusable_free_blocks(5) == 16


def test_unusable_free_blocks_count_the_max_len_reservation() -> None:
    alloc = ContiguousAllocator(num_blocks=8, block_size=1, reserve="max_len", max_len=3)
    alloc.allocate("a", 1)
    alloc.allocate("b", 1)  # regions [0, 3) and [3, 6): a free run of 2 is left
    # Even a 1-token sequence reserves 3 blocks, so both free blocks are unusable.
    assert alloc.unusable_free_blocks(1) == 2
    assert not alloc.can_allocate("c", 1)


def test_max_len_reserves_up_front_and_grows_without_moving() -> None:
    alloc = ContiguousAllocator(num_blocks=16, block_size=4, reserve="max_len", max_len=20)
    alloc.allocate("a", 1)
    alloc.allocate("b", 1)
    assert runs(alloc, "a", "b") == [[0], [5]]
    assert alloc.stats().used_blocks == 10 and alloc.stats().used_slots == 2
    assert alloc.held_slots("a") == 20  # 5 blocks of 4 slots for 1 token
    assert alloc.blocks_needed("a", 20) == 0
    assert alloc.allocate("a", 20) is NO_COPIES
    assert alloc.dump().splitlines()[1] == "XXXXXXrrrr......"


def test_max_len_beyond_the_arena_reserves_the_arena() -> None:
    alloc = ContiguousAllocator(num_blocks=4, block_size=4, reserve="max_len", max_len=100)
    # 100 slots would be 25 blocks; the reservation is capped at the 4 the arena has.
    assert alloc.blocks_needed("a", 1) == 4 and alloc.can_allocate("a", 1)
    alloc.allocate("a", 1)
    assert alloc.held_slots("a") == 16 and alloc.num_free_blocks() == 0
    alloc.check()


def test_oracle_reserves_the_expected_slots_and_keeps_the_hint_across_free() -> None:
    alloc = ContiguousAllocator(num_blocks=16, block_size=4, reserve="oracle")
    alloc.expect("a", 10)  # 3 blocks
    assert alloc.blocks_needed("a", 1) == 3 and alloc.unusable_free_blocks(1, "a") == 0
    alloc.allocate("a", 1)
    alloc.allocate("b", 1)  # no hint: exactly one block
    assert runs(alloc, "a", "b") == [[0], [3]] and alloc.held_slots("a") == 12
    assert alloc.allocate("a", 10) is NO_COPIES  # grows into its reservation
    alloc.free("a")  # preempted: comes back with the same reservation
    assert alloc.blocks_needed("a", 1) == 3
    alloc.expect("a", None)  # finished: forgotten
    assert alloc.blocks_needed("a", 1) == 1
    alloc.check()


def test_pow2_reserves_the_hint_rounded_up_to_a_power_of_two_slots() -> None:
    alloc = ContiguousAllocator(num_blocks=16, block_size=4, reserve="pow2")
    alloc.expect("a", 17)  # 32 slots: 8 blocks
    alloc.expect("b", 16)  # already a power of two: 4 blocks
    alloc.allocate("a", 3)
    alloc.allocate("b", 3)
    assert (alloc.held_slots("a"), alloc.held_slots("b")) == (32, 16)
    alloc.check()


def test_oracle_unusable_free_blocks_size_the_region_by_the_hint() -> None:
    alloc = ContiguousAllocator(num_blocks=8, block_size=1, reserve="oracle")
    alloc.allocate("x", 5)  # a free run of 3 is left
    alloc.expect("c", 4)
    assert alloc.unusable_free_blocks(1) == 0  # a 1-slot sequence without a hint fits
    assert alloc.unusable_free_blocks(1, "c") == 3 and not alloc.can_allocate("c", 1)


def test_a_fork_reserves_the_childs_own_hint() -> None:
    alloc = ContiguousAllocator(num_blocks=16, block_size=4, reserve="oracle")
    alloc.expect("p", 12)
    alloc.expect("c", 12)
    alloc.allocate("p", 5)
    assert alloc.fork("p", "c").copies == ((0, 3), (1, 4))
    assert alloc.held_slots("c") == 12
    alloc.check()


@pytest.mark.parametrize(
    "reserve", [{}, {"reserve": "max_len", "max_len": 12}, {"reserve": "oracle"}]
)
def test_an_empty_table_holds_no_region(reserve: dict) -> None:
    alloc = ContiguousAllocator(num_blocks=8, block_size=4, **reserve)
    for seq_id in "abc":
        alloc.expect(seq_id, 12)
    assert alloc.allocate("a", 0) is NO_COPIES
    assert alloc.held_slots("a") == 0 and alloc.num_free_blocks() == 8
    alloc.allocate("b", 5)
    alloc.trim("b", 0)  # the whole region goes back
    assert alloc.held_slots("b") == 0 and alloc.num_free_blocks() == 8
    assert alloc.fork("b", "c") is NO_COPIES  # nothing to copy, nothing reserved
    alloc.check()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"reserve": "greedy"}, "reserve"), ({"reserve": "max_len"}, "max_len")],
)
def test_bad_policy_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ContiguousAllocator(num_blocks=8, block_size=2, **kwargs)


def test_a_region_moves_over_its_own_blocks_when_that_is_the_only_room() -> None:
    # 8 blocks of 4: a's region sits at [4, 8) with [0, 4) free. Growing to 17 slots needs
    # 5 blocks; only [0, 8) counting a's own blocks holds them: a moves to [0, 5). Block 4
    # is both a source and a destination: the engine reads every source before writing.
    alloc = ContiguousAllocator(num_blocks=8, block_size=4)
    alloc.allocate("x", 16)
    alloc.allocate("a", 16)
    alloc.free("x")
    assert alloc.block_table("a") == [4, 5, 6, 7]
    assert alloc.can_allocate("a", 17) and alloc.blocks_needed("a", 17) == 1
    result = alloc.allocate("a", 17)
    assert alloc.block_table("a") == [0, 1, 2, 3, 4]
    assert result.copies == ((4, 0), (5, 1), (6, 2), (7, 3))
    assert alloc.num_free_blocks() == 3
    alloc.check()


@pytest.mark.parametrize("reserve", ["oracle", "pow2"])
def test_allocate_many_reserves_by_the_hints_as_allocate_one_by_one(reserve: str) -> None:
    # The conf options the contract tests leave out: their regions are sized by expect hints.
    alloc = ContiguousAllocator(num_blocks=32, block_size=4, reserve=reserve)
    for seq_id, slots in (("a", 20), ("b", 9), ("c", 100), ("d", 30)):
        alloc.expect(seq_id, slots)
    alloc.allocate("a", 3)
    alloc.allocate("b", 9)
    alloc.allocate("x", 4)  # right after b's region: b cannot grow past it in place
    twin = copy.deepcopy(alloc)
    requests = [("a", 18), ("b", 17), ("d", 1), ("a", 21), ("e", 6), ("c", 5), ("a", 22)]
    expected = [twin.allocate(seq_id, num_tokens) for seq_id, num_tokens in requests[:-1]]
    assert alloc.allocate_many(requests) == expected  # c's hint never fits: the call ends
    assert expected[-1] is None and expected[1].copies  # b relocates
    assert runs(alloc, "a", "b", "d", "e") == runs(twin, "a", "b", "d", "e")
    assert (alloc.dump(), alloc.stats()) == (twin.dump(), twin.stats())
    alloc.check()
