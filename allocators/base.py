"""The block-allocator contract and the bookkeeping every allocator shares.

An allocator hands out fixed-size KV blocks (``block_size`` token slots each) to
sequences, keyed by ``seq_id``. The base class owns everything that does not
depend on placement: per-block reference counts, per-sequence block tables and
token counts, input validation, statistics, the invariant check and the block
map. A subclass decides only *which* blocks a sequence gets (placement) and what
happens to a block nobody holds any more (free list, cache, region merge).

Block states, as ``dump()`` draws them::

    X  held, in exactly one block table        .  free
    S  held, shared by several tables (fork,   c  unreferenced but cached
       prefix match): copied before a write       (radix, evictable)
    r  held by a region beyond its table (contiguous ``max_len``, buddy)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    """The result of a successful ``allocate`` or ``fork``.

    ``block_table`` is the sequence's whole table after the call. ``copies`` lists
    ``(src_block, dst_block)`` pairs whose KV the engine must copy before it writes
    (relocation of a contiguous run, copy-on-write of a shared block).
    """

    block_table: tuple[int, ...]
    copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of an allocator's memory and counters.

    Blocks: ``used_blocks`` are held by some sequence (in a table, or reserved by
    a region), ``cached_blocks`` are unreferenced but kept by a prefix cache and
    evictable, ``free_blocks`` are the rest; the three sum to ``num_blocks``.
    Slots: ``reserved_slots`` = ``used_blocks * block_size``; ``used_slots`` counts
    the slots sequences asked for, a shared block counted once (at the fill of its
    fullest holder). Counters (``prefix_*``, ``evictions``, ``cow_copies``,
    ``relocations``, ``relocated_blocks``, ``fork_copies``) are cumulative.
    """

    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    reserved_slots: int
    used_slots: int
    external_fragmentation: float
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    cow_copies: int
    relocations: int
    relocated_blocks: int
    fork_copies: int

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens over queried tokens (0.0 before any query)."""
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

    @property
    def utilisation(self) -> float:
        """Used over reserved token slots (0.0 when nothing is reserved)."""
        return self.used_slots / self.reserved_slots if self.reserved_slots else 0.0


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` slots."""
    return -(-num_tokens // block_size)


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class BlockAllocator(ABC):
    """Hands out KV blocks to sequences; see the module docstring and DESIGN.md.

    Constructed as ``Cls(num_blocks=..., block_size=..., **policy_options)``.
    Wrong input (unknown ``seq_id``, negative counts) raises ``ValueError``; lack of
    memory is a value (``allocate``/``fork`` return ``None`` and change nothing).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = _check_count("num_blocks", num_blocks, 1)
        self.block_size = _check_count("block_size", block_size, 1)
        self._ref = [0] * num_blocks
        self._used = 0  # blocks with ref > 0, kept so num_free_blocks() is O(1)
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}
        self._prefix_queries = self._prefix_query_tokens = self._prefix_hit_tokens = 0
        self._evictions = self._cow_copies = self._relocations = 0
        self._relocated_blocks = self._fork_copies = 0

    # -- the contract ----------------------------------------------------------------

    def num_free_blocks(self) -> int:
        """Blocks an ``allocate`` could still take, evictable cached blocks included."""
        return self.num_blocks - self._used

    def match_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Share the cached KV of a prefix of ``token_ids`` with ``seq_id``.

        Returns how many leading tokens are now in ``seq_id``'s table (0 without a
        prefix cache); never all of them, so the engine computes the last token's
        logits. ``seq_id`` must hold nothing yet.
        """
        if self._tables.get(seq_id):
            raise ValueError(f"match_prefix: {seq_id!r} already holds blocks; free it first")
        self._prefix_queries += 1
        self._prefix_query_tokens += len(token_ids)
        self._tables.setdefault(seq_id, [])
        self._num_tokens.setdefault(seq_id, 0)
        matched = self._match(seq_id, token_ids)
        self._prefix_hit_tokens += matched
        return matched

    def allocate(self, seq_id: str, num_tokens: int) -> Allocation | None:
        """Grow ``seq_id``'s table to ``num_tokens`` slots in all; ``None`` if it cannot.

        All or nothing. ``num_tokens`` at or below the current count returns the
        current table. The slots ``[current, num_tokens)`` are about to be written,
        so a block covering them that is shared or cached is copied first.
        """
        _check_count("num_tokens", num_tokens, 0)
        table = self._tables.get(seq_id)
        current = self._num_tokens.get(seq_id, 0)
        if table is not None and num_tokens <= current:
            return Allocation(tuple(table))
        copies = self._grow(seq_id, table or [], current, num_tokens)
        if copies is None:
            return None
        self._num_tokens[seq_id] = num_tokens
        return Allocation(tuple(self._tables[seq_id]), tuple(copies))

    def commit(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """Record that the KV of these leading tokens is written (a cache may share it)."""
        if len(token_ids) > self._tokens_of(seq_id):
            raise ValueError(
                f"commit: {len(token_ids)} tokens exceed the {self._num_tokens[seq_id]} "
                f"slots allocated to {seq_id!r}; allocate them first"
            )
        self._commit(seq_id, token_ids)

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Shrink ``seq_id`` to ``num_tokens`` slots (speculative-decoding rollback)."""
        _check_count("num_tokens", num_tokens, 0)
        if num_tokens > self._tokens_of(seq_id):
            raise ValueError(
                f"trim: {seq_id!r} holds {self._num_tokens[seq_id]} slots, cannot trim to "
                f"{num_tokens}; use allocate to grow"
            )
        table = self._tables[seq_id]
        keep = blocks_for(num_tokens, self.block_size)
        dropped = table[keep:]
        del table[keep:]
        self._num_tokens[seq_id] = num_tokens
        self._after_trim(seq_id, dropped)

    def fork(self, parent_id: str, child_id: str) -> Allocation | None:
        """Give ``child_id`` the parent's tokens; ``None`` (nothing changed) if no room."""
        self._tokens_of(parent_id)
        if child_id in self._tables:
            raise ValueError(f"fork: child {child_id!r} already exists; free it or pick a new id")
        copies = self._fork(parent_id, child_id)
        if copies is None:
            return None
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        return Allocation(tuple(self._tables[child_id]), tuple(copies))

    def free(self, seq_id: str) -> None:
        """Release everything ``seq_id`` holds; a sequence holding nothing is a no-op."""
        if seq_id in self._tables:
            self._free_seq(seq_id)
            del self._tables[seq_id], self._num_tokens[seq_id]

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of ``seq_id``'s block table (logical block i -> physical block id)."""
        self._tokens_of(seq_id)
        return list(self._tables[seq_id])

    def stats(self) -> AllocatorStats:
        """A snapshot of blocks, slots and counters; O(total table length)."""
        cached = self._num_cached()
        return AllocatorStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=self._used,
            free_blocks=self.num_blocks - self._used - cached,
            cached_blocks=cached,
            reserved_slots=self._used * self.block_size,
            used_slots=self._used_slots(),
            external_fragmentation=self._external_fragmentation(),
            prefix_queries=self._prefix_queries,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            evictions=self._evictions,
            cow_copies=self._cow_copies,
            relocations=self._relocations,
            relocated_blocks=self._relocated_blocks,
            fork_copies=self._fork_copies,
        )

    def check(self) -> None:
        """Raise ``AssertionError`` if a bookkeeping invariant is broken."""
        assert self._tables.keys() == self._num_tokens.keys(), "tables and token counts disagree"
        held: Counter[int] = Counter()
        for seq_id, table in self._tables.items():
            need = blocks_for(self._num_tokens[seq_id], self.block_size)
            assert len(table) == need, f"{seq_id}: {len(table)} blocks for {need} needed"
            blocks = list(self._held_blocks(seq_id))
            assert len(set(blocks)) == len(blocks), f"{seq_id} holds a block twice: {blocks}"
            held.update(blocks)
        for block, ref in enumerate(self._ref):
            assert ref == held[block], f"block {block}: ref {ref}, held by {held[block]}"
        assert self._used == len(held), f"used count {self._used} != {len(held)} held blocks"
        free, cached = self._free_blocks(), self._cached_blocks()
        assert not free & cached, f"blocks both free and cached: {sorted(free & cached)}"
        assert not held.keys() & (free | cached), "a held block is also free or cached"
        assert len(free) + len(cached) + len(held) == self.num_blocks, "blocks lost or duplicated"
        assert self.num_free_blocks() == len(free) + len(cached), "num_free_blocks() is off"
        self._check_placement()

    def dump(self) -> str:
        """A block map, 64 blocks a line, in the symbols of the module docstring."""
        in_table = Counter(b for table in self._tables.values() for b in table)
        cached = self._cached_blocks()

        def symbol(block: int) -> str:
            if self._ref[block] == 0:
                return "c" if block in cached else "."
            if block not in in_table:
                return "r"
            return "S" if self._ref[block] > 1 else "X"

        cells = "".join(symbol(b) for b in range(self.num_blocks))
        s = self.stats()
        header = (
            f"{type(self).__name__}: {s.used_blocks} used, {s.free_blocks} free, "
            f"{s.cached_blocks} cached of {s.num_blocks} blocks x {s.block_size} slots, "
            f"fragmentation {s.external_fragmentation:.2f}"
        )
        return "\n".join([header, *(cells[i : i + 64] for i in range(0, len(cells), 64))])

    # -- helpers for subclasses ------------------------------------------------------

    def _tokens_of(self, seq_id: str) -> int:
        if seq_id not in self._num_tokens:
            raise ValueError(f"unknown seq_id {seq_id!r}: allocate or match_prefix it first")
        return self._num_tokens[seq_id]

    def _hold(self, block: int) -> None:
        if self._ref[block] == 0:
            self._used += 1
        self._ref[block] += 1

    def _drop(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._used -= 1
            self._on_unreferenced(block)

    def _used_slots(self) -> int:
        # Without shared blocks every slot belongs to one table: skip the per-block walk,
        # which the engine would otherwise pay on every step it records.
        if max(self._ref, default=0) <= 1:
            return sum(self._num_tokens.values())
        return sum(self._fill().values())

    def _fill(self) -> dict[int, int]:
        """Slots in use per held block, each block at its fullest holder."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for seq_id, table in self._tables.items():
            n = self._num_tokens[seq_id]
            for i, block in enumerate(table):
                fill[block] = max(fill.get(block, 0), min(bs, n - i * bs))
        return fill

    # -- placement hooks -------------------------------------------------------------

    def _match(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Put cached prefix blocks into the (empty) table; return tokens matched."""
        return 0

    @abstractmethod
    def _grow(self, seq_id: str, table: list[int], old: int, new: int) -> list | None:
        """Make ``self._tables[seq_id]`` hold ``new`` slots; return the copies, or
        ``None`` without changing anything. ``table`` is the current table."""

    def _commit(self, seq_id: str, token_ids: Sequence[int]) -> None:  # noqa: B027 (optional hook)
        """Prefix caches index the newly full blocks; others need nothing."""

    @abstractmethod
    def _after_trim(self, seq_id: str, dropped: list[int]) -> None:
        """The table lost ``dropped``; release or keep them reserved."""

    @abstractmethod
    def _fork(self, parent_id: str, child_id: str) -> list | None:
        """Create the child's table; return the copies, or ``None`` changing nothing."""

    @abstractmethod
    def _free_seq(self, seq_id: str) -> None:
        """Drop every reference ``seq_id`` holds."""

    @abstractmethod
    def _on_unreferenced(self, block: int) -> None:
        """``block``'s last reference went: free it or keep it cached."""

    @abstractmethod
    def _free_blocks(self) -> set[int]:
        """The free blocks (for check and dump; may be O(num_blocks))."""

    def _held_blocks(self, seq_id: str) -> Iterable[int]:
        """The blocks ``seq_id`` holds a reference on: its table unless it owns a region."""
        return self._tables[seq_id]

    def _cached_blocks(self) -> set[int]:
        return set()

    def _num_cached(self) -> int:
        return 0

    def _external_fragmentation(self) -> float:
        return 0.0

    def _check_placement(self) -> None:  # noqa: B027 (optional hook)
        """Allocator-specific invariants (contiguity, alignment, tree shape)."""
