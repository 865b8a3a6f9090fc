"""Runs an unmodified mlx_lm model over the KV arena: one step's batched forward.

A step's rows are split into padded batches of similar shape (``group_rows``,
harness/engine/step_shape.py, which says why), each a padded batch of its own; all groups
are built lazily and evaluated together, so MLX sees one graph per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import add
from typing import NamedTuple, Protocol

import mlx.core as mx
import numpy as np

from harness.costmodel.work import StepWork
from harness.engine.kv_cache import BatchLayout, HostBlocks, KVArena, PagedKVCache
from harness.engine.step_shape import StepShape, forward_work, group_rows, key_cost
from harness.engine.window import WindowGroup, WindowKVCache
from harness.platform.models import LoadedModel


class Row(NamedTuple):
    """One sequence's work this step: feed ``tokens`` from position ``start`` on, read its
    blocks ``table``, and return logits for the last ``num_logits`` fed positions.

    ``carried``: (position in ``tokens``, index into the ``carried`` tokens given to
    ``forward``) for tokens the previous step sampled and the host has not seen yet (their
    place in ``tokens`` holds a placeholder). ``ring``: its window-layer blocks (a model
    with sliding-window layers, harness/engine/window.py). Immutable; a named tuple (one per
    scheduled sequence per step: a frozen dataclass costs 2.4x as much to build)."""

    tokens: Sequence[int]
    start: int
    table: Sequence[int]
    num_logits: int = 1
    carried: Sequence[tuple[int, int]] = ()
    ring: Sequence[int] = ()


class _Columns(NamedTuple):
    """A batch's ``Row``s as columns (one ``zip`` over the rows, in C): what the layout and
    the inputs read, without a pass per field."""

    tokens: tuple[Sequence[int], ...]
    starts: tuple[int, ...]
    tables: tuple[Sequence[int], ...]
    num_logits: tuple[int, ...]
    carried: tuple[Sequence[tuple[int, int]], ...]
    rings: tuple[Sequence[int], ...]


@dataclass
class Forward:
    """A step's forward as a lazy graph: logits of the rows that asked for them
    ([sum num_logits, vocab], in row order), nothing evaluated yet. A runner without a
    model (harness/engine/modelled.py) gives no logits but the ``tokens`` of those rows; the
    engine sets ``tokens`` to the logits' argmax, in the same graph, when that is all a step
    samples (``StepSampler.argmax_only``) and MLX takes it (``argmax_on_host``)."""

    logits: mx.array | None
    build_time: float  # building index arrays (Python + numpy)
    graph_time: float  # building the model's lazy graph
    work: StepWork  # the forward's part (``forward_work``)
    tokens: np.ndarray | mx.array | None = None


class Runner(Protocol):
    """The engine's seam to whatever computes a step: run the plan's rows and move blocks.

    ``ModelRunner`` runs the model; a runner without a model (a cost model's clock, say)
    stands in by taking the same calls. The engine calls, per step: the block moves the plan
    asks for (``swap_out``, ``copy_blocks``, ``swap_in``), then ``forward`` over the step,
    ``launch`` (start computing, return at once) and ``wait`` (block until done). A runner
    that ``computes_logits`` is handed the step's ``Row``s (tokens, block tables, rings) and
    returns ``Forward.logits``, one row per logit each ``Row`` asks for; one that does not
    is handed only the step's shape as lists (``StepShape``: no token list sliced, no block
    table read) and returns the tokens it chose as ``Forward.tokens``; it is also asked for a
    run of decode steps' forwards (``decode_run(starts)``, an object whose ``forward(step)``
    gives each: harness/engine/modelled.py's ``RunForwards``), which ``ModelRunner``, whose
    every step needs the last token on the host, is never asked for."""

    computes_logits: bool

    def forward(
        self, step: Sequence[Row] | StepShape, carried: mx.array | None = None
    ) -> Forward: ...

    def launch(self, outputs: Sequence[mx.array]) -> None: ...

    def wait(self, outputs: Sequence[mx.array]) -> None: ...

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None: ...

    def swap_out(self, blocks: Sequence[int]) -> HostBlocks: ...

    def swap_in(self, host: HostBlocks, blocks: Sequence[int], first: int = 0) -> None: ...


class ModelRunner:
    """Owns MLX for one model and its arena: applies block copies, runs forwards.

    ``arena`` holds the full-attention layers; ``window`` the sliding-window layers' group,
    for a model that has some."""

    computes_logits = True

    def __init__(self, loaded: LoadedModel, arena: KVArena, window: WindowGroup | None = None):
        self.loaded = loaded
        self.arena = arena
        self.window = window
        # Each layer's arena and its index there.
        full, ring = loaded.full_layers, loaded.window_layers
        self._slots = {layer: (False, i) for i, layer in enumerate(full)}
        self._slots.update({layer: (True, i) for i, layer in enumerate(ring)})
        self.body, self.head = _split_head(loaded.model)
        self.key_cost = key_cost(loaded)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply (src, dst) block copies (relocation, copy-on-write, forks)."""
        self.arena.copy_blocks(copies)

    def swap_out(self, blocks: Sequence[int]) -> HostBlocks:
        """Copy ``blocks`` of every layer to host memory (a swapped-out sequence's KV)."""
        return self.arena.swap_out(blocks)

    def swap_in(self, host: HostBlocks, blocks: Sequence[int], first: int = 0) -> None:
        """Write host blocks ``first, first + 1, ...`` back into device ``blocks``."""
        self.arena.swap_in(host, blocks, first)

    def forward(self, rows: Sequence[Row], carried: mx.array | None = None) -> Forward:
        """Build all rows' forward, grouped into padded batches (``group_rows``) of one
        lazy graph. Nothing is evaluated but the groups before the last (see below):
        ``launch`` starts the rest, ``wait`` blocks on it."""
        t0 = time.perf_counter()
        columns = _Columns(*zip(*rows, strict=True))
        queries = list(map(len, columns.tokens))
        contexts = list(map(add, columns.starts, queries))
        groups = group_rows(queries, contexts, self.key_cost)
        # One batch in the rows' own order (most decode steps): no row lists regrouped.
        in_order = len(groups) == 1 and groups[0] == list(range(len(rows)))
        batches = [rows] if in_order else [[rows[i] for i in g] for g in groups]
        plans = [
            self._plan(columns if in_order else _Columns(*zip(*batch, strict=True)))
            for batch in batches
        ]
        window = self.window.window if self.window is not None else None
        logit_rows = sum(columns.num_logits)
        work = forward_work(queries, contexts, logit_rows, groups, self.arena.block_size, window)
        t1 = time.perf_counter()
        outputs: list[mx.array | None] = []
        for batch, (inputs, layout, picks) in zip(batches, plans, strict=True):
            if outputs:
                # A write to the arena dispatched while an earlier group's read of it is
                # pending is a copy of the whole layer, not an in-place write (measured on
                # MLX's CPU build): finish the earlier groups first.
                self.wait([o for o in outputs if o is not None])
            outputs.append(self._run_group(_with_carried(inputs, batch, carried), layout, picks))
        logits = None
        parts = [o for o in outputs if o is not None]
        if parts:
            logits = parts[0] if len(parts) == 1 else mx.concatenate(parts)
            if not in_order:  # rows asked in their own order; the groups reordered them
                order = [i for g in groups for i in g]
                wanted = [i for i in order if rows[i].num_logits]
                if wanted != sorted(wanted):
                    logits = logits[mx.array(_regroup(rows, order))]
        return Forward(logits, t1 - t0, time.perf_counter() - t1, work)

    def run(self, rows: Sequence[Row]) -> mx.array | None:
        """A synchronised forward: the rows' logits, computed, with the arena's writes."""
        logits = self.forward(rows).logits
        self.wait([] if logits is None else [logits])
        return logits

    def launch(self, outputs: Sequence[mx.array]) -> None:
        """Start computing ``outputs`` and the arena's writes; returns at once."""
        mx.async_eval(*outputs, *self._pools())

    def wait(self, outputs: Sequence[mx.array]) -> None:
        """Block until ``outputs`` and the arena's writes are computed."""
        mx.eval(*outputs, *self._pools())

    def _pools(self) -> list[list[mx.array]]:
        pools = [self.arena.keys, self.arena.values]
        if self.window is not None:
            pools += [self.window.arena.keys, self.window.arena.values]
        return pools

    def _plan(self, rows: _Columns):
        """One padded batch's inputs [B, L], its layouts, and the flat positions whose logits
        it returns (None: every position, in order, as at decode), from its rows' columns.
        Built with a few array calls over the whole batch, not per row: at decode this is the
        per-step host work that grows with the batch."""
        tokens, starts, num_logits = rows.tokens, rows.starts, rows.num_logits
        lengths = list(map(len, tokens))
        n, width = len(tokens), max(lengths)
        last = num_logits.count(1) == n  # each row's logits at its last position
        if width == 1 and last:  # decode: [B, 1] straight from the rows' one-token lists
            layout = self._layout(starts, lengths, rows.tables, self.arena)
            return mx.array(tokens, dtype=mx.int32), (layout, self._ring(rows, lengths)), None
        flat = np.fromiter(chain.from_iterable(tokens), dtype=np.int32, count=sum(lengths))
        if len(flat) == n * width:  # every row as long: no padding
            inputs = flat.reshape(n, width)
            picks = None if last and width == 1 else np.arange(width - 1, n * width, width)
        else:
            lens = np.array(lengths)
            inputs = np.zeros((n, width), dtype=np.int32)
            inputs[np.arange(width) < lens[:, None]] = flat
            picks = np.arange(0, n * width, width) + (lens - 1) if last else None
        if not last:
            picks = [
                b * width + length - k + j
                for b, (length, k) in enumerate(zip(lengths, num_logits, strict=True))
                for j in range(k)
            ]
        layout = self._layout(starts, lengths, rows.tables, self.arena)
        return mx.array(inputs), (layout, self._ring(rows, lengths)), picks

    def _ring(self, rows: _Columns, lengths: list[int]) -> BatchLayout | None:
        """The batch's layout over its window-layer rings (None: no window layers)."""
        window = self.window
        if window is None:
            return None
        return self._layout(rows.starts, lengths, rows.rings, window.arena, window.window)

    def _layout(
        self,
        starts: Sequence[int],
        lengths: Sequence[int],
        tables: Sequence[Sequence[int]],
        arena: KVArena,
        window: int | None = None,
    ) -> BatchLayout:
        return BatchLayout.build(
            tables,
            starts,
            lengths,
            block_size=arena.block_size,
            scratch_block=arena.scratch_block,
            num_kv_heads=self.loaded.num_kv_heads,
            window=window,
        )

    def _run_group(
        self,
        inputs: mx.array,
        layouts: tuple[BatchLayout, BatchLayout | None],
        picks: np.ndarray | list[int] | None,
    ) -> mx.array | None:
        layout, ring = layouts
        caches = []
        for layer in range(self.loaded.num_layers):
            windowed, i = self._slots[layer]
            if windowed:
                caches.append(WindowKVCache(self.window.arena, i, ring, self.window.window))
            else:
                caches.append(PagedKVCache.over(self.arena, i, layout))
        hidden = self.body(inputs, cache=caches)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if picks is None:  # every position (decode)
            return self.head(flat)
        if not len(picks):
            return None
        # The LM head only where logits are needed: over every prompt position it costs
        # about a third of prefill time on this model size.
        return self.head(flat[mx.array(picks, dtype=mx.int32)])


