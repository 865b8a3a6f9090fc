"""A step's forward by its shape (harness/engine/step_shape.py): the work counted for given
groups, and the modelled runner's work and tokens from a ``StepShape`` alone. Block size 4,
a key 1/1024 of a token (the tiny model's ``key_cost``); every count below by hand."""

from __future__ import annotations

import numpy as np

from harness.engine.modelled import ModelledRunner
from harness.engine.step_shape import StepShape, forward_work

KEY = 1 / 1024


def shape(queries, starts, num_logits, drafts=None) -> StepShape:
    return StepShape(np.array(queries), np.array(starts), np.array(num_logits), drafts or {})


def runner(acceptance: float = 0.5, window: int | None = None) -> ModelledRunner:
    return ModelledRunner(
        block_size=4, key_cost=KEY, vocab_size=100, acceptance=acceptance, seed=0, window=window
    )


def test_each_group_pads_to_its_own_longest_row_and_context():
    """Rows (queries, start): (3, 5), (1, 20), (2, 0); contexts 8, 21, 2. Groups [1] and
    [2, 0], given out of row order. [1]: 1 query, ceil(21/4) = 6 blocks = 24 slots, 24
    pairs. [2, 0]: padded to 3 queries and ceil(8/4) x 4 = 8 slots: 6 queries, 16 slots,
    2 x 3 x 8 = 48 pairs. A sliding window of 8: start 20 reads blocks of positions 13..19,
    blocks 3..4: 2 blocks = 8 slots, 1 x (8 + 1) = 9 pairs; starts 0 and 5 read none and
    blocks 0..1 (positions 0..4): 2 blocks = 8 slots each, 2 x 3 x (8 + 3) = 66 pairs."""
    work = forward_work([3, 1, 2], [8, 21, 2], 3, [[1], [2, 0]], block_size=4, window=8)
    assert (work.batch_size, work.row_groups, work.logit_rows) == (3, 2, 3)
    assert (work.query_tokens_padded, work.kv_slots_read, work.attention_pairs) == (7, 40, 72)
    assert (work.kv_slots_attended, work.single_token_rows) == (31, 1)
    assert (work.window_kv_slots_read, work.window_attention_pairs) == (24, 75)


def test_the_modelled_runner_counts_one_batch_from_the_shape_alone():
    """The same rows from a ``StepShape``: sorted (1, 21), (2, 2), (3, 8), each joins (row
    2: 16 + 2 x 2 x 1.02 = 20.1 <= 17.0 + 18.0; row 0: 16 + 3 x 3 x 1.02 = 25.2 <= 20.1 +
    19.0): one batch of 3 rows x 3 queries over ceil(21/4) x 4 = 24 slots: 9 queries, 72
    slots, 216 pairs. Rows 0 and 1 sample (2 logits rows): two tokens."""
    forward = runner().forward(shape([3, 1, 2], [5, 20, 0], [1, 1, 0]))
    work = forward.work
    assert (work.row_groups, work.query_tokens_padded, work.kv_slots_read) == (1, 9, 72)
    assert (work.attention_pairs, work.kv_slots_attended, work.logit_rows) == (216, 31, 2)
    assert forward.logits is None and len(forward.tokens) == 2


def test_a_verification_keeps_its_drafts_while_accepted_and_changes_the_first_rejected():
    """Row 0 decodes (1 logits row); row 1 verifies drafts 5, 6, 7 (its last token and the
    drafts: 4 logits rows). All accepted: rows 1..3 are the drafts, then a bonus token. None
    accepted: row 1 differs from draft 5."""
    step = shape([1, 4], [10, 10], [1, 4], {1: [5, 6, 7]})
    tokens = runner(acceptance=1.0).forward(step).tokens
    assert len(tokens) == 5 and tokens[1:4].tolist() == [5, 6, 7]
    tokens = runner(acceptance=0.0).forward(step).tokens
    assert len(tokens) == 5 and tokens[1] != 5
