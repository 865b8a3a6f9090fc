"""A step's forward by its shape alone: which rows share a padded batch, and the work counted.

Both runners behind the ``Runner`` seam call these, so a modelled step counts what a real
one would: the real runner (harness/engine/model_runner.py) reads the shape off its ``Row``s,
a runner without a model (harness/engine/modelled.py) gets it from the engine as lists of ints
(``StepShape``), no row built, no token list sliced, no block table read.

An mlx_lm model takes a rectangular batch: every row is padded to the longest row's length
(queries) and context (keys read). One padded batch of a mixed step would make every row
pay for the longest: a 1024-token prompt beside seven 16-token ones cost 8.2x the parts
alone, one 3,000-token context beside 31 short decodes 9.4x. So a step's rows are split into
groups of similar shape (``group_rows``), each a padded batch of its own. A group costs a
pass over the weights, so rows share one unless padding them together costs more than that.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import islice, repeat
from operator import lt, mul, sub
from typing import NamedTuple

import numpy as np

from harness.costmodel.work import StepWork, window_blocks_read
from harness.platform.models import LoadedModel

KEYS_PER_TOKEN_COST = 4  # keys per query that cost as much as the query's token: x hidden
GROUP_COST = 16  # a group's own cost (a pass over the weights, graph building), in tokens


class StepShape(NamedTuple):
    """A step's forward as lists of ints, one entry per row (a scheduled sequence, in plan order):
    feed ``queries`` tokens from position ``starts``, return logits for the last
    ``num_logits`` fed. ``drafts``: by row index, the drafts a verification row feeds last
    and wants logits for (only rows that verify at least one draft). What a runner that
    computes no logits needs of a step; the tokens themselves it never reads."""

    queries: list[int]
    starts: list[int]
    num_logits: list[int]
    drafts: dict[int, Sequence[int]]


def key_cost(loaded: LoadedModel) -> float:
    """One key read by one query, in units of one token through the weights: attention
    takes ~4 flops per hidden unit per key, the layers' matmuls ~24 per hidden unit^2."""
    return 1.0 / (KEYS_PER_TOKEN_COST * loaded.hidden_size)


def group_rows(queries: Sequence[int], contexts: Sequence[int], key_cost: float) -> list[list[int]]:
    """Split rows (indices) of ``queries`` tokens each over ``contexts`` (keys: cached plus
    new) into padded batches whose total estimated cost is low (lists, or integer arrays).

    A padded batch of n rows, the longest Q tokens and the longest context C, costs
    ``GROUP_COST + n * Q * (1 + C * key_cost)`` (in tokens through the weights). Rows are
    taken in order of length then context, and a row joins the current group unless running
    it as a group of its own would cost less than the padding it adds there.

    The rows of the shortest length come first (a decode step's every row): when there are
    ``_VECTOR_MIN`` or more, their groups are found by numpy (``_equal_queries``), the same
    float expressions as the loop's (``_greedy``), which takes the rest; fewer that all join
    one group (``_one_group``) are made one at once (``_greedy_after_shortest``).
    """
    n = len(queries)
    if not n:
        return []
    if n < _VECTOR_MIN:
        if min(queries) == max(queries):  # one length (decodes): by context alone
            order = sorted(range(n), key=contexts.__getitem__)  # stable: ties by index
            ascending = list(map(contexts.__getitem__, order))
            if _one_group(queries[0], ascending, key_cost):
                return [order]
            return _greedy(zip(repeat(queries[0]), ascending, order), key_cost)
        rows = sorted(zip(queries, contexts, range(n), strict=True))
        return _greedy_after_shortest(rows, key_cost)
    q = np.asarray(queries, dtype=np.int64)
    c = np.asarray(contexts, dtype=np.int64)
    order = np.lexsort((c, q))  # by length, then context, then index (a stable sort)
    q, c = q[order], c[order]
    first = int(q[0])
    run = int(np.searchsorted(q, first, side="right"))  # the rows of the shortest length
    if run < _VECTOR_MIN:
        return _greedy(zip(q.tolist(), c.tolist(), order.tolist(), strict=True), key_cost)
    groups, at = _equal_queries(first, c[:run], order[:run], key_cost)
    # The loop goes on from the last group as the vector part left it (its longest context
    # the last row's: contexts ascend within a length).
    last = int(c[at - 1])
    here = GROUP_COST + len(groups[-1]) * first * (1.0 + last * key_cost)
    rest = zip(q[at:].tolist(), c[at:].tolist(), order[at:].tolist(), strict=True)
    return _greedy(rest, key_cost, groups, last, here)