def _with_carried(inputs: mx.array, rows: Sequence[Row], carried: mx.array | None) -> mx.array:
    """``inputs`` [B, L] with each row's carried tokens put in place, still lazily."""
    if carried is None:  # no tokens left on the device (not pipelined)
        return inputs
    width = inputs.shape[1]
    at = [(b * width + j, k) for b, r in enumerate(rows) for j, k in r.carried]
    if not at:
        return inputs
    flat = inputs.reshape(-1)
    flat[mx.array([p for p, _ in at])] = carried[mx.array([k for _, k in at])].astype(mx.int32)
    return flat.reshape(inputs.shape)


def _regroup(rows: Sequence[Row], order: list[int]) -> list[int]:
    """Permutation from grouped logits rows back to the callers' row order."""
    position = {}
    k = 0
    for i in order:
        for j in range(rows[i].num_logits):
            position[(i, j)] = k
            k += 1
    return [position[(i, j)] for i in range(len(rows)) for j in range(rows[i].num_logits)]


def _split_head(model) -> tuple[Callable, Callable]:
    """(body, head) of an mlx_lm model: the transformer without and with the LM head."""
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers"):
        raise ValueError(
            f"{type(model).__module__}.Model has no .model transformer body; kvbench needs "
            "mlx_lm's usual Model(model=...) structure to compute logits only where needed"
        )
    if getattr(model, "lm_head", None) is not None:
        return body, model.lm_head
    if hasattr(body, "embed_tokens"):
        return body, body.embed_tokens.as_linear
    raise ValueError(f"cannot find the LM head of {type(model).__module__}.Model")
