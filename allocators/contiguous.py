"""Contiguous allocation: each sequence owns one run of consecutive blocks.

The engine can then read a sequence's KV as one slice instead of a gather. The
price is external fragmentation: free blocks scattered in runs too short to use.
``RegionAllocator`` holds what contiguous and buddy placement share (regions,
growth in place or by relocation, forks by copy); ``ContiguousAllocator`` places
regions first fit, as CortexStream's linear scan does. Its free map covers the blocks up to
the highest one ever placed; every block past it is free, so the map grows with use::

    XXXXrr....XXX.....   seq a: table 0-3, reserved 4-5 (max_len, oracle); seq b: 10-12
    grow b by 3 -> 13-15 are free: in place.  grow a by 3 -> relocate to the first
    free run of 9 blocks or fail; copies ((0, dst), (1, dst + 1), ...).
"""

from __future__ import annotations

from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable
from typing import Literal

from allocators.base import BlockAllocator, SeqState, blocks_for


class RegionState(SeqState):
    """A sequence's table is the start of its region ``[start, start + size)``; ``floor`` is
    the fewest blocks its region holds once it holds any (a reservation ahead)."""

    __slots__ = ("start", "size", "floor")

    def __init__(self) -> None:
        super().__init__()
        self.start = self.size = self.floor = 0


class RegionAllocator(BlockAllocator):
    """A sequence's table is the start of a region of consecutive blocks it holds.

    Every block of a region is held once, table or not (a fork copies, so no reference
    counts are kept: the regions are the holders). The region's size
    is always ``_region_size(state, len(table))``; growing past it extends the region in
    place when possible, else moves the written blocks to a new, disjoint region
    and reports them as copies. Subclasses place and release regions.
    """

    _State = RegionState
    fragments_free_space = True

    # -- placement, written by subclasses ----------------------------------------------

    def _region_size(self, s: RegionState, table_blocks: int) -> int:
        """Blocks to reserve for ``s`` with a table of ``table_blocks`` blocks (0: no region)."""
        return max(table_blocks, s.floor) if table_blocks else 0

    @abstractmethod
    def _can_place(self, size: int) -> bool:
        """Whether a free region of ``size`` blocks exists."""

    @abstractmethod
    def _place(self, size: int) -> int | None:
        """Reserve a free region of ``size`` blocks and return its start, or ``None``."""

    def _can_move(self, start: int, size: int, new_size: int) -> bool:
        """Whether the region could move to a new one of ``new_size`` blocks."""
        return self._can_place(new_size)

    def _move(self, start: int, size: int, new_size: int) -> int | None:
        """Reserve the blocks of a new region of ``new_size`` for the region at ``start`` and
        return its start, or ``None``. It may overlap the old region where the placement
        allows (the caller releases the old blocks outside it); by default it is disjoint."""
        return self._place(new_size)

    @abstractmethod
    def _can_extend(self, start: int, size: int, new_size: int) -> bool:
        """Whether the blocks after a region are free so it could become ``new_size`` long."""

    @abstractmethod
    def _extend(self, start: int, size: int, new_size: int) -> None:
        """Reserve the blocks after a region (``_can_extend`` said yes)."""

    @abstractmethod
    def _give_back(self, start: int, size: int) -> None:
        """Return blocks that nobody holds any more to the free structures."""

    def _shrink(self, start: int, size: int, new_size: int) -> None:
        self._release(start + new_size, size - new_size)

    # -- shared mechanics --------------------------------------------------------------

    def _hold_run(self, start: int, size: int) -> None:
        self._used += size

    def _release(self, start: int, size: int) -> None:
        if size:
            self._used -= size
            self._give_back(start, size)

    def _need(self, s: RegionState, new: int) -> int:
        return max(0, self._region_size(s, blocks_for(new, self.block_size)) - s.size)

    def _fits(self, s: RegionState, new: int) -> bool:
        new_size = self._region_size(s, blocks_for(new, self.block_size))
        return (
            new_size <= s.size
            or (s.size and self._can_extend(s.start, s.size, new_size))
            or self._can_move(s.start, s.size, new_size)
        )

    def _grow(self, s: RegionState, new: int) -> list | None:
        need = blocks_for(new, self.block_size)
        table = s.table
        new_size = self._region_size(s, need)
        if new_size <= s.size:
            table.extend(range(s.start + len(table), s.start + need))
            return []
        if s.size and self._can_extend(s.start, s.size, new_size):
            self._extend(s.start, s.size, new_size)
            self._hold_run(s.start + s.size, new_size - s.size)
            s.size = new_size
            table.extend(range(s.start + len(table), s.start + need))
            return []
        dst = self._move(s.start, s.size, new_size)
        if dst is None:
            return None
        # The engine reads every source before it writes (one gather, one scatter), so the
        # new region may overlap the old one. It never starts where the old one did (that
        # would have been growth in place), so every block of the run moves.
        copies = tuple(zip(table, range(dst, dst + len(table)), strict=True))
        old, moved = (s.start, s.start + s.size), (dst, dst + new_size)
        overlap = dst < old[1] and old[0] < moved[1]
        for lo, hi in _minus(moved, old) if overlap else (moved,):
            self._hold_run(lo, hi - lo)
        s.start, s.size = dst, new_size
        table[:] = range(dst, dst + need)
        for lo, hi in _minus(old, moved) if overlap else (old,):
            self._release(lo, hi - lo)
        if copies:
            self._relocations += 1
            self._relocated_blocks += len(copies)
        return copies

    def _after_trim(self, s: RegionState, dropped: list[int], old: int) -> None:
        new_size = self._region_size(s, len(s.table))
        if new_size < s.size:
            self._shrink(s.start, s.size, new_size)
            s.size = new_size
            if not new_size:
                s.start = 0

    def _fork(self, parent: RegionState, child: RegionState) -> list | None:
        n = len(parent.table)
        size = self._region_size(child, n)
        dst = self._place(size) if size else 0
        if dst is None:
            return None
        self._hold_run(dst, size)
        child.start, child.size = dst, size
        child.table = list(range(dst, dst + n))
        self._fork_copies += n
        return list(zip(parent.table, child.table, strict=True))

    def _free_seq(self, s: RegionState) -> None:
        self._release(s.start, s.size)

    def _reclaimable(self, s: RegionState) -> int:
        return s.size

    def _held_blocks(self, s: RegionState) -> Iterable[int]:
        return range(s.start, s.start + s.size)

    def _held_count(self, s: RegionState) -> int:
        return s.size

    def _needs_copy(self, block: int) -> bool:
        return False  # regions are never shared: a fork copies

    def _table_blocks(self) -> int:
        return self._table_refs  # no two tables share a block; a region's slack is in none

    def _ref_counts(self) -> Counter[int]:
        return Counter(b for s in self._seqs.values() for b in self._held_blocks(s))

    def _region_blocks(self, num_tokens: int, seq_id: str | None) -> int:
        """The region a new sequence ``seq_id`` of ``num_tokens`` slots would reserve."""
        return self._region_size(self._new_state(seq_id), blocks_for(num_tokens, self.block_size))

    def _check_placement(self) -> None:
        for seq_id, s in self._seqs.items():
            table = s.table
            assert table == list(range(s.start, s.start + len(table))), f"{seq_id}: not a run"
            assert s.size == self._region_size(s, len(table)), f"{seq_id}: region size {s.size}"


