"""Random operation sequences against every allocator, checked against a model.

The model plays the engine: it keeps a simulated KV arena (the token each block
slot holds), applies every ``copies`` list before writing the new slots, and after
each step asserts that every live sequence reads its own tokens back through its
block table. That catches a shared block written without copy-on-write, a cached
block evicted while in use, or a relocation that forgot a block; ``check()`` runs
after every step too.

It also holds the allocator to its forecasts: before every ``allocate`` it asks
``blocks_needed`` and ``can_allocate`` (for a new sequence with its prompt's
``token_ids`` too, before ``match_prefix``), then compares them with what happened;
``free`` must return ``reclaimable_blocks`` and the rise of ``num_free_blocks()``;
``trim`` must raise exactly when the model sees the new end cut into a block another
table shares or the prefix cache indexes. ``allocate_many`` must give the results, and
leave the state, of the same requests passed to ``allocate`` one by one on a copy of
the allocator (a differential check). ``stats`` counts the tables' entries and distinct
blocks as the model's tables have them.

Growth within a sequence's write limit may go unreported (contract version 5): a rule
writes such tokens without asking the allocator, which then counts the sequence as last
reported; the caller reports before a fork or a trim, a commit reports what it covers, and
every other call works on the count as it is.

For the radix allocator the model keeps its own prefix index (full-block token prefix
-> block): ``commit`` adds to it, a block that shows up new in a table was evicted (or
was never indexed), and ``match_prefix`` must return the longest indexed prefix.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from allocators.base import NO_COPIES, Allocation, BlockAllocator
from allocators.buddy import BuddyAllocator
from allocators.contiguous import ContiguousAllocator
from allocators.free_list import FreeListAllocator
from allocators.radix import EVICTION, RadixAllocator

BLOCK_SIZE = 2
# A two-letter alphabet and tiny blocks make shared prefixes (and radix hits) common.
TOKENS = st.lists(st.integers(0, 1), max_size=12)


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


class AllocatorMachine(RuleBasedStateMachine):
    """Drives one allocator; subclasses choose which through ``make``."""

    paged = True  # blocks are shared by reference (fork, prefix match), never by region
    caches = False  # a prefix cache indexes committed full blocks (radix)

    @staticmethod
    def make() -> BlockAllocator:
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self.alloc = self.make()
        self.tokens: dict[str, list[int]] = {}  # what each live sequence has written
        self.reported: dict[str, int] = {}  # its count as the allocator knows it
        self.arena: dict[int, list[int | None]] = {}
        self.index: dict[tuple[int, ...], int] = {}  # cached full-block prefix -> block
        self.prompts: list[list[int]] = []  # token lists committed so far
        self.next_id = 0

    # -- the engine's side ------------------------------------------------------------

    def copy(self, result: Allocation) -> None:
        """Copy blocks as one gather: every source is read before any destination is written."""
        if not result.copies:
            assert result is NO_COPIES, "nothing copied, but not the shared NO_COPIES"
        empty = [None] * BLOCK_SIZE
        sources = {src: list(self.arena.get(src, empty)) for src, _ in result.copies}
        for src, dst in result.copies:
            self.arena[dst] = list(sources[src])

    def write(
        self, seq: str, result: Allocation, new_tokens: list[int], reported: bool = True
    ) -> None:
        """Apply the copies, then write the new tokens into their slots, as the engine does;
        ``reported``: the allocator was told (else they are within the write limit)."""
        self.copy(result)
        table = self.alloc.block_table(seq)
        start = len(self.tokens[seq])
        for pos, token in enumerate(new_tokens, start):
            block = table[pos // BLOCK_SIZE]
            self.arena.setdefault(block, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = token
        self.tokens[seq].extend(new_tokens)
        if reported:
            self.reported[seq] = len(self.tokens[seq])

    def report(self, seq: str) -> None:
        """Tell the allocator the growth it was not told of (before a fork or a trim)."""
        assert self.alloc.allocate(seq, len(self.tokens[seq])) is NO_COPIES
        self.reported[seq] = len(self.tokens[seq])

    def allocate(self, seq: str, num_tokens: int) -> Allocation | None:
        """``allocate``, held to ``blocks_needed`` and ``can_allocate`` asked just before."""
        alloc = self.alloc
        need, can = alloc.blocks_needed(seq, num_tokens), alloc.can_allocate(seq, num_tokens)
        table = alloc.block_table(seq) if seq in self.tokens else None
        old = set(table or ())
        free, before = alloc.num_free_blocks(), self.snapshot()
        result = alloc.allocate(seq, num_tokens)
        assert (result is not None) == can, f"can_allocate said {can}, allocate gave {result}"
        if result is None:
            assert self.snapshot() == before, "a failed allocate changed state"
        else:
            assert free - alloc.num_free_blocks() == need, f"blocks_needed said {need}"
            new = set(alloc.block_table(seq)) - old  # a cached block taken was evicted
            self.index = {k: b for k, b in self.index.items() if b not in new}
        if table is not None:
            assert alloc.block_table(seq) is table, "block_table is not the live list"
        return result

    def grow(self, seq: str, new_tokens: list[int]) -> None:
        result = self.allocate(seq, len(self.tokens[seq]) + len(new_tokens))
        if result is not None:
            self.write(seq, result, new_tokens)

    def snapshot(self) -> tuple:
        tables = {s: list(self.alloc.block_table(s)) for s in self.tokens}
        return self.alloc.dump(), self.alloc.stats(), tables

    def pick(self, data: st.DataObject) -> str | None:
        """A live sequence, or ``None`` (the rule does nothing): a precondition instead
        would make hypothesis give up on many runs that free every sequence."""
        return data.draw(st.sampled_from(sorted(self.tokens))) if self.tokens else None

    def shared(self, seq: str, block: int) -> bool:
        """Whether another live sequence's table holds ``block`` too (its ref is > 1)."""
        return any(block in self.alloc.block_table(s) for s in self.tokens if s != seq)

    def expected_match(self, prompt: list[int]) -> int:
        """Tokens ``match_prefix`` shares: the longest indexed prefix of whole blocks that
        leaves the last token to compute."""
        full = 0
        while (full + 1) * BLOCK_SIZE < len(prompt) and tuple(
            prompt[: (full + 1) * BLOCK_SIZE]
        ) in self.index:
            full += 1
        return full * BLOCK_SIZE

    # -- rules ------------------------------------------------------------------------

    def begin(self, prompt: list[int], use_cache: bool) -> None:
        """A new sequence with this prompt, through the prefix cache or not."""
        seq = f"s{self.next_id}"
        self.next_id += 1
        if use_cache:
            # The forecast for a sequence not known yet, given the prompt: match + allocate.
            alloc = self.alloc
            need = alloc.blocks_needed(seq, len(prompt), prompt)
            can = alloc.can_allocate(seq, len(prompt), prompt)
            free = alloc.num_free_blocks()
            matched = alloc.match_prefix(seq, prompt)
            assert matched == (self.expected_match(prompt) if self.caches else 0)
            # The invariant then checks the shared blocks already hold the prompt's tokens.
            self.tokens[seq] = list(prompt[:matched])
            self.reported[seq] = matched
            result = self.allocate(seq, len(prompt))  # on failure seq keeps its matched prefix
            assert (result is not None) == can, f"can_allocate with token_ids said {can}"
            if result is not None:
                assert free - alloc.num_free_blocks() == need, f"blocks_needed said {need}"
                self.write(seq, result, prompt[matched:])
            return
        result = self.allocate(seq, len(prompt))
        if result is not None:
            self.tokens[seq] = []
            self.write(seq, result, prompt)

    @initialize(prompts=st.lists(TOKENS.filter(bool), min_size=1, max_size=3))
    def first_sequences(self, prompts: list[list[int]]) -> None:
        # Runs begin with live sequences: hypothesis often repeats one rule for a whole run,
        # which would do nothing on an empty allocator.
        for prompt in prompts:
            self.begin(prompt, use_cache=False)

    @precondition(lambda self: len(self.tokens) < 6)
    @rule(prompt=TOKENS.filter(bool), use_cache=st.booleans())
    def start(self, prompt: list[int], use_cache: bool) -> None:
        self.begin(prompt, use_cache)

    @precondition(lambda self: self.prompts and len(self.tokens) < 6)
    @rule(data=st.data(), suffix=TOKENS.filter(bool))
    def start_on_a_shared_prefix(self, data: st.DataObject, suffix: list[int]) -> None:
        """Like a system prompt: an earlier committed prompt plus new tokens, via the cache."""
        self.begin([*data.draw(st.sampled_from(self.prompts)), *suffix], use_cache=True)

    @rule(data=st.data(), new_tokens=TOKENS)
    def extend(self, data: st.DataObject, new_tokens: list[int]) -> None:
        seq = self.pick(data)
        if seq is not None:
            self.grow(seq, new_tokens)

    @rule(data=st.data(), new_tokens=TOKENS, commit=st.booleans())
    def extend_quietly(self, data: st.DataObject, new_tokens: list[int], commit: bool) -> None:
        """A running batch's decodes: tokens written up to the write limit, unreported;
        ``commit``: then all it wrote is committed (a block filled), which reports them."""
        seq = self.pick(data)
        if seq is not None:
            room = self.alloc.write_limit(seq) - len(self.tokens[seq])
            self.write(seq, NO_COPIES, new_tokens[: max(room, 0)], reported=False)
            if commit:
                self.commit_tokens(seq, self.tokens[seq])

    @rule(data=st.data(), grows=st.lists(TOKENS, min_size=1, max_size=5), new=TOKENS)
    def extend_many(self, data: st.DataObject, grows: list[list[int]], new: list[int]) -> None:
        """Several sequences grow in one ``allocate_many`` (a sequence may come twice, each
        time further; a new one, with ``new`` as its prompt, may come too), checked against
        the same requests one by one on a copy of the allocator, up to the first that
        cannot be met."""
        alloc, asked, requests = self.alloc, {}, []  # asked: the tokens each sequence asks for
        for tokens in grows:
            seq = self.pick(data)
            if seq is not None:
                asked[seq] = asked.get(seq, []) + tokens
                requests.append((seq, len(self.tokens[seq]) + len(asked[seq])))
        before = {seq: set(alloc.block_table(seq)) for seq in asked}
        if new and len(self.tokens) < 6:
            asked[seq := f"s{self.next_id}"] = new
            self.next_id += 1
            requests.insert(data.draw(st.integers(0, len(requests))), (seq, len(new)))
        twin = copy.deepcopy(alloc)
        expected = []  # one by one, up to and with the first that cannot be met
        for seq, num_tokens in requests:
            expected.append(twin.allocate(seq, num_tokens))
            if expected[-1] is None:
                break
        results = alloc.allocate_many(requests)
        assert results == expected, f"{requests}: {results}, one by one {expected}"
        assert [r is NO_COPIES for r in results] == [r is NO_COPIES for r in expected]
        assert (alloc.dump(), alloc.stats()) == (twin.dump(), twin.stats())
        assert alloc.cached_paths() == twin.cached_paths()
        grown = {}  # what each sequence holds now: the count of its last request that succeeded
        for (seq, num_tokens), result in zip(requests, results, strict=False):
            if result is not None:
                self.copy(result)
                grown[seq] = num_tokens
        for seq in before.keys() | grown.keys():
            assert alloc.block_table(seq) == twin.block_table(seq), seq
        for seq, num_tokens in grown.items():
            taken = set(alloc.block_table(seq)) - before.get(seq, set())  # cached ones evicted
            self.index = {k: b for k, b in self.index.items() if b not in taken}
            written = self.tokens.setdefault(seq, [])
            self.write(seq, NO_COPIES, asked[seq][: num_tokens - len(written)])

    def commit_tokens(self, seq: str, committed: list[int]) -> None:
        self.alloc.commit(seq, committed)
        self.reported[seq] = max(self.reported[seq], len(committed))  # reported by it
        if len(committed) >= BLOCK_SIZE and len(self.prompts) < 8:
            self.prompts.append(committed)
        if self.caches:  # index the full blocks, up to one whose tokens another block holds
            table = self.alloc.block_table(seq)
            for i in range(len(committed) // BLOCK_SIZE):
                block = self.index.setdefault(tuple(committed[: (i + 1) * BLOCK_SIZE]), table[i])
                if block != table[i]:
                    break

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        if seq is not None:
            written = self.tokens[seq]
            self.commit_tokens(seq, written[: data.draw(st.integers(0, len(written)))])

    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        if seq is None:
            return
        self.report(seq)
        written = self.tokens[seq]
        keep = data.draw(st.integers(0, len(written)))
        block = self.alloc.block_table(seq)[keep // BLOCK_SIZE] if keep % BLOCK_SIZE else None
        read_by_others = (
            block is not None
            and keep < len(written)
            and (self.shared(seq, block) or block in self.index.values())
        )
        if read_by_others:  # other holders, or later matches, would disagree on its fill
            before = self.snapshot()
            with pytest.raises(ValueError, match="trim"):
                self.alloc.trim(seq, keep)
            assert self.snapshot() == before, "a refused trim changed state"
            return
        self.alloc.trim(seq, keep)
        del written[keep:]
        self.reported[seq] = keep

    @rule(data=st.data(), new_tokens=TOKENS)
    def fork(self, data: st.DataObject, new_tokens: list[int]) -> None:
        """Fork, then the child writes on at once (parallel sampling) if it has new tokens."""
        parent, child = self.pick(data), f"s{self.next_id}"
        if parent is None or len(self.tokens) >= 6:
            return
        self.next_id += 1
        self.report(parent)
        before = self.snapshot()
        result = self.alloc.fork(parent, child)
        if result is None:
            assert not self.paged, "a paged fork needs no block"
            assert self.snapshot() == before, "a failed fork changed state"
            return
        self.copy(result)
        self.tokens[child] = list(self.tokens[parent])
        self.reported[child] = len(self.tokens[child])
        self.grow(child, new_tokens)

    def release(self, seq: str) -> None:
        reclaimable, free = self.alloc.reclaimable_blocks(seq), self.alloc.num_free_blocks()
        given_back = self.alloc.free(seq)
        assert given_back == reclaimable == self.alloc.num_free_blocks() - free
        del self.tokens[seq], self.reported[seq]

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        if seq is not None:
            self.release(seq)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A request completes as in the engine: everything written is committed, then freed
        (a prefix cache keeps the full blocks, to be matched or evicted)."""
        seq = self.pick(data)
        if seq is not None:
            self.commit_tokens(seq, self.tokens[seq])
            self.release(seq)

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        alloc = self.alloc
        alloc.check()
        stats = alloc.stats()
        assert stats.used_blocks + stats.free_blocks + stats.cached_blocks == stats.num_blocks
        assert stats.used_slots <= stats.reserved_slots
        fill: dict[int, int] = {}  # slots in use per block; a shared block counts once
        for seq, written in self.tokens.items():
            table, reported = alloc.block_table(seq), self.reported[seq]
            assert len(table) == blocks(len(written)) and alloc.num_tokens(seq) == reported
            assert reported <= len(written) <= alloc.write_limit(seq)
            read = [self.arena[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(len(written))]
            assert read == written, f"{seq} reads {read}, wrote {written}"
            for i, block in enumerate(table):  # the fill as reported: the allocator's count
                in_block = min(BLOCK_SIZE, reported - i * BLOCK_SIZE)
                fill[block] = max(fill.get(block, 0), in_block)
            held, in_table = alloc.held_slots(seq), len(table) * BLOCK_SIZE
            assert held == in_table if self.paged else held >= in_table  # regions: slack
        assert stats.used_slots == sum(fill.values()), f"used_slots {stats.used_slots} != {fill}"
        unheld = set(self.index.values()) - fill.keys()
        assert stats.cached_blocks == len(unheld), f"cached {stats.cached_blocks} != {unheld}"

    @invariant()
    def stats_count_the_tables(self) -> None:
        """``stats``' sequences, table entries and distinct blocks are the live tables'."""
        tables = self.alloc.block_tables(list(self.tokens))
        stats = self.alloc.stats()
        assert stats.num_seqs == len(tables), f"{stats.num_seqs} sequences, {len(tables)} live"
        assert stats.table_refs == sum(map(len, tables)), f"table entries {stats.table_refs}"
        assert stats.table_blocks == len(set().union(*tables)), f"blocks {stats.table_blocks}"

    @invariant()
    def placement_forecasts(self) -> None:
        """For a new sequence, a region fits iff some free block is not in a too-small run."""
        alloc = self.alloc
        assert not alloc.can_allocate("new", alloc.max_seq_tokens + 1)
        assert alloc.fragments_free_space is not self.paged  # regions leave unusable holes
        for n in range(1, alloc.num_blocks + 1):
            unusable = alloc.unusable_free_blocks(n * BLOCK_SIZE)
            if self.paged:
                assert unusable == 0
            else:
                assert 0 <= unusable <= alloc.num_free_blocks()
                fits = unusable < alloc.num_free_blocks()
                assert alloc.can_allocate("new", n * BLOCK_SIZE) == fits, f"{n} blocks"

    def teardown(self) -> None:
        for seq in list(self.tokens):
            self.alloc.free(seq)
        self.alloc.check()
        assert self.alloc.num_free_blocks() == self.alloc.num_blocks


def _machine(name: str, factory: Callable[[], BlockAllocator], examples: int) -> type:
    machine = type(
        f"{name}_machine",
        (AllocatorMachine,),
        {
            "make": staticmethod(factory),
            "paged": isinstance(factory(), FreeListAllocator),
            "caches": isinstance(factory(), RadixAllocator),
        },
    )
    machine.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    return machine.TestCase


TestFreeList = _machine(
    "free_list", lambda: FreeListAllocator(num_blocks=12, block_size=BLOCK_SIZE), 100
)
TestContiguous = _machine(
    "contiguous", lambda: ContiguousAllocator(num_blocks=16, block_size=BLOCK_SIZE), 100
)
TestContiguousMaxLen = _machine(
    "contiguous_max_len",
    lambda: ContiguousAllocator(num_blocks=16, block_size=BLOCK_SIZE, reserve="max_len", max_len=8),
    100,
)
TestBuddy = _machine("buddy", lambda: BuddyAllocator(num_blocks=24, block_size=BLOCK_SIZE), 100)


def _radix(eviction: str) -> Callable[[], BlockAllocator]:
    return lambda: RadixAllocator(num_blocks=8, block_size=BLOCK_SIZE, eviction=eviction)


# One machine per eviction policy (TestRadix_lru, TestRadix_lfu, ...): the policy decides
# which cached blocks survive, so each explores different sharing.
for _eviction in EVICTION:
    globals()[f"TestRadix_{_eviction}"] = _machine(f"radix_{_eviction}", _radix(_eviction), 60)
