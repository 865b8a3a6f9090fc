"""A step's forward by its shape (harness/engine/step_shape.py): the work counted for given
groups, and the modelled runner's work and tokens from a ``StepShape`` alone. Block size 4,
a key 1/1024 of a token (the tiny model's ``key_cost``); every count below by hand."""

from __future__ import annotations

import numpy as np
import pytest

from harness.engine.modelled import ModelledRunner
from harness.engine.step_shape import (
    GROUP_COST,
    StepShape,
    count_work,
    decodes_work,
    forward_work,
    group_rows,
)

KEY = 1 / 1024


def shape(queries, starts, num_logits, drafts=None) -> StepShape:
    return StepShape(list(queries), list(starts), list(num_logits), drafts or {})


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


def _rule(queries, contexts, key):
    """``group_rows``' rule written out: rows by (length, context, index); a row joins the
    current group unless running it alone costs less than the padding it adds there."""
    groups, cost = [], lambda n, q, c: GROUP_COST + n * q * (1.0 + c * key)
    for q, c, i in sorted(zip(queries, contexts, range(len(queries)), strict=True)):
        if groups:
            g = groups[-1]
            gq, gc = max(queries[r] for r in g), max(contexts[r] for r in g)
            joined = cost(len(g) + 1, max(gq, q), max(gc, c))
            if joined <= cost(len(g), gq, gc) + cost(1, q, c):
                g.append(i)
                continue
        groups.append([i])
    return groups


def test_a_long_decode_step_splits_where_the_padding_costs_more_than_a_group():
    """100 decode rows, even ones at context 100 and odd ones at 500, key 1/1024. The 50 at
    100 join each other (no padding); the first at 500 would make a group of 51 padded to
    500: 16 + 51 x (1 + 500/1024) = 91.90, against the 50's 16 + 50 x (1 + 100/1024) =
    70.88 plus its own 16 + 1.488 = 17.49: 88.37, so it starts a group, which the other 49
    join."""
    contexts = [100 if i % 2 == 0 else 500 for i in range(100)]
    groups = group_rows([1] * 100, contexts, KEY)
    assert groups == [list(range(0, 100, 2)), list(range(1, 100, 2))]
    assert group_rows(np.ones(100, dtype=np.int64), np.array(contexts), KEY) == groups


def test_long_runs_of_one_length_group_as_the_rule_says():
    """Steps of 96 to 400 rows, mostly decodes (one length), some with prompt chunks after
    them, contexts spread or tied: the groups are the rule's, row for row."""
    rng = np.random.default_rng(7)
    for case in range(60):
        n = int(rng.integers(96, 400))
        queries = [1] * n if case % 3 else rng.choice([1, 1, 1, 1, 8, 64], n).tolist()
        if case % 4 == 0:  # ties: contexts on a coarse grid
            contexts = (rng.integers(1, 20, n) * int(rng.integers(1, 500))).tolist()
        else:
            contexts = rng.integers(1, 20_000, n).tolist()
        key = [KEY, 1 / 256, 1 / 16384][case % 3]
        assert group_rows(queries, contexts, key) == _rule(queries, contexts, key), case


