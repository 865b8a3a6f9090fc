"""The allocator contract (docs/design.md section 4, version 5), checked for every allocator."""

from __future__ import annotations

import copy
import tracemalloc
from collections import Counter

import pytest
from support import allocator_options

from allocators.base import NO_COPIES, BlockAllocator

BS = 4
ALLOCATORS = allocator_options(max_len=12)  # contiguous_max_len: a region of at least 3 blocks
PAGED = {"free_list", "radix"}


@pytest.fixture(params=sorted(ALLOCATORS))
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make(kind: str):
    def build(num_blocks: int = 16) -> BlockAllocator:
        return ALLOCATORS[kind](num_blocks=num_blocks, block_size=BS)

    return build


def traced_bytes(build) -> tuple[object, int]:
    """What ``build()`` returns, and the bytes it left allocated (tracemalloc)."""
    tracemalloc.start()
    try:
        result = build()
        return result, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def snapshot(alloc: BlockAllocator, seqs: list[str]) -> tuple:
    """Everything observable; tables copied, since ``block_table`` is the live list."""
    return alloc.dump(), alloc.stats(), {s: list(alloc.block_table(s)) for s in seqs}


def allocate_as_forecast(alloc: BlockAllocator, seq: str, num_tokens: int) -> int:
    """``allocate``, asserting it took exactly ``blocks_needed``; returns that number."""
    need, free = alloc.blocks_needed(seq, num_tokens), alloc.num_free_blocks()
    assert alloc.can_allocate(seq, num_tokens)
    assert alloc.allocate(seq, num_tokens) is not None
    assert free - alloc.num_free_blocks() == need
    return need


# -- construction and bad input -----------------------------------------------------------


def test_a_6m_block_arena_costs_nothing_until_its_blocks_are_used(make) -> None:
    # Under 100 kB: less than one bit per block, so no structure is sized by the arena.
    alloc, cost = traced_bytes(lambda: make(num_blocks=6_000_000))
    assert cost < 100_000, f"{cost} bytes to construct"
    assert alloc.num_free_blocks() == 6_000_000


def test_memory_grows_with_the_blocks_used_not_the_arena(make) -> None:
    def use(num_blocks: int) -> BlockAllocator:
        alloc = make(num_blocks=num_blocks)
        for i in range(64):
            alloc.allocate(f"s{i}", 7 * BS)
            alloc.commit(f"s{i}", [i] * 7 * BS)
        for i in range(0, 64, 2):
            alloc.free(f"s{i}")
        return alloc

    small, small_cost = traced_bytes(lambda: use(4096))
    large, large_cost = traced_bytes(lambda: use(6_000_000))
    assert large.stats().used_blocks == small.stats().used_blocks > 0
    assert large_cost < small_cost + 10_000, f"{large_cost} bytes against {small_cost}"
    large.check()


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
        ALLOCATORS[kind](**kwargs)


@pytest.mark.parametrize(
    "call",
    ["trim", "block_table", "num_tokens", "held_slots", "fork", "commit", "holdings",
     "block_tables"],
)  # fmt: skip
def test_unknown_sequences_are_rejected(make, call: str) -> None:
    args = {"trim": ("x", 0), "fork": ("x", "y"), "commit": ("x", [])}.get(call, ("x",))
    if call in ("holdings", "block_tables"):  # a batch: the unknown one is named
        make_ = make()
        make_.allocate("a", 3)
        with pytest.raises(ValueError, match="unknown seq_id 'x'"):
            getattr(make_, call)(["a", "x"])
        return
    with pytest.raises(ValueError, match="unknown seq_id 'x'"):
        getattr(make(), call)(*args)


def test_a_batch_read_is_each_sequences_own(make, kind: str) -> None:
    # holdings and block_tables read a step's batch in one call: each entry is what the
    # one-sequence calls say, the tables live (not copies), in the order asked.
    alloc = make()
    alloc.allocate("a", 5)  # 2 blocks of 4
    alloc.allocate("b", 1)  # 1 block
    assert alloc.fork("b", "c") is not None
    got = alloc.holdings(["c", "a", "b"])
    assert got.num_tokens == [alloc.num_tokens(s) for s in ("c", "a", "b")] == [1, 5, 1]
    assert got.held_slots == [alloc.held_slots(s) for s in ("c", "a", "b")]
    assert got.held_slots[1] >= 8  # a region may hold slack beyond 2 blocks
    tables = alloc.block_tables(["b", "a"])
    assert tables[0] is alloc.block_table("b") and tables[1] is alloc.block_table("a")
    assert alloc.holdings([]) == ([], []) and alloc.block_tables([]) == []


