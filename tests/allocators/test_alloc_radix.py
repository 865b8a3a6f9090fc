"""Radix allocator: prefix sharing, the last-token rule, leaf eviction by policy, COW."""

from __future__ import annotations

import random
import tracemalloc
from array import array

import pytest

from allocators.base import NO_COPIES
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


@pytest.mark.parametrize("typecode", ["H", "i", "q"])
def test_a_compact_prompt_matches_the_blocks_its_list_would(typecode: str) -> None:
    # A waiting prompt is a trace's compact array; its keys are made from its bytes, a
    # running sequence's list from its ints: the two must spell the same keys.
    alloc = RadixAllocator(num_blocks=16, block_size=BS)
    system = [70000 % 65536, 3, 65535, 9, 1, 2, 4, 8]
    serve(alloc, "a", [*system, 100, 101])
    assert alloc.match_prefix("b", array(typecode, [*system, 7, 8, 9])) == 8
    assert alloc.match_prefix("c", array(typecode, [*system[:4], 5, 6, 7, 8, 9])) == 4
    assert alloc.match_prefix("d", array(typecode, [1])) == 0
    assert alloc.block_table("b") == alloc.block_table("a")[:2]
    # and a block committed from a compact prompt is found by its list
    assert serve(alloc, "e", array(typecode, [9, 9, 9, 9, 8, 8, 8, 8, 1])) == 0
    assert alloc.match_prefix("f", [9, 9, 9, 9, 8, 8, 8, 8, 2]) == 8
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
    assert alloc.free("a") == 3  # 2 cached + 1 unindexed: all count as free
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
    assert not alloc.can_allocate("c", 12)  # only 2 free blocks, and nothing evictable
    assert alloc.allocate("c", 12) is None
    alloc.allocate("c", 8)
    assert alloc.block_table("c") == [2, 3]
    assert alloc.block_table("b") == [0, 1]
    alloc.check()


def test_a_failed_allocate_leaves_refs_and_tree_untouched() -> None:
    alloc = RadixAllocator(num_blocks=4, block_size=BS)
    serve(alloc, "a", list(range(8)))
    alloc.free("a")
    alloc.match_prefix("b", list(range(9)))
    before = (alloc.dump(), alloc.stats(), list(alloc.block_table("b")), alloc.cached_paths())
    assert alloc.allocate("b", 20) is None
    assert (alloc.dump(), alloc.stats(), alloc.block_table("b"), alloc.cached_paths()) == before
    alloc.check()  # every block's refs still match the tables that hold it


def test_fork_then_diverging_writes_copy_the_shared_partial_block() -> None:
    alloc = RadixAllocator(num_blocks=8, block_size=BS)
    serve(alloc, "p", list(range(6)))
    alloc.fork("p", "c")
    parent = alloc.allocate("p", 7)
    child = alloc.allocate("c", 7)
    assert parent.copies != () and child is NO_COPIES  # the first writer copies
    assert alloc.block_table("p")[1] != alloc.block_table("c")[1]
    assert alloc.block_table("p")[0] == alloc.block_table("c")[0]
    assert alloc.stats().cow_copies == 1
    alloc.check()


def test_trim_into_an_indexed_block_raises() -> None:
    alloc = RadixAllocator(num_blocks=8, block_size=BS)
    serve(alloc, "a", list(range(8)))  # blocks 0 and 1 indexed: later matches read them
    before = (alloc.dump(), alloc.stats(), list(alloc.block_table("a")))
    with pytest.raises(ValueError, match="trim"):
        alloc.trim("a", 6)
    assert (alloc.dump(), alloc.stats(), list(alloc.block_table("a"))) == before


def test_trim_to_a_block_boundary_leaves_the_dropped_indexed_blocks_cached() -> None:
    alloc = RadixAllocator(num_blocks=8, block_size=BS)
    serve(alloc, "a", list(range(12)))
    alloc.trim("a", 4)  # blocks 1 and 2 go to the cache, still indexed
    assert alloc.stats().cached_blocks == 2 and alloc.num_free_blocks() == 7
    assert alloc.match_prefix("b", list(range(13))) == 12  # the cached blocks kept their KV
    alloc.check()


