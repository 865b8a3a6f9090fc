"""The KV arena and the paged cache view that unmodified mlx_lm models attend through.

Arena layout, per layer, for K and for V: one row of head_dim per (block, head, slot)::

    [(num_blocks + 1) * n_kv_heads * block_size, head_dim]   viewed as
    [num_blocks + 1, n_kv_heads, block_size, head_dim]
      block 0 .. num_blocks-1: handed out by the allocator
      block num_blocks:        scratch; padded query rows write here and nothing reads it

Head-major inside a block measured fastest for gather-then-attend on MLX (MLX_NOTES.md). The
arrays are kept flat because a write is a scatter along axis 0 of exactly the stored array:
one flat row index per new (token, head) cost a third of a block/slot scatter into the 4-d
shape, and a reshaped view would share the buffer and turn the write into a copy of the layer.
A run of consecutive blocks is a contiguous range of rows, so block copies go run by run.

Quantized (``KVFormat(bits=8 | 4)``, engine.kv_bits): a row is one head's K (or V) of one
token as ``mx.quantize`` gives it along head_dim, stored as uint32 words::

    [ packed values: head_dim * bits / 32 words | scales, then biases: head_dim / group_size
      each, in the model's dtype, viewed as words ]

A token's row is quantized on its own (groups run along head_dim, as mlx_lm's
``QuantizedKVCache``), so overwriting a slot, a partial block or a trimmed draft needs no
other row; and every path that moves blocks (copies, relocations, swaps, KV files) moves raw
words, whatever the format. The paged view hands attention (packed, scales, biases) tuples
and exposes ``bits`` and ``group_size``, so mlx_lm's attention takes its quantized path
(``quantized_scaled_dot_product_attention``: ``mx.quantized_matmul`` on the gathered blocks).

One batch of a step is described once by a ``BatchLayout`` (index arrays built on the host),
shared by every layer's ``PagedKVCache`` view::

    row b:  computes n_b new tokens at positions start_b .. start_b+n_b-1 (right-padded to L)
            reads its blocks table_b[0..k_b) and attends to positions <= its query position
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from itertools import chain

import mlx.core as mx
import numpy as np

from harness.platform.models import KV_BITS, LoadedModel, kv_row_bytes

QUANT_GROUP_SIZES = (32, 64, 128)  # what mx.quantize supports


@dataclass(frozen=True)
class KVFormat:
    """How the arena stores K and V: ``bits=16`` in the model's dtype as is (float32 models
    too: 16 names "not quantized"); 8 or 4 group-wise affine, ``mx.quantize`` with
    ``group_size`` values per scale and bias along head_dim (mlx_lm's ``QuantizedKVCache``
    default: 64). Config: ``engine.kv_bits``, ``engine.kv_group_size``."""

    bits: int = 16
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS or isinstance(self.bits, bool):
            raise ValueError(
                f"engine.kv_bits={self.bits!r} is invalid: choose 16 (the model's dtype, not "
                "quantized), 8 or 4"
            )
        if self.group_size not in QUANT_GROUP_SIZES or isinstance(self.group_size, bool):
            raise ValueError(
                f"engine.kv_group_size={self.group_size!r} is invalid: choose 32, 64 or 128 "
                "(the group sizes mx.quantize supports)"
            )

    @property
    def quantized(self) -> bool:
        return self.bits != 16

    def check(self, model: LoadedModel) -> None:
        """``ValueError`` when ``model``'s KV cannot be stored in this format."""
        if self.quantized and model.head_dim % self.group_size:
            raise ValueError(
                f"engine.kv_group_size={self.group_size} does not divide model "
                f"{model.name!r}'s head_dim={model.head_dim}: choose one of 32, 64, 128 that "
                "divides it"
            )


