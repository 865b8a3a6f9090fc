"""The KV arena and the paged cache view that unmodified mlx_lm models attend through.

Arena layout, per layer, for K and for V::

    [num_blocks + 1, n_kv_heads, block_size, head_dim]
      block 0 .. num_blocks-1: handed out by the allocator
      block num_blocks:        scratch; padded query rows write here and nothing reads it

Head-major inside a block measured fastest for gather-then-attend on MLX (MLX_NOTES.md).

One batch of a step is described once by a ``BatchLayout`` (index arrays built in numpy),
shared by every layer's ``PagedKVCache`` view::

    row b:  computes n_b new tokens at positions start_b .. start_b+n_b-1 (right-padded to L)
            reads its blocks table_b[0..k_b) and attends to positions <= its query position
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from harness.models import LoadedModel


class KVArena:
    """Per-layer K and V storage indexed by block id (plus one scratch block)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype = mx.float32,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"the KV arena needs num_blocks >= 1 and block_size >= 1, "
                f"got {num_blocks} and {block_size}: raise engine.num_blocks or kv_cache_bytes"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, num_kv_heads, block_size, head_dim)
        # Exactly one live reference to each array: a second one would turn every in-place
        # write into a copy of the whole layer (MLX arrays are values).
        self.keys = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.keys, self.values)

    @classmethod
    def for_model(cls, model: LoadedModel, num_blocks: int, block_size: int) -> KVArena:
        """An arena shaped for ``model``'s KV (layers, KV heads, head size, dtype)."""
        return cls(
            num_layers=model.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.dtype,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the allocatable blocks (the scratch block is not counted)."""
        per_layer = self.keys[0].nbytes * self.num_blocks // (self.num_blocks + 1)
        return 2 * len(self.keys) * per_layer

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply (src, dst) block copies reported by the allocator (relocation, COW)."""
        if not copies:
            return
        src = mx.array([s for s, _ in copies], dtype=mx.int32)
        dst = mx.array([d for _, d in copies], dtype=mx.int32)
        for arrays in (self.keys, self.values):
            for layer, pool in enumerate(arrays):
                moved = pool[src]
                mx.eval(moved)  # materialise first so the scatter below can write in place
                pool[dst] = moved
                arrays[layer] = pool
        mx.eval(self.keys, self.values)

    def swap_out(self, blocks: Sequence[int]) -> HostBlocks:
        """Copy ``blocks`` (every layer, K and V) into host memory, in the given order."""
        idx = mx.array(blocks, dtype=mx.int32)
        # numpy has no bfloat16: move the raw bits. np.array copies out of MLX's buffer, so
        # the copy is paid even on unified memory (it is what the step's swap_time measures).
        raw = _RAW[self.keys[0].dtype.size]
        keys = [np.array(pool[idx].view(raw)) for pool in self.keys]
        values = [np.array(pool[idx].view(raw)) for pool in self.values]
        return HostBlocks(keys, values)

    def swap_in(self, host: HostBlocks, blocks: Sequence[int], first: int = 0) -> None:
        """Write host blocks ``first, first + 1, ...`` into device ``blocks``."""
        if not blocks:
            return
        dst = mx.array(blocks, dtype=mx.int32)
        for arrays, saved in ((self.keys, host.keys), (self.values, host.values)):
            for layer, pool in enumerate(arrays):
                pool[dst] = mx.array(saved[layer][first : first + len(blocks)]).view(pool.dtype)
                arrays[layer] = pool
        mx.eval(self.keys, self.values)


_RAW = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


@dataclass
class HostBlocks:
    """A swapped-out sequence's KV in host memory: per layer ``[n, n_kv, block_size, d]``
    raw bits of the arena dtype."""

    keys: list[np.ndarray]
    values: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)


