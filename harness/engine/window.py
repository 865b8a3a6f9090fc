"""The window group: sliding-window layers' KV in rings of blocks that never grow past k.

A sliding-window layer (mlx_lm's ``RotatingKVCache``) lets each query attend to the last
``window`` positions, itself included. Its layers live in an arena of their own, over an
allocator of their own built by the engine's allocator partial; a sequence's window table is a
ring of k = ceil(window / block_size) + 1 blocks, allocated whole at its first step::

    logical block j (positions j*bs .. j*bs+bs-1) lives in ring slot j mod k

    position:   0 ........ 15 | 16 ....... 31 | 32 ....... 47 | 48 ... (window 16, bs 16, k 2)
    ring slot:        0       |       1       |       0       |   1    the oldest is reused

A step's row reads the blocks holding the positions of the window before its first query
(``start - window + 1 .. start - 1``) and the new keys themselves, not from the arena: a
prefill chunk longer than the ring overwrites slots its own first queries still need, so the
ring is read before it is written (mlx_lm's prefill likewise keeps ``window - 1`` keys plus the
chunk). Only the chunk's last ``k * block_size`` positions are written. The mask keeps key
position p for query q iff ``q - window < p <= q``: mlx_lm's window, in prefill and decode.

Every ring is the same size, so the group's arena holds one per running sequence
(``max_num_seqs`` rings of what one costs under the allocator: buddy rounds k up to a power of
two) and an allocation never fails. The scheduler does not see this group: its allocator is
the full-attention layers'. A sequence leaving the device (finish, abort, preemption) gives
its ring back; a swapped-out one keeps a host copy, written back whole at swap-in; a fork
copies its parent's ring (a shared ring would be overwritten in place by both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from allocators.base import BlockAllocator
from harness.engine.kv_cache import HostBlocks, KVArena
from harness.platform.models import LoadedModel


def ring_blocks(window: int, block_size: int) -> int:
    """Blocks in a ring: the window's positions span at most ceil(window / bs) + 1 blocks."""
    return -(-window // block_size) + 1


class WindowGroup:
    """The window layers' arena and allocator, and each running sequence's ring."""

    def __init__(
        self,
        model: LoadedModel,
        allocator: Callable[..., BlockAllocator],
        *,
        block_size: int,
        max_num_seqs: int,
    ) -> None:
        self.window = model.window
        self.max_num_seqs = max_num_seqs
        self.layers = model.window_layers
        self.ring = ring_blocks(model.window, block_size)
        # A region allocator reserving max_len slots reserves the ring: nothing more is used.
        options = {"max_len": self.ring * block_size} if _takes(allocator, "max_len") else {}
        self.blocks_per_ring = blocks_per_ring(allocator, self.ring, block_size, options)
        self.allocator = allocator(
            num_blocks=max_num_seqs * self.blocks_per_ring, block_size=block_size, **options
        )
        self.arena = KVArena(
            num_layers=len(self.layers),
            num_blocks=self.allocator.num_blocks,
            block_size=block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.dtype,
        )
        self._rings: dict[str, Sequence[int]] = {}  # running sequences' rings (fixed tables)
        self._host: dict[str, HostBlocks] = {}  # swapped-out sequences' rings
        # Rings given back this step, readable until the step's swap-outs have copied them
        # (no ring is allocated before then).
        self._released: dict[str, list[int]] = {}

    def table(self, seq_id: str) -> Sequence[int]:
        """``seq_id``'s ring, allocated (whole) when it has none."""
        ring = self._rings.get(seq_id)
        return self._allocate(seq_id) if ring is None else ring

    def release(self, seq_id: str) -> None:
        """``seq_id`` left the device (a scheduler release listener): its ring goes back; a
        host copy of a sequence that finishes while swapped out goes too."""
        self._host.pop(seq_id, None)
        ring = self._rings.pop(seq_id, None)
        if ring is not None:
            self._released[seq_id] = list(ring)
            self.allocator.free(seq_id)

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` continues from ``parent_id``'s KV: a copy of the parent's ring."""
        parent = self._rings[parent_id]
        child = self._allocate(child_id)
        self.arena.copy_blocks(list(zip(parent, child, strict=True)))

    def swap_out(self, seq_id: str) -> None:
        """Copy the ring ``seq_id`` gave back this step to host memory."""
        self._host[seq_id] = self.arena.swap_out(self._released[seq_id])

    def swap_in(self, seq_id: str) -> None:
        """Write a swapped-out sequence's ring back, slot for slot, into a new ring."""
        self.arena.swap_in(self._host.pop(seq_id), self._allocate(seq_id))

    def moved(self) -> None:
        """The step's swaps are done: rings given back may be reused."""
        self._released.clear()

    def _allocate(self, seq_id: str) -> Sequence[int]:
        alloc = self.allocator
        if alloc.allocate(seq_id, self.ring * alloc.block_size) is None:
            raise RuntimeError(
                f"the window group has no ring for {seq_id!r}: it holds one per running "
                f"sequence ({alloc.num_blocks} blocks); more sequences run than max_num_seqs"
            )
        ring = self._rings[seq_id] = alloc.block_table(seq_id)
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


@dataclass(frozen=True)
class WindowLayout:
    """Index arrays that place one padded batch in the window arena (every window layer).

    Attributes:
        offsets: [B] start position of each row (RoPE offset).
        write_rows: [B*H*L] arena row of each new (token, head) kept in the ring: the row's
            last ``ring * block_size`` positions; the rest and padding go to scratch.
        read_rows: [B, H, K] rows of the arena viewed as [(num_blocks+1) * H, bs * D]: the
            ring blocks holding the window's positions before the row's first query.
        mask: [B, 1, L, K*bs + L] keys read, then the new keys: True where
            ``query - window < key position <= query`` and the key is written.
    """

    offsets: mx.array
    write_rows: mx.array
    read_rows: mx.array
    mask: mx.array
    num_read_blocks: int

    @classmethod
    def build(
        cls,
        rings: Sequence[Sequence[int]],
        starts: Sequence[int],
        lengths: Sequence[int],
        *,
        window: int,
        block_size: int,
        scratch_block: int,
        num_kv_heads: int,
    ) -> WindowLayout:
        bs = block_size
        start = np.array(starts)
        lens = np.array(lengths)
        width = int(lens.max())
        # Logical blocks lo..hi hold positions start - window + 1 .. start - 1.
        lo = np.maximum(start - window + 1, 0) // bs
        count = np.where(start > 0, (start - 1) // bs - lo + 1, 0)
        num_read = max(1, int(count.max()))
        read = np.full((len(rings), num_read), scratch_block)
        for b, ring in enumerate(rings):
            k = len(ring)
            read[b, : count[b]] = [ring[j % k] for j in range(lo[b], lo[b] + count[b])]
        step = np.arange(width)
        pos = start[:, None] + step  # [B, L] query positions
        # Keys: the blocks read (positions before start), then the new keys.
        old = lo[:, None] + np.arange(num_read)  # [B, K] logical blocks read
        old_pos = (old[:, :, None] * bs + np.arange(bs)).reshape(len(rings), -1)  # [B, K*bs]
        old_ok = (np.arange(num_read) < count[:, None]).repeat(bs, axis=1)
        old_ok &= old_pos < start[:, None]
        new_ok = step[None, :] < lens[:, None]  # [B, L]
        keys = np.concatenate([old_pos, pos], axis=1)  # [B, K*bs + L]
        ok = np.concatenate([old_ok, new_ok], axis=1)
        q = pos[:, :, None]
        mask = ok[:, None, :] & (keys[:, None, :] <= q) & (keys[:, None, :] > q - window)
        # Writes: a row's last ring * bs positions (distinct ring slots), else scratch.
        ring_len = np.array([len(r) for r in rings])
        kept = new_ok & (pos >= (start + lens - ring_len * bs)[:, None])
        logical = pos // bs
        blocks = np.full(pos.shape, scratch_block)
        for b, ring in enumerate(rings):
            cols = np.nonzero(kept[b])[0]
            blocks[b, cols] = np.asarray(ring)[logical[b, cols] % len(ring)]
        heads = np.arange(num_kv_heads)[:, None]
        write_rows = (blocks[:, None, :] * num_kv_heads + heads) * bs + (pos % bs)[:, None, :]
        return cls(
            offsets=mx.array(start.astype(np.int32)),
            write_rows=mx.array(write_rows.reshape(-1).astype(np.int32)),
            read_rows=mx.array((read[:, None, :] * num_kv_heads + heads).astype(np.int32)),
            mask=mx.array(mask[:, None]),
            num_read_blocks=num_read,
        )


class WindowKVCache:
    """One window layer's view of the window arena for one batch: mlx_lm's cache protocol
    (``offset``, ``make_mask``, ``update_and_fetch``), as ``PagedKVCache`` is for full ones."""

    def __init__(self, arena: KVArena, layer: int, layout: WindowLayout, window: int) -> None:
        self.arena = arena
        self.layer = layer
        self.layout = layout
        self.window = window

    @property
    def offset(self) -> mx.array:
        return self.layout.offsets

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None and window_size != self.window:
            raise ValueError(
                f"a window layer's cache holds a {self.window}-token window, the model asked "
                f"for a mask of {window_size}"
            )
        return self.layout.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._read_write(self.arena.keys, keys), self._read_write(self.arena.values, values)

    def _read_write(self, pools: list[mx.array], new: mx.array) -> mx.array:
        layout = self.layout
        batch, heads, _, dim = new.shape
        pool = pools[self.layer]
        bs = self.arena.block_size
        # Read before writing: a long chunk's writes reuse slots its first queries read.
        old = pool.reshape(-1, bs * dim)[layout.read_rows]  # [B, H, K, bs * D]
        old = old.reshape(batch, heads, layout.num_read_blocks * bs, dim)
        pool[layout.write_rows] = new.reshape(-1, dim)
        pools[self.layer] = pool
        return mx.concatenate([old, new], axis=2)