def test_trim_into_a_block_shared_by_a_prefix_match_raises() -> None:
    alloc = RadixAllocator(num_blocks=8, block_size=BS)
    serve(alloc, "a", list(range(8)))
    serve(alloc, "b", list(range(10)))  # shares a's blocks 0 and 1, writes block 2
    with pytest.raises(ValueError, match="trim"):
        alloc.trim("b", 6)  # block 1 is a's too, and indexed
    alloc.trim("b", 9)  # inside b's own, unindexed block 2
    alloc.trim("b", 8)  # b's block 2 goes; 0 and 1 stay whole
    alloc.check()


def test_a_match_of_blocks_a_trimmed_sequence_holds_keeps_used_slots_exact() -> None:
    alloc = RadixAllocator(num_blocks=8, block_size=BS)
    serve(alloc, "a", list(range(8)))
    alloc.trim("a", 4)  # a keeps block 0; block 1 goes to the cache
    assert alloc.match_prefix("b", list(range(9))) == 8  # b shares 0 with a, holds 1 again
    # Slots in use: blocks 0 and 1 in full, once each (a's 4 slots are block 0's).
    assert alloc.stats().used_slots == 8
    alloc.check()


# -- forecasts with a cache -------------------------------------------------------------------


def test_evictable_cached_blocks_count_as_free_in_the_forecast() -> None:
    alloc = RadixAllocator(num_blocks=4, block_size=BS)
    serve(alloc, "a", list(range(8)))
    alloc.free("a")  # 2 cached blocks + 2 free ones
    assert alloc.blocks_needed("b", 16) == 4 and alloc.can_allocate("b", 16)
    assert alloc.allocate("b", 16) is not None
    assert alloc.num_free_blocks() == 0 and alloc.stats().evictions == 2
    assert alloc.blocks_needed("c", 1) == 1 and not alloc.can_allocate("c", 1)


def test_an_indexed_block_dropped_by_trim_is_evictable_in_the_forecast() -> None:
    alloc = RadixAllocator(num_blocks=3, block_size=BS)
    serve(alloc, "a", list(range(12)))  # the whole arena, all indexed
    alloc.trim("a", 8)  # block 2 goes to the cache: free, as far as allocate is concerned
    assert alloc.blocks_needed("a", 9) == 1 and alloc.can_allocate("a", 9)
    assert alloc.allocate("a", 9) is NO_COPIES
    assert alloc.block_table("a") == [0, 1, 2]  # block 2 evicted and taken back
    assert alloc.num_free_blocks() == 0 and alloc.stats().evictions == 1
    alloc.check()