def _greedy_after_shortest(rows: list[tuple[int, int, int]], key_cost: float) -> list[list[int]]:
    """``_greedy`` over ``rows`` (length, context, index), sorted, of a step with rows of
    several lengths (an admission's prompt or a chunk among decodes): when the rows of the
    shortest length, first, all join one group (``_one_group``), that group is made at once
    and the loop goes on from it, as ``group_rows`` does past numpy's groups."""
    first = rows[0][0]
    run = bisect_left(rows, (first + 1,))  # the rows of the shortest length, found in C
    shortest = rows[:run]
    if run < 2 or not _one_group(first, [c for _, c, _ in shortest], key_cost):
        return _greedy(rows, key_cost)
    last = shortest[-1][1]
    here = GROUP_COST + run * first * (1.0 + last * key_cost)
    return _greedy(rows[run:], key_cost, [[i for _, _, i in shortest]], last, here)


_VECTOR_MIN = 96  # rows of one length from which numpy finds their groups faster
_VECTOR_GROUPS = 4  # groups numpy finds before the loop takes over (each costs a pass)
# ``_one_group``'s test passes with a slack of 1e-6 x GROUP_COST (16e-6 tokens) to spare,
# ~30x the loop's float rounding on costs below 1e9 tokens (a few ulp of 1.2e-7 each).
_MARGIN = 1.0 - 1e-6


def _one_group(q: int, contexts: list[int], key_cost: float) -> bool:
    """Whether ``_greedy`` puts rows of one length ``q`` (``contexts`` ascending) in one
    group, found without its loop (a decode step's rows, most often one group).

    In one group, row j joins the j rows before it when the joined group costs no more than
    the group before it plus the row alone: ``GROUP_COST + (j+1)q(1 + c_j k) <= GROUP_COST +
    jq(1 + c_{j-1} k) + GROUP_COST + q(1 + c_j k)``, i.e. ``j q k (c_j - c_{j-1}) <=
    GROUP_COST``. So all join when every ``j (c_j - c_{j-1})`` passes, by a margin
    (``_MARGIN``) far above the loop's rounding: then the loop's own float test passes too.
    Else (found at the first that does not) the loop decides (a row may start a group).
    Rows of no work (``q`` or ``key_cost`` 0) all join, as in the loop."""
    if not q * key_cost:
        return True
    steps = map(mul, map(sub, islice(contexts, 1, None), contexts), range(1, len(contexts)))
    return all(map(lt, steps, repeat(GROUP_COST * _MARGIN / (q * key_cost))))  # stops at a split


def _equal_queries(
    q: int, contexts: np.ndarray, rows: np.ndarray, key_cost: float
) -> tuple[list[list[int]], int]:
    """``_greedy``'s first groups over sorted rows of one length ``q`` (``contexts``
    ascending, ``rows`` their indices), at most ``_VECTOR_GROUPS``: the groups and how many
    rows they hold. In a group started at row s, row j > s joins while every row before it
    did, so its group then holds m = j - s rows of the longest context ``contexts[j - 1]``:
    the test is the loop's ``joined <= here + alone`` with those, for all j at once; the
    first j that fails starts the next group."""
    groups: list[list[int]] = []
    s, n = 0, len(contexts)
    alone = GROUP_COST + q * (1.0 + contexts * key_cost)  # each row a group of its own
    scale = 1.0 + contexts * key_cost
    while s < n and len(groups) < _VECTOR_GROUPS:
        m = np.arange(1, n - s)  # rows in the group before each next row
        joined = GROUP_COST + ((m + 1) * q) * scale[s + 1 :]
        here = GROUP_COST + (m * q) * scale[s : n - 1]
        fails = np.flatnonzero(joined > here + alone[s + 1 :])
        end = s + 1 + int(fails[0]) if len(fails) else n
        groups.append(rows[s:end].tolist())
        s = end
    return groups, s


