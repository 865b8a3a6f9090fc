"""Runs an unmodified mlx_lm model over the KV arena: one step's batched forward.

A step's rows are split into two padded batches: decodes (one token each, no padding) and
prefill chunks (right-padded to the longest chunk). Mixing them in one padded batch would
pad every decode to the chunk length and multiply the MLP work by it. Both forwards are
built lazily and evaluated together, so MLX sees one graph per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from harness.kv_cache import BatchLayout, KVArena, PagedKVCache
from harness.models import LoadedModel


@dataclass(frozen=True)
class Row:
    """One sequence's work this step: feed ``tokens`` from position ``start`` on, read its
    blocks ``table``, and return logits for the last ``num_logits`` fed positions."""

    tokens: Sequence[int]
    start: int
    table: Sequence[int]
    num_logits: int = 1


@dataclass
class ForwardResult:
    """Logits of the rows that asked for them ([sum num_logits, vocab], in row order)."""

    logits: mx.array | None
    build_time: float  # building index arrays (Python + numpy)
    forward_time: float  # graph construction and evaluation of the model forward


class ModelRunner:
    """Owns MLX for one model and its arena: applies block copies, runs forwards."""

    def __init__(self, loaded: LoadedModel, arena: KVArena):
        self.loaded = loaded
        self.arena = arena
        self.body, self.head = _split_head(loaded.model)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        self.arena.copy_blocks(copies)

    def forward(
        self, rows: Sequence[Row], overlap: Callable[[], None] | None = None
    ) -> ForwardResult:
        """Run all rows; decodes and prefill chunks as two batches of one lazy graph.

        ``overlap`` is called while MLX computes (bookkeeping that does not need the result).
        """
        t0 = time.perf_counter()
        groups = [
            [i for i, r in enumerate(rows) if len(r.tokens) == 1],
            [i for i, r in enumerate(rows) if len(r.tokens) > 1],
        ]
        plans = [self._plan([rows[i] for i in g]) for g in groups if g]
        t1 = time.perf_counter()
        outputs = [self._run(*plan) for plan in plans]
        order = [i for g in groups if g for i in g]
        logits = None
        parts = [o for o in outputs if o is not None]
        if parts:
            logits = parts[0] if len(parts) == 1 else mx.concatenate(parts)
            # rows asked in their own order; the groups reordered them
            wanted = [i for i in order if rows[i].num_logits]
            if wanted != sorted(wanted):
                logits = logits[mx.array(_regroup(rows, order))]
        results = [logits if logits is not None else [], self.arena.keys, self.arena.values]
        mx.async_eval(results)
        if overlap is not None:
            overlap()
        mx.eval(results)
        return ForwardResult(logits, t1 - t0, time.perf_counter() - t1)

    def _plan(self, rows: Sequence[Row]):
        width = max(len(r.tokens) for r in rows)
        inputs = np.zeros((len(rows), width), dtype=np.int32)
        for b, r in enumerate(rows):
            inputs[b, : len(r.tokens)] = r.tokens
        layout = BatchLayout.build(
            [r.table for r in rows],
            [r.start for r in rows],
            [len(r.tokens) for r in rows],
            block_size=self.arena.block_size,
            scratch_block=self.arena.scratch_block,
            num_kv_heads=self.loaded.num_kv_heads,
        )
        picks = [
            b * width + len(r.tokens) - r.num_logits + j
            for b, r in enumerate(rows)
            for j in range(r.num_logits)
        ]
        return mx.array(inputs), layout, picks

    def _run(self, inputs: mx.array, layout: BatchLayout, picks: list[int]) -> mx.array | None:
        caches = [PagedKVCache(self.arena, i, layout) for i in range(self.loaded.num_layers)]
        hidden = self.body(inputs, cache=caches)
        if not picks:
            return None
        flat = hidden.reshape(-1, hidden.shape[-1])
        # The LM head only where logits are needed: over every prompt position it costs
        # about a third of prefill time on this model size.
        return self.head(flat[mx.array(picks, dtype=mx.int32)])


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