def test_stats_count_the_tables_entries_and_their_distinct_blocks(make, kind: str) -> None:
    # a: 5 slots in 2 blocks of 4; b: 1 slot in 1 block; c, b's fork, shares b's block where
    # the allocator shares (paged) and copies it where it cannot (regions). 4 table entries;
    # 3 distinct blocks shared, 4 copied. Growth within a block, a new block, a trim and a
    # free each move the counts with the tables.
    alloc = make()

    def counts() -> tuple[int, int, int]:
        s = alloc.stats()
        return s.num_seqs, s.table_refs, s.table_blocks

    assert counts() == (0, 0, 0)
    alloc.allocate("a", 5)
    alloc.allocate("b", 1)
    assert alloc.fork("b", "c") is not None
    shared = alloc.block_table("c") == alloc.block_table("b")
    assert counts() == (3, 4, 3 if shared else 4)
    assert shared == (kind in PAGED)
    alloc.allocate("a", 8)  # within its 2 blocks
    assert counts() == (3, 4, 3 if shared else 4)
    alloc.allocate("a", 9)  # a third block
    assert counts() == (3, 5, 4 if shared else 5)
    alloc.trim("a", 4)  # down to 1 block
    assert counts() == (3, 3, 2 if shared else 3)
    alloc.free("b")
    assert counts() == (2, 2, 2)
    alloc.check()


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


def test_forecasts_reject_a_negative_count_as_allocate_does(make) -> None:
    # allocate("new", -1) raises, so can_allocate cannot answer True (nor blocks_needed 0).
    alloc = make()
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.allocate("new", -1)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.can_allocate("new", -1)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.blocks_needed("new", -1)


# -- allocate -----------------------------------------------------------------------------


def test_allocate_grows_the_table_to_cover_the_tokens(make) -> None:
    alloc = make()
    assert alloc.allocate("a", 5) is not None
    assert len(alloc.block_table("a")) == 2 and alloc.num_tokens("a") == 5
    alloc.check()
    assert alloc.allocate("a", 13) is not None
    assert len(alloc.block_table("a")) == 4 and alloc.num_tokens("a") == 13
    alloc.check()


def test_growth_within_a_block_returns_no_copies_and_keeps_the_live_table(make) -> None:
    alloc = make()
    alloc.allocate("a", 5)
    table = alloc.block_table("a")
    assert alloc.allocate("a", 6) is NO_COPIES  # slot 5 lies in block 1: the O(1) path
    assert alloc.allocate("a", 8) is NO_COPIES
    assert alloc.block_table("a") is table and len(table) == 2
    # A new block that copies nothing is NO_COPIES too (every kind grows in place here),
    # and the list handed out before shows it: it is the live table, not a copy.
    assert alloc.allocate("a", 9) is NO_COPIES
    assert alloc.block_table("a") is table and len(table) == 3
    alloc.check()


def test_the_write_limit_is_where_growth_takes_a_block(make) -> None:
    alloc = make()
    alloc.allocate("a", 5)
    limit = alloc.write_limit("a")
    assert limit == len(alloc.block_table("a")) * BS == 8  # a region's slack is not a table's
    table = list(alloc.block_table("a"))
    assert alloc.allocate("a", limit) is NO_COPIES and alloc.block_table("a") == table
    assert alloc.allocate("a", limit + 1) is not None
    assert len(alloc.block_table("a")) == len(table) + 1
    assert alloc.write_limit("a") == 12


@pytest.mark.parametrize("kind", sorted(PAGED))  # a region's fork copies its blocks
def test_a_fork_leaves_its_shared_partial_block_no_write_limit(make) -> None:
    alloc = make()
    alloc.allocate("a", 5)
    alloc.fork("a", "f")
    assert alloc.write_limit("a") == alloc.write_limit("f") == 5  # the next write copies


