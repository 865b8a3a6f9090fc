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
preemption, swap-out), so each step's ``future`` is completed after: a sequence's slots in a
step count as future up to what it has written when it leaves (ended allocations settle
together, and all of them before the columns are read). Rows are final once every allocation
live at their step has ended; ``step_columns`` (and ``steps``) resolve the rest as of the
last step.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from itertools import chain, repeat
from operator import attrgetter, sub
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from allocators.stats import AllocatorStats
from harness.analysis.metrics import REQUEST_SCHEMA, STEP_SCHEMA
from harness.costmodel.work import COLUMNS, StepWork
from harness.engine.request import Seq
from harness.engine.speculative import Verifications
from schedulers.batch import RunningBatch, decodes
from schedulers.output import BatchStep, KVStats, SchedulerOutput

_TYPECODES = {"int": "q", "float": "d"}  # a column's array, by its kind

# A step row's columns by who gives them: ``Recorder.snapshot`` (its values' order), the step's
# ``StepWork`` (work.COLUMNS) and ``Recorder.step`` itself (in the order it lists them); each
# STEP_SCHEMA column once.
_SNAPSHOT_COLUMNS = (
    "prefill_tokens",
    "decode_tokens",
    "num_waiting",
    "num_running",
    "num_swapped",
    "blocks_used",
    "blocks_free",
    "blocks_cached",
    "block_refs",
    "blocks_shared",
    "slots_tokens",
    "slots_external",
    "slots_total",
    "external_fragmentation",
    "draft_blocks_used",
    "window_blocks_used",
    "mlx_active_bytes",
)
_STEP_OWN_COLUMNS = (
    "host_bytes_loaded",
    "disk_bytes_loaded",
    "host_bytes_written",
    "disk_bytes_written",
    "tier_time",
    "step",
    "start_time",
    "duration",
    "forward_time",
    "build_time",
    "preempted",
    "swap_time",
    "mlx_peak_bytes",
    "spec_proposed",
    "spec_accepted",
    "spec_rejected",
    "spec_verifications",
)
# The snapshot's two columns that ``_settle`` completes as allocations end, kept apart (each
# an array, written into at past steps): the KV breakdown's future and internal slots.
_SETTLED_COLUMNS = ("slots_future", "slots_internal")
_ROW_COLUMNS = (*_SNAPSHOT_COLUMNS, *COLUMNS, *_STEP_OWN_COLUMNS)
_ALL_COLUMNS = (*_ROW_COLUMNS, *_SETTLED_COLUMNS)
if sorted(_ALL_COLUMNS) != sorted(STEP_SCHEMA):  # a column added to one place, not the other
    raise ImportError(f"recorder: step columns {sorted(set(_ALL_COLUMNS) ^ set(STEP_SCHEMA))}")
_WORK_VALUES = attrgetter(*COLUMNS)
# A step's snapshot as ``Recorder.step`` takes it: its ``_SNAPSHOT_COLUMNS`` values, and its
# internal slots before any settles (its future slots start at 0).
Snapshot = tuple[tuple, int]


class Rows(NamedTuple):
    """A step's running sequences as the snapshot reads them, in running order: each one's
    preemptions (with the sequence, its holding's key), held slots, and slots written by
    the step's end (lists the recorder keeps; ``preempts`` may be the very list of the step
    before when the rows are the same)."""

    running: Sequence[Seq]
    preempts: list[int]
    held: list[int]
    written: list[int]


