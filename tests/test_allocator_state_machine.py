"""Random operation sequences against every allocator, checked against a model.

The model plays the engine: it keeps a simulated KV arena (the token each block
slot holds), applies every ``copies`` list before writing the new slots, and after
each step asserts that every live sequence reads its own tokens back through its
block table. That catches a shared block written without copy-on-write, a cached
block evicted while in use, or a relocation that forgot a block; ``check()`` runs
after every step too.
"""

from __future__ import annotations

from collections.abc import Callable

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from allocators.base import Allocation, BlockAllocator
from allocators.buddy import BuddyAllocator
from allocators.contiguous import ContiguousAllocator
from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator

BLOCK_SIZE = 2
# A two-letter alphabet and tiny blocks make shared prefixes (and radix hits) common.
TOKENS = st.lists(st.integers(0, 1), max_size=12)


class AllocatorMachine(RuleBasedStateMachine):
    """Drives one allocator; subclasses choose which through ``make``."""

    @staticmethod
    def make() -> BlockAllocator:
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self.alloc = self.make()
        self.tokens: dict[str, list[int]] = {}  # what each live sequence has written
        self.arena: dict[int, list[int | None]] = {}
        self.next_id = 0

    # -- the engine's side ------------------------------------------------------------

    def copy(self, result: Allocation) -> None:
        """Copy blocks as one gather: every source is read before any destination is written."""
        empty = [None] * BLOCK_SIZE
        sources = {src: list(self.arena.get(src, empty)) for src, _ in result.copies}
        for src, dst in result.copies:
            self.arena[dst] = list(sources[src])

    def write(self, seq: str, result: Allocation, new_tokens: list[int]) -> None:
        """Apply the copies, then write the new tokens into their slots, as the engine does."""
        self.copy(result)
        start = len(self.tokens[seq])
        for pos, token in enumerate(new_tokens, start):
            block = result.block_table[pos // BLOCK_SIZE]
            self.arena.setdefault(block, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = token
        self.tokens[seq].extend(new_tokens)

    def grow(self, seq: str, new_tokens: list[int]) -> None:
        before = self.snapshot()
        result = self.alloc.allocate(seq, len(self.tokens[seq]) + len(new_tokens))
        if result is None:
            assert self.snapshot() == before, "a failed allocate changed state"
            return
        self.write(seq, result, new_tokens)

    def snapshot(self) -> tuple:
        tables = {s: self.alloc.block_table(s) for s in self.tokens}
        return self.alloc.dump(), self.alloc.stats(), tables

    def pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    # -- rules ------------------------------------------------------------------------

    @precondition(lambda self: len(self.tokens) < 6)
    @rule(prompt=TOKENS.filter(bool), use_cache=st.booleans())
    def start(self, prompt: list[int], use_cache: bool) -> None:
        seq = f"s{self.next_id}"
        self.next_id += 1
        if use_cache:
            matched = self.alloc.match_prefix(seq, prompt)
            assert matched % BLOCK_SIZE == 0 and matched < len(prompt)
            # The invariant then checks the shared blocks already hold the prompt's tokens.
            self.tokens[seq] = list(prompt[:matched])
            self.grow(seq, prompt[matched:])  # on failure seq keeps its matched prefix
            return
        before = self.snapshot()
        result = self.alloc.allocate(seq, len(prompt))
        if result is None:
            assert self.snapshot() == before, "a failed allocate changed state"
            return
        self.tokens[seq] = []
        self.write(seq, result, prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=TOKENS)
    def extend(self, data: st.DataObject, new_tokens: list[int]) -> None:
        self.grow(self.pick(data), new_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        written = self.tokens[seq]
        self.alloc.commit(seq, written[: data.draw(st.integers(0, len(written)))])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        keep = data.draw(st.integers(0, len(self.tokens[seq])))
        self.alloc.trim(seq, keep)
        del self.tokens[seq][keep:]

    @precondition(lambda self: self.tokens and len(self.tokens) < 6)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent, child = self.pick(data), f"s{self.next_id}"
        self.next_id += 1
        before = self.snapshot()
        result = self.alloc.fork(parent, child)
        if result is None:
            assert self.snapshot() == before, "a failed fork changed state"
            return
        self.copy(result)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        self.alloc.free(seq)
        del self.tokens[seq]

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.alloc.check()
        stats = self.alloc.stats()
        assert stats.used_blocks + stats.free_blocks + stats.cached_blocks == stats.num_blocks
        assert stats.used_slots <= stats.reserved_slots
        for seq, written in self.tokens.items():
            table = self.alloc.block_table(seq)
            assert len(table) == -(-len(written) // BLOCK_SIZE)
            read = [self.arena[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(len(written))]
            assert read == written, f"{seq} reads {read}, wrote {written}"

    def teardown(self) -> None:
        for seq in list(self.tokens):
            self.alloc.free(seq)
        self.alloc.check()
        assert self.alloc.num_free_blocks() == self.alloc.num_blocks


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _machine(factory: Callable[[], BlockAllocator]) -> type:
    machine = type(
        f"{factory.__name__}_machine", (AllocatorMachine,), {"make": staticmethod(factory)}
    )
    machine.TestCase.settings = SETTINGS
    return machine.TestCase


def free_list() -> BlockAllocator:
    return FreeListAllocator(num_blocks=12, block_size=BLOCK_SIZE)


def radix() -> BlockAllocator:
    return RadixAllocator(num_blocks=12, block_size=BLOCK_SIZE)


def contiguous() -> BlockAllocator:
    return ContiguousAllocator(num_blocks=16, block_size=BLOCK_SIZE)


def contiguous_max_len() -> BlockAllocator:
    return ContiguousAllocator(num_blocks=16, block_size=BLOCK_SIZE, reserve="max_len", max_len=8)


def buddy() -> BlockAllocator:
    return BuddyAllocator(num_blocks=24, block_size=BLOCK_SIZE)


TestFreeList = _machine(free_list)
TestRadix = _machine(radix)
TestContiguous = _machine(contiguous)
TestContiguousMaxLen = _machine(contiguous_max_len)
TestBuddy = _machine(buddy)