def test_matching_cached_blocks_takes_them_from_the_free_count() -> None:
    alloc = RadixAllocator(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    serve(alloc, "a", prompt)
    alloc.free("a")  # blocks 0 and 1 cached: nobody runs on them
    # b would match them (2 blocks leave the free count) and take 1 new: 3 in all.
    assert alloc.blocks_needed("b", 9, prompt) == 3
    free = alloc.num_free_blocks()
    serve(alloc, "b", prompt)
    assert free - alloc.num_free_blocks() == 3


# -- eviction policies ------------------------------------------------------------------------


def six_cached_leaves(eviction: str) -> RadixAllocator:
    """A full arena of six cached one-block prompts A-F (blocks 0-5), whose keys differ.

    Each creation (commit) and each hit (match_prefix) ticks the clock once::

        t  1 A   2 B   3 B hit   4 B hit   5 C   6 C hit   7 D   8 E   9 F
          10 A hit   11 A hit   12 E hit

        leaf  block  created  last access  hits
        A     0      1        11           2
        B     1      2         4           2
        C     2      5         6           1
        D     3      7         7           0
        E     4      8        12           1
        F     5      9         9           0
    """
    alloc = RadixAllocator(num_blocks=6, block_size=BS, eviction=eviction)
    leaves = {name: [i] * BS for i, name in enumerate("ABCDEF")}

    def create(name: str) -> None:
        alloc.allocate(name, BS)
        alloc.commit(name, leaves[name])
        alloc.free(name)

    def hit(name: str) -> None:
        assert alloc.match_prefix("hit", [*leaves[name], 99]) == BS
        alloc.free("hit")

    for step in ("A", "B", "hit B", "hit B", "C", "hit C", "D", "E", "F"):
        hit(step[-1]) if step.startswith("hit") else create(step)
    for step in ("A", "A", "E"):
        hit(step)
    assert alloc.stats().cached_blocks == 6 and alloc.stats().free_blocks == 0
    return alloc


def eviction_order(alloc: RadixAllocator) -> list[int]:
    """Grow a sequence one block at a time: each new block is the next victim."""
    for n in range(1, alloc.num_blocks + 1):
        alloc.allocate("x", n * BS)
    assert alloc.stats().evictions == alloc.num_blocks
    alloc.check()
    return list(alloc.block_table("x"))


def test_lru_evicts_the_least_recently_accessed_first() -> None:
    # last access: B 4, C 6, D 7, F 9, A 11, E 12
    assert eviction_order(six_cached_leaves("lru")) == [1, 2, 3, 5, 0, 4]


def test_mru_evicts_the_most_recently_accessed_first() -> None:
    # last access, newest first: E 12, A 11, F 9, D 7, C 6, B 4
    assert eviction_order(six_cached_leaves("mru")) == [4, 0, 5, 3, 2, 1]


def test_fifo_evicts_the_oldest_created_first() -> None:
    # created: A 1, B 2, C 5, D 7, E 8, F 9 (hits do not matter)
    assert eviction_order(six_cached_leaves("fifo")) == [0, 1, 2, 3, 4, 5]


def test_filo_evicts_the_newest_created_first() -> None:
    # created, newest first: F 9, E 8, D 7, C 5, B 2, A 1
    assert eviction_order(six_cached_leaves("filo")) == [5, 4, 3, 2, 1, 0]


def test_lfu_evicts_the_fewest_hits_first_then_the_least_recent() -> None:
    # (hits, last access): D (0, 7), F (0, 9), C (1, 6), E (1, 12), B (2, 4), A (2, 11)
    assert eviction_order(six_cached_leaves("lfu")) == [3, 5, 2, 4, 1, 0]


def test_slru_evicts_probationary_leaves_first_then_protected_by_recency() -> None:
    # hits < 2 (probationary) by last access: C 6, D 7, F 9, E 12; then protected B 4, A 11
    assert eviction_order(six_cached_leaves("slru")) == [2, 3, 5, 4, 1, 0]


def test_a_parent_becomes_evictable_once_its_children_are_gone() -> None:
    alloc = RadixAllocator(num_blocks=3, block_size=BS, eviction="mru")
    serve(alloc, "a", list(range(8)))  # parent 0 and child 1: one commit, one last access
    alloc.free("a")
    # A tie goes to the lower block, so mru would take parent 0 first if it were a
    # candidate; it is not while its child 1 is cached.
    alloc.allocate("x", 4)  # the free block 2
    alloc.allocate("x", 12)  # then the leaf 1, then 0, now a leaf
    assert alloc.block_table("x") == [2, 1, 0]
    alloc.check()


def test_an_unknown_eviction_policy_names_the_argument() -> None:
    with pytest.raises(ValueError, match="eviction"):
        RadixAllocator(num_blocks=4, block_size=BS, eviction="random")


def test_a_cached_block_of_16_tokens_costs_under_330_bytes() -> None:
    # Everything the tree keeps per cached block once its sequences and their token lists
    # are gone (node, key, maps, heap entry, ref count); ids above 256 are int objects of
    # their own, as a tokenizer's are. Was 1,091 bytes (tuple keys, a dict per node), then
    # 349 with a dict from block to node (now a list, 8 bytes a block): 313.
    rng = random.Random(0)
    tracemalloc.start()
    try:
        alloc = RadixAllocator(num_blocks=4096, block_size=16)
        for i in range(64):
            tokens = [rng.randrange(300, 150_000) for _ in range(50 * 16)]
            serve(alloc, f"s{i}", tokens)
            alloc.free(f"s{i}")
        del tokens
        cost = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    cached = alloc.stats().cached_blocks
    assert cached == 64 * 50
    assert cost / cached < 330, f"{cost / cached:.0f} bytes a cached block"
