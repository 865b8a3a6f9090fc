"""Records what the engine did: one row per step and one row per finished request.

Column names are those of ``harness.analysis.metrics`` (REQUEST_COLUMNS, STEP_COLUMNS); the summary
is computed from these rows alone, so every figure in it can be recomputed from the tables.

The KV breakdown of a step (the vLLM paper's Fig. 2) is the arena as the step leaves it:

    tokens    slots holding a token's KV once the step's writes are done (a shared block once)
    future    allocated slots its holder fills later (within the same allocation)
    internal  allocated slots nobody ever fills (block tails, region slack, reserve beyond the
              request's real length, a region freed by preemption before it is filled)
    external  free slots in runs or buddies too small for the next request in line

Which allocated slots get filled is known only when an allocation ends (finish, abort,
preemption, swap-out), so each step's ``future`` is completed then: a sequence's slots in a
step count as future up to what it has written when it leaves. Rows are final once every
allocation live at their step has ended; ``step_columns`` (and ``steps``) resolve the rest as
of the last step.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from harness.analysis.metrics import STEP_SCHEMA
from harness.costmodel.work import StepWork
from harness.engine.request import Seq
from harness.engine.speculative import Verifications
from schedulers.output import KVStats, SchedulerOutput


class _Holding:
    """One allocation of a sequence (admission to release) and the steps it was live in."""

    __slots__ = ("entries", "written", "table")

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, int]] = []  # (step, held slots, written)
        self.written = 0  # slots written as of the latest step
        self.table: list[int] = []  # its block table as the latest step counted it


class Recorder:
    """Collects per-step and per-request rows (a no-op when disabled, e.g. in benchmarks)."""

    def __init__(self, *, enabled: bool = True, measured: bool = True, block_bytes: int = 0):
        """``measured``: the step timings and MLX memory are real; a model clock's replay
        records them as 0 (its durations are priced, and nothing runs on MLX), so its
        tables are the same on any machine. ``block_bytes``: an arena block's K and V over
        every full-attention layer, what a tier move carries (the ``*_bytes_*`` columns)."""
        self.enabled = enabled
        self.measured = measured
        self.block_bytes = block_bytes
        self.requests: list[dict] = []
        # The step rows as columns (8 bytes a value, against ~1.5 KiB a step as a dict).
        self._columns = {
            name: array("q" if kind == "int" else "d") for name, kind in STEP_SCHEMA.items()
        }
        self._num_steps = 0
        self._live: dict[tuple[Seq, int], _Holding] = {}  # by (sequence, preemptions)
        # How many running tables hold each block (its keys: the distinct blocks), kept up
        # to date as tables change rather than recounted every step.
        self._holders: dict[int, int] = {}

    def step_columns(self) -> dict[str, np.ndarray]:
        """The step table by column (``STEP_COLUMNS``); allocations still live count what
        they have written so far."""
        n = self._num_steps  # a step interrupted while recorded is left out
        columns = {name: np.array(col[:n]) for name, col in self._columns.items()}
        future, internal = columns["slots_future"], columns["slots_internal"]
        for holding in self._live.values():
            _settle(holding, future, internal, n)
        return columns

    @property
    def steps(self) -> list[dict]:
        """The step rows, one dict each (as ``step_columns``)."""
        columns = self.step_columns()
        values = zip(*(col.tolist() for col in columns.values()), strict=True)
        return [dict(zip(columns, row, strict=True)) for row in values]

    def request(self, seq: Seq, **columns) -> None:
        """A finished request's row, from ``seq``; ``columns`` replace what the sequence
        alone cannot say (a beam search's row is its group's, not one beam's)."""
        if not self.enabled:
            return
        nan = float("nan")
        host, disk = seq.num_cached_tokens_host, seq.num_cached_tokens_disk
        row = {
            "request_id": seq.request_id,
            "priority": seq.priority,
            "arrival_time": seq.arrival_time,
            "first_scheduled_time": _or_nan(seq.first_scheduled_time),
            "first_token_time": _or_nan(seq.first_token_time),
            "finish_time": seq.finish_time,
            "prompt_tokens": seq.num_prompt_tokens,
            "output_tokens": seq.num_output_tokens,
            "cached_tokens": seq.num_cached_tokens or 0,
            "forked_tokens": seq.num_forked_tokens,
            "preemptions": seq.preemptions,
            "finish_reason": seq.finish_reason,
            "abort_reason": seq.abort_reason,
            "ttft_slo": nan if seq.ttft_slo is None else seq.ttft_slo,
            "tpot_slo": nan if seq.tpot_slo is None else seq.tpot_slo,
            "token_times": seq.token_times,  # the sequence has left: its array, uncopied
            "spec_proposed": seq.spec_proposed,
            "spec_accepted": seq.spec_accepted,
            "cached_tokens_device": (seq.num_cached_tokens or 0) - host - disk,
            "cached_tokens_host": host,
            "cached_tokens_disk": disk,
        }
        self.requests.append(row | columns)

    def snapshot(
        self, stats: KVStats | None, plan: SchedulerOutput, proposed: Mapping[Seq, int]
    ) -> dict | None:
        """The step's KV memory, token split and queue figures, from the scheduler's
        ``stats`` (None when recording is off). Taken after scheduling and before the step's
        outputs are processed (while its forward computes, so the bookkeeping overlaps the
        model): the plan's allocations are made, its writes are about to happen, and each
        sequence's ``num_computed_tokens`` is still pre-step."""
        if stats is None:
            return None
        blocks = stats.blocks
        # Each scheduled row's new KV; a verification writes the drafts ``proposed`` (by
        # sequence), which may be fewer than the slots reserved for them (n-gram lookup).
        new = {}
        prefill = 0
        for s in plan.scheduled:
            seq = s.seq
            fed = s.num_new_tokens - s.num_draft_tokens
            new[seq] = fed + proposed.get(seq, 0) if proposed else fed
            # A decode feeds the one sampled token that has no KV yet (plus drafts to
            # verify); any other row computes prompt (or recomputed) tokens, even a 1-token
            # chunk.
            if fed != 1:
                prefill += fed
                continue
            n = len(seq.token_ids)
            if not (n > seq.num_prompt_tokens and seq.num_computed_tokens == n - 1):
                prefill += fed
        row: dict = {}
        index = self._num_steps  # this step's row
        unwritten = 0  # allocated slots not written by the end of this step
        refs = 0  # table entries: a block once per table that holds it
        live, holders = self._live, self._holders
        for seq, (num_tokens, held_slots, table) in zip(stats.running, stats.holdings, strict=True):
            written = seq.num_computed_tokens + new.get(seq, 0)
            unwritten += num_tokens - written
            key = (seq, seq.preemptions)
            holding = live.get(key)
            if holding is None:
                holding = live[key] = _Holding()
            holding.entries.append((index, held_slots, written))
            holding.written = written
            refs += len(table)
            if holding.table != table:  # most steps: a decode within its last block
                _count_table(holders, holding.table, table)
                holding.table = table.copy()
        # Allocations live at the previous step and not now have ended: their tables
        # uncount, and their slots settle (in the order they started).
        if len(live) > len(stats.running):  # some ended (every running one is live)
            current = {(seq, seq.preemptions) for seq in stats.running}
            ended = [key for key in live if key not in current]
            columns = self._columns
            for key in ended:
                holding = live.pop(key)
                _uncount(holders, holding.table)
                _settle(holding, columns["slots_future"], columns["slots_internal"], index)
        tokens = blocks.used_slots - unwritten
        # External fragmentation as the vLLM paper means it: free blocks that cannot serve
        # the request next in line (runs or buddies too small for its region).
        unusable = stats.unusable_free_blocks
        bs = blocks.block_size
        row.update(
            prefill_tokens=prefill,
            decode_tokens=sum(new.values()) - prefill,
            num_waiting=stats.num_waiting,
            num_running=len(stats.running),
            num_swapped=stats.num_swapped,
            blocks_used=blocks.used_blocks,
            blocks_free=blocks.free_blocks,
            blocks_cached=blocks.cached_blocks,
            block_refs=refs,
            blocks_shared=refs - len(self._holders),
            slots_tokens=tokens,
            slots_future=0,  # completed as the allocations live now end (_settle)
            slots_internal=blocks.reserved_slots - tokens,
            slots_external=unusable * bs,
            slots_total=blocks.num_blocks * bs,
            external_fragmentation=unusable / blocks.free_blocks if blocks.free_blocks else 0.0,
            draft_blocks_used=stats.draft_blocks_used,
            window_blocks_used=stats.window_blocks_used,
            mlx_active_bytes=mx.get_active_memory() if self.measured else 0,
        )
        return row

    def step(
        self,
        plan: SchedulerOutput,
        row: dict | None,
        start: float,
        duration: float,
        forward_time: float,
        build_time: float,
        swap_time: float = 0.0,
        verifications: Verifications | None = None,
        *,
        work: StepWork,
        tier_time: float = 0.0,
    ) -> None:
        """One row per step: the plan, its timings (``tier_time``: the tier moves' copies,
        measured as ``swap_time`` is), its ``work`` (every field the column of its name, the
        tier moves' bytes from their blocks) and the ``snapshot`` taken during it."""
        if not self.enabled:
            return
        spec = verifications or Verifications()
        if not self.measured:
            forward_time = build_time = swap_time = tier_time = 0.0
        row.update(vars(work))
        size = self.block_bytes
        row.update(
            host_bytes_loaded=work.host_blocks_loaded * size,
            disk_bytes_loaded=work.disk_blocks_loaded * size,
            host_bytes_written=work.host_blocks_written * size,
            disk_bytes_written=work.disk_blocks_written * size,
            tier_time=tier_time,
            step=self._num_steps,
            start_time=start,
            duration=duration,
            forward_time=forward_time,
            build_time=build_time,
            preempted=len(plan.preempted),
            swap_time=swap_time,
            mlx_peak_bytes=mx.get_peak_memory() if self.measured else 0,
            spec_proposed=spec.proposed,
            spec_accepted=spec.accepted,
            spec_rejected=spec.rejected,
            spec_verifications=spec.verifications,
        )
        for name, column in self._columns.items():
            column.append(row[name])
        self._num_steps += 1


def _settle(holding: _Holding, future, internal, num_steps: int) -> None:
    """Move the slots an allocation went on to fill from ``internal`` to ``future`` (step
    columns) in each of the first ``num_steps`` steps it was live in."""
    final = holding.written
    for step, held, written in holding.entries:
        fills = (held if held < final else final) - written
        if fills > 0 and step < num_steps:
            # Capped by the step's unfilled slots: a partial block shared by several holders
            # (fork) is in each one's held slots but is one block of the arena.
            moved = min(fills, internal[step])
            future[step] += moved
            internal[step] -= moved


def _count_table(holders: dict[int, int], old: list[int], table: list[int]) -> None:
    """Recount a table that changed since it was last counted: a table that only grew (a
    decode into a new block, a chunk) adds its new blocks; any other change (copy-on-write,
    relocation, trim) recounts it whole."""
    n = len(old)
    if n and table[:n] == old:
        added = table[n:]
    else:
        _uncount(holders, old)
        added = table
    for block in added:
        holders[block] = holders.get(block, 0) + 1


def _uncount(holders: dict[int, int], table: list[int]) -> None:
    for block in table:
        left = holders[block] - 1
        if left:
            holders[block] = left
        else:
            del holders[block]


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else x
