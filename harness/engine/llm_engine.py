"""LLMEngine: the loop that ties scheduler, model runner and sampler together.

    step():  schedule -> move blocks -> run the rows -> sample -> Scheduler.update -> outputs

The scheduler decides and owns every allocation and each sequence's state: its progress,
tokens, stops and finish (``Scheduler.update``, ``finish``). The engine runs its plan (block
moves, then one batched forward through the model runner), samples, hands the step's results
back and builds the outputs. It is composed of parts, each built with explicit arguments and
the only writer of its own state:

    requests  request_table.py  live sequences, completions (n > 1), beam searches, owed outputs
    intake    intake.py         requests checked, made and queued
    host      host_kv.py        block moves, host copies of KV, save targets, KV files
    sampler   step_sampler.py   a step's logits into its tokens (verification, forks, beams)
    outputs   outputs.py        logprobs in, RequestOutputs out
    forks     forks.py          parallel sampling's completions, beam search's rounds
    pipeline  pipeline.py       tokens left on the device one step (``pipeline``, off by default)
    recorder  recorder.py       the steps and requests tables

The plain and the pipelined step are two step functions, chosen when the engine is built
(``build_engine`` in builder.py sizes the arena and builds the rest).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from allocators.base import BlockAllocator
from allocators.tiers import KVTier
from harness.costmodel.work import StepWork
from harness.engine.clock import Clock, VirtualClock
from harness.engine.forks import Forks
from harness.engine.host_kv import HostKV, Moved
from harness.engine.intake import Intake, Params
from harness.engine.kv_cache import UNQUANTIZED, KVArena, KVFormat
from harness.engine.model_runner import Forward, ModelRunner, Row, Runner
from harness.engine.modelled import step_work
from harness.engine.outputs import OutputProcessor, prompt_positions
from harness.engine.pipeline import Pipeline
from harness.engine.recorder import Recorder, Snapshot
from harness.engine.request import RequestOutput, Seq
from harness.engine.request_table import RequestTable
from harness.engine.sampling import argmax_on_host
from harness.engine.sampling_params import LOGPROBS_MODES, LogprobsMode, SamplingParams
from harness.engine.speculative import Proposer
from harness.engine.step_sampler import Drawn, StepSampler
from harness.engine.step_shape import StepShape
from harness.engine.step_state import StepState
from harness.engine.tier_kv import TierKV
from harness.engine.window import WindowTables
from harness.platform.models import LoadedModel
from schedulers.base import Scheduler, SchedulerOutput
from schedulers.decode_run import DecodeRun
from schedulers.output import BatchStep, Scheduled, StepResults
from schedulers.request import Status
from schedulers.stats import kv_stats

_NO_EVENTS = SchedulerOutput()  # a batch step's plan when nothing comes in: read, never changed
_NOT_MOVED = Moved()


class LLMEngine:
    """Continuous-batching engine over a paged KV arena (the API of docs/design.md).

    Build one with ``harness.engine.build_engine``, which sizes the arena and builds the
    allocators and the policy."""

    def __init__(
        self,
        model: LoadedModel,
        allocator: BlockAllocator,
        scheduler: Scheduler,
        *,
        proposer: Proposer | None = None,
        window: WindowTables | None = None,
        runner: Runner | None = None,
        clock: Clock | None = None,
        seed: int = 0,
        record: bool = True,
        pipeline: bool = False,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        kv_format: KVFormat = UNQUANTIZED,
        kv_tier: KVTier | None = None,
        batch_steps: bool = True,
        decode_runs: bool = True,
    ) -> None:
        """``logprobs_mode`` (vLLM's, engine-wide as there): what ``SamplingParams.logprobs``
        report, raw (before any processing, the default) or processed (what the token was
        drawn from), as log-probabilities or logits; see ``harness/engine/sampling.py``.
        ``window``: the sliding-window layers' rings of a model that has them
        (harness/engine/window.py; ``build_engine`` makes them: a ``WindowGroup`` with their
        arena, or on the model clock ``WindowTables``, the rings alone). ``runner``: what runs the
        rows and moves blocks (harness/engine/model_runner.py's ``Runner``); by default the
        model itself over an arena of ``allocator``'s blocks, stored in ``kv_format``
        (engine.kv_bits: 16, or quantized to 8 or 4 bits, harness/engine/kv_cache.py).

        ``kv_tier``: the lower tiers under the radix allocator's prefix cache (built with
        them), whose moves this engine makes (harness/engine/tier_kv.py: host copies, and
        block files in a folder made inside ``kv_tier.dir``, or the system's temporary folder).
        ``close`` removes that folder unless ``kv_tier.keep``.

        ``pipeline``: steps one deep (harness/engine/pipeline.py; off by default: on MLX's
        CPU build pipelined decode measured 1-25 % slower, side by side, docs/design.md).

        ``batch_steps``: a step the scheduler can decide over its running batch does so
        (``Scheduler.schedule_batch``); off, every step takes the general path, the
        reference a batch step's tables and tokens are checked against. The attribute says
        whether this engine's steps may (the option, and an engine of the kind: see
        ``_batch_step``).

        ``decode_runs``: ``steps`` takes runs of batch steps whose rows all decode
        (``Scheduler.begin_run``) on a runner that computes no logits (the model clock's),
        the same steps one at a time; off, ``steps`` is ``step``."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"engine.logprobs_mode={logprobs_mode!r} is invalid: it must be one of "
                f"{', '.join(LOGPROBS_MODES)}"
            )
        if scheduler.allocator is not allocator:
            raise ValueError("the scheduler must be built over the engine's allocator")
        if (proposer is None) != (scheduler.num_lookahead_slots == 0):
            raise ValueError(
                "a draft proposer and the scheduler's num_lookahead_slots go together: build "
                "a speculative engine with build_engine(..., speculative=Speculation(...))"
            )
        stopping = scheduler.progress.stopping
        if stopping.eos_token_ids != tuple(model.eos_token_ids) or (
            (stopping.detokenize is None) != (model.tokenizer is None)
        ):
            raise ValueError(
                f"the scheduler's stop checks are not model {model.name!r}'s (its EOS ids and "
                "detokenizer): build the engine with build_engine, which gives them"
            )
        if (window is None) != (not model.window_layers):
            raise ValueError(
                f"model {model.name!r} has sliding-window layers {model.window_layers}: build "
                "its engine with build_engine, which makes their window group"
                if window is None
                else f"model {model.name!r} has no sliding-window layers: give no window group"
            )
        self.model = model
        self.window = window
        self.allocator = allocator  # read for block tables; only the scheduler calls it
        self.scheduler = scheduler
        self.clock = clock or VirtualClock()
        if runner is None:
            arena = KVArena.for_model(model, allocator.num_blocks, allocator.block_size, kv_format)
            runner = ModelRunner(model, arena, window)
        self.runner = runner
        self.proposer = proposer  # proposes drafts, when speculating
        block_bytes = model.kv_bytes_per_token(kv_format.bits, kv_format.group_size)
        self.recorder = Recorder(
            enabled=record,
            measured=self.clock.measures,
            block_bytes=block_bytes * allocator.block_size,
        )
        # One call at a time (steps, requests in and out); a caller may hold it to keep the
        # engine still.
        self.lock = threading.RLock()
        self.requests = RequestTable()
        draft_runner = proposer.runner if proposer is not None and proposer.runs_model else None
        tiers = None
        if kv_tier is not None and kv_tier.enabled:
            tiers = TierKV(kv_tier, runner, lambda: self.host.kv_spec)
        self.host = HostKV(model, scheduler, runner, kv_format, window, draft_runner, tiers)
        self.outputs = OutputProcessor(model, self.requests)
        self.forks = Forks(self.requests, scheduler, runner, window, self.outputs, self.recorder)
        self.sampler = StepSampler(self.requests, self.outputs, self.forks, logprobs_mode)
        self.intake = Intake(
            model,
            self.requests,
            self.host,
            scheduler,
            self.lock,
            seed=seed,
            speculative=proposer is not None,
            has_window=window is not None,
            logits=runner.computes_logits,
        )
        self.pipeline = Pipeline(scheduler, self.requests) if pipeline else None
        # Its steps may run over the scheduler's running batch (``_batch_step``) with no
        # draft, window or pipeline; each step also needs sequences alone (n = 1, no beam)
        # and nothing owed.
        self.batch_steps = batch_steps and not (
            scheduler.batch is None or proposer is not None or pipeline or window is not None
        )
        # A run's steps need no token on the host until it ends: a runner that feeds none.
        self.decode_runs = decode_runs and self.batch_steps and not runner.computes_logits
        # The class's function: a bound method kept by its engine is a cycle (freed by GC).
        self._step_fn = LLMEngine._pipelined_step if pipeline else LLMEngine._plain_step

    @property
    def arena(self) -> KVArena:  # the full-attention layers' KV arena
        return self.runner.arena

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: Params | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        *,
        ttft_slo: float | None = None,
        tpot_slo: float | None = None,
        save_kv: str | Path | None = None,
        restore_kv: str | Path | None = None,
    ) -> None:
        """Queue a request. A prompt is token ids, or text when the model has a tokenizer.
        ``BeamSearchParams`` run a beam search (harness/engine/beam_search.py): the request's
        one output, when it finishes, holds the best ``beam_width`` beams.

        ``save_kv``: a file the request's KV (prompt and output but the last token) is
        saved to when it finishes. ``restore_kv``: such a file; the KV of the longest prefix
        of this prompt it holds is written back at admission instead of computed. A file
        that cannot be used (unreadable, corrupted, another model or block size) or shares
        no prefix warns (``KVRestoreWarning``, one line naming it) and the prompt is
        computed (harness/engine/persistence.py). A malformed request raises
        ``RequestError`` naming the field and the fix; nothing is queued then."""
        # Arrival is when the caller hands the request over, not when the lock is free.
        arrived = self.clock.now() if arrival_time is None else arrival_time
        self.intake.add(
            request_id,
            prompt,
            sampling_params or SamplingParams(),
            arrived,
            priority,
            ttft_slo=ttft_slo,
            tpot_slo=tpot_slo,
            save_kv=save_kv,
            restore_kv=restore_kv,
        )

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state; its blocks are free when this returns."""
        with self.lock:
            now = self.clock.now()
            group = self.requests.beams.get(request_id)
            if group is not None:
                for out in self.forks.end_beams(group, "abort", now, "aborted by the user"):
                    self.requests.owe(out)
                self._settle()
                return
            if request_id.rpartition("/")[0] in self.requests.beams:
                return  # a beam's own id: the engine's, not a request (vLLM ignores those)
            completions = self.requests.groups.get(request_id) or []
            ids = [s.request_id for s in completions if not s.finished] or [request_id]
            aborted = [self.scheduler.abort(rid, now, "aborted by the user") for rid in ids]
            aborted = [seq for seq in aborted if seq is not None]
            self._settle()
            if aborted:  # one output for the request, all its completions in
                self.requests.owe(self.outputs.report(aborted[0]))

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or an abort's output is not yet returned."""
        with self.lock:
            busy = self.pipeline is not None and self.pipeline.busy
            return self.scheduler.has_unfinished() or bool(self.requests.owed) or busy

    def get_num_unfinished_requests(self) -> int:
        """Requests (not completions of n > 1) still running or waiting."""
        with self.lock:
            return len({seq.group_id for seq in self.scheduler.unfinished()})

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Params | Sequence[Params] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        if sampling_params is None or isinstance(sampling_params, Params):
            sampling_params = [sampling_params] * len(prompts)
        ids = [f"gen-{self.requests.num_added + i}" for i in range(len(prompts))]
        for rid, prompt, params in zip(ids, prompts, sampling_params, strict=True):
            self.add_request(rid, prompt, params)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    # -- KV files ------------------------------------------------------------------------
    def close(self, discard: bool = False) -> None:
        """Remove the disk tier's folder (``kv_tier``) now, unless it is kept (``discard``:
        even then: a throwaway engine's); without a disk tier, nothing. A run calls it when
        its replay ends."""
        if self.host.tiers is not None:
            self.host.tiers.close(discard)

    def save_prefix_cache(self, folder: str | Path) -> int:
        """Snapshot the radix allocator's prefix cache into ``folder`` (``HostKV``)."""
        with self.lock:
            return self.host.save_prefix_cache(folder)

    def restore_prefix_cache(self, folder: str | Path) -> int:
        """Load a ``save_prefix_cache`` snapshot into the prefix cache (``HostKV``)."""
        with self.lock:
            return self.host.restore_prefix_cache(folder)

    # -- the loop ------------------------------------------------------------------------
    def step(self, next_arrival: float | None = None) -> list[RequestOutput]:
        """Run one scheduling step and one batched forward; return what progressed.

        ``next_arrival``: when the driver will add its next request, so a scheduler that holds
        back a small batch (min_batch_size) idles no later than that.
        """
        with self.lock:
            start, now = time.perf_counter(), self.clock.now()
            if self.batch_steps and self._alone():
                batch_step = self.scheduler.schedule_batch(now)
                if batch_step is not None:
                    return self._batch_step(batch_step, start, now)
            plan = self.scheduler.schedule(now)
            outputs = self._collect_owed(plan)
            moved = self.host.move_blocks(plan)
            outputs += self._step_fn(self, plan, start, now, moved)
            self._wait_for_batch(plan, next_arrival)
            # One output per request: its completions progress together (n > 1).
            return list({out.request_id: out for out in outputs}.values())

    def steps(self, next_arrival: float | None = None) -> list[RequestOutput]:
        """``step``, or as many steps as a run of decode steps takes (``decode_runs``,
        schedulers/decode_run.py): the same steps ``step`` would take one at a time. The
        first is taken as ``step`` would be (the driver has added what arrived by now);
        after it, none that would start at or after ``next_arrival`` (the driver adds that
        request first, as between steps). Returns what progressed, one output per request:
        a streaming request's, one for the whole run. The engine's lock is held throughout
        (an abort from another thread waits for the run's end)."""
        with self.lock:
            if self.decode_runs and self._alone():
                run = self.scheduler.begin_run()
                if run is not None and (outputs := self._run(run, next_arrival)) is not None:
                    return outputs
            return self.step(next_arrival)

    def _run(self, run: DecodeRun, next_arrival: float | None) -> list[RequestOutput] | None:
        """The steps of ``run``, each as ``_batch_step`` takes a step of decodes alone on a
        runner that computes no logits (the runner's ``decode_run`` gives each step's
        forward from the run's starts): its work priced, its memory snapshot, its tokens
        handed to the scheduler (``run_tokens``), its row recorded. None if it took none
        (its first step's crossings outnumber the free blocks: ``step`` decides)."""
        scheduler, clock, recorder = self.scheduler, self.clock, self.recorder
        batch, forwards = scheduler.batch, self.runner.decode_run(run.starts)
        waiting = len(scheduler.waiting)  # nobody is let in or added during a run
        last = False
        while not last:
            start, now = time.perf_counter(), clock.now()
            if run.steps and next_arrival is not None and now >= next_arrival:
                break
            starts = scheduler.run_step(run)
            if starts is None:
                break
            state = StepState(start)
            forward = forwards.forward(run.steps)
            work = forward.work  # nothing moves in a run (``step_work`` adds moves)
            clock.charge(work)
            snapshot = None
            if recorder.enabled:
                step = BatchStep(starts, None)
                snapshot = recorder.snapshot_batch(self.allocator.stats(), batch, step, waiting)
            done = clock.after(time.perf_counter() - start)
            last = scheduler.run_tokens(run, forward.tokens, done)
            if last:  # its rows that stop finish before its row, as in a single step
                scheduler.end_run(run)
                self._settle()
            self._record(_NO_EVENTS, snapshot, now, _NOT_MOVED, forward, work, state)
        if not last:
            scheduler.end_run(run)
        return self._report(run.seqs) if run.steps else None

    def _alone(self) -> bool:
        """Every request is a sequence alone (n = 1, no beam search) and nothing is owed (an
        abort's output): a step the batch, or a run of its steps, may take."""
        requests = self.requests
        return not (requests.groups or requests.beams or requests.owed)

    def _batch_step(self, step: BatchStep, start: float, now: float) -> list[RequestOutput]:
        """A step the scheduler decided over its running batch (``schedule_batch``): its
        forward from the batch's columns (a model clock's shape, or ``Row``s), started, its
        row's memory taken while it computes, its tokens drawn, the results handed back
        (``update_batch``) and its row recorded, as ``_plain_step`` does for any plan,
        without a per-row object past the runner's rows."""
        batch, events = self.scheduler.batch, step.events
        n = len(step.starts)
        outputs, moved = [], _NOT_MOVED
        sampled = batch.seqs[:n]
        if events is not None:
            outputs = self._collect_owed(events)  # rejections
            moved = self.host.move_blocks(events)
            sampled += [row.seq for row in events.scheduled if row.samples]
        state = StepState(start)
        real = self.runner.computes_logits
        if real:
            forward = self.runner.forward(self._batch_rows(step, state))
        else:
            forward = self.runner.forward(self._batch_shape(step, state))
        work = step_work(events or _NO_EVENTS, forward.work, False)
        self.clock.charge(work)
        if real:  # started and waited on with or without logits: the arena's writes too
            logits = forward.logits
            argmax = (
                logits is not None
                and not state.prompt_positions
                and not argmax_on_host(logits.dtype)
                and self.sampler.argmax_rows(sampled)
            )
            forward = self._start(forward, state, argmax)
        snapshot = None
        if self.recorder.enabled:  # the step's memory and queues, taken while it computes
            waiting = len(self.scheduler.waiting)
            snapshot = self.recorder.snapshot_batch(self.allocator.stats(), batch, step, waiting)
        if real:
            self._wait(forward, state)
        if state.prompt_positions:
            # A prompt let in asks its logprobs: the general draw, over the step's rows as a
            # plan (each decode one token that samples, then the other rows), in the order
            # _batch_rows gave the runner.
            rows = [Scheduled(seq, 1, True) for seq in sampled[:n]]
            plan = SchedulerOutput(scheduled=rows + events.scheduled)
            drawn = self.sampler.draw(plan, forward, {}, state.prompt_positions)
        else:
            drawn = self.sampler.draw_rows(sampled, forward)
        done = self.clock.after(time.perf_counter() - start)
        self.scheduler.update_batch(step, drawn.tokens, done)
        self._settle()
        self._add_logprobs(drawn)
        outputs += self._report(sampled)
        self._record(events or _NO_EVENTS, snapshot, now, moved, forward, work, state)
        return outputs

    def _batch_rows(self, step: BatchStep, state: StepState) -> list[Row]:
        """A batch step's ``Row``s: each decode's last token from its start, over its block
        table, one logit; then the other rows as ``_build_rows`` builds any plan's."""
        batch = self.scheduler.batch
        tables = self.allocator.block_tables(batch.ids[: len(step.starts)])
        new_row = tuple.__new__  # as _build_rows does
        rows = [
            new_row(Row, ([seq.token_ids[start]], start, table, 1, (), ()))
            for seq, start, table in zip(batch.seqs, step.starts, tables)  # noqa: B905 (the decodes)
        ]
        if step.events is not None:
            rows += self._build_rows(step.events, state)
        return rows

    def _batch_shape(self, step: BatchStep, state: StepState) -> StepShape:
        """A batch step's shape for a runner that computes no logits (``StepShape``): one
        token and one logit a decode, then the other rows as ``_build_shape`` counts any
        plan's."""
        n = len(step.starts)
        if step.events is None or not step.events.scheduled:
            return StepShape([1] * n, step.starts, [1] * n, {})
        rest = self._build_shape(step.events, state)
        return StepShape(
            [1] * n + rest.queries, step.starts + rest.starts, [1] * n + rest.num_logits, {}
        )

    def _collect_owed(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Outputs of aborts since the last step and of the requests the scheduler rejected
        this step (it finished them; a rejected beam ends its search, ``_settle``)."""
        outputs = self.requests.take_owed() if self.requests.owed else []
        beams = self.requests.beams
        rejected = plan.rejected  # most steps reject nobody: then no pass over them
        searches = {s.group_id for s, _ in rejected if s.group_id in beams} if rejected else set()
        outputs += self._settle()
        for seq, _ in plan.rejected:
            if seq.group_id not in searches:  # one output per request, all its completions in
                searches.add(seq.group_id)
                outputs.append(self.outputs.report(seq))
        return outputs

    def _settle(self) -> list[RequestOutput]:
        """Who the scheduler let go: kept KV saved (before this step writes a block), host
        copies and rings dropped, each request's row recorded in the order they left (a
        beam's is its search's: a rejected beam ends its search). Returns ended searches'."""
        progress, outputs = self.scheduler.progress, []
        if progress.released:
            for seq, table in progress.take_released():
                self.host.save(seq, table)
        while progress.finished:  # a search that ends drops its other beams
            window, beams = self.window, self.requests.beams
            for seq in progress.take_finished():
                self.host.forget(seq.request_id)
                if window is not None:
                    window.drop(seq.request_id)
                self.outputs.forget(seq)
                self.requests.remove(seq)
                group = beams.get(seq.group_id)
                if group is None and seq.finish_reason is not None:
                    self.recorder.request(seq)
                elif group is not None and seq.finish_reason == "abort":  # rejected
                    reason = seq.abort_reason
                    outputs += self.forks.end_beams(group, "abort", seq.finish_time, reason)
        return outputs

    def _plain_step(
        self,
        plan: SchedulerOutput,
        start: float,
        now: float,
        moved: Moved,
        step: StepState | None = None,
    ) -> list[RequestOutput]:
        """Launch the forward, take the step's memory figures while it computes, wait for
        its logits, sample and hand the results to the scheduler; record the step. The clock
        advances by the step's measured duration (or its price, on a model clock)."""
        step = step or StepState(start)
        forward, work = self._launch(plan, step, None)
        snapshot = self._snapshot(plan, step)
        outputs = []
        if forward is not None:
            self._wait(forward, step)
            outputs = self._postprocess(plan, forward, step)
        self._record(plan, snapshot, now, moved, forward, work, step)
        return outputs

    def _pipelined_step(
        self, plan: SchedulerOutput, start: float, now: float, moved: Moved
    ) -> list[RequestOutput]:
        """A step whose rows all sample on the device launches its forward and argmax and
        leaves the tokens there, reading the previous step's while it computes; any other
        step first reads them, then runs plainly (harness/engine/pipeline.py)."""
        pipeline = self.pipeline
        step = StepState(start)
        if not pipeline.on_device(plan):
            outputs = self._resolve(start, step)
            # A sequence that stopped on the token just read runs no more.
            plan = replace(plan, scheduled=[s for s in plan.scheduled if not s.seq.finished])
            return outputs + self._plain_step(plan, start, now, moved, step)
        forward, work = self._launch(plan, step, pipeline.tokens, on_device=True)
        snapshot = self._snapshot(plan, step)
        outputs = self._resolve(start, step)
        if forward is not None:
            pipeline.carry(plan, step.tokens)
            self._settle()
        self._record(plan, snapshot, now, moved, forward, work, step)
        return outputs

    def _resolve(self, start: float, step: StepState) -> list[RequestOutput]:
        """The last step's tokens, read from the device: the scheduler takes them."""
        if not self.pipeline.busy:
            return []
        resolved, waited = self.pipeline.resolve(
            lambda: self.clock.after(time.perf_counter() - start)
        )
        step.waited += waited
        self._settle()
        return self._report(resolved)

    def _launch(
        self, plan: SchedulerOutput, step: StepState, carried: mx.array | None, on_device=False
    ):
        """Propose the step's drafts, build its forward (``Row``s for a runner that computes
        logits, else only its ``StepShape``) and start it (the clock is charged the step's
        work); ``on_device``: the tokens are its logits' argmax, left on the device."""
        forward = None
        if plan.scheduled:
            spec = []  # the rows that verify drafts: only a speculating engine's have any
            if self.proposer is not None:
                spec = [s for s in plan.scheduled if s.num_draft_tokens]
            if spec:
                proposals = self.proposer.propose(spec, self.outputs.sample_row)
                step.proposals = dict(zip([s.seq for s in spec], proposals, strict=True))
            if self.runner.computes_logits:
                forward = self.runner.forward(self._build_rows(plan, step), carried)
            else:  # the model clock: the step's shape is all it reads
                forward = self.runner.forward(self._build_shape(plan, step))
        # The step's work, priced by a model clock (a measuring clock ignores it).
        drafted = self.proposer is not None and self.proposer.runs_model
        work = step_work(plan, forward.work if forward else StepWork(), drafted)
        self.clock.charge(work)
        if forward is not None:
            logits = forward.logits
            argmax = logits is not None and (
                on_device
                or not argmax_on_host(logits.dtype)
                and self.sampler.argmax_only(plan, step.proposals, step.prompt_positions)
            )
            forward = self._start(forward, step, argmax, on_device)
        return forward, work

    def _start(
        self, forward: Forward, step: StepState, argmax: bool, on_device: bool = False
    ) -> Forward:
        """Start computing ``forward`` (``runner.launch``); ``argmax``: the step's tokens
        are its logits' argmax, which MLX takes, part of the forward's graph, as mlx_lm's
        generate and vLLM's sampler on the device take theirs (``on_device``: left there for
        a pipelined step to carry, else the sampler reads them as ``Forward.tokens``)."""
        if argmax:
            step.tokens = mx.argmax(forward.logits, axis=-1)
            if not on_device:
                forward = replace(forward, tokens=step.tokens)
        wanted = step.tokens if step.tokens is not None else forward.logits
        launched = time.perf_counter()
        self.runner.launch([] if wanted is None else [wanted])  # blocks on MLX's CPU build
        step.waited += time.perf_counter() - launched
        return forward

    def _wait(self, forward: Forward, step: StepState) -> None:
        """Block until the step's tokens (or logits) and the arena's writes are computed."""
        waited = time.perf_counter()
        wanted = step.tokens if step.tokens is not None else forward.logits
        self.runner.wait([] if wanted is None else [wanted])
        step.waited += time.perf_counter() - waited

    def _snapshot(self, plan: SchedulerOutput, step: StepState) -> Snapshot | None:
        """The step's memory and queues, taken while its forward computes."""
        stats = kv_stats(self.scheduler) if self.recorder.enabled else None
        proposed = {seq: len(p.tokens) for seq, p in step.proposals.items()}
        return self.recorder.snapshot(stats, plan, proposed)

    def _record(self, plan, snapshot, now, moved, forward, work, step: StepState) -> None:
        """The step's row: the clock advances by its measured duration (or, on a model
        clock, by the price of its ``work``)."""
        duration = self.clock.advance(time.perf_counter() - step.start)
        self.recorder.step(
            plan,
            snapshot,
            now,
            duration,
            forward_time=(forward.graph_time if forward else 0.0) + step.waited,
            build_time=forward.build_time if forward else 0.0,
            swap_time=moved.swap_time,
            verifications=step.verifications,
            work=work,
            tier_time=moved.tier_time,
        )

    def _wait_for_batch(self, plan: SchedulerOutput, next_arrival: float | None) -> None:
        """The scheduler lets a bigger batch form: idle until it stops holding, or until the
        next arrival the driver knows of, whichever comes first."""
        if plan.hold_until is not None:
            wake = plan.hold_until if next_arrival is None else min(plan.hold_until, next_arrival)
            self.clock.wait_until(wake)

    # -- inside a step -------------------------------------------------------------------
    def _build_rows(self, plan: SchedulerOutput, step: StepState) -> list[Row]:
        """The runner's rows: each scheduled sequence's new tokens (and the drafts proposed
        to verify).

        Run once per sequence per step, one pass reading only the sequence's own counts and
        tokens: what only some rows need (drafts, tokens carried from the device, window
        rings) is looked up only when a step has any of them, and prompt logprobs only for a
        row that computes a prompt position before the last (a decode row computes none, so
        its parameters are not read)."""
        scheduled = plan.scheduled
        tables = self.allocator.block_tables([s.seq.request_id for s in scheduled])
        carried = self.pipeline.rows() if self.pipeline is not None else None
        window, proposals = self.window, step.proposals
        # Row's generated __new__ is a Python frame over tuple.__new__: 0.63 against 0.36 µs
        # a row, called straight.
        new_row = tuple.__new__
        rows = []
        for (seq, num_new, samples, num_draft, _), table in zip(scheduled, tables, strict=True):
            start = seq.num_computed_tokens
            end = start + num_new - num_draft
            fed = seq.token_ids[start:end].tolist()
            num_logits = 1 if samples else 0
            on_device = ring = ()
            if num_draft:
                # A verification feeds the last token and the drafts, and wants logits for
                # each.
                drafts = proposals[seq].tokens
                fed = fed + drafts
                num_logits += len(drafts) if samples else 0
            # The previous step's token, not yet on the host, is fed from the device (it is
            # the sequence's last; a recomputed prefix chunk that stops short never feeds it).
            if carried and samples and seq in carried:
                on_device = ((end - 1 - start, carried[seq]),)
            if start < seq.num_prompt_tokens - 1 and seq.params.prompt_logprobs is not None:
                # Prompt logprobs want logits at the prompt positions before the sampling one.
                positions = step.prompt_positions[seq] = prompt_positions(seq, num_new)
                num_logits += len(positions)
            if window is not None:
                ring = window.table(seq.request_id)
            rows.append(new_row(Row, (fed, start, table, num_logits, on_device, ring)))
        return rows

    def _build_shape(self, plan: SchedulerOutput, step: StepState) -> StepShape:
        """The step's shape for a runner that computes no logits (``StepShape``): per row
        the tokens fed, where they start, the logits asked; the drafts (proposed) only of
        the rows that verify some. As ``_build_rows`` counts them, without slicing a token
        list or reading a block table."""
        scheduled = plan.scheduled
        seqs, num_new, samples, _, _ = zip(*scheduled, strict=True)  # the plan's columns
        queries = list(num_new)
        starts = [seq.num_computed_tokens for seq in seqs]
        num_logits = list(map(int, samples))
        drafts = {}
        if step.proposals:  # a verification feeds its new tokens but the slots it reserved
            for row, s in enumerate(scheduled):
                if s.num_draft_tokens:
                    proposed = step.proposals[s.seq].tokens
                    queries[row] += len(proposed) - s.num_draft_tokens
                    if s.samples and proposed:
                        num_logits[row] += len(proposed)
                        drafts[row] = proposed
        return StepShape(queries, starts, num_logits, drafts)

    def _postprocess(
        self, plan: SchedulerOutput, forward: Forward, step: StepState
    ) -> list[RequestOutput]:
        """Draw the step's tokens (``StepSampler``), then hand them to the scheduler
        (``Scheduler.update``: progress, forks, tokens, stops) and build the outputs: a
        token's time is when it exists, so the clock is read after sampling."""
        drawn = self.sampler.draw(plan, forward, step.proposals, step.prompt_positions)
        step.verifications = drawn.verifications
        now = self.clock.after(time.perf_counter() - step.start)
        verified, sampled, tokens = drawn.verified, drawn.sampled, drawn.tokens
        got_tokens = {seq: got.tokens for seq, got in verified} if verified else {}
        results = StepResults(got_tokens, sampled, tokens, drawn.forks, now)
        lengths = {seq: len(seq.token_ids) for seq, _ in verified} if verified else None
        forked = self.scheduler.update(plan, results)
        self._settle()
        if forked:
            self.forks.copy_forked(forked)
        for seq, got in verified:  # the logprobs of the tokens kept, up to a stop
            if got.logprobs is not None:
                kept = got.tokens[: len(seq.token_ids) - lengths[seq]]
                for token, token_logprobs in zip(kept, got.logprobs, strict=False):
                    self.outputs.add_logprobs(seq, token, token_logprobs)
        self._add_logprobs(drawn)
        outputs = self._report([seq for seq, _ in verified] + sampled if verified else sampled)
        for seq, candidates in drawn.offering:
            outputs += self.forks.offer(seq, candidates, now)
        if drawn.offering:
            self._settle()
        return outputs

    def _add_logprobs(self, drawn: Drawn) -> None:
        """The logprobs of each token drawn that asked for them (``SamplingParams.logprobs``)."""
        logprobs = drawn.logprobs
        if logprobs.count(None) != len(logprobs):
            tokens = drawn.tokens
            for seq, token, token_logprobs in zip(drawn.sampled, tokens, logprobs, strict=True):
                if token_logprobs is not None:
                    self.outputs.add_logprobs(seq, token, token_logprobs)

    def _report(self, progressed: list[Seq]) -> list[RequestOutput]:
        """One output per request of the sequences that got tokens, once all are in."""
        if not (self.requests.groups or self.requests.beams):  # a sequence per request
            return self.outputs.report_alone(progressed)
        outputs = []
        seen = set()
        report, report_progress = self.outputs.report, self.outputs.report_progress
        for seq in progressed:
            group = seq.group_id
            if group in seen:
                continue
            if seq.params.output_kind == "cumulative":
                seen.add(group)
                outputs.append(report(seq))
            # A request that asked for its final output only gets none before it finishes.
            elif seq.status is Status.FINISHED:
                seen.add(group)
                outputs += report_progress(seq)
        return outputs