def test_growth_within_the_write_limit_may_go_unreported(make) -> None:
    """Version 5: a batch that grows ``a`` by a token a step reports only its crossings;
    every block, copy and count is then what reporting each step gives."""
    steps = range(5, 31)
    reported, quiet = make(num_blocks=32), make(num_blocks=32)
    for alloc in (reported, quiet):
        alloc.allocate("a", 5)
        alloc.allocate("b", 3)
    for n in steps:
        got = reported.allocate("a", n)
        assert got is not None
        if n > quiet.write_limit("a"):  # the same blocks and copies (a region relocates)
            assert quiet.allocate("a", n) == got
        else:  # counted as last reported, at most the write limit
            assert quiet.num_tokens("a") <= n <= quiet.write_limit("a")
    quiet.check()
    assert quiet.block_table("a") == reported.block_table("a")
    stale = quiet.num_tokens("a")
    assert stale < steps[-1]
    shared = quiet.stats().shared_slots
    assert quiet.stats().used_slots == stale + 3 - shared  # the counts as reported
    assert quiet.allocate("a", steps[-1]) is NO_COPIES  # a late report: nothing else moves
    assert snapshot(quiet, ["a", "b"]) == snapshot(reported, ["a", "b"])


def test_commit_reports_the_growth_it_covers(make) -> None:
    alloc = make()
    alloc.allocate("a", 5)
    alloc.commit("a", list(range(8)))  # up to the write limit, unreported
    assert alloc.num_tokens("a") == 8 and alloc.stats().used_slots == 8
    alloc.check()
    with pytest.raises(ValueError, match="commit: 9 tokens exceed the 8 slots"):
        alloc.commit("a", list(range(9)))


@pytest.mark.parametrize("kind", sorted(PAGED))  # a region's fork copies its blocks
def test_shared_slots_are_the_slots_counted_twice(make) -> None:
    alloc = make()
    alloc.allocate("a", 5)
    assert alloc.stats().shared_slots == 0
    alloc.fork("a", "f")
    stats = alloc.stats()
    assert stats.shared_slots == 5 and stats.used_slots == 5  # the tables' 10 less the 5


def test_allocate_at_or_below_the_current_count_is_a_no_op(make) -> None:
    alloc = make()
    alloc.allocate("a", 9)
    before = snapshot(alloc, ["a"])
    assert alloc.allocate("a", 3) is NO_COPIES
    assert alloc.allocate("a", 9) is NO_COPIES
    assert alloc.blocks_needed("a", 3) == 0 and alloc.can_allocate("a", 3)
    assert snapshot(alloc, ["a"]) == before


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [
        # New 5-token sequence: 2 blocks; max_len reserves 3; buddy's region of 2.
        (5, {"free_list": 2, "radix": 2, "contiguous": 2, "contiguous_max_len": 3, "buddy": 2}),
        # 5 -> 9 tokens, 3 blocks: max_len's region already covers 12; buddy doubles 2 -> 4.
        (9, {"free_list": 1, "radix": 1, "contiguous": 1, "contiguous_max_len": 0, "buddy": 2}),
        # 9 -> 17 tokens, 5 blocks: max_len's region 3 -> 5; buddy doubles 4 -> 8.
        (17, {"free_list": 2, "radix": 2, "contiguous": 2, "contiguous_max_len": 2, "buddy": 4}),
    ],
)
def test_blocks_needed_is_the_drop_of_free_blocks(
    make, kind: str, num_tokens: int, expected: dict
) -> None:
    alloc = make()
    for earlier in (5, 9, 17):
        if earlier == num_tokens:
            break
        alloc.allocate("a", earlier)
    assert allocate_as_forecast(alloc, "a", num_tokens) == expected[kind]
    alloc.check()


