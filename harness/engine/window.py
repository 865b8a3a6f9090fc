"""The window group: sliding-window layers' KV in rings of blocks that never grow past k.

A sliding-window layer (mlx_lm's ``RotatingKVCache``) lets each query attend to the last
``window`` positions, itself included. Its layers live in an arena of their own, over an
allocator of their own built by the engine's allocator partial; a sequence's window table is a
ring of k = ceil(window / block_size) + 1 blocks, allocated whole when it comes on the device::

    logical block j (positions j*bs .. j*bs+bs-1) lives in ring slot j mod k

    position:   0 ........ 15 | 16 ....... 31 | 32 ....... 47 | 48 ... (window 16, bs 16, k 2)
    ring slot:        0       |       1       |       0       |   1    the oldest is reused

A step's row reads the blocks holding the positions of the window before its first query
(``start - window + 1 .. start - 1``) and the new keys themselves, not from the arena: a
prefill chunk longer than the ring overwrites slots its own first queries still need, so the
ring is read before it is written (mlx_lm's prefill likewise keeps ``window - 1`` keys plus the
chunk). Only the chunk's last ``k * block_size`` positions are written. The mask keeps key
position p for query q iff ``q - window < p <= q``: mlx_lm's window, in prefill and decode.

The rings' allocator is the scheduler's (``schedulers/kv_groups.py``, ``WindowRings``): it
holds one ring per running sequence, takes a sequence's ring when it comes on the device and
gives it back when it leaves. ``WindowTables`` reads the rings (a row's ring); the model
clock runs it alone, as its runner holds no arena. ``WindowGroup`` adds the window layers'
arena and moves their KV: a swapped-out sequence's ring goes to a host copy
(``SwapOut.ring``) and is written back whole into its new ring at swap-in (``SwapIn.ring``);
a fork copies its parent's ring into its own (a shared ring would be overwritten in place by
both).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from harness.engine.kv_cache import BatchLayout, HostBlocks, KVArena, PagedKVCache
from harness.platform.models import LoadedModel
from schedulers.kv_groups import WindowRings


class WindowTables:
    """The window layers' rings as the scheduler's ``WindowRings`` hands them out, without
    their KV: what the model clock runs (harness/engine/modelled.py), whose runner holds no
    arena either. The KV moves a ring takes (a swap-out's host copy, a swap-in, a fork's
    copy, a finished sequence's host copy dropped) move nothing here; ``WindowGroup`` makes
    them move the window layers' KV. Both read the same rings, so a schedule's rings are the
    same whichever runs."""

    def __init__(self, model: LoadedModel, rings: WindowRings) -> None:
        self.window = model.window
        self.layers = model.window_layers
        self.rings = rings

    @property
    def allocator(self):
        """The rings' allocator (the scheduler's; read here, never called)."""
        return self.rings.allocator

    @property
    def blocks_per_ring(self) -> int:
        return self.rings.blocks_per_ring

    @property
    def max_num_seqs(self) -> int:
        return self.allocator.num_blocks // self.rings.blocks_per_ring

    def table(self, seq_id: str) -> Sequence[int]:
        """``seq_id``'s ring (it runs, so it has one)."""
        return self.rings.table(seq_id)

    def copy_ring(self, copies: Sequence[tuple[int, int]]) -> None:
        """A fork's ring copies (``schedulers.output.Fork.ring_copies``): no KV to copy."""

    def swap_out(self, seq_id: str, ring: Sequence[int]) -> None:
        """The ring ``seq_id`` gave back this step: no KV to keep."""

    def swap_in(self, seq_id: str, ring: Sequence[int]) -> None:
        """A swapped-out sequence's new ring: no KV to write back."""

    def drop(self, seq_id: str) -> None:
        """``seq_id`` finished: no host copy to drop."""


class WindowGroup(WindowTables):
    """The window layers' arena and the host copies of swapped-out rings, over the rings'
    tables (``WindowTables``)."""

    def __init__(self, model: LoadedModel, rings: WindowRings) -> None:
        super().__init__(model, rings)
        self.arena = KVArena(
            num_layers=len(self.layers),
            num_blocks=rings.allocator.num_blocks,
            block_size=rings.allocator.block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.dtype,
        )
        self._host: dict[str, HostBlocks] = {}  # swapped-out sequences' rings

    def copy_ring(self, copies: Sequence[tuple[int, int]]) -> None:
        """A fork's ring copies (``schedulers.output.Fork.ring_copies``): the child continues
        from a copy of its parent's ring."""
        self.arena.copy_blocks(list(copies))

    def swap_out(self, seq_id: str, ring: Sequence[int]) -> None:
        """Copy the ring ``seq_id`` gave back this step to host memory."""
        self._host[seq_id] = self.arena.swap_out(ring)

    def swap_in(self, seq_id: str, ring: Sequence[int]) -> None:
        """Write a swapped-out sequence's ring back, slot for slot, into its new ring."""
        self.arena.swap_in(self._host.pop(seq_id), ring)

    def drop(self, seq_id: str) -> None:
        """``seq_id`` finished: a host copy it left while swapped out goes."""
        self._host.pop(seq_id, None)


class WindowKVCache(PagedKVCache):
    """One window layer's view of the window arena for one batch: mlx_lm's cache protocol
    as ``PagedKVCache`` gives it, over rings, reading each ring before writing it."""

    def __init__(self, arena: KVArena, layer: int, layout: BatchLayout, window: int) -> None:
        super().__init__(arena, layer, layout)
        self.window = window

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None and window_size != self.window:
            raise ValueError(
                f"a window layer's cache holds a {self.window}-token window, the model asked "
                f"for a mask of {window_size}"
            )
        return self.layout.mask

    def _write_read(self, pools: list[mx.array], new: mx.array) -> mx.array:
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