def _minus(a: tuple[int, int], b: tuple[int, int]) -> list[tuple[int, int]]:
    """The half-open interval ``a`` without ``b``: zero, one or two intervals."""
    parts = [(a[0], min(a[1], b[0])), (max(a[0], b[1]), a[1])]
    return [(lo, hi) for lo, hi in parts if lo < hi]


class ContiguousAllocator(RegionAllocator):
    """First-fit contiguous runs. What a region reserves up front (at most the whole arena),
    the baselines of the vLLM paper's Fig. 2: ``reserve="exact"`` nothing beyond the table;
    ``"max_len"`` ``max_len`` slots, as Orca (Max); ``"oracle"`` the slots the sequence will
    hold when it finishes, its ``expect`` hint, as Orca (Oracle); ``"pow2"`` that hint rounded
    up to a power of two slots, as Orca (Pow2) (which rounds the output length alone). A
    sequence without a hint reserves exactly."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        reserve: Literal["exact", "max_len", "oracle", "pow2"] = "exact",
        max_len: int | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size)
        if reserve not in ("exact", "max_len", "oracle", "pow2"):
            raise ValueError(
                f"reserve must be 'exact', 'max_len', 'oracle' or 'pow2', got {reserve!r}"
            )
        if reserve == "max_len" and (
            isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1
        ):
            raise ValueError(f"max_len must be an int >= 1 with reserve='max_len', got {max_len!r}")
        self.reserve = reserve
        self._reserve_blocks = (
            min(blocks_for(max_len, block_size), num_blocks) if reserve == "max_len" else 0
        )
        self._expected: dict[str, int] = {}  # oracle, pow2: seq_id -> slots to reserve
        # 1 = free, for blocks below the highest ever held; those past it are free too (the
        # map grows with use, not with the arena). bytes.find scans it at C speed.
        self._is_free = bytearray()

    def expect(self, seq_id: str, num_tokens: int | None) -> None:
        if num_tokens is None:
            self._expected.pop(seq_id, None)
            return
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"expect: num_tokens must be an int >= 0 or None, got {num_tokens!r}")
        if self.reserve == "pow2":
            num_tokens = 1 << (num_tokens - 1).bit_length() if num_tokens else 0
        if self.reserve in ("oracle", "pow2"):
            self._expected[seq_id] = num_tokens

    def _new_state(self, seq_id: str | None) -> RegionState:
        s = RegionState()
        s.floor = self._reserve_blocks
        if seq_id in self._expected:
            s.floor = min(blocks_for(self._expected[seq_id], self.block_size), self.num_blocks)
        return s

    def _first_fit(self, size: int) -> int:
        """The first start of ``size`` free blocks, or -1: in the map, else where its free
        tail (after the last held block, ``rfind``) runs on past it."""
        free = self._is_free
        start = free.find(b"\x01" * size)
        if start < 0:
            start = free.rfind(0) + 1
            if self.num_blocks - start < size:
                return -1
        return start

    def _can_place(self, size: int) -> bool:
        return self._first_fit(size) >= 0

    def _place(self, size: int) -> int | None:
        start = self._first_fit(size)
        if start < 0:
            return None
        # start <= len(map): a slice past its end extends it by the blocks now held.
        self._is_free[start : start + size] = bytes(size)
        return start

    def _can_move(self, start: int, size: int, new_size: int) -> bool:
        return self._move_target(start, size, new_size) >= 0

    def _move(self, start: int, size: int, new_size: int) -> int | None:
        dst = self._move_target(start, size, new_size)
        if dst < 0:
            return None
        self._is_free[dst : dst + new_size] = bytes(new_size)  # the old part is marked already
        return dst

    def _move_target(self, start: int, size: int, new_size: int) -> int:
        """First fit for a region moving out of ``[start, start + size)``: its own blocks
        count as free, so a sequence alone in the arena can always grow into it."""
        free = self._is_free
        free[start : start + size] = b"\x01" * size
        dst = self._first_fit(new_size)
        free[start : start + size] = bytes(size)
        return dst

    def _can_extend(self, start: int, size: int, new_size: int) -> bool:
        end = start + new_size  # the map's slice stops at its end: blocks past it are free
        return end <= self.num_blocks and 0 not in self._is_free[start + size : end]

    def _extend(self, start: int, size: int, new_size: int) -> None:
        # The region ends inside the map: a slice past its end extends it.
        self._is_free[start + size : start + new_size] = bytes(new_size - size)

    def _give_back(self, start: int, size: int) -> None:
        self._is_free[start : start + size] = b"\x01" * size

    def _free_blocks(self) -> set[int]:
        free = self._is_free
        return {b for b, f in enumerate(free) if f}.union(range(len(free), self.num_blocks))

    def unusable_free_blocks(self, num_tokens: int, seq_id: str | None = None) -> int:
        size = self._region_blocks(num_tokens, seq_id)
        if not size:
            return 0  # no region needed: every free block will do
        free, past = self._is_free, self.num_blocks - len(self._is_free)  # past the map: free
        # Every free block but those in runs of ``size`` or more, found in C: the long runs
        # (a few) by their first ``size`` blocks, each to its end. (A list of every run,
        # made every step the recorder asks, cost as many objects as a fragmented map has
        # holes.)
        usable, at, run = 0, 0, b"\x01" * size
        while (start := free.find(run, at)) >= 0:
            at = free.find(0, start)
            if at < 0:  # it runs on past the map
                usable += len(free) - start + past
                break
            usable += at - start
        else:  # the run the map ends with (short in it), and the blocks past it
            tail = len(free) - free.rfind(0) - 1 + past
            usable += tail if tail >= size else 0
        return free.count(1) + past - usable