def test_short_steps_of_one_length_group_as_the_rule_says():
    """Steps of 2 to 95 rows all of one length (decodes, or equal chunks), contexts close
    (one group), spread (several) or tied: the groups are the rule's, row for row."""
    rng = np.random.default_rng(11)
    splits = 0
    for case in range(300):
        n = int(rng.integers(2, 96))
        q = [1, 1, 8, 64][case % 4]
        top = [50, 2_000, 60_000][case % 3]
        contexts = (rng.integers(1, top, n) + q).tolist()
        if case % 5 == 0:  # ties
            contexts = [contexts[0]] * (n // 2) + contexts[n // 2 :]
        key = [KEY, 1 / 256, 1 / 16384][case % 3]
        expected = _rule([q] * n, contexts, key)
        splits += len(expected) > 1
        assert group_rows([q] * n, contexts, key) == expected, case
    assert 30 < splits < 270  # both kinds of step were tried


def test_short_mixed_steps_group_as_the_rule_says():
    """Steps of 2 to 95 rows, decodes with a few prompts or chunks among them (an admission
    step's, chunked prefill's), contexts close (the decodes one group), spread or tied: the
    groups are the rule's, row for row."""
    rng = np.random.default_rng(13)
    joined = 0
    for case in range(400):
        n = int(rng.integers(2, 96))
        queries = [1] * n
        for row in rng.choice(n, size=int(rng.integers(1, min(n, 4) + 1)), replace=False):
            queries[row] = int(rng.choice([2, 16, 512, 3_000]))
        top = [50, 2_000, 60_000][case % 3]
        contexts = [q + int(c) for q, c in zip(queries, rng.integers(0, top, n), strict=True)]
        if case % 5 == 0:  # ties
            contexts = [contexts[0]] * (n // 2) + contexts[n // 2 :]
        key = [KEY, 1 / 256, 1 / 16384][case % 3]
        expected = _rule(queries, contexts, key)
        ones = sorted(i for i in range(n) if queries[i] == 1)
        joined += len(ones) > 1 and sorted(expected[0]) == ones
        assert group_rows(queries, contexts, key) == expected, case
    assert 50 < joined < 350  # both kinds of step were tried


def test_the_counts_alone_are_those_of_the_groups_rows():
    """``count_work`` (the model clock's) counts what ``forward_work`` counts over
    ``group_rows``' groups: steps of one length that join one group or split, mixed steps,
    long runs, a window model's reads."""
    rng = np.random.default_rng(12)
    for case in range(300):
        n = int(rng.integers(1, 130))
        mixed = case % 4 == 3
        queries = rng.integers(1, 64, n).tolist() if mixed else [[1, 8][case % 2]] * n
        top = [50, 2_000, 60_000][case % 3]
        contexts = [q + int(c) for q, c in zip(queries, rng.integers(0, top, n), strict=True)]
        key = [KEY, 1 / 256, 1 / 16384][case % 3]
        window = 64 if case % 5 == 0 else None
        groups = group_rows(queries, contexts, key)
        expected = forward_work(queries, contexts, n, groups, 16, window)
        assert count_work(queries, contexts, n, key, 16, window) == expected, case


def test_one_group_of_decodes_is_counted_from_its_longest_context_and_its_sum():
    """``decodes_work``: two single-token rows of contexts 5 and 17 in one group, block 4,
    read 20 slots each (17 rounded up to blocks): 40 keys read and 40 pairs, 22 attended;
    and for random groups, ``forward_work``'s counts."""
    got = decodes_work(2, 17, 22, 4)
    assert (got.batch_size, got.row_groups, got.query_tokens_padded) == (2, 1, 2)
    assert (got.kv_slots_read, got.attention_pairs, got.kv_slots_attended) == (40, 40, 22)
    assert (got.logit_rows, got.single_token_rows, got.window_kv_slots_read) == (2, 2, 0)
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 32, 95):
        contexts = rng.integers(1, 5_000, n).tolist()
        expected = forward_work([1] * n, contexts, n, (range(n),), 16)
        assert decodes_work(n, max(contexts), sum(contexts), 16) == expected, n


def test_a_runs_forwards_are_its_steps_shapes_forwards():
    """``ModelledRunner.decode_run``: each step of a run of decodes (every row one token
    further a step) has the work and tokens ``forward`` gives its shape, whether its rows
    join one group (contexts close together) or not (far apart, a tiny key cost's split)."""
    for starts in ([10, 12, 15, 11], [3, 900, 40, 20_000]):
        run, steps = runner().decode_run(starts), runner()
        assert run.joined == (starts[1] == 12)
        ones = [1] * len(starts)
        for step in range(40):
            alone = steps.forward(shape(ones, [s + step for s in starts], ones))
            got = run.forward(step)
            assert got.work == alone.work, (starts, step)
            np.testing.assert_array_equal(got.tokens, alone.tokens)


def test_decode_rows_on_the_edge_of_joining_group_as_the_rule_says():
    """A row joins the j rows before it (one length q, contexts ascending) when
    j q key (c_j - c_(j-1)) <= GROUP_COST. With key 1/1024, q 1 and j 2 the edge is a gap of
    8192 tokens: 8191 joins (15.998), 8193 starts a group (16.002), and 8192 is the edge
    itself, where the rule's floats decide. All three group as the rule says."""
    for gap, joins in ((8191, True), (8192, None), (8193, False)):
        contexts = [100, 110, 110 + gap]
        expected = _rule([1] * 3, contexts, KEY)
        assert group_rows([1] * 3, contexts, KEY) == expected, gap
        if joins is not None:
            assert expected == ([[0, 1, 2]] if joins else [[0, 1], [2]]), gap


def test_keys_that_cost_nothing_put_every_row_of_a_length_in_one_group():
    """With a key cost of 0 a row adds only its own tokens however long its context, never
    more than a group of its own: every decode joins one group, as the loop's rule says."""
    contexts = [5, 6, 100_000]
    assert group_rows([1] * 3, contexts, 0.0) == _rule([1] * 3, contexts, 0.0) == [[0, 1, 2]]


def test_a_runner_that_verifies_nothing_draws_the_same_tokens_ahead():
    """Steps of 1 to 3,000 sampling rows (past one draw ahead of 4,096): a runner built to
    verify nothing hands out the tokens the per-step draws give, and refuses a verification."""
    per_step, ahead = (
        runner(),
        ModelledRunner(
            block_size=4, key_cost=KEY, vocab_size=100, acceptance=0.5, seed=0, verifies=False
        ),
    )
    for n in [1, 32, 7, 3000, 64, 2500, 1, 900]:
        step = shape([1] * n, list(range(n)), [1] * n)
        assert ahead.forward(step).tokens.tolist() == per_step.forward(step).tokens.tolist()
    with pytest.raises(RuntimeError, match="verifies"):
        ahead.forward(shape([1, 4], [10, 10], [1, 4], {1: [5, 6, 7]}))