def test_can_allocate_agrees_with_allocate_on_a_nearly_full_arena(make, kind: str) -> None:
    alloc = make(num_blocks=4)
    alloc.allocate("a", 12)  # 3 blocks; buddy's region is 4 (the whole arena)
    # b needs 1 block: 1 is free, except for max_len (reserves 3) and buddy (0 free).
    can_b = kind in {"free_list", "radix", "contiguous"}
    assert alloc.can_allocate("b", 4) is can_b
    assert (alloc.allocate("b", 4) is not None) is can_b
    # a to 4 blocks: paged and contiguous have no block left (b took it); max_len extends
    # over block 3 (b could not start); buddy's region of 4 already covers it.
    can_a = kind in {"contiguous_max_len", "buddy"}
    assert alloc.can_allocate("a", 13) is can_a
    assert (alloc.allocate("a", 13) is not None) is can_a
    alloc.check()


def test_failed_allocate_changes_nothing(make) -> None:
    alloc = make()
    alloc.allocate("a", 20)
    alloc.allocate("b", 10)
    before = snapshot(alloc, ["a", "b"])
    assert not alloc.can_allocate("a", 16 * BS + 1)
    assert alloc.allocate("a", 16 * BS + 1) is None
    assert not alloc.can_allocate("c", 16 * BS)
    assert alloc.allocate("c", 16 * BS) is None
    assert snapshot(alloc, ["a", "b"]) == before
    with pytest.raises(ValueError, match="unknown"):
        alloc.block_table("c")
    alloc.check()


def one_by_one(alloc, requests: list[tuple[str, int]]) -> list:
    """``allocate`` for each request in order, up to and with the first ``None``."""
    results = []
    for seq, num_tokens in requests:
        results.append(alloc.allocate(seq, num_tokens))
        if results[-1] is None:
            break
    return results


@pytest.mark.parametrize("stops", [False, True])
def test_allocate_many_is_allocate_for_each_request_in_order(make, stops: bool) -> None:
    alloc = make(num_blocks=32)
    alloc.allocate("a", 5)
    alloc.allocate("b", 4)
    alloc.fork("a", "f")  # paged: a and f share a partial block, the first write copies it
    alloc.commit("b", list(range(4)))  # radix: b's full block is indexed
    twin = copy.deepcopy(alloc)
    requests = [
        ("a", 9),  # a block boundary
        ("b", 6),
        ("f", 6),
        ("a", 10),  # a again, further (within its block)
        ("c", 3),  # a new sequence
        ("b", 2),  # below its count: nothing
        ("a", 40),
    ]
    if stops:  # one that never fits: None, nothing changes for it, and the call ends there
        requests.insert(2, ("d", 33 * BS))
    expected = one_by_one(twin, requests)
    assert alloc.allocate_many(requests) == expected
    assert len(expected) == (3 if stops else len(requests))
    assert (expected[-1] is None) == stops
    assert stops or expected[5] is not None  # below its count: nothing changes, no None
    seqs = ["a", "b", "f", *(["c"] if not stops else [])]  # d and, stopped, c never exist
    assert snapshot(alloc, seqs) == snapshot(twin, seqs)
    alloc.check()


def test_allocate_many_raises_at_a_wrong_request_after_the_ones_before_it(make) -> None:
    alloc = make()
    alloc.allocate("a", 2)
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.allocate_many([("a", BS + 1), ("b", -1), ("a", 4 * BS)])
    assert alloc.num_tokens("a") == BS + 1
    alloc.check()


@pytest.mark.parametrize("num_blocks", [16, 24])
def test_max_seq_tokens_is_the_longest_sequence_that_fits(make, kind: str, num_blocks: int) -> None:
    alloc = make(num_blocks=num_blocks)
    # Buddy: the largest aligned power-of-two chunk (24 blocks = 16 + 8); others: the arena.
    longest = 16 if kind == "buddy" else num_blocks
    assert alloc.max_seq_tokens == longest * BS
    assert not alloc.can_allocate("a", longest * BS + 1)
    assert alloc.allocate("a", longest * BS + 1) is None
    assert alloc.can_allocate("a", longest * BS)
    assert alloc.allocate("a", longest * BS) is not None
    alloc.check()


# -- free -----------------------------------------------------------------------------------


