"""The index arrays of one padded batch (``BatchLayout.build``), computed by hand: a decode
batch (one new token a row) and a batch of prompt chunks, over tables longer than what
their rows read."""

from __future__ import annotations

import numpy as np

import harness  # noqa: F401  (BLAS switch before mlx)
from harness.engine.kv_cache import BatchLayout

# block size 4, 2 KV heads, scratch block 9. Row 0 decodes position 5 over table [3, 7, 8]
# (block 8 is reserved ahead, not read); row 1 decodes position 2 over table [1].
TABLES = [[3, 7, 8], [1]]


def test_a_decode_batch_by_hand():
    layout = BatchLayout.build(
        TABLES, [5, 2], [1, 1], block_size=4, scratch_block=9, num_kv_heads=2
    )
    # Row 0 reads blocks 3, 7; row 1 block 1, then the scratch block: rows block * 2 + head.
    assert layout.num_read_blocks == 2
    assert np.array(layout.read_rows).tolist() == [[[6, 14], [7, 15]], [[2, 18], [3, 19]]]
    # Position 5 is slot 1 of block 7: (7 * 2 + head) * 4 + 1; position 2 slot 2 of block 1.
    assert np.array(layout.write_rows).tolist() == [57, 61, 10, 14]
    assert np.array(layout.offsets).tolist() == [5, 2]
    mask = np.array(layout.mask)
    assert mask.shape == (2, 1, 1, 8)
    assert mask[0, 0, 0].tolist() == [True] * 6 + [False] * 2
    assert mask[1, 0, 0].tolist() == [True] * 3 + [False] * 5


def test_a_batch_of_chunks_by_hand():
    """Row 0 computes positions 5, 6 (a 2-token chunk); row 1 position 2 alone, padded to two
    queries: its padding position writes to the scratch block."""
    layout = BatchLayout.build(
        TABLES, [5, 2], [2, 1], block_size=4, scratch_block=9, num_kv_heads=2
    )
    assert layout.num_read_blocks == 2
    assert np.array(layout.read_rows).tolist() == [[[6, 14], [7, 15]], [[2, 18], [3, 19]]]
    # [B, H, L]: row 0 slots 1, 2 of block 7; row 1 slot 2 of block 1, then scratch slot 3.
    assert np.array(layout.write_rows).tolist() == [
        *[57, 58, 61, 62],
        *[10, (9 * 2 + 0) * 4 + 3, 14, (9 * 2 + 1) * 4 + 3],
    ]
    mask = np.array(layout.mask)
    assert mask.shape == (2, 1, 2, 8)
    assert mask[0, 0].tolist() == [[True] * 6 + [False] * 2, [True] * 7 + [False]]
    assert mask[1, 0, 0].tolist() == [True] * 3 + [False] * 5


def test_a_decode_batch_reads_the_same_rows_however_many_blocks_it_reads():
    """Batches of decodes below and above the size from which MLX scales the blocks to rows
    (``_SCALE_IN_GRAPH``, 256 blocks read): each row reads its table's first blocks, then
    the scratch block, as rows block * heads + head; its token goes to its last block."""
    rng = np.random.default_rng(5)
    for rows, longest in ((3, 20), (40, 150)):  # 3 x 6 blocks; 40 x 10 blocks read
        starts = rng.integers(1, longest, rows).tolist()
        starts[0] = longest  # the longest row sets the blocks read
        tables = [rng.choice(500, s // 16 + 2, replace=False).tolist() for s in starts]
        layout = BatchLayout.build(
            tables, starts, [1] * rows, block_size=16, scratch_block=999, num_kv_heads=4
        )
        width = longest // 16 + 1
        assert layout.num_read_blocks == width
        for b, (table, start) in enumerate(zip(tables, starts, strict=True)):
            blocks = table[: start // 16 + 1]
            blocks += [999] * (width - len(blocks))
            want = [[block * 4 + h for block in blocks] for h in range(4)]
            assert np.array(layout.read_rows[b]).tolist() == want, (rows, b)
            last = table[start // 16]
            got = np.array(layout.write_rows[4 * b : 4 * b + 4]).tolist()
            assert got == [(last * 4 + h) * 16 + start % 16 for h in range(4)]