@dataclass(frozen=True)
class BatchLayout:
    """Index arrays that place one padded batch in the arena; built once, used by every layer.

    Attributes:
        offsets: [B] start position of each row (RoPE offset).
        write_blocks, write_slots: [B*L] block and in-block slot of each new token
            (padding goes to the scratch block).
        read_rows: [B, H, K] rows of the arena viewed as [(num_blocks+1) * H, bs * D]
            (block * H + head) that each row attends over, padded with the scratch block;
            one gather lands K/V straight in the [B, H, K*bs, D] layout attention wants
            (5x faster than gathering blocks and then transposing). Tables that are runs of
            consecutive blocks (contiguous, buddy) use it too: a slice of a head-major arena
            still needs a transposing copy, and measured no faster than this gather.
        mask: [B, 1, L, K*block_size] True where a query may attend to a key.
    """

    offsets: mx.array
    write_blocks: mx.array
    write_slots: mx.array
    read_rows: mx.array
    mask: mx.array
    num_read_blocks: int

    @classmethod
    def build(
        cls,
        tables: Sequence[Sequence[int]],
        starts: Sequence[int],
        lengths: Sequence[int],
        *,
        block_size: int,
        scratch_block: int,
        num_kv_heads: int,
    ) -> BatchLayout:
        """Lay out rows that compute ``lengths[b]`` tokens from position ``starts[b]``."""
        num_rows = len(tables)
        width = max(lengths)
        start = np.asarray(starts, dtype=np.int64)
        ends = start + np.asarray(lengths, dtype=np.int64)
        num_read = int(-(-ends.max() // block_size))

        pos = start[:, None] + np.arange(width)[None, :]  # [B, L]
        real = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
        padded = np.full((num_rows, num_read), scratch_block, dtype=np.int32)
        for b, table in enumerate(tables):
            k = -(-int(ends[b]) // block_size)
            padded[b, :k] = table[:k]
        block_of = np.where(real, pos // block_size, 0)
        write_blocks = np.where(real, np.take_along_axis(padded, block_of, axis=1), scratch_block)
        write_slots = np.where(real, pos % block_size, 0)
        key_pos = np.arange(num_read * block_size)
        mask = key_pos[None, None, None, :] <= pos[:, None, :, None]
        return cls(
            offsets=mx.array(start.astype(np.int32)),
            write_blocks=mx.array(write_blocks.reshape(-1).astype(np.int32)),
            write_slots=mx.array(write_slots.reshape(-1).astype(np.int32)),
            read_rows=mx.array(
                padded[:, None, :] * num_kv_heads + np.arange(num_kv_heads)[:, None]
            ),
            mask=mx.array(mask),
            num_read_blocks=num_read,
        )


class PagedKVCache:
    """One layer's view of the arena for one batch: mlx_lm's cache protocol.

    mlx_lm attention calls ``offset`` (RoPE positions), ``update_and_fetch`` and, through
    ``create_attention_mask``, ``make_mask``. Nothing else is needed, so models run unmodified.
    """

    def __init__(self, arena: KVArena, layer: int, layout: BatchLayout) -> None:
        self.arena = arena
        self.layer = layer
        self.layout = layout

    @property
    def offset(self) -> mx.array:
        return self.layout.offsets

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("PagedKVCache implements full attention only, not sliding windows")
        return self.layout.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._write_read(self.arena.keys, keys), self._write_read(self.arena.values, values)

    def _write_read(self, pools: list[mx.array], new: mx.array) -> mx.array:
        layout = self.layout
        batch, heads, width, dim = new.shape
        pool = pools[self.layer]
        pool[layout.write_blocks, :, layout.write_slots] = new.transpose(0, 2, 1, 3).reshape(
            batch * width, heads, dim
        )
        pools[self.layer] = pool
        block_size = pool.shape[2]
        flat = pool.reshape(-1, block_size * dim)
        fetched = flat[layout.read_rows]  # [B, H, K, bs * D]
        return fetched.reshape(batch, heads, layout.num_read_blocks * block_size, dim)
