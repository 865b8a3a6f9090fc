"""A run of decode steps' own bookkeeping (schedulers/decode_run.py): at which steps its rows
cross their write limits and fill their blocks, its tokens and times kept across growth, and
which rows stop at its last step. Values worked out by hand in each test; the engine-level
equivalence with single steps is tests/engine/test_batch_steps.py's."""

from __future__ import annotations

import numpy as np

from schedulers.decode_run import DecodeRun


def test_crossings_and_fills_come_at_the_steps_that_write_past_and_fill_a_block():
    # block_size 4. Row 0 decodes from slot 5 and holds 2 blocks (limit 8): it writes slot 8
    # at step 3 (a crossing), and fills its block when 8 slots are computed, after step 2
    # (5 + 2 + 1), then every 4 steps. Row 1 from slot 10, limit 12: crosses at step 2, fills
    # after step 1 (12 computed). Both stop at length 19 and 24: after step 12, the last.
    run = DecodeRun(["a", "b"], [5, 10], [8, 12], [19, 24], block_size=4)
    assert run.last == 12
    crossings, fills = [], []
    for step in range(13):
        assert run.step_starts() == [5 + step, 10 + step]
        crossing = run.crossing()
        crossings += [(step, row) for row in crossing]
        for row in crossing:  # each takes one block: 4 more slots
            run.cross_at(row, run.starts[row] + step + 4)
        run.took([step, -step], float(step))
        fills += [(step, row) for row in run.filled()]
    assert crossings == [(2, 1), (3, 0), (6, 1), (7, 0), (10, 1), (11, 0)]
    assert fills == [(1, 1), (2, 0), (5, 1), (6, 0), (9, 1), (10, 0)]


def test_a_rows_tokens_and_times_are_kept_past_the_first_columns():
    run = DecodeRun(["a", "b", "c"], [0, 3, 7], [400] * 3, [201, 204, 208], block_size=16)
    assert run.last == 199
    for step in range(150):  # past the 64 columns the tokens start with, twice grown
        run.took([step, 1000 + step, 2000 + step], 0.5 * step)
    assert run.steps == 150
    tokens, times = run.take(1, 150)
    np.testing.assert_array_equal(np.frombuffer(tokens, dtype=np.int32), 1000 + np.arange(150))
    assert times.tolist() == [0.5 * s for s in range(150)]
    assert run.take(1, 150) == (b"", times[:0])  # taken once
    tokens, _ = run.take(2, 100)
    np.testing.assert_array_equal(np.frombuffer(tokens, dtype=np.int32), 2000 + np.arange(100))
    assert run.tokens.shape[1] <= 200  # never more columns than the run has steps


def test_the_rows_at_their_length_limit_stop_at_the_last_step():
    # A row of length start + 1 reaches limit L after step L - start - 2: row 0 (start 10,
    # limit 20) after step 8, row 2 (start 4, limit 14) after step 8 too, row 1 after 12.
    run = DecodeRun(["a", "b", "c"], [10, 6, 4], [99, 99, 99], [20, 20, 14], block_size=16)
    assert run.last == 8
    assert run.stopped() == [0, 2]
