"""The allocator contract (DESIGN.md), checked the same way for every allocator."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest

from allocators.base import BlockAllocator

BS = 4
ALLOCATORS = {
    "free_list": ("allocators.free_list.FreeListAllocator", {}),
    "radix": ("allocators.radix.RadixAllocator", {}),
    "contiguous": ("allocators.contiguous.ContiguousAllocator", {}),
    "contiguous_max_len": (
        "allocators.contiguous.ContiguousAllocator",
        {"reserve": "max_len", "max_len": 12},
    ),
    "buddy": ("allocators.buddy.BuddyAllocator", {}),
}
PAGED = {"free_list", "radix"}


def load(name: str) -> type[BlockAllocator]:
    module, _, cls = ALLOCATORS[name][0].rpartition(".")
    return getattr(importlib.import_module(module), cls)


@pytest.fixture(params=sorted(ALLOCATORS))
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make(kind: str):
    def build(num_blocks: int = 16) -> BlockAllocator:
        return load(kind)(num_blocks=num_blocks, block_size=BS, **ALLOCATORS[kind][1])

    return build


def snapshot(alloc: BlockAllocator, seqs: list[str]) -> tuple:
    return alloc.dump(), alloc.stats(), {s: alloc.block_table(s) for s in seqs}


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_blocks": 0, "block_size": 4}, "num_blocks"),
        ({"num_blocks": 8, "block_size": -1}, "block_size"),
        ({"num_blocks": "8", "block_size": 4}, "num_blocks"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(kind: str, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        load(kind)(**kwargs, **ALLOCATORS[kind][1])


def test_allocate_grows_the_table_to_cover_the_tokens(make) -> None:
    alloc = make()
    assert len(alloc.allocate("a", 5).block_table) == 2
    alloc.check()
    result = alloc.allocate("a", 13)
    assert len(result.block_table) == 4 and alloc.block_table("a") == list(result.block_table)
    alloc.check()


def test_allocate_at_or_below_the_current_count_is_a_no_op(make) -> None:
    alloc = make()
    table = alloc.allocate("a", 9).block_table
    before = snapshot(alloc, ["a"])
    assert alloc.allocate("a", 3).block_table == table
    assert alloc.allocate("a", 9).copies == ()
    assert snapshot(alloc, ["a"]) == before


def test_failed_allocate_changes_nothing(make) -> None:
    alloc = make()
    alloc.allocate("a", 20)
    alloc.allocate("b", 10)
    before = snapshot(alloc, ["a", "b"])
    assert alloc.allocate("a", 16 * BS + 1) is None
    assert alloc.allocate("c", 16 * BS) is None
    assert snapshot(alloc, ["a", "b"]) == before
    with pytest.raises(ValueError, match="unknown"):
        alloc.block_table("c")
    alloc.check()


def test_free_after_failed_allocate_releases_matched_blocks(make) -> None:
    alloc = make()
    prompt = list(range(9))
    alloc.allocate("a", 9)
    alloc.commit("a", prompt)
    alloc.free("a")
    alloc.match_prefix("b", prompt)
    assert alloc.allocate("b", 1000) is None
    alloc.free("b")
    alloc.check()
    assert alloc.num_free_blocks() == alloc.num_blocks


def test_everything_is_free_again_after_free(make) -> None:
    alloc = make()
    prompt = list(range(10))
    for seq in "abc":
        alloc.match_prefix(seq, prompt)
        alloc.allocate(seq, 10)
        alloc.commit(seq, prompt)
    alloc.fork("a", "d")
    alloc.trim("b", 3)
    for seq in "abcd":
        alloc.free(seq)
        alloc.check()
    stats = alloc.stats()
    assert alloc.num_free_blocks() == alloc.num_blocks
    assert stats.used_blocks == stats.reserved_slots == stats.used_slots == 0
    assert stats.free_blocks + stats.cached_blocks == alloc.num_blocks
    assert set(alloc.dump().splitlines()[1]) <= {".", "c"}


def test_freeing_a_sequence_holding_nothing_is_a_no_op(make) -> None:
    alloc = make()
    alloc.free("never-seen")
    alloc.free("never-seen")
    alloc.check()


def test_trim_shrinks_and_a_later_allocate_regrows(make) -> None:
    alloc = make()
    alloc.allocate("a", 14)
    alloc.trim("a", 5)
    alloc.check()
    assert len(alloc.block_table("a")) == 2
    assert len(alloc.allocate("a", 17).block_table) == 5
    alloc.check()


def test_fork_gives_the_child_the_parents_tokens(make, kind: str) -> None:
    alloc = make()
    parent = alloc.allocate("p", 10).block_table
    result = alloc.fork("p", "c")
    alloc.check()
    assert len(result.block_table) == len(parent)
    if kind in PAGED:
        assert result.block_table == parent and result.copies == ()
        assert set(alloc.dump().splitlines()[1]) <= {"S", "."}
    else:
        assert set(result.block_table).isdisjoint(parent)
        assert result.copies == tuple(zip(parent, result.block_table, strict=True))
    with pytest.raises(ValueError, match="already exists"):
        alloc.fork("p", "c")


def test_fork_without_room_returns_none_and_changes_nothing(make, kind: str) -> None:
    alloc = make(num_blocks=4)
    alloc.allocate("p", 12)
    before = snapshot(alloc, ["p"])
    result = alloc.fork("p", "c")
    if kind in PAGED:
        assert result is not None  # sharing needs no block
        return
    assert result is None and snapshot(alloc, ["p"]) == before


def test_tables_share_blocks_only_through_fork_or_prefix(make, kind: str) -> None:
    alloc = make(num_blocks=32)
    for i, seq in enumerate("abcd"):
        alloc.allocate(seq, 3 + 4 * i)
    alloc.fork("a", "e")
    held = Counter(b for s in "abcde" for b in alloc.block_table(s))
    shared = {b for b, n in held.items() if n > 1}
    assert shared == (set(alloc.block_table("a")) if kind in PAGED else set())
    assert set(alloc.dump().splitlines()[1][b] for b in shared) <= {"S"}


def test_stats_agree_with_the_block_tables(make) -> None:
    alloc = make(num_blocks=32)
    alloc.allocate("a", 5)
    alloc.allocate("b", 9)
    stats = alloc.stats()
    tables = alloc.block_table("a") + alloc.block_table("b")
    assert stats.used_slots == 14
    assert stats.reserved_slots == stats.used_blocks * BS >= len(tables) * BS
    assert stats.used_blocks + stats.free_blocks + stats.cached_blocks == 32
    assert alloc.num_free_blocks() == stats.free_blocks + stats.cached_blocks
    assert 0 < stats.utilisation <= 1


def test_match_prefix_never_covers_every_token(make, kind: str) -> None:
    alloc = make()
    prompt = list(range(8))
    alloc.allocate("a", 8)
    alloc.commit("a", prompt)
    matched = alloc.match_prefix("b", prompt)
    assert matched == (4 if kind == "radix" else 0)
    assert matched < len(prompt) and alloc.stats().prefix_queries == 1
    with pytest.raises(ValueError, match="already holds"):
        alloc.match_prefix("a", prompt)


@pytest.mark.parametrize("call", ["trim", "commit", "block_table", "fork"])
def test_unknown_sequences_are_rejected(make, call: str) -> None:
    args = {"trim": ("x", 0), "commit": ("x", []), "block_table": ("x",), "fork": ("x", "y")}
    with pytest.raises(ValueError, match="unknown seq_id 'x'"):
        getattr(make(), call)(*args[call])


def test_bad_counts_are_rejected(make) -> None:
    alloc = make()
    alloc.allocate("a", 4)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.allocate("a", -1)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.trim("a", -1)
    with pytest.raises(ValueError, match="allocate"):
        alloc.trim("a", 5)
    with pytest.raises(ValueError, match="allocate them first"):
        alloc.commit("a", list(range(5)))
