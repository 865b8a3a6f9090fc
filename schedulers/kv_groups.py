"""The KV beside the policy's own allocator: a draft model's blocks and sliding-window rings.

A speculative engine keeps its draft model's KV on an allocator of its own (same policy and
size as the target's); a model with sliding-window layers keeps those layers' KV in rings on
another. Both are block allocators like the policy's, and the scheduler alone calls them, as
it calls its own: one owner for every allocation a sequence holds. The engine reads their
block tables; it never allocates, trims or frees.

    DraftKV      grows with a verification's lookahead (the scheduler's _widen), rolls back
                 to the accepted tokens (update), goes when the sequence leaves the device
    WindowRings  one ring of k = ceil(window / block_size) + 1 blocks per running sequence,
                 taken whole when it comes on the device, given back when it leaves
"""

from __future__ import annotations

from collections.abc import Callable

from allocators.base import Allocation, BlockAllocator


class DraftKV:
    """The draft model's allocator and how many tokens of each sequence have draft KV."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.computed: dict[str, int] = {}  # tokens of each sequence with draft KV

    def grow(self, seq_id: str, num_tokens: int) -> Allocation | None:
        """Slots for the first ``num_tokens`` tokens (the draft computes up to there this
        step); None, changing nothing, when the draft's arena has no room."""
        grown = self.allocator.allocate(seq_id, num_tokens)
        if grown is not None:
            self.computed.setdefault(seq_id, 0)
        return grown

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Keep draft KV for at most the first ``num_tokens`` tokens (the accepted ones)."""
        if seq_id in self.computed:
            keep = min(self.computed[seq_id], num_tokens)
            self.computed[seq_id] = keep
            self.allocator.trim(seq_id, keep)

    def release(self, seq_id: str) -> None:
        """Drop a sequence's draft KV (a no-op for a sequence the draft never saw)."""
        self.allocator.free(seq_id)
        self.computed.pop(seq_id, None)


def ring_blocks(window: int, block_size: int) -> int:
    """Blocks in a ring: the window's positions span at most ceil(window / bs) + 1 blocks."""
    return -(-window // block_size) + 1


class WindowRings:
    """The sliding-window layers' allocator, sized for one ring per running sequence.

    Every ring is the same size, so ``max_num_seqs`` rings of what one costs under the
    allocator (buddy rounds k up to a power of two) always fit: taking a ring never fails
    while at most ``max_num_seqs`` sequences run."""

    def __init__(
        self,
        allocator: Callable[..., BlockAllocator],
        *,
        window: int,
        block_size: int,
        max_num_seqs: int,
    ) -> None:
        self.window = window
        self.ring = ring_blocks(window, block_size)
        # A region allocator reserving max_len slots reserves the ring: nothing more is used.
        options = {"max_len": self.ring * block_size} if _takes(allocator, "max_len") else {}
        self.blocks_per_ring = blocks_per_ring(allocator, self.ring, block_size, options)
        self.allocator = allocator(
            num_blocks=max_num_seqs * self.blocks_per_ring, block_size=block_size, **options
        )
        self._rings: dict[str, tuple[int, ...]] = {}  # running sequences' rings (fixed)

    def take(self, seq_id: str) -> tuple[int, ...]:
        """A whole ring for ``seq_id``, which comes on the device."""
        alloc = self.allocator
        if alloc.allocate(seq_id, self.ring * alloc.block_size) is None:
            raise RuntimeError(
                f"the window rings have no ring for {seq_id!r}: they hold one per running "
                f"sequence ({alloc.num_blocks} blocks); more sequences run than max_num_seqs"
            )
        ring = self._rings[seq_id] = tuple(alloc.block_table(seq_id))
        return ring

    def table(self, seq_id: str) -> tuple[int, ...]:
        """``seq_id``'s ring (logical block j lives in slot j mod k)."""
        return self._rings[seq_id]

    def release(self, seq_id: str) -> tuple[int, ...]:
        """``seq_id`` leaves the device: its ring goes back. Returns the ring (its blocks stay
        readable until the step's first write), empty if it held none."""
        ring = self._rings.pop(seq_id, ())
        if ring:
            self.allocator.free(seq_id)
        return ring


def blocks_per_ring(
    allocator: Callable[..., BlockAllocator], ring: int, block_size: int, options: dict
) -> int:
    """Blocks one ring of ``ring`` blocks holds under ``allocator`` (region rounding)."""
    probe = allocator(num_blocks=1 << (ring - 1).bit_length(), block_size=block_size, **options)
    probe.allocate("ring", ring * block_size)
    return probe.held_slots("ring") // block_size


def _takes(allocator: Callable, name: str) -> bool:
    return name in getattr(allocator, "keywords", {})
