"""Contiguous allocator: first fit, runs, growth in place or relocation, reserve policies."""

from __future__ import annotations

import pytest

from allocators.contiguous import ContiguousAllocator


def runs(alloc: ContiguousAllocator, *seqs: str) -> list[list[int]]:
    return [alloc.block_table(s) for s in seqs]


def test_first_fit_takes_the_lowest_free_run_that_fits() -> None:
    alloc = ContiguousAllocator(num_blocks=10, block_size=1)
    for seq, n in (("a", 2), ("b", 3), ("c", 2)):
        alloc.allocate(seq, n)
    alloc.free("a")
    alloc.free("c")  # free runs: [0, 2) and [5, 10)
    assert alloc.allocate("d", 3).block_table == (5, 6, 7)
    assert alloc.allocate("e", 2).block_table == (0, 1)


def test_grows_in_place_when_the_next_blocks_are_free() -> None:
    alloc = ContiguousAllocator(num_blocks=8, block_size=2)
    alloc.allocate("a", 3)
    result = alloc.allocate("a", 8)
    assert result.block_table == (0, 1, 2, 3) and result.copies == ()
    assert alloc.stats().relocations == 0


def test_relocates_to_a_disjoint_run_and_reports_the_copies() -> None:
    alloc = ContiguousAllocator(num_blocks=8, block_size=2)
    alloc.allocate("a", 4)
    alloc.allocate("b", 2)  # blocks a: 0-1, b: 2
    result = alloc.allocate("a", 6)
    assert result.block_table == (3, 4, 5)
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
    assert alloc.allocate("a", 5) is None
    assert alloc.dump() == before


def test_max_len_reserves_up_front_and_grows_without_moving() -> None:
    alloc = ContiguousAllocator(num_blocks=16, block_size=4, reserve="max_len", max_len=20)
    alloc.allocate("a", 1)
    alloc.allocate("b", 1)
    assert runs(alloc, "a", "b") == [[0], [5]]
    assert alloc.stats().used_blocks == 10 and alloc.stats().used_slots == 2
    assert alloc.allocate("a", 20).copies == ()
    assert alloc.dump().splitlines()[1] == "XXXXXXrrrr......"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"reserve": "greedy"}, "reserve"), ({"reserve": "max_len"}, "max_len")],
)
def test_bad_policy_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ContiguousAllocator(num_blocks=8, block_size=2, **kwargs)


def test_external_fragmentation_is_one_minus_largest_free_run_over_free() -> None:
    alloc = ContiguousAllocator(num_blocks=10, block_size=1)
    for seq, n in (("a", 1), ("b", 2), ("c", 1), ("d", 3), ("e", 1)):
        alloc.allocate(seq, n)
    alloc.free("b")
    alloc.free("d")  # X..X...X..: free runs 2, 3, 2
    assert alloc.dump().splitlines()[1] == "X..X...X.."
    assert alloc.stats().external_fragmentation == pytest.approx(1 - 3 / 7)
    assert ContiguousAllocator(num_blocks=4, block_size=1).stats().external_fragmentation == 0