_NO_VERIFICATIONS = Verifications()


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
        # The finished requests' rows as columns (REQUEST_SCHEMA's order): 8 bytes a number,
        # against ~0.5 KiB a row as a dict.
        self._requests: dict[str, array | list] = {
            name: array(_TYPECODES[kind]) if kind in _TYPECODES else []
            for name, kind in REQUEST_SCHEMA.items()
        }
        # The step rows as columns: 8 bytes a value, or none while a column holds one
        # constant (``_Columns``), against ~1.5 KiB a step as a dict; ``_SETTLED_COLUMNS``
        # as arrays. None once a run's end took them.
        self._columns: _Columns | None = _Columns(
            {name: _TYPECODES[STEP_SCHEMA[name]] for name in _ROW_COLUMNS}
        )
        self._future, self._internal = array("q"), array("q")
        self._num_steps = 0
        # Each allocation (a sequence from admission to release) is a holding, numbered in
        # the order it started; ``_live`` maps (sequence, preemptions) to the live ones.
        self._live: dict[tuple[Seq, int], int] = {}
        self._num_holdings = 0  # holdings numbered so far
        # One entry per running sequence per step, as flat columns: its holding, the step,
        # its held slots and the slots written by the step's end. A holding's entries are
        # read once, when it ends (_settle), and dropped at the next compaction.
        self._entries = _Entries()
        # Holdings that ended and are not settled yet (``_settle_ended``: a step's column
        # totals are the same whenever they settle, so they settle ``_SETTLE_BATCH`` at a
        # time, one pass over the entries for them all).
        self._ended: list[int] = []
        # The step before's running set, its preemption counts and holdings (a list the
        # entries keep, never changed).
        self._last_running: tuple[Seq, ...] = ()
        self._last_preempts: list[int] = []
        self._last_ids: list[int] = []

    def step_columns(self) -> dict[str, np.ndarray]:
        """The step table by column (``STEP_COLUMNS``), copies (the run may go on);
        allocations still live count what they have written so far."""
        return self._settled({name: col.copy() for name, col in self._views().items()})

    def take_step_columns(self) -> dict[str, np.ndarray]:
        """``step_columns`` as a run's end takes them: the recorder's own arrays, not copies
        (a 1M-request replay's steps are ~2.3 GB); it records no step after this."""
        columns = self._settled(self._views())
        self._columns = None
        return columns

    def _views(self) -> dict[str, np.ndarray]:
        """The step columns (STEP_SCHEMA's order) as numpy views of the recorder's arrays,
        a constant column as a read-only view of its one value (no step may be recorded
        while one is alive: an ``array`` cannot grow under a view); every ended holding
        settled."""
        self._open()
        self._settle_ended()
        n = self._num_steps  # a step interrupted while recorded is left out
        views = self._columns.views(n)
        views["slots_future"] = np.frombuffer(self._future, dtype=np.int64)[:n]
        views["slots_internal"] = np.frombuffer(self._internal, dtype=np.int64)[:n]
        return {name: views[name] for name in STEP_SCHEMA}

    def _open(self) -> None:
        """Raise once a run's end took the step columns (``take_step_columns``)."""
        if self._columns is None:
            raise RuntimeError("the recorder's step columns were taken: it records no more steps")

    def _settled(self, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``columns`` with the live allocations' ``slots_future`` settled as of now."""
        future, internal = columns["slots_future"], columns["slots_internal"]
        live = list(self._live.values())
        _settle(self._entries.of(live, self._num_holdings), future, internal, self._num_steps)
        return columns

    @property
    def steps(self) -> list[dict]:
        """The step rows, one dict each (as ``step_columns``)."""
        columns = self.step_columns()
        values = zip(*(col.tolist() for col in columns.values()), strict=True)
        return [dict(zip(columns, row, strict=True)) for row in values]

    @property
    def requests(self) -> list[dict]:
        """The finished requests' rows, one dict each (as ``request_columns``)."""
        names = list(self._requests)
        values = (c.tolist() if isinstance(c, array) else c for c in self._requests.values())
        return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]

    @property
    def num_requests(self) -> int:
        """How many requests have finished (rows recorded)."""
        return len(self._requests["request_id"])

    def request_columns(self) -> dict[str, np.ndarray | list]:
        """The request table by column (``REQUEST_COLUMNS``): a typed array per int or
        float column, a list per object column (its values uncopied), each the caller's."""
        return {
            name: np.array(col, dtype=np.int64 if col.typecode == "q" else np.float64)
            if isinstance(col, array)
            else list(col)
            for name, col in self._requests.items()
        }

    def request(self, seq: Seq, **columns) -> None:
        """A finished request's row, from ``seq``; ``columns`` replace what the sequence
        alone cannot say (a beam search's row is its group's, not one beam's)."""
        if not self.enabled:
            return
        nan = float("nan")
        host, disk = seq.num_cached_tokens_host, seq.num_cached_tokens_disk
        cached = seq.num_cached_tokens or 0
        row = (  # REQUEST_COLUMNS' order
            seq.request_id,
            seq.priority,
            seq.arrival_time,
            _or_nan(seq.first_scheduled_time),
            _or_nan(seq.first_token_time),
            _or_nan(seq.finish_time),
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            cached,
            seq.num_forked_tokens,
            seq.preemptions,
            seq.finish_reason,
            seq.abort_reason,
            nan if seq.ttft_slo is None else seq.ttft_slo,
            nan if seq.tpot_slo is None else seq.tpot_slo,
            seq.token_times,  # the sequence has left: its array, uncopied
            seq.spec_proposed,
            seq.spec_accepted,
            cached - host - disk,
            host,
            disk,
        )
        if columns:
            row = [columns.get(name, v) for name, v in zip(self._requests, row, strict=True)]
        for column, value in zip(self._requests.values(), row, strict=True):
            column.append(value)

    def snapshot(
        self, stats: KVStats | None, plan: SchedulerOutput, proposed: Mapping[Seq, int]
    ) -> Snapshot | None:
        """The step's KV memory, token split and queue figures, from the scheduler's
        ``stats`` (None when recording is off). Taken after scheduling and before the step's
        outputs are processed (while its forward computes, so the bookkeeping overlaps the
        model): the plan's allocations are made, its writes are about to happen, and each
        sequence's ``num_computed_tokens`` is still pre-step."""
        if stats is None:
            return None
        self._open()
        blocks = stats.blocks
        running = stats.running
        fed, new, fed_total = _rows(plan, proposed, running)
        written: list[int] = []  # slots written by the step's end
        preempts: list[int] = []
        decodes = 0
        for seq, f, n in zip(running, fed, new, strict=True):
            computed = seq.num_computed_tokens
            written.append(computed + n)
            preempts.append(seq.preemptions)
            # A decode feeds the one sampled token that has no KV yet (plus drafts to
            # verify), past its prompt; any other row computes prompt (or recomputed)
            # tokens, even a 1-token chunk.
            if f == 1 and computed == len(seq.token_ids) - 1 and computed >= seq.num_prompt_tokens:
                decodes += 1
        holdings = stats.holdings
        unwritten = sum(holdings.num_tokens) - sum(written)  # allocated, not written by the end
        return self._snapshot(
            blocks,
            # Built in C: a named tuple's own __new__ is a Python call, one a step.
            tuple.__new__(Rows, (running, preempts, holdings.held_slots, written)),
            blocks.used_slots - unwritten,
            fed_total - decodes,
            sum(new) - fed_total + decodes,
            (stats.num_waiting, stats.num_swapped, stats.unusable_free_blocks),
            (stats.draft_blocks_used, stats.window_blocks_used),
        )

    def snapshot_batch(
        self, blocks: AllocatorStats, batch: RunningBatch, step: BatchStep, num_waiting: int
    ) -> Snapshot | None:
        """``snapshot`` of a running batch's step (``Scheduler.schedule_batch``), from the
        batch's columns: each row's slots written by the step's end, and the prompt and
        decode tokens the step computes (a row of one token past its prompt decodes, as in
        ``snapshot``). A paged allocator's, with no draft or window blocks, nothing swapped
        and no unusable free block. Its tokens are the slots written less those counted
        twice: the allocator's sequences are the running ones, so its token total is theirs,
        whatever growth they left unreported (contract version 5)."""
        if not self.enabled:
            return None
        self._open()
        written = [c + 1 for c in step.starts]
        fed = prefill = 0
        if step.events is not None:  # the rows past the decodes: chunks, admissions
            scheduled = step.events.scheduled
            new = {row.seq: row.num_new_tokens for row in scheduled}
            for seq in batch.seqs[len(written) :]:
                written.append(seq.num_computed_tokens + new.get(seq, 0))
            for row in scheduled:  # prompt tokens, unless one row computes the one token
                # left past its prompt (a recompute's prefix hit)
                fed += row.num_new_tokens
                prefill += row.num_new_tokens - (row.num_new_tokens == 1 and decodes(row.seq))
        rows = tuple.__new__(Rows, (batch.seqs, batch.preempts, list(batch.held), written))
        tokens = sum(written) - blocks.shared_slots
        decode = len(step.starts) + fed - prefill
        return self._snapshot(blocks, rows, tokens, prefill, decode, (num_waiting, 0, 0), (0, 0))

    def _snapshot(
        self,
        blocks: AllocatorStats,
        rows: Rows,
        tokens: int,
        prefill: int,
        decode: int,
        queues: tuple[int, int, int],
        others: tuple[int, int],
    ) -> Snapshot:
        """The step's row of ``snapshot`` from its parts (``queues``: waiting, swapped,
        unusable free blocks; ``others``: draft and window blocks used); its holdings'
        entries kept."""
        index = self._num_steps  # this step's row
        live = self._live
        running, preempts = rows.running, rows.preempts
        ids = self._holding_ids(running, preempts)
        self._entries.add(ids, index, rows.held, rows.written)
        # Allocations live at the previous step and not now have ended: they settle
        # ``_SETTLE_BATCH`` at a time (``_settle``: in any order, the same columns).
        if len(live) > len(running):  # some ended (every running one is live)
            current = set(zip(running, preempts, strict=True))
            ended = [key for key in live if key not in current]
            self._ended += [live.pop(key) for key in ended]
            if len(self._ended) >= _SETTLE_BATCH:
                self._settle_ended()
        num_waiting, num_swapped, unusable = queues
        # External fragmentation as the vLLM paper means it: free blocks that cannot serve
        # the request next in line (runs or buddies too small for its region).
        bs = blocks.block_size
        # The sharing of the running tables, the allocator's count: its sequences are the
        # running ones (the scheduler allocates on admission and frees on leaving).
        if blocks.num_seqs != len(running):
            raise RuntimeError(
                f"the allocator holds {blocks.num_seqs} sequences and {len(running)} run: the "
                "scheduler must free a sequence's blocks when it stops running"
            )
        refs = blocks.table_refs  # table entries: a block once per table that holds it
        values = (  # _SNAPSHOT_COLUMNS' order
            prefill,
            decode,
            num_waiting,
            len(running),
            num_swapped,
            blocks.used_blocks,
            blocks.free_blocks,
            blocks.cached_blocks,
            refs,
            refs - blocks.table_blocks,
            tokens,
            unusable * bs,
            blocks.num_blocks * bs,
            unusable / blocks.free_blocks if blocks.free_blocks else 0.0,
            others[0],
            others[1],
            mx.get_active_memory() if self.measured else 0,
        )
        # slots_future starts at 0, completed as the allocations live now end (_settle)
        return values, blocks.reserved_slots - tokens

    def _holding_ids(self, running: Sequence[Seq], preempts: list[int]) -> list[int]:
        """The holding of each running sequence, in order; an allocation that starts now
        gets the next number. The running set of the step before, the same sequences with
        the same preemption counts, reuses its list (most steps): at once when ``preempts`` is
        the very list of the step before (a running batch's, replaced whenever its rows
        change)."""
        last = self._last_preempts
        if preempts is last or (running == self._last_running and preempts == last):
            return self._last_ids
        live = self._live
        keys = list(zip(running, preempts, strict=True))
        ids = list(map(live.get, keys))
        if None in ids:
            for i, key in enumerate(keys):
                if ids[i] is None:  # an allocation that starts now
                    ids[i] = live[key] = self._num_holdings
                    self._num_holdings += 1
        self._last_running, self._last_preempts, self._last_ids = tuple(running), preempts, ids
        return ids

    def _settle_ended(self) -> None:
        """Settle the ended holdings into the step columns, then let the entries go once
        they outnumber the live holdings' by enough to compact."""
        if not self._ended:
            return
        future = np.frombuffer(self._future, dtype=np.int64)
        internal = np.frombuffer(self._internal, dtype=np.int64)
        count = self._num_holdings
        try:
            _settle(self._entries.of(self._ended, count), future, internal, self._num_steps)
        finally:  # the columns grow again next step: no view may outlive this, even a raise
            del future, internal
        self._ended = []
        self._entries.compact(list(self._live.values()), count)

    def step(
        self,
        plan: SchedulerOutput,
        row: Snapshot | None,
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
        self._open()
        spec = verifications or _NO_VERIFICATIONS
        if not self.measured:
            forward_time = build_time = swap_time = tier_time = 0.0
        size = self.block_bytes
        values = (
            *row[0],
            *_WORK_VALUES(work),
            work.host_blocks_loaded * size,  # _STEP_OWN_COLUMNS' order
            work.disk_blocks_loaded * size,
            work.host_blocks_written * size,
            work.disk_blocks_written * size,
            tier_time,
            self._num_steps,
            start,
            duration,
            forward_time,
            build_time,
            len(plan.preempted),
            swap_time,
            mx.get_peak_memory() if self.measured else 0,
            spec.proposed,
            spec.accepted,
            spec.rejected,
            spec.verifications,
        )
        self._columns.append(values)
        self._future.append(0)
        self._internal.append(row[1])
        self._num_steps += 1


def _rows(
    plan: SchedulerOutput, proposed: Mapping[Seq, int], running: tuple[Seq, ...]
) -> tuple[list[int], list[int], int]:
    """Per running sequence, in order: what its row feeds (its reserved draft slots aside;
    0 without a row) and its new KV slots (that plus the drafts ``proposed`` for it: a
    verification writes those, which may be fewer than the slots reserved for them, n-gram
    lookup); then the rows' total fed."""
    if not plan.scheduled:
        none = [0] * len(running)
        return none, none, 0
    seqs, num_new, _, drafts, _ = zip(*plan.scheduled, strict=True)
    fed = list(map(sub, num_new, drafts)) if any(drafts) else list(num_new)
    new = [f + proposed.get(s, 0) for s, f in zip(seqs, fed, strict=True)] if proposed else fed
    total = sum(fed)
    if seqs != running:  # most steps: every running sequence has a row, in order
        fed_by, new_by = dict(zip(seqs, fed, strict=True)), dict(zip(seqs, new, strict=True))
        fed = list(map(fed_by.get, running, repeat(0)))
        new = list(map(new_by.get, running, repeat(0))) if proposed else fed
    return fed, new, total


_SETTLE_BATCH = 64  # ended holdings settled together (``Recorder._ended``)


class _Columns:
    """Step columns filled a row at a time. Rows wait as tuples and become columns
    ``_BATCH`` at a time; a column whose every value so far is one constant (most are, in
    most runs: no speculation, tiers or swaps leaves theirs 0) is kept as that value, and
    becomes an array (8 bytes a value) only at its first other value."""

    _BATCH = 1024

    def __init__(self, typecodes: dict[str, str]) -> None:
        """``typecodes``: each column's array typecode, in a row's order."""
        self._typecodes = typecodes
        self._arrays: list[array | None] = [None] * len(typecodes)  # None: constant so far
        self._constants: list[object] = [0] * len(typecodes)  # the value while constant
        self._count = 0  # rows in the columns
        self._rows: list[tuple] = []  # rows waiting

    def append(self, row: tuple) -> None:
        """One row, its values in the columns' order."""
        self._rows.append(row)
        if len(self._rows) == self._BATCH:
            self._flush()

    def _flush(self) -> None:
        rows, count = self._rows, self._count
        if not rows:
            return
        arrays, constants = self._arrays, self._constants
        columns = zip(zip(*rows, strict=True), self._typecodes.values(), strict=True)
        for i, (values, code) in enumerate(columns):
            column = arrays[i]
            if column is None:
                # The first value as its column stores it: a wrong type raises here, as an
                # array's append would, not once the column first changes
                value = constants[i] if count else array(code, values[:1])[0]
                if values.count(value) == len(values):  # still that one value
                    constants[i] = value
                    continue
                column = arrays[i] = array(code, repeat(value, count))
            column.extend(values)
        self._count = count + len(rows)
        self._rows = []

    def views(self, n: int) -> dict[str, np.ndarray]:
        """The first ``n`` rows of each column: a numpy view of its array, or of its one
        value (read-only, repeated without memory)."""
        self._flush()
        views = {}
        for (name, code), column, value in zip(
            self._typecodes.items(), self._arrays, self._constants, strict=True
        ):
            dtype = np.int64 if code == "q" else np.float64
            if column is None:
                views[name] = np.broadcast_to(np.asarray(value, dtype=dtype), (n,))
            else:
                views[name] = np.frombuffer(column, dtype=dtype)[:n]
        return views


class _Entries:
    """The running sequences' (holding, step, held slots, written) of every step, as four
    flat int64 columns. A step hands its lists as they are (one append each, no conversion
    per sequence); they become columns in one pass when entries are read or 64 steps wait.
    Entries of ended holdings are dropped in one pass once the columns have doubled since the
    last one (amortised O(1) an entry)."""

    _MIN = 1 << 12  # entries below which no compaction is worth a pass
    _BATCH = 64  # steps handed before they become columns, if no entry is read before

    def __init__(self) -> None:
        self._columns = np.zeros((4, self._MIN), dtype=np.int64)
        self._size = 0
        self._pending: tuple[list, list, list, list] = ([], [], [], [])  # by step, as handed
        self._limit = self._MIN

    def add(self, holdings: list[int], step: int, held: list[int], written: list[int]) -> None:
        """A step's entries: its running sequences' holdings, held slots and written slots
        (lists the caller no longer changes)."""
        ids, steps, helds, writtens = self._pending
        ids.append(holdings)
        steps.append(step)
        helds.append(held)
        writtens.append(written)
        if len(steps) == self._BATCH:
            self._flush()

    def _flush(self) -> None:
        ids, steps, helds, writtens = self._pending
        if not ids:
            return
        counts = list(map(len, ids))
        total = sum(counts)
        start, end = self._size, self._size + total
        if end > self._columns.shape[1]:
            grown = np.zeros((4, max(2 * self._columns.shape[1], end)), dtype=np.int64)
            grown[:, :start] = self._columns[:, :start]
            self._columns = grown
        columns = self._columns[:, start:end]
        columns[1] = np.repeat(steps, counts)
        values = chain.from_iterable(chain(ids, helds, writtens))
        columns[[0, 2, 3]] = np.fromiter(values, dtype=np.int64, count=3 * total).reshape(3, -1)
        for lists in self._pending:
            lists.clear()
        self._size = end

    def of(self, holdings: list[int], count: int) -> np.ndarray:
        """The entries of ``holdings`` (numbered below ``count``), in the order they were
        added: a (4, n) array, a copy."""
        self._flush()
        columns = self._columns[:, : self._size]
        wanted = np.zeros(count, dtype=bool)
        wanted[holdings] = True
        return columns[:, np.flatnonzero(wanted[columns[0]])]

    def compact(self, live: list[int], count: int) -> None:
        """Keep only the entries of the ``live`` holdings, once the columns have doubled
        since the last compaction."""
        if self._size + sum(map(len, self._pending[0])) < self._limit:
            return
        kept = self.of(live, count)
        self._size = kept.shape[1]
        self._columns[:, : self._size] = kept
        self._limit = max(2 * self._size, self._MIN)


def _settle(entries: np.ndarray, future, internal, num_steps: int) -> None:
    """Move the slots each holding of ``entries`` went on to fill from ``internal`` to
    ``future`` (step columns, in place) in each of the first ``num_steps`` steps it was live
    in: its slots in a step count as future up to what it had written at its last step. A
    step's move is capped by its unfilled slots (a partial block shared by several holders,
    a fork, is in each one's held slots but is one block of the arena): the holdings' fills
    in a step are summed, then capped, which is what settling them one after another in any
    order moves (``min(a, u) + min(b, u - min(a, u)) = min(a + b, u)``)."""
    holding, step, held, written = entries
    if not len(holding):
        return
    # Each holding's last entry (they come in step order: its highest index), so its final
    # written slots; no sort (a stable argsort of 20k entries took 0.95 ms, this 0.04).
    lo = int(holding.min())
    last = np.zeros(int(holding.max()) - lo + 1, dtype=np.int64)
    np.maximum.at(last, holding - lo, np.arange(len(holding)))
    fills = np.minimum(held, written[last[holding - lo]]) - written
    keep = (fills > 0) & (step < num_steps)
    at, fills = step[keep], fills[keep]
    if not len(at):
        return
    first = int(at.min())  # the steps' fills summed (exact: int sums far below 2^53)
    summed = np.bincount(at - first, weights=fills)
    at = np.flatnonzero(summed)
    fills = summed[at].astype(np.int64)
    at += first
    moved = np.minimum(fills, internal[at])
    future[at] += moved
    internal[at] -= moved


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else x
