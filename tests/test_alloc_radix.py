"""Radix allocator: prefix sharing, the last-token rule, LRU leaf eviction, COW."""

from __future__ import annotations

from allocators.radix import RadixAllocator

BS = 4


def serve(alloc: RadixAllocator, seq: str, tokens: list[int]) -> int:
    """Match, allocate and commit a prompt as the engine does; returns tokens matched."""
    matched = alloc.match_prefix(seq, tokens)
    assert alloc.allocate(seq, len(tokens)) is not None
    alloc.commit(seq, tokens)
    return matched


def test_two_sequences_with_a_common_prefix_share_its_blocks() -> None:
    alloc = RadixAllocator(num_blocks=16, block_size=BS)
    system = list(range(8))
    serve(alloc, "a", [*system, 100, 101])
    assert serve(alloc, "b", [*system, 200]) == 8
    assert alloc.block_table("a")[:2] == alloc.block_table("b")[:2]
    assert alloc.block_table("a")[2] != alloc.block_table("b")[2]
    stats = alloc.stats()
    assert (stats.prefix_queries, stats.prefix_hit_tokens) == (2, 8)
    assert stats.hit_rate == 8 / 19
    alloc.check()


def test_a_prompt_of_whole_blocks_leaves_its_last_block_to_compute() -> None:
    alloc = RadixAllocator(num_blocks=16, block_size=BS)
    prompt = list(range(12))
    serve(alloc, "a", prompt)
    assert alloc.match_prefix("b", prompt) == 8
    assert alloc.match_prefix("c", prompt[:9]) == 8
    assert alloc.match_prefix("d", prompt[:4]) == 0


def test_freed_indexed_blocks_stay_cached_and_count_as_free() -> None:
    alloc = RadixAllocator(num_blocks=8, block_size=BS)
    serve(alloc, "a", list(range(10)))
    alloc.free("a")
    stats = alloc.stats()
    assert (stats.cached_blocks, stats.free_blocks) == (2, 6)
    assert alloc.num_free_blocks() == 8
    assert alloc.dump().splitlines()[1] == "cc......"


def test_eviction_waits_for_the_free_list_and_takes_the_lru_leaf() -> None:
    alloc = RadixAllocator(num_blocks=6, block_size=BS)
    serve(alloc, "old", [1] * 8)  # blocks 0, 1
    serve(alloc, "new", [2] * 8)  # blocks 2, 3
    alloc.free("old")
    alloc.free("new")
    alloc.allocate("x", 8)  # takes the two free blocks, evicts nothing
    assert alloc.stats().evictions == 0
    alloc.allocate("x", 12)
    assert alloc.block_table("x")[-1] == 1  # the least recently used leaf is old's tail
    alloc.allocate("x", 16)
    assert alloc.block_table("x")[-1] == 0  # then its parent, now a leaf
    assert alloc.stats().evictions == 2
    assert alloc.match_prefix("y", [2] * 9) == 8  # new's blocks survived
    alloc.check()


def test_eviction_never_touches_a_referenced_block() -> None:
    alloc = RadixAllocator(num_blocks=4, block_size=BS)
    serve(alloc, "a", list(range(8)))
    alloc.free("a")
    assert alloc.match_prefix("b", list(range(9))) == 8  # b holds both cached blocks
    assert alloc.allocate("c", 12) is None  # only 2 free blocks, and nothing evictable
    assert alloc.allocate("c", 8).block_table == (2, 3)
    assert alloc.block_table("b") == [0, 1]
    alloc.check()


def test_a_failed_allocate_leaves_refs_and_tree_untouched() -> None:
    alloc = RadixAllocator(num_blocks=4, block_size=BS)
    serve(alloc, "a", list(range(8)))
    alloc.free("a")
    alloc.match_prefix("b", list(range(9)))
    before = (alloc.dump(), alloc.stats(), list(alloc._ref), set(alloc._node_of))
    assert alloc.allocate("b", 20) is None
    assert (alloc.dump(), alloc.stats(), list(alloc._ref), set(alloc._node_of)) == before


def test_fork_then_diverging_writes_copy_the_shared_partial_block() -> None:
    alloc = RadixAllocator(num_blocks=8, block_size=BS)
    serve(alloc, "p", list(range(6)))
    alloc.fork("p", "c")
    parent = alloc.allocate("p", 7)
    child = alloc.allocate("c", 7)
    assert parent.copies != () and child.copies == ()  # the first writer copies
    assert parent.block_table[1] != child.block_table[1]
    assert parent.block_table[0] == child.block_table[0]
    assert alloc.stats().cow_copies == 1
    alloc.check()


def test_writing_after_a_trim_into_an_indexed_block_copies_it() -> None:
    alloc = RadixAllocator(num_blocks=8, block_size=BS)
    serve(alloc, "a", list(range(8)))
    alloc.trim("a", 6)
    result = alloc.allocate("a", 7)
    assert result.copies == ((1, result.block_table[1]),)
    assert alloc.match_prefix("b", list(range(9))) == 8  # the cached block kept its tokens