def test_free_returns_the_blocks_it_gives_back_as_reclaimable_forecast(make, kind: str) -> None:
    alloc = make()
    alloc.allocate("p", 10)  # 3 blocks; buddy's region is 4
    alloc.fork("p", "c")
    # Paged: c shares all of p's blocks, so freeing it gives back none; regions own a copy.
    own = {"free_list": 3, "radix": 3, "contiguous": 3, "contiguous_max_len": 3, "buddy": 4}
    for seq, expected in (("c", 0 if kind in PAGED else own[kind]), ("p", own[kind])):
        reclaimable, free = alloc.reclaimable_blocks(seq), alloc.num_free_blocks()
        assert alloc.free(seq) == reclaimable == expected == alloc.num_free_blocks() - free
        alloc.check()
    assert alloc.num_free_blocks() == alloc.num_blocks


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
    alloc.trim("b", 9)  # inside b's own last block (radix shares blocks 0-1 by prefix)
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
    assert alloc.reclaimable_blocks("never-seen") == 0
    assert alloc.free("never-seen") == 0
    assert alloc.free("never-seen") == 0
    alloc.check()


# -- trim -----------------------------------------------------------------------------------


def test_trim_shrinks_and_a_later_allocate_regrows(make) -> None:
    alloc = make()
    alloc.allocate("a", 14)
    alloc.trim("a", 5)
    alloc.check()
    assert len(alloc.block_table("a")) == 2 and alloc.num_tokens("a") == 5
    assert alloc.allocate("a", 17) is not None
    assert len(alloc.block_table("a")) == 5
    alloc.check()


def test_trim_into_a_block_shared_by_a_fork_raises(make, kind: str) -> None:
    alloc = make()
    alloc.allocate("p", 6)  # blocks 0 (full) and 1 (2 slots)
    alloc.fork("p", "c")
    if kind in PAGED:  # c shares block 1 with p: cutting it to 1 slot would make them disagree
        before = snapshot(alloc, ["p", "c"])
        with pytest.raises(ValueError, match="trim"):
            alloc.trim("c", 5)
        assert snapshot(alloc, ["p", "c"]) == before
    else:  # a fork copies into a region of c's own
        alloc.trim("c", 5)
    alloc.trim("c", 4)  # at a block boundary: c just drops its reference to block 1
    assert alloc.num_tokens("c") == 4 and alloc.num_tokens("p") == 6
    alloc.check()


# -- fork and sharing -----------------------------------------------------------------------


def test_fork_gives_the_child_the_parents_tokens(make, kind: str) -> None:
    alloc = make()
    alloc.allocate("p", 10)
    parent = list(alloc.block_table("p"))
    result = alloc.fork("p", "c")
    alloc.check()
    child = alloc.block_table("c")
    assert len(child) == len(parent) and alloc.num_tokens("c") == 10
    if kind in PAGED:
        assert child == parent and result is NO_COPIES
        assert set(alloc.dump().splitlines()[1]) <= {"S", "."}
    else:
        assert set(child).isdisjoint(parent)
        assert result.copies == tuple(zip(parent, child, strict=True))
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


def test_copy_on_write_after_fork_is_forecast(make, kind: str) -> None:
    alloc = make()
    alloc.allocate("p", 6)
    alloc.fork("p", "c")
    # Paged: c's write into shared block 1 copies it into a new block. Regions: c's own
    # region (2 blocks; 3 for max_len) already covers slot 6.
    assert allocate_as_forecast(alloc, "c", 7) == (1 if kind in PAGED else 0)
    assert allocate_as_forecast(alloc, "p", 7) == 0  # p is block 1's only holder now
    assert alloc.stats().cow_copies == (1 if kind in PAGED else 0)
    alloc.check()


def test_tables_share_blocks_only_through_fork_or_prefix(make, kind: str) -> None:
    alloc = make(num_blocks=32)
    for i, seq in enumerate("abcd"):
        alloc.allocate(seq, 3 + 4 * i)
    alloc.fork("a", "e")
    held = Counter(b for s in "abcde" for b in alloc.block_table(s))
    shared = {b for b, n in held.items() if n > 1}
    assert shared == (set(alloc.block_table("a")) if kind in PAGED else set())
    assert set(alloc.dump().splitlines()[1][b] for b in shared) <= {"S"}


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


