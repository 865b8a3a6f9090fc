"""The block-allocator contract (version 5) and the bookkeeping every allocator shares.

An allocator hands out fixed-size KV blocks (``block_size`` token slots each) to
sequences, keyed by ``seq_id``. The base class owns everything that does not
depend on placement: per-sequence state (table, token count, write limit), input
validation, O(1) statistics, the invariant check and the block map. A subclass
decides only *which* blocks a sequence gets (placement), how many holders a block
has (paged: reference counts; a region's blocks are held once each) and what happens
to a block nobody holds any more (free list, cache, region merge).
docs/design.md states the contract; this docstring and that section move together.

Sized by use. Constructing an allocator of any ``num_blocks`` costs O(1) memory and
time: no structure has an entry per block until that block is first handed out (a
never-used block is free implicitly, past a high-water mark), so memory grows with
what the blocks in use need, not with the arena. ``check`` and ``dump`` stay O(arena).

The hot path. A decode grows a sequence by one token per step; ``allocate`` answers
that in O(1) from the sequence's *write limit* (the slots it can fill without a new
block or a copy) and returns the shared ``NO_COPIES`` constant, allocating nothing.
Growth within the write limit need not be reported at all (version 5): a caller that knows
a sequence's ``write_limit`` (a step's running batch) asks only when a row crosses it, and
the sequence's count stays the one last reported (``num_tokens``, ``holdings``, the tables'
token total in ``stats``), at most its write limit, until the next ``allocate`` reports it;
every block, fill and copy decision is the same either way, since the slots up to the write
limit are in blocks the sequence alone holds. ``commit`` reports the growth up to its tokens
(at most the write limit): a committed block may be shared from then on.
``block_table`` returns the live table, not a copy. ``stats`` reads counters kept up
to date by every call, the tables' entries and distinct blocks among them (a reader of a
step's sharing counts no table). ``allocate_many`` grows a step's running sequences in one call
(those crossing a block boundary take their blocks there), exactly as ``allocate`` one by
one would, up to the first request it cannot meet, which ends the call.

Questions a scheduler asks instead of doing block arithmetic itself (exact for
every allocator: region sizes, buddy rounding, copy-on-write, evictable cache)::

    blocks_needed(seq, n)     net blocks allocate(seq, n) would take from the free count
    can_allocate(seq, n)      whether it would succeed now (a region also needs a place)
    reclaimable_blocks(seq)   blocks free(seq) would give back (shared blocks stay held)
    free(seq) -> int          frees, and says how many blocks it gave back
    held_slots(seq)           slots of the blocks seq holds, region slack included

What the scheduler tells it: ``expect(seq, n)``, the slots a request will hold when it
finishes (prompt + output), for allocators that reserve ahead (contiguous ``oracle``);
the others ignore it.

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
from typing import NamedTuple

from allocators.stats import AllocatorStats
from allocators.tiers import TierMove


@dataclass(frozen=True, slots=True)
class Allocation:
    """The result of a successful ``allocate`` or ``fork``: ``(src_block, dst_block)``
    pairs whose KV the engine copies before it writes (relocation of a region,
    copy-on-write of a shared block). Read the table itself with ``block_table``."""

    copies: tuple[tuple[int, int], ...] = ()


NO_COPIES = Allocation()  # returned whenever nothing is copied: no object per call


class Holdings(NamedTuple):
    """A batch's memory as ``holdings`` reads it: per sequence, in order, its token slots
    allocated and the slots of the blocks it holds; one list each, so that a step's reader
    sums a column without a Python object per sequence. The recorder keeps ``held_slots``
    for up to 64 steps: an override builds fresh lists on every call, never one it changes
    later."""

    num_tokens: list[int]
    held_slots: list[int]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` slots."""
    return -(-num_tokens // block_size)


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class SeqState:
    """What an allocator keeps per sequence. ``limit`` is the slot count the sequence
    can grow to without a new block or a copy (its write limit): the fast path. ``refs``:
    the entries of ``table`` in the allocator's count (``BlockAllocator._changed``)."""

    __slots__ = ("table", "num_tokens", "limit", "refs")

    def __init__(self) -> None:
        self.table: list[int] = []
        self.num_tokens = 0
        self.limit = 0
        self.refs = 0


class BlockAllocator(ABC):
    """Hands out KV blocks to sequences; see the module docstring and docs/design.md.

    Constructed as ``Cls(num_blocks=..., block_size=..., **policy_options)``.
    Wrong input (unknown ``seq_id``, negative counts) raises ``ValueError``; lack of
    memory is a value (``allocate``/``fork`` return ``None`` and change nothing).
    """

    _State: type[SeqState] = SeqState
    # A capability of the contract: committed blocks outlive their sequences and later
    # prompts match them (``cached_paths`` snapshots them); False, nothing is cached.
    caches_prefixes: bool = False
    # Lower KV tiers under the prefix cache (kv_tier): then ``match_prefix`` has effects
    # (it loads a lower tier's hits into the arena, evicting to make room), so a caller
    # checks that a request fits before it looks its prefix up.
    has_lower_tiers: bool = False
    # Free blocks can be unusable (regions: a run or buddy too small for a request), so
    # ``unusable_free_blocks`` depends on who asks; False, it is 0 for anyone.
    fragments_free_space: bool = False

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = _check_count("num_blocks", num_blocks, 1)
        self.block_size = _check_count("block_size", block_size, 1)
        self.max_seq_tokens = num_blocks * block_size  # most one sequence can ever hold
        self._used = 0  # blocks with ref > 0
        self._seqs: dict[str, SeqState] = {}
        self._token_slots = 0  # sum of num_tokens over sequences
        self._shared_slots = 0  # slots counted twice or more in _token_slots (shared blocks)
        self._prefix_queries = self._prefix_query_tokens = self._prefix_hit_tokens = 0
        self._evictions = self._cow_copies = self._relocations = 0
        self._relocated_blocks = self._fork_copies = 0
        self._table_refs = 0  # entries of all tables (``_changed``)

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
        s = self._seqs.get(seq_id)
        if s is not None and s.table:
            raise ValueError(f"match_prefix: {seq_id!r} already holds blocks; free it first")
        self._prefix_queries += 1
        self._prefix_query_tokens += len(token_ids)
        if s is None:
            s = self._seqs[seq_id] = self._new_state(seq_id)
        matched = self._match(s, token_ids)
        self._changed(s)
        self._prefix_hit_tokens += matched
        self._token_slots += matched
        return matched

    def blocks_needed(self, seq_id: str, num_tokens: int, token_ids: Sequence[int] = ()) -> int:
        """Net blocks ``allocate(seq_id, num_tokens)`` would take from ``num_free_blocks()``.

        Exact: region sizes, copy-on-write and blocks a relocation gives back included.
        For a sequence not known yet, ``token_ids`` lets a prefix cache leave out the
        blocks ``match_prefix`` would share with running sequences.
        """
        _check_count("num_tokens", num_tokens, 0)
        s = self._seqs.get(seq_id)
        if s is None:
            return self._need_new(seq_id, num_tokens, token_ids)
        return self._need(s, num_tokens) if num_tokens > s.num_tokens else 0

    def can_allocate(self, seq_id: str, num_tokens: int, token_ids: Sequence[int] = ()) -> bool:
        """Whether ``allocate(seq_id, num_tokens)`` would succeed now (a region also needs a
        place to go); ``token_ids`` as in ``blocks_needed``."""
        _check_count("num_tokens", num_tokens, 0)
        s = self._seqs.get(seq_id)
        if s is None:
            return self._fits_new(seq_id, num_tokens, token_ids)
        return num_tokens <= s.limit or self._fits(s, num_tokens)

    def allocate(self, seq_id: str, num_tokens: int) -> Allocation | None:
        """Grow ``seq_id`` to ``num_tokens`` slots in all; ``None`` (nothing changed) if it
        cannot. ``num_tokens`` at or below the current count changes nothing. The slots
        ``[current, num_tokens)`` are about to be written, so a block covering them that is
        shared or cached is copied first (listed in the result's ``copies``).

        The O(1) path checks nothing but the write limit: it trusts ``num_tokens`` to be an
        int, as the scheduler's counts are (a wrong type is caught once it leaves the
        limit; checking it on every call cost 10-20 % of the growth path)."""
        s = self._seqs.get(seq_id)
        if s is not None and s.num_tokens <= num_tokens <= s.limit:
            self._token_slots += num_tokens - s.num_tokens
            s.num_tokens = num_tokens
            return NO_COPIES
        if type(num_tokens) is not int or num_tokens < 0:
            _check_count("num_tokens", num_tokens, 0)  # raises, naming the argument
        new = s is None
        if new:
            s = self._new_state(seq_id)
        elif num_tokens <= s.num_tokens:
            return NO_COPIES
        copies = self._grow(s, num_tokens)
        if copies is None:
            return None
        self._changed(s)
        if new:
            self._seqs[seq_id] = s
        self._token_slots += num_tokens - s.num_tokens
        s.num_tokens = num_tokens
        s.limit = len(s.table) * self.block_size  # the blocks written into are its own now
        return Allocation(tuple(copies)) if copies else NO_COPIES

    def allocate_many(self, requests: Sequence[tuple[str, int]]) -> list[Allocation | None]:
        """``allocate(seq_id, num_tokens)`` for each request, in order, in one call (a step's
        running sequences), up to the first that cannot be met. Results and state are
        exactly those of the calls one by one, stopping there: the list ends with that
        request's ``None`` (it changed nothing) and no later request is tried; blocks are
        handed out in the same order, and a wrong request raises after the ones before it
        took effect. This default loops; an allocator may take blocks in one go."""
        results: list[Allocation | None] = []
        allocate = self.allocate
        for seq_id, num_tokens in requests:
            results.append(got := allocate(seq_id, num_tokens))
            if got is None:
                break
        return results

    def commit(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """Record that the KV of these leading tokens is written (a cache may share it)."""
        s = self._seqs.get(seq_id) or self._state(seq_id)  # _state raises for an unknown id
        n = len(token_ids)
        if n > s.num_tokens:  # growth within the write limit, unreported: reported now
            if n > s.limit:
                raise ValueError(
                    f"commit: {n} tokens exceed the {s.limit} slots allocated to "
                    f"{seq_id!r}; allocate them first"
                )
            self._token_slots += n - s.num_tokens
            s.num_tokens = n
        self._commit(s, token_ids)

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Shrink ``seq_id`` to ``num_tokens`` slots (speculative-decoding rollback).

        The block the new end falls in must be the sequence's own: cutting into a block
        another sequence or a prefix cache reads raises (they would disagree on its fill; a
        rollback only ever trims slots past its committed tokens)."""
        _check_count("num_tokens", num_tokens, 0)
        s = self._state(seq_id)
        old, bs = s.num_tokens, self.block_size
        if num_tokens > old:
            raise ValueError(
                f"trim: {seq_id!r} holds {old} slots, cannot trim to {num_tokens}; "
                "use allocate to grow"
            )
        if num_tokens == old:
            return
        keep = blocks_for(num_tokens, bs)
        if num_tokens % bs and self._needs_copy(s.table[keep - 1]):
            raise ValueError(
                f"trim: {seq_id!r} to {num_tokens} slots cuts into block {s.table[keep - 1]}, "
                "which another sequence or the prefix cache reads; trim only slots past the "
                "committed tokens"
            )
        dropped = s.table[keep:]
        del s.table[keep:]
        self._changed(s)
        self._token_slots -= old - num_tokens
        s.num_tokens = num_tokens
        self._after_trim(s, dropped, old)
        s.limit = self._write_limit(s)

    def fork(self, parent_id: str, child_id: str) -> Allocation | None:
        """Give ``child_id`` the parent's tokens; ``None`` (nothing changed) if no room."""
        parent = self._state(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"fork: child {child_id!r} already exists; free it or pick a new id")
        child = self._new_state(child_id)
        child.num_tokens = parent.num_tokens
        copies = self._fork(parent, child)
        if copies is None:
            return None
        self._changed(child)
        self._seqs[child_id] = child
        self._token_slots += child.num_tokens
        parent.limit, child.limit = self._write_limit(parent), self._write_limit(child)
        return Allocation(tuple(copies)) if copies else NO_COPIES

    def expect(self, seq_id: str, num_tokens: int | None) -> None:  # noqa: B027 (optional)
        """``seq_id`` will hold ``num_tokens`` slots in all when it finishes (its prompt and
        output as far as the caller knows); ``None`` forgets it. The hint outlives ``free``
        (a preempted request comes back with it) until it is forgotten. An allocator that
        reserves ahead (contiguous ``reserve="oracle"``) sizes a new region of ``seq_id``
        to it; the others ignore it, as this default does."""

    def free(self, seq_id: str) -> int:
        """Release everything ``seq_id`` holds; returns the blocks this gave back to
        ``num_free_blocks()``. A sequence holding nothing is a no-op (0)."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return 0
        used = self._used
        self._token_slots -= s.num_tokens
        self._table_refs -= s.refs
        self._free_seq(s)
        return used - self._used

    def reclaimable_blocks(self, seq_id: str) -> int:
        """Blocks ``free(seq_id)`` would give back (0 for an unknown sequence)."""
        s = self._seqs.get(seq_id)
        return 0 if s is None else self._reclaimable(s)

    def drain_tier_moves(self) -> list[TierMove]:
        """The block moves between the arena and lower KV tiers (``allocators.tiers``) this
        allocator decided since the last call, in the order the engine must make them; the
        caller takes them over (empty without lower tiers)."""
        return []

    def lower_tier_hits(self, seq_id: str) -> tuple[int, int]:
        """Tokens of ``seq_id``'s last ``match_prefix`` loaded from the host tier and from the
        disk tier (part of what it returned; the rest was in the arena). (0, 0) without
        lower tiers."""
        return (0, 0)

    def cached_paths(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """Every root-to-leaf path of the prefix cache: the tokens it spells and its blocks,
        in token order (empty unless ``caches_prefixes``)."""
        return []

    def block_table(self, seq_id: str) -> list[int]:
        """``seq_id``'s live block table (logical block i -> physical block id).

        Not a copy: it changes as the sequence grows or moves, and callers must not
        modify it. Copy it to keep it across allocator calls."""
        return self._state(seq_id).table

    def num_tokens(self, seq_id: str) -> int:
        """Token slots allocated to ``seq_id``, as last reported (growth within its write
        limit may go unreported)."""
        return self._state(seq_id).num_tokens

    def write_limit(self, seq_id: str) -> int:
        """The slots ``seq_id`` can grow to without asking (its blocks alone hold them, so
        ``allocate`` up to there changes nothing else): a running batch asks only when a row
        crosses it."""
        return self._state(seq_id).limit

    def held_slots(self, seq_id: str) -> int:
        """Slots of the blocks ``seq_id`` holds, region slack included (contiguous
        ``max_len``, buddy rounding); shared blocks count for each holder."""
        return self._held_count(self._state(seq_id)) * self.block_size

    def block_tables(self, seq_ids: Iterable[str]) -> list[list[int]]:
        """``block_table`` of each sequence, in order, in one call: a step's batch."""
        return [s.table for s in self._states(seq_ids)]

    def holdings(self, seq_ids: Iterable[str]) -> Holdings:
        """``num_tokens`` and ``held_slots`` of each sequence, in order, in one call: a
        step's memory snapshot of its batch, as two columns."""
        bs = self.block_size
        states = self._states(seq_ids)
        if type(self)._held_count is BlockAllocator._held_count:  # it holds its table
            held = [len(s.table) * bs for s in states]
        else:
            count = self._held_count
            held = [count(s) * bs for s in states]
        return Holdings([s.num_tokens for s in states], held)

    def unusable_free_blocks(self, num_tokens: int, seq_id: str | None = None) -> int:
        """Free blocks that cannot serve a new sequence of ``num_tokens`` slots: those in
        runs or regions too small for its region (external fragmentation in the vLLM
        paper's sense); ``seq_id`` names it, so that its ``expect`` hint sizes the region.
        Paged allocators have none."""
        return 0

    def stats(self) -> AllocatorStats:
        """A snapshot of blocks, slots and counters, O(1)."""
        cached = self._num_cached_blocks()
        return AllocatorStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=self._used,
            free_blocks=self.num_blocks - self._used - cached,
            cached_blocks=cached,
            reserved_slots=self._used * self.block_size,
            used_slots=self._token_slots - self._shared_slots,
            shared_slots=self._shared_slots,
            prefix_queries=self._prefix_queries,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            evictions=self._evictions,
            cow_copies=self._cow_copies,
            relocations=self._relocations,
            relocated_blocks=self._relocated_blocks,
            fork_copies=self._fork_copies,
            num_seqs=len(self._seqs),
            table_refs=self._table_refs,
            table_blocks=self._table_blocks(),
        )

    def check(self) -> None:
        """Raise ``AssertionError`` if a bookkeeping invariant is broken (O(arena))."""
        held: Counter[int] = Counter()
        bs = self.block_size
        for seq_id, s in self._seqs.items():
            need = blocks_for(s.num_tokens, bs)
            assert len(s.table) == need, f"{seq_id}: {len(s.table)} blocks for {need} needed"
            assert s.num_tokens <= s.limit <= len(s.table) * bs, f"{seq_id}: limit {s.limit}"
            if s.limit > s.num_tokens:  # growing in place must not write shared/cached KV
                assert not self._needs_copy(s.table[-1]), f"{seq_id}: limit over a shared block"
            blocks = list(self._held_blocks(s))
            assert len(set(blocks)) == len(blocks), f"{seq_id} holds a block twice: {blocks}"
            held.update(blocks)
        refs = self._ref_counts()
        for block in refs.keys() | held.keys():
            ref = refs[block]
            assert ref == held[block], f"block {block}: ref {ref}, held by {held[block]}"
        assert self._used == len(held), f"used count {self._used} != {len(held)} held blocks"
        free, cached = self._free_blocks(), self._cached_blocks()
        assert not free & cached, f"blocks both free and cached: {sorted(free & cached)}"
        assert not held.keys() & (free | cached), "a held block is also free or cached"
        assert len(free) + len(cached) + len(held) == self.num_blocks, "blocks lost or duplicated"
        assert self.num_free_blocks() == len(free) + len(cached), "num_free_blocks() is off"
        assert self._num_cached_blocks() == len(cached), "cached count is off"
        assert self._token_slots == sum(s.num_tokens for s in self._seqs.values())
        tables = [s.table for s in self._seqs.values()]
        assert self._table_refs == sum(map(len, tables)), "table entries count is off"
        assert self._table_blocks() == len(set().union(*tables)), "distinct table blocks off"
        fill = self._fill()
        assert self._token_slots - self._shared_slots == sum(fill.values()), "used slots off"
        for seq_id, s in self._seqs.items():
            assert self._reclaimable(s) <= self._held_count(s), f"{seq_id}: reclaimable"
        self._check_placement()

    def dump(self) -> str:
        """A block map, 64 blocks a line, in the symbols of the module docstring."""
        in_table = Counter(b for s in self._seqs.values() for b in s.table)
        cached, refs = self._cached_blocks(), self._ref_counts()

        def symbol(block: int) -> str:
            if refs[block] == 0:
                return "c" if block in cached else "."
            if block not in in_table:
                return "r"
            return "S" if refs[block] > 1 else "X"

        cells = "".join(symbol(b) for b in range(self.num_blocks))
        s = self.stats()
        header = (
            f"{type(self).__name__}: {s.used_blocks} used, {s.free_blocks} free, "
            f"{s.cached_blocks} cached of {s.num_blocks} blocks x {s.block_size} slots"
        )
        return "\n".join([header, *(cells[i : i + 64] for i in range(0, len(cells), 64))])

    # -- helpers for subclasses ------------------------------------------------------

    def _state(self, seq_id: str) -> SeqState:
        s = self._seqs.get(seq_id)
        if s is None:
            raise self._unknown(seq_id)
        return s

    def _states(self, seq_ids: Iterable[str]) -> list[SeqState]:
        try:
            return list(map(self._seqs.__getitem__, seq_ids))
        except KeyError as unknown:
            raise self._unknown(unknown.args[0]) from None

    @staticmethod
    def _unknown(seq_id: str) -> ValueError:
        return ValueError(f"unknown seq_id {seq_id!r}: allocate or match_prefix it first")

    def _write_limit(self, s: SeqState) -> int:
        """Slots ``s`` can grow to in place: to the end of its last block, unless that
        block is partly written and someone else reads it (then any write copies)."""
        if s.num_tokens % self.block_size and self._needs_copy(s.table[-1]):
            return s.num_tokens
        return len(s.table) * self.block_size

    def _fill(self) -> dict[int, int]:
        """Slots in use per held block, each block at its fullest holder (for ``check``)."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for s in self._seqs.values():
            for i, block in enumerate(s.table):
                fill[block] = max(fill.get(block, 0), min(bs, s.num_tokens - i * bs))
        return fill

    # -- placement hooks -------------------------------------------------------------

    def _match(self, s: SeqState, token_ids: Sequence[int]) -> int:
        """Put cached prefix blocks into the (empty) table; return tokens matched."""
        return 0

    @abstractmethod
    def _grow(self, s: SeqState, new: int) -> list | None:
        """Make ``s.table`` cover ``new`` slots (``s.num_tokens`` is still the old count);
        return the copies, or ``None`` without changing anything."""

    @abstractmethod
    def _need(self, s: SeqState, new: int) -> int:
        """``blocks_needed`` for a known sequence growing past its count."""

    @abstractmethod
    def _fits(self, s: SeqState, new: int) -> bool:
        """``can_allocate`` for a known sequence growing past its write limit."""

    def _changed(self, s: SeqState) -> None:
        """``s``'s table changed, or may have: the tables' entries count it anew (called
        after each change; ``free`` takes a sequence's out)."""
        n = len(s.table)
        self._table_refs += n - s.refs
        s.refs = n

    def _table_blocks(self) -> int:
        """The distinct blocks the tables point at: the held ones, for an allocator whose
        every held block is in a table (paged: its reference counts are its table entries)."""
        return self._used

    def _new_state(self, seq_id: str | None) -> SeqState:
        """The state of a sequence not known yet (``None``: one without an id)."""
        return self._State()

    def _need_new(self, seq_id: str, num_tokens: int, token_ids: Sequence[int]) -> int:
        """``blocks_needed`` for a sequence that holds nothing."""
        return self._need(self._new_state(seq_id), num_tokens)

    def _fits_new(self, seq_id: str, num_tokens: int, token_ids: Sequence[int]) -> bool:
        """``can_allocate`` for a sequence that holds nothing."""
        return self._fits(self._new_state(seq_id), num_tokens)

    def _commit(self, s: SeqState, token_ids: Sequence[int]) -> None:  # noqa: B027 (optional hook)
        """Prefix caches index the newly full blocks; others need nothing."""

    @abstractmethod
    def _after_trim(self, s: SeqState, dropped: list[int], old: int) -> None:
        """The table lost ``dropped`` (it covered ``old`` slots); release or keep them."""

    @abstractmethod
    def _fork(self, parent: SeqState, child: SeqState) -> list | None:
        """Fill the child's table; return the copies, or ``None`` changing nothing."""

    @abstractmethod
    def _free_seq(self, s: SeqState) -> None:
        """Drop every reference ``s`` holds."""

    @abstractmethod
    def _reclaimable(self, s: SeqState) -> int:
        """Blocks freeing ``s`` would give back."""

    @abstractmethod
    def _free_blocks(self) -> set[int]:
        """The free blocks (for check and dump; may be O(num_blocks))."""

    @abstractmethod
    def _needs_copy(self, block: int) -> bool:
        """Whether writing into ``block`` would change KV someone else reads."""

    @abstractmethod
    def _ref_counts(self) -> Counter[int]:
        """Each held block's holders (for check and dump; may be O(num_blocks))."""

    def _held_blocks(self, s: SeqState) -> Iterable[int]:
        """The blocks ``s`` holds a reference on: its table unless it owns a region."""
        return s.table

    def _held_count(self, s: SeqState) -> int:
        return len(s.table)

    def _cached_blocks(self) -> set[int]:
        return set()

    def _num_cached_blocks(self) -> int:
        return 0

    def _check_placement(self) -> None:  # noqa: B027 (optional hook)
        """Allocator-specific invariants (contiguity, alignment, tree shape)."""