UNQUANTIZED = KVFormat()  # engine.kv_bits=16, the default


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
        kv_format: KVFormat = UNQUANTIZED,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"the KV arena needs num_blocks >= 1 and block_size >= 1, "
                f"got {num_blocks} and {block_size}: raise engine.num_blocks or kv_cache_bytes"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # the model's: K and V in, attention's inputs out
        self.format = kv_format
        self.scratch_block = num_blocks
        self.rows_per_block = num_kv_heads * block_size
        # A row's stored width: head_dim values, or the words of a quantized row.
        row = kv_row_bytes(head_dim, dtype, kv_format.bits, kv_format.group_size)
        self.width = row // 4 if kv_format.quantized else head_dim
        stored = mx.uint32 if kv_format.quantized else dtype
        shape = ((num_blocks + 1) * self.rows_per_block, self.width)
        # Exactly one live reference to each array: a second one would turn every in-place
        # write into a copy of the whole layer (MLX arrays are values).
        self.keys = [mx.zeros(shape, dtype=stored) for _ in range(num_layers)]
        self.values = [mx.zeros(shape, dtype=stored) for _ in range(num_layers)]
        mx.eval(self.keys, self.values)

    @classmethod
    def for_model(
        cls,
        model: LoadedModel,
        num_blocks: int,
        block_size: int,
        kv_format: KVFormat = UNQUANTIZED,
    ) -> KVArena:
        """An arena shaped for ``model``'s full-attention KV (layers, KV heads, head size,
        dtype), stored in ``kv_format``; sliding-window layers have their own
        (harness/engine/window.py)."""
        kv_format.check(model)
        return cls(
            num_layers=len(model.full_layers),
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.dtype,
            kv_format=kv_format,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the allocatable blocks (the scratch block is not counted): packed values,
        scales and biases when quantized."""
        per_layer = self.keys[0].nbytes * self.num_blocks // (self.num_blocks + 1)
        return 2 * len(self.keys) * per_layer

    def blocks(self, pool: mx.array) -> mx.array:
        """A read-only view of one layer's K or V as ``[num_blocks + 1, H, bs, D]``."""
        return pool.reshape(self.num_blocks + 1, self.num_kv_heads, self.block_size, -1)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply (src, dst) block copies reported by the allocator (relocation, COW).

        Every source is read (one gather per array) before any destination is written, so
        a relocation may overlap its old region; each run of consecutive destinations is then
        one slice write (MLX's CPU scatter moves ~10 ns per element, a slice write is a copy).
        """
        if not copies:
            return
        src = mx.array([s for s, _ in copies], dtype=mx.int32)
        keys = [self.blocks(pool)[src] for pool in self.keys]
        values = [self.blocks(pool)[src] for pool in self.values]
        mx.eval(keys, values)  # materialise first, so the writes below go in place
        self._write_blocks([d for _, d in copies], keys, values)

    def swap_out(self, blocks: Sequence[int]) -> HostBlocks:
        """Copy ``blocks`` (every layer, K and V) into host memory, in the given order."""
        idx = mx.array(blocks, dtype=mx.int32)
        # numpy has no bfloat16: move the raw bits. np.array copies out of MLX's buffer, so
        # the copy is paid even on unified memory (it is what the step's swap_time measures).
        raw = RAW_BITS[self.keys[0].dtype.size]
        keys = [np.array(self.blocks(pool)[idx].view(raw)) for pool in self.keys]
        values = [np.array(self.blocks(pool)[idx].view(raw)) for pool in self.values]
        return HostBlocks(keys, values)

    def swap_in(self, host: HostBlocks, blocks: Sequence[int], first: int = 0) -> None:
        """Write host blocks ``first, first + 1, ...`` into device ``blocks``."""
        if not blocks:
            return
        dtype = self.keys[0].dtype
        keys, values = (
            [mx.array(a[first : first + len(blocks)]).view(dtype) for a in saved]
            for saved in (host.keys, host.values)
        )
        self._write_blocks(blocks, keys, values)

    def _write_blocks(self, dst: Sequence[int], keys: list, values: list) -> None:
        """Write block ``j`` of ``keys[layer]`` / ``values[layer]`` into block ``dst[j]``,
        one slice write per run of consecutive destination blocks."""
        runs = _runs(dst)
        per = self.rows_per_block
        for arrays, data in ((self.keys, keys), (self.values, values)):
            for layer, blocks in enumerate(data):
                rows = blocks.reshape(-1, self.width)
                pool = arrays[layer]
                for at, block, n in runs:
                    pool[block * per : (block + n) * per] = rows[at * per : (at + n) * per]
                arrays[layer] = pool
        mx.eval(self.keys, self.values)


def _runs(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in ``blocks``, first block, length) of each run of consecutive block ids."""
    runs = []
    start = 0
    for j in range(1, len(blocks) + 1):
        if j == len(blocks) or blocks[j] != blocks[j - 1] + 1:
            runs.append((start, blocks[start], j - start))
            start = j
    return runs


# Unsigned ints of each dtype size: host copies keep an array's raw bits (numpy has no
# bfloat16).
RAW_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


@dataclass
class HostBlocks:
    """A swapped-out sequence's KV in host memory: per layer ``[n, n_kv, block_size, w]``
    raw bits of the arena's stored rows (w = head_dim values, or a quantized row's words)."""

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
        write_rows: [B*H*L] arena row of each new (token, head), in the order of the model's
            ``[B, H, L, D]`` keys and values (padding goes to the scratch block).
        read_rows: [B, H, K] rows of the arena viewed as [(num_blocks+1) * H, bs * D]
            (block * H + head) that each row attends over, padded with the scratch block;
            one gather lands K/V straight in the [B, H, K*bs, D] layout attention wants
            (5x faster than gathering blocks and then transposing). Tables that are runs of
            consecutive blocks (contiguous, buddy) use it too: a token-major arena
            ([H, blocks, bs, D]) reads one row's run by a zero-copy slice, but measured no
            faster at batch 1 (where the gather is small), and a batch's rows start at
            unrelated offsets, so a batch of them needs a copy all the same.
        mask: [B, 1, L, K*block_size] True where a query may attend to a key.

    With ``window`` (a sliding-window layer, harness/engine/window.py) the tables are rings:
    ``read_rows`` holds the ring blocks with the window's positions before each row's first
    query, ``write_rows`` the row's last ``ring * block_size`` positions (the rest and the
    padding go to scratch), and ``mask`` [B, 1, L, K*bs + L] covers the keys read, then the
    new keys: True where ``query - window < key position <= query`` and the key is written.
    """

    offsets: mx.array
    write_rows: mx.array
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
        window: int | None = None,
    ) -> BatchLayout:
        """Lay out rows that compute ``lengths[b]`` tokens from position ``starts[b]`` over
        their block ``tables`` (rings, with ``window``)."""
        if window is not None:
            return _ring_layout(
                tables, starts, lengths, window, block_size, scratch_block, num_kv_heads
            )
        if max(lengths) == 1:
            return _decode_layout(tables, starts, block_size, scratch_block, num_kv_heads)
        # Few numpy calls and transfers, none per row: at decode this runs on the host every
        # step, beside a forward of a few ms. The mask is built by MLX from the offsets.
        start = np.asarray(starts, dtype=np.int32)
        lens = np.asarray(lengths, dtype=np.int32)
        need = -(-(start + lens) // block_size)  # blocks each row reads
        num_read = int(need.max())
        padded = _padded_tables(tables, need, num_read + 1, scratch_block)  # last: padding
        step = np.arange(lens.max(), dtype=np.int32)
        pos = start[:, None] + step  # [B, L]
        block_of = np.where(step < lens[:, None], pos // block_size, num_read)
        blocks = padded[np.arange(len(padded))[:, None], block_of][:, None, :]  # [B, 1, L]
        heads = np.arange(num_kv_heads, dtype=np.int32)[:, None]
        write_rows = (blocks * num_kv_heads + heads) * block_size + (pos % block_size)[:, None, :]
        offsets = mx.array(start)
        queries = offsets[:, None, None, None] + mx.arange(len(step))[None, None, :, None]
        return cls(
            offsets=offsets,
            write_rows=mx.array(write_rows.reshape(-1)),
            read_rows=mx.array(padded[:, None, :num_read] * num_kv_heads + heads),
            mask=mx.arange(num_read * block_size) <= queries,
            num_read_blocks=num_read,
        )


def _decode_layout(
    tables: Sequence[Sequence[int]],
    starts: Sequence[int],
    block_size: int,
    scratch_block: int,
    num_kv_heads: int,
) -> BatchLayout:
    """``BatchLayout.build`` for rows of one new token each (decode), the step the host
    builds most often: a few integer operations a row in Python (its blocks read, as head
    0's rows; its new token's rows for every head), then three MLX arrays made straight from
    the lists, the read rows' other heads one lazy add in the forward's graph, and the mask.
    No numpy: right after a forward has run through the caches each numpy or MLX call costs
    ~10 µs, several times what it does in a loop of its own, and this way makes the fewest
    (measured inside a running engine, batch 32 on the tiny model, with the step's inputs:
    ~200 -> ~120 µs). A batch that reads ``_SCALE_IN_GRAPH`` blocks or more has its blocks
    sliced from its tables in C and scaled to rows by one more lazy op instead of one by
    one (host_time at batch 32 and 1,024 tokens of context, 66 blocks a row: build 0.74 ->
    0.65 ms; at 64 tokens the loop is as fast)."""
    bs, heads = block_size, num_kv_heads
    num_read = max(starts) // bs + 1
    pad = [scratch_block] * num_read
    head_rows = range(0, heads * bs, bs)  # a head's rows in a block: bs apart
    in_graph = len(starts) * num_read >= _SCALE_IN_GRAPH
    read, written = [], []  # per row [its blocks read (as head 0's rows)]; its new token's rows
    for table, start in zip(tables, starts, strict=True):
        k = start // bs + 1
        blocks = table[:k] if k == num_read else [*table[:k], *pad[k:]]
        read.append([blocks if in_graph else [b * heads for b in blocks]])
        row = table[k - 1] * heads * bs + start % bs
        written += [row + h for h in head_rows]
    offsets = mx.array(starts, dtype=mx.int32)
    read_rows = mx.array(read, dtype=mx.int32)  # [B, 1, K]
    if in_graph:
        read_rows = read_rows * heads
    return BatchLayout(
        offsets=offsets,
        write_rows=mx.array(written, dtype=mx.int32),
        read_rows=read_rows + _head_column(heads),  # [B, 1, K] + [H, 1]
        mask=mx.arange(num_read * bs) <= offsets.reshape(-1, 1, 1, 1),
        num_read_blocks=num_read,
    )


_SCALE_IN_GRAPH = 256  # blocks a decode batch reads from which MLX scales them (above)


@cache
def _head_column(heads: int) -> mx.array:
    """[heads, 1] int32: 0 .. heads - 1, made once per head count (a constant, never
    written)."""
    return mx.arange(heads, dtype=mx.int32)[:, None]


def _padded_tables(
    tables: Sequence[Sequence[int]], need: np.ndarray, width: int, scratch_block: int
) -> np.ndarray:
    """[B, width] int32: row b's first ``need[b]`` blocks of its table, then the scratch
    block. The tables are read as one flat array (a table may hold more blocks than its row
    reads: lookahead slots, a region's slack), not row by row."""
    sizes = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(sizes.sum()))
    cols = np.arange(width)
    first = np.cumsum(sizes) - sizes  # where each table starts in ``flat``
    at = np.minimum(first[:, None] + cols, len(flat) - 1)
    return np.where(cols < need[:, None], flat[at], np.int32(scratch_block))


def _ring_layout(
    rings: Sequence[Sequence[int]],
    starts: Sequence[int],
    lengths: Sequence[int],
    window: int,
    block_size: int,
    scratch_block: int,
    num_kv_heads: int,
) -> BatchLayout:
    """``BatchLayout.build`` over rings: logical block j of a row lives in ring slot j mod k."""
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
    return BatchLayout(
        offsets=mx.array(start.astype(np.int32)),
        write_rows=mx.array(write_rows.reshape(-1).astype(np.int32)),
        read_rows=mx.array((read[:, None, :] * num_kv_heads + heads).astype(np.int32)),
        mask=mx.array(mask[:, None]),
        num_read_blocks=num_read,
    )


class PagedKVCache:
    """One layer's view of the arena for one batch: mlx_lm's cache protocol.

    mlx_lm attention calls ``offset`` (RoPE positions), ``update_and_fetch`` and, through
    ``create_attention_mask``, ``make_mask``. Nothing else is needed, so models run unmodified.
    ``PagedKVCache.over`` picks the view of a quantized arena when it is one.
    """

    @staticmethod
    def over(arena: KVArena, layer: int, layout: BatchLayout) -> PagedKVCache:
        """The view of ``arena``'s ``layer`` for ``layout``, quantized or not."""
        if arena.format.quantized:
            return QuantizedPagedKVCache(arena, layer, layout)
        return PagedKVCache(arena, layer, layout)

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
        batch, heads, _, dim = new.shape
        pool = pools[self.layer]
        pool[layout.write_rows] = new.reshape(-1, dim)
        pools[self.layer] = pool
        block_size = self.arena.block_size
        fetched = pool.reshape(-1, block_size * dim)[layout.read_rows]  # [B, H, K, bs * D]
        return fetched.reshape(batch, heads, layout.num_read_blocks * block_size, dim)


class QuantizedPagedKVCache(PagedKVCache):
    """The paged view of a quantized arena. ``bits`` and ``group_size`` are what mlx_lm's
    ``scaled_dot_product_attention`` looks for: it then attends with
    ``quantized_scaled_dot_product_attention`` over the (packed, scales, biases) tuples
    ``update_and_fetch`` returns, as over its own ``QuantizedKVCache``. New K/V are quantized
    before they are attended to, so a token's own key is read back quantized, as there."""

    @property
    def bits(self) -> int:
        return self.arena.format.bits

    @property
    def group_size(self) -> int:
        return self.arena.format.group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        return self._write_read(self.arena.keys, keys), self._write_read(self.arena.values, values)

    def _write_read(self, pools: list[mx.array], new: mx.array) -> tuple[mx.array, ...]:
        arena, layout = self.arena, self.layout
        batch, heads, _, dim = new.shape
        packed, scales, biases = mx.quantize(
            new.reshape(-1, dim), group_size=self.group_size, bits=self.bits
        )
        words = packed.shape[-1]
        rows = mx.concatenate(
            [packed, mx.concatenate([scales, biases], axis=-1).view(mx.uint32)], axis=-1
        )
        pool = pools[self.layer]
        pool[layout.write_rows] = rows
        pools[self.layer] = pool
        bs, width = arena.block_size, arena.width
        fetched = pool.reshape(-1, bs * width)[layout.read_rows]  # [B, H, K, bs * width]
        fetched = fetched.reshape(batch, heads, layout.num_read_blocks * bs, width)
        groups = dim // self.group_size
        affine = fetched[..., words:].view(arena.dtype)
        return fetched[..., :words], affine[..., :groups], affine[..., groups:]