def test_forecast_for_a_new_sequence_leaves_out_blocks_a_prefix_match_shares(
    make, kind: str
) -> None:
    alloc = make(num_blocks=4)
    prompt = list(range(12))
    alloc.allocate("a", 12)  # 3 blocks (buddy: a region of 4): 1 block free, 0 for buddy
    alloc.commit("a", prompt)
    b_prompt = [*prompt, 99]  # 13 tokens, 4 blocks
    # Radix: b would share a's 3 running blocks, so only 1 is new, and it fits. The others
    # ignore token_ids: 4 blocks (a region of 4), which do not fit.
    need = 1 if kind == "radix" else 4
    assert alloc.blocks_needed("b", 13, b_prompt) == need
    assert alloc.can_allocate("b", 13, b_prompt) is (kind == "radix")
    assert alloc.blocks_needed("b", 13) == 4 and not alloc.can_allocate("b", 13)
    free = alloc.num_free_blocks()
    alloc.match_prefix("b", b_prompt)
    result = alloc.allocate("b", 13)
    assert (result is not None) is (kind == "radix")
    if result is not None:
        assert free - alloc.num_free_blocks() == need
    alloc.check()


# -- per-sequence slots and stats --------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "expected_blocks"),
    [
        # 5 tokens, 2 blocks: max_len holds a region of 3 blocks (12 slots).
        (5, {"free_list": 2, "radix": 2, "contiguous": 2, "contiguous_max_len": 3, "buddy": 2}),
        # 17 tokens, 5 blocks: past max_len's 3; buddy rounds up to a region of 8 (32 slots).
        (17, {"free_list": 5, "radix": 5, "contiguous": 5, "contiguous_max_len": 5, "buddy": 8}),
    ],
)
def test_held_slots_include_region_slack(
    make, kind: str, num_tokens: int, expected_blocks: dict
) -> None:
    alloc = make()
    alloc.allocate("a", num_tokens)
    assert alloc.held_slots("a") == expected_blocks[kind] * BS
    assert alloc.stats().reserved_slots == expected_blocks[kind] * BS  # a is alone


def test_used_slots_count_a_block_shared_by_a_fork_once(make, kind: str) -> None:
    alloc = make()
    alloc.allocate("p", 6)
    alloc.fork("p", "c")
    # Paged: c shares both of p's blocks (6 slots in use); regions: c holds a copy (12).
    assert alloc.stats().used_slots == (6 if kind in PAGED else 12)


def test_used_slots_count_a_block_shared_by_a_prefix_match_once(make, kind: str) -> None:
    alloc = make()
    prompt = list(range(9))
    alloc.allocate("a", 9)
    alloc.commit("a", prompt)
    alloc.match_prefix("b", prompt)
    alloc.allocate("b", 9)
    # Radix: b shares a's 2 full blocks and writes 1 slot of its own: 9 + 1. Others: 9 + 9.
    assert alloc.stats().used_slots == (10 if kind == "radix" else 18)
    alloc.check()


def test_stats_agree_with_the_block_tables(make) -> None:
    alloc = make(num_blocks=32)
    alloc.allocate("a", 5)
    alloc.allocate("b", 9)
    stats = alloc.stats()
    tables = alloc.block_table("a") + alloc.block_table("b")
    assert stats.used_slots == 14
    assert stats.reserved_slots == stats.used_blocks * BS >= len(tables) * BS
    assert stats.reserved_slots == alloc.held_slots("a") + alloc.held_slots("b")
    assert stats.used_blocks + stats.free_blocks + stats.cached_blocks == 32
    assert alloc.num_free_blocks() == stats.free_blocks + stats.cached_blocks
    assert 0 < stats.utilisation <= 1
    assert not hasattr(stats, "external_fragmentation")


@pytest.mark.parametrize("kind", sorted(PAGED))  # regions: test_alloc_contiguous/buddy.py
def test_paged_allocators_have_no_unusable_free_blocks(make) -> None:
    alloc = make(num_blocks=8)
    for seq in "abcd":
        alloc.allocate(seq, BS)
    alloc.free("a")
    alloc.free("c")  # free blocks scattered: any of them serves any sequence
    assert alloc.unusable_free_blocks(BS) == alloc.unusable_free_blocks(6 * BS) == 0
