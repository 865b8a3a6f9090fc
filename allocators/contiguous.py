"""Contiguous allocation: each sequence owns one run of consecutive blocks.

The engine can then read a sequence's KV as one slice instead of a gather. The
price is external fragmentation: free blocks scattered in runs too short to use.
``RegionAllocator`` holds what contiguous and buddy placement share (regions,
growth in place or by relocation, forks by copy); ``ContiguousAllocator`` places
regions first fit, as CortexStream's linear scan does::

    XXXXrr....XXX.....   seq a: table 0-3, reserved 4-5 (max_len); seq b: 10-12
    grow b by 3 -> 13-15 are free: in place.  grow a by 3 -> relocate to the first
    free run of 9 blocks or fail; copies ((0, dst), (1, dst + 1), ...).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable

from allocators.base import BlockAllocator, blocks_for


class RegionAllocator(BlockAllocator):
    """A sequence's table is the start of a region of consecutive blocks it holds.

    Every block of a region carries one reference, table or not. The region's size
    is always ``_region_size(len(table))``; growing past it extends the region in
    place when possible, else moves the written blocks to a new, disjoint region
    and reports them as copies. Subclasses place and release regions.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._region: dict[str, tuple[int, int]] = {}  # seq -> (start, size)

    # -- placement, written by subclasses ----------------------------------------------

    def _region_size(self, table_blocks: int) -> int:
        """Blocks to reserve for a table of ``table_blocks`` blocks (0: no region)."""
        return table_blocks

    @abstractmethod
    def _place(self, size: int) -> int | None:
        """Reserve a free region of ``size`` blocks and return its start, or ``None``."""

    @abstractmethod
    def _extend(self, start: int, size: int, new_size: int) -> bool:
        """Reserve the blocks after a region so it becomes ``new_size`` long, if free."""

    @abstractmethod
    def _give_back(self, start: int, size: int) -> None:
        """Return blocks that nobody holds any more to the free structures."""

    def _shrink(self, start: int, size: int, new_size: int) -> None:
        self._release(start + new_size, size - new_size)

    # -- shared mechanics --------------------------------------------------------------

    def _reserve(self, seq_id: str, start: int, size: int, table_blocks: int) -> None:
        for block in range(start, start + size):
            if self._ref[block] == 0:  # extending in place keeps the old blocks' references
                self._hold(block)
        if size:
            self._region[seq_id] = (start, size)
        self._tables[seq_id] = list(range(start, start + table_blocks))

    def _release(self, start: int, size: int) -> None:
        for block in range(start, start + size):
            self._drop(block)
        if size:
            self._give_back(start, size)

    def _grow(self, seq_id: str, table: list[int], old: int, new: int) -> list | None:
        need = blocks_for(new, self.block_size)
        start, size = self._region.get(seq_id, (0, 0))
        new_size = self._region_size(need)
        if new_size <= size:
            self._tables[seq_id] = list(range(start, start + need))
            return []
        if size and self._extend(start, size, new_size):
            self._reserve(seq_id, start, new_size, need)
            return []
        # Place before releasing: the new region is disjoint, so one gather copies it.
        dst = self._place(new_size)
        if dst is None:
            return None
        self._reserve(seq_id, dst, new_size, need)
        copies = list(zip(table, range(dst, dst + len(table)), strict=True))
        if size:
            self._release(start, size)
        if copies:
            self._relocations += 1
            self._relocated_blocks += len(copies)
        return copies

    def _after_trim(self, seq_id: str, dropped: list[int]) -> None:
        start, size = self._region.get(seq_id, (0, 0))
        new_size = self._region_size(len(self._tables[seq_id]))
        if new_size < size:
            self._shrink(start, size, new_size)
            if new_size:
                self._region[seq_id] = (start, new_size)
            else:
                del self._region[seq_id]

    def _fork(self, parent_id: str, child_id: str) -> list | None:
        table = self._tables[parent_id]
        size = self._region_size(len(table))
        dst = self._place(size) if size else 0
        if dst is None:
            return None
        self._reserve(child_id, dst, size, len(table))
        self._fork_copies += len(table)
        return list(zip(table, self._tables[child_id], strict=True))

    def _free_seq(self, seq_id: str) -> None:
        self._release(*self._region.pop(seq_id, (0, 0)))

    def _on_unreferenced(self, block: int) -> None:
        """Regions are given back whole, in ``_release``."""

    def _held_blocks(self, seq_id: str) -> Iterable[int]:
        start, size = self._region.get(seq_id, (0, 0))
        return range(start, start + size)

    def _check_placement(self) -> None:
        assert all(size for _, size in self._region.values()), "an empty region is stored"
        for seq_id, table in self._tables.items():
            start, size = self._region.get(seq_id, (0, 0))
            assert table == list(range(start, start + len(table))), f"{seq_id}: not a run"
            # A sequence only matched (never allocated) has no region yet.
            expected = {self._region_size(len(table))} | (set() if table else {0})
            assert size in expected, f"{seq_id}: region size {size}"


class ContiguousAllocator(RegionAllocator):
    """First-fit contiguous runs; ``reserve="max_len"`` reserves ``max_len`` slots up front."""

    def __init__(
        self, num_blocks: int, block_size: int, reserve: str = "exact", max_len: int | None = None
    ) -> None:
        super().__init__(num_blocks, block_size)
        if reserve not in ("exact", "max_len"):
            raise ValueError(f"reserve must be 'exact' or 'max_len', got {reserve!r}")
        if reserve == "max_len" and (
            isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1
        ):
            raise ValueError(f"max_len must be an int >= 1 with reserve='max_len', got {max_len!r}")
        self.reserve = reserve
        self._reserve_blocks = blocks_for(max_len, block_size) if reserve == "max_len" else 0
        self._is_free = bytearray(b"\x01" * num_blocks)  # bytes.find scans it at C speed

    def _region_size(self, table_blocks: int) -> int:
        return max(table_blocks, self._reserve_blocks)

    def _place(self, size: int) -> int | None:
        start = self._is_free.find(b"\x01" * size)
        if start < 0:
            return None
        self._is_free[start : start + size] = bytes(size)
        return start

    def _extend(self, start: int, size: int, new_size: int) -> bool:
        end = start + new_size
        if end > self.num_blocks or 0 in self._is_free[start + size : end]:
            return False
        self._is_free[start + size : end] = bytes(new_size - size)
        return True

    def _give_back(self, start: int, size: int) -> None:
        self._is_free[start : start + size] = b"\x01" * size

    def _free_blocks(self) -> set[int]:
        return {b for b, free in enumerate(self._is_free) if free}

    def _external_fragmentation(self) -> float:
        runs = [len(run) for run in bytes(self._is_free).split(b"\x00") if run]
        return 1.0 - max(runs) / sum(runs) if runs else 0.0