def _greedy(
    rows: Iterable[tuple[int, int, int]],
    key_cost: float,
    groups: list[list[int]] | None = None,
    c: int = 0,
    here: float = 0.0,
) -> list[list[int]]:
    """``group_rows``' greedy over ``rows`` (length, context, index) in sorted order, going
    on from ``groups`` (its last, of longest context ``c`` and cost ``here``, may grow)."""
    # cost(n, q, c) = GROUP_COST + n * q * (1.0 + c * key_cost), written out in the loop:
    # it runs once per row per step. Rows come by (queries, context, index), so a group's
    # longest row is the one joining, and its longest context the larger of the two.
    groups = groups if groups is not None else []
    group = groups[-1] if groups else []
    for q, ci, i in rows:
        if group:
            mc = c if c > ci else ci
            joined = GROUP_COST + (len(group) + 1) * q * (1.0 + mc * key_cost)
            if joined <= here + (GROUP_COST + q * (1.0 + ci * key_cost)):
                group.append(i)
                c, here = mc, joined
                continue
        group = [i]
        groups.append(group)
        c, here = ci, GROUP_COST + q * (1.0 + ci * key_cost)
    return groups


def count_work(
    queries: list[int],
    contexts: list[int],
    logit_rows: int,
    key_cost: float,
    block_size: int,
    window: int | None = None,
    joined: bool | None = None,
) -> StepWork:
    """``forward_work`` of the rows as ``group_rows`` groups them, for a runner that counts
    and runs nothing (the model clock): which rows a group holds does not change the counts,
    so rows of one length that all join one group (a decode step's, most often) are found
    so from their contexts sorted, without ordering the rows themselves. ``joined``: whether
    they are rows of one length that ``decodes_join`` says all join, if the caller knows."""
    n = len(queries)
    if joined is None:
        joined = decodes_join(queries, contexts, key_cost)
    groups = (range(n),) if joined else group_rows(queries, contexts, key_cost)
    return forward_work(queries, contexts, logit_rows, groups, block_size, window)


def decodes_join(queries: list[int], contexts: list[int], key_cost: float) -> bool:
    """The rows are of one length and ``_one_group`` says they all join one group (a decode
    step's, most often), from their contexts sorted."""
    n = len(queries)
    one_length = n and n < _VECTOR_MIN and min(queries) == max(queries)
    return bool(one_length and _one_group(queries[0], sorted(contexts), key_cost))


def decodes_work(n: int, max_context: int, sum_contexts: int, block_size: int) -> StepWork:
    """``forward_work`` of ``n`` single-token rows that form one group (a decode step whose
    rows all join, ``decodes_join``) of a model without window layers, from the rows'
    longest context and their contexts' sum alone: the same counts, no list of contexts."""
    read = n * (-(-max_context // block_size) * block_size)
    return StepWork(
        batch_size=n,
        row_groups=1,
        query_tokens_padded=n,
        kv_slots_read=read,
        kv_slots_attended=sum_contexts,
        attention_pairs=read,
        logit_rows=n,
        single_token_rows=n,
    )


def forward_work(
    queries: list[int],
    contexts: list[int],
    logit_rows: int,
    groups: Sequence[Sequence[int]],
    block_size: int,
    window: int | None = None,
) -> StepWork:
    """The forward's part of a step's work: rows of ``queries`` tokens ending at ``contexts``
    (plain ints, as ``group_rows`` takes them), ``logit_rows`` logits in all, run as the
    padded batches ``groups`` (row indices). Counts no timing changes, the same on any
    machine for the same shape (harness/costmodel/work.py says what each one counts); each
    row reads as many blocks as its group's longest context needs
    (``BatchLayout.num_read_blocks``). With ``window`` (a model's sliding-window layers), a
    window layer's reads and pairs too: each row of a group reads the ring blocks the
    group's row with the most needs (``window_blocks_read``, from its start), then attends
    over them and the group's padded new keys."""
    padded = keys = pairs = ring_keys = ring_pairs = 0
    whole = len(groups) == 1  # most steps: one batch of every row, none picked out
    for g in groups:
        q = max(queries) if whole else max([queries[i] for i in g])
        c = max(contexts) if whole else max([contexts[i] for i in g])
        k = -(-c // block_size) * block_size
        padded += len(g) * q
        keys += len(g) * k
        pairs += len(g) * q * k
        if window is not None:
            starts = [contexts[i] - queries[i] for i in g]
            read = max([window_blocks_read(s, window, block_size) for s in starts])
            read = max(1, read) * block_size
            ring_keys += len(g) * read
            ring_pairs += len(g) * q * (read + q)
    return StepWork(
        batch_size=len(queries),
        row_groups=len(groups),
        query_tokens_padded=padded,
        kv_slots_read=keys,
        kv_slots_attended=sum(contexts),
        attention_pairs=pairs,
        window_kv_slots_read=ring_keys,
        window_attention_pairs=ring_pairs,
        logit_rows=logit_rows,
        single_token_rows=queries.count(1),
    )
