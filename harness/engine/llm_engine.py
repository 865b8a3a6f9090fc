"""LLMEngine: the loop that ties scheduler, model runner and sampler together.

    step():  schedule -> move blocks -> run the rows -> update the scheduler -> outputs

The scheduler decides and owns every allocation and each sequence's progress; the engine
runs its plan (block moves, then one batched forward through the model runner), samples,
hands the step's results back (``Scheduler.update``) and builds the outputs. The engine's
other concerns live beside it, each a part of this class:

    intake.py      add_request (a request checked, then queued) and abort_request
    outputs.py     tokens in, stop conditions, finished requests, RequestOutputs
    forks.py       parallel sampling's completions and beam search's rounds
    pipeline.py    steps pipelined one deep (``pipeline``, off by default)
    kv_files.py    KV save and restore, host copies of swapped-out KV
    builder.py     build_engine: the arena sized, the parts built
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from allocators.base import BlockAllocator
from harness.costmodel.work import StepWork
from harness.engine.beam_search import BeamGroup
from harness.engine.clock import Clock, VirtualClock
from harness.engine.forks import Forks
from harness.engine.intake import Intake, Params
from harness.engine.kv_cache import UNQUANTIZED, HostBlocks, KVArena, KVFormat
from harness.engine.kv_files import KVFiles
from harness.engine.model_runner import Forward, ModelRunner, Row, Runner
from harness.engine.modelled import step_work
from harness.engine.outputs import Outputs, prompt_positions
from harness.engine.pipeline import Pipelined
from harness.engine.recorder import Recorder
from harness.engine.request import RequestOutput
from harness.engine.request import Sequence as Seq
from harness.engine.sampling import sample
from harness.engine.sampling_params import LOGPROBS_MODES, LogprobsMode
from harness.engine.speculative import (
    Proposal,
    Proposer,
    Verifications,
    Verified,
    verify,
    verify_tokens,
)
from harness.engine.window import WindowGroup
from harness.platform.models import LoadedModel
from schedulers.base import Scheduler, SchedulerOutput


class LLMEngine(Intake, Outputs, Forks, Pipelined, KVFiles):
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
        window: WindowGroup | None = None,
        runner: Runner | None = None,
        clock: Clock | None = None,
        seed: int = 0,
        record: bool = True,
        pipeline: bool = False,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        kv_format: KVFormat = UNQUANTIZED,
    ) -> None:
        """``logprobs_mode`` (vLLM's, engine-wide as there): what ``SamplingParams.logprobs``
        report, raw (before any processing, the default) or processed (what the token was
        drawn from), as log-probabilities or logits; see ``harness/engine/sampling.py``.
        ``window``: the sliding-window layers' group of a model that has them
        (harness/engine/window.py; ``build_engine`` makes it). ``runner``: what runs the
        rows and moves blocks (harness/engine/model_runner.py's ``Runner``); by default the
        model itself over an arena of ``allocator``'s blocks, stored in ``kv_format``
        (engine.kv_bits: 16, or quantized to 8 or 4 bits, harness/engine/kv_cache.py).

        ``pipeline``: steps one deep (harness/engine/pipeline.py), off by default. On MLX's
        CPU build async_eval returns only when all but the graph's last few dozen ops have
        run, and the host then competes with the BLAS threads: pipelined decode measured
        1-25 % slower, side by side. On Metal it is unmeasured, and a step's arena writes
        dispatched while the previous step's reads are pending may copy whole layers."""
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
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        self.pipeline = pipeline
        self.kv_format = kv_format
        if runner is None:
            arena = KVArena.for_model(model, allocator.num_blocks, allocator.block_size, kv_format)
            runner = ModelRunner(model, arena, window)
        self.runner = runner
        self.proposer = proposer  # proposes drafts, when speculating
        self.recorder = Recorder(enabled=record, measured=self.clock.measures)
        self._verifications = Verifications()  # this step's, filled by _verify
        self._proposals: dict[Seq, Proposal] = {}  # this step's drafts, from _rows on
        self._lock = threading.RLock()
        self._requests: dict[str, Seq] = {}
        self._pending: list[RequestOutput] = []  # aborts and rejections, returned next step
        self._num_added = 0
        self._waited = 0.0  # this step's seconds blocked on MLX
        # KVFiles': host copies of swapped-out and restored requests, save_kv destinations.
        self._host: dict[str, HostBlocks] = {}
        self._save_to: dict[str, Path] = {}
        # Pipelined's: the tokens the last step sampled, still on the device, with the
        # sequence and place each goes to; sequences already released to stop on theirs.
        self._inflight: list[tuple[Seq, int]] = []
        self._inflight_tokens: mx.array | None = None
        self._draining: set[Seq] = set()
        # Forks': completions of requests with n > 1, beam searches by request id.
        self._groups: dict[str, list[Seq]] = {}
        self._beams: dict[str, BeamGroup] = {}

    @property
    def arena(self) -> KVArena:
        """The full-attention layers' KV arena."""
        return self.runner.arena

    # -- requests (add_request, abort_request: harness/engine/intake.py) ---------------
    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or an abort's output is not yet returned."""
        with self._lock:
            return self.scheduler.has_unfinished() or bool(self._pending or self._inflight)

    def get_num_unfinished_requests(self) -> int:
        """Requests (not completions of n > 1) still running or waiting."""
        with self._lock:
            queued = [*self.scheduler.unfinished(), *self._draining]
            return len({seq.group_id for seq in queued})

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Params | Sequence[Params] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        if sampling_params is None or isinstance(sampling_params, Params):
            sampling_params = [sampling_params] * len(prompts)
        ids = [f"gen-{self._num_added + i}" for i in range(len(prompts))]
        for rid, prompt, params in zip(ids, prompts, sampling_params, strict=True):
            self.add_request(rid, prompt, params)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    # -- the loop ------------------------------------------------------------------------
    def step(self, next_arrival: float | None = None) -> list[RequestOutput]:
        """Run one scheduling step and one batched forward; return what progressed.

        ``next_arrival``: when the driver will add its next request, so a scheduler that holds
        back a small batch (min_batch_size) idles no later than that.
        """
        with self._lock:
            start, now = time.perf_counter(), self.clock.now()
            plan = self.scheduler.schedule(now)
            outputs = self._rejected(plan, now)
            swap_time = self._move_blocks(plan)
            outputs += self._run(plan, start, now, swap_time)
            self._idle(plan, next_arrival)
            # One output per request: its completions progress together (n > 1).
            return list({out.request_id: out for out in outputs}.values())

    def _rejected(self, plan: SchedulerOutput, now: float) -> list[RequestOutput]:
        """Outputs of pending aborts and of requests the scheduler rejected this step."""
        outputs, self._pending = self._pending, []
        for seq, reason in plan.rejected:
            if seq.finished:  # a beam of a search another rejection just ended
                continue
            if seq.group_id in self._beams:
                outputs += self._end_beams(self._beams[seq.group_id], "abort", now, reason)
                continue
            self._finish(seq, "abort", now, abort_reason=reason)
            outputs.append(self._output(seq))
        return outputs

    def _move_blocks(self, plan: SchedulerOutput) -> float:
        """Swap-outs, block copies, swap-ins: each block is read before a later op (or the
        forward) reuses it. Returns the seconds the swaps took."""
        swap_time = 0.0
        if plan.swapped_out:
            start = time.perf_counter()
            for s in plan.swapped_out:
                self._host[s.seq.request_id] = self.runner.swap_out(s.blocks)
                if self.window is not None:
                    self.window.swap_out(s.seq.request_id, s.ring)
            swap_time += time.perf_counter() - start
        self.runner.copy_blocks(plan.copies)  # a source may be a block a swap-in reuses
        if plan.draft_copies:  # only a draft model's KV moves
            self.proposer.runner.copy_blocks(plan.draft_copies)
        if plan.swapped_in:
            start = time.perf_counter()
            for s in plan.swapped_in:
                self.runner.swap_in(self._host.pop(s.seq.request_id), s.blocks, s.first)
                if self.window is not None:
                    self.window.swap_in(s.seq.request_id, s.ring)
            swap_time += time.perf_counter() - start
        return swap_time

    def _run(
        self, plan: SchedulerOutput, start: float, now: float, swap_time: float
    ) -> list[RequestOutput]:
        """Launch the forward, then take the step's memory figures and read the previous
        step's tokens while it computes; sample (on the device when pipelined, else after
        waiting); record the step. The clock advances by the step's measured duration."""
        self._verifications = Verifications()
        self._waited = 0.0
        pipelined = self.pipeline and self._on_device(plan)
        outputs = []
        if not pipelined:  # its rows need every token on the host
            outputs = self._resolve(start)
            # A sequence that stopped on the token just read runs no more.
            plan.scheduled = [s for s in plan.scheduled if not s.seq.finished]
        forward = tokens = None
        if plan.scheduled:
            forward = self.runner.forward(self._rows(plan), self._inflight_tokens)
        # The step's work, priced by a model clock (a measuring clock ignores it).
        drafted = self.proposer is not None and self.proposer.runs_model
        work = step_work(plan, forward.work if forward else StepWork(), drafted)
        self.clock.charge(work)
        if forward is not None:
            if pipelined and forward.logits is not None:
                tokens = mx.argmax(forward.logits, axis=-1)
            wanted = tokens if pipelined else forward.logits
            launched = time.perf_counter()
            self.runner.launch([] if wanted is None else [wanted])  # blocks on MLX's CPU build
            self._waited += time.perf_counter() - launched
        stats = self.scheduler.stats() if self.recorder.enabled else None
        proposed = {seq: len(p.tokens) for seq, p in self._proposals.items()}
        snapshot = self.recorder.snapshot(stats, plan, proposed)
        outputs += self._resolve(start)
        if forward is not None:
            if pipelined:
                self._carry(plan, tokens)
            else:
                waited = time.perf_counter()
                self.runner.wait([] if forward.logits is None else [forward.logits])
                self._waited += time.perf_counter() - waited
                outputs += self._postprocess(plan, forward, start)
        duration = self.clock.advance(time.perf_counter() - start)
        self.recorder.step(
            plan,
            snapshot,
            now,
            duration,
            forward_time=(forward.graph_time if forward else 0.0) + self._waited,
            build_time=forward.build_time if forward else 0.0,
            swap_time=swap_time,
            verifications=self._verifications,
            work=work,
        )
        return outputs

    def _idle(self, plan: SchedulerOutput, next_arrival: float | None) -> None:
        """The scheduler lets a bigger batch form: idle until it stops holding, or until the
        next arrival the driver knows of, whichever comes first."""
        if plan.hold_until is not None:
            wake = plan.hold_until if next_arrival is None else min(plan.hold_until, next_arrival)
            self.clock.wait_until(wake)

    # -- inside a step -------------------------------------------------------------------
    def _rows(self, plan: SchedulerOutput) -> list[Row]:
        """The runner's rows: each scheduled sequence's new tokens (and drafts to verify).

        Run once per sequence per step: what only some rows need (drafts, tokens carried
        from the device, prompt logprobs, window rings) is looked up only when a step has
        any of them."""
        spec = [s for s in plan.scheduled if s.num_draft_tokens]
        proposals = self.proposer.propose(spec, self._sample_row) if spec else []
        self._proposals = dict(zip([s.seq for s in spec], proposals, strict=True))
        inflight = {seq: k for seq, k in self._inflight}
        table = self.allocator.block_table
        window = self.window
        rows = []
        for s in plan.scheduled:
            seq = s.seq
            start, tokens = seq.num_computed_tokens, seq.token_ids
            end = start + s.num_new_tokens - s.num_draft_tokens
            last = end == len(tokens)
            if s.num_draft_tokens:
                # A verification feeds the last token and the drafts, and wants logits for
                # each.
                drafts = self._proposals[seq].tokens
                fed = tokens[start:end] + drafts
            else:
                drafts, fed = (), tokens[start:end]
            num_logits = 1 + len(drafts) if last else 0
            # The previous step's token, not yet on the host, is fed from the device (it is
            # the sequence's last; a recomputed prefix chunk that stops short never feeds it).
            carried = ((end - 1 - start, inflight[seq]),) if last and seq in inflight else ()
            if seq.params.prompt_logprobs is not None:
                # Prompt logprobs want logits at the prompt positions before the sampling one.
                num_logits += len(prompt_positions(seq, s.num_new_tokens))
            ring = window.table(seq.request_id) if window is not None else ()
            rows.append(Row(fed, start, table(seq.request_id), num_logits, carried, ring))
        return rows

    def _postprocess(
        self, plan: SchedulerOutput, forward: Forward, start: float
    ) -> list[RequestOutput]:
        """Take prompt logprobs and verify drafts, hand the step's results to the scheduler,
        then sample and stamp: a token's time is when it exists, so the clock is read after
        sampling, ``start`` being the step's ``perf_counter`` start. A runner without a
        model chose the tokens itself (``forward.tokens``)."""
        logits = forward.logits
        sampling, verifying, offset = [], {}, 0  # rows that sample and verify, by logits row
        for s in plan.scheduled:
            seq = s.seq
            if s.num_draft_tokens:  # the drafts proposed (n-gram lookup may find fewer)
                verifying[seq] = offset
                offset += len(self._proposals[seq].tokens) + 1
                continue
            if seq.params.prompt_logprobs is not None and (
                positions := prompt_positions(seq, s.num_new_tokens)
            ):
                self._prompt_logprobs(seq, positions, logits[offset : offset + len(positions)])
                offset += len(positions)
            if seq.num_computed_tokens + s.num_new_tokens == len(seq.token_ids):
                sampling.append((seq, offset))
                offset += 1
        verified = self._verify(forward, verifying) if verifying else []
        self.scheduler.update(plan, {seq: got.tokens[: got.accepted] for seq, got in verified})
        to_sample, picks = [], []
        offering: list[tuple[Seq, int]] = []  # beams offering candidates, and their row
        if not (self._beams or self._groups):  # no beam offers, no completion forks
            to_sample, picks = [seq for seq, _ in sampling], [row for _, row in sampling]
            sampling = []
        for seq, row in sampling:
            if seq.group_id in self._beams:
                offering.append((seq, row))
                continue
            # The prompt is done: n > 1 forks the other completions off it, each sampling
            # its first token from the same logits.
            fork = seq.params.n > 1 and len(self._groups[seq.group_id]) == 1
            for completion in [seq, *self._fork(seq)] if fork else [seq]:
                to_sample.append(completion)
                picks.append(row)
        candidates = []
        if offering:
            rows = mx.array([i for _, i in offering], dtype=mx.int32)
            candidates = np.array(logits[rows].astype(mx.float32))
        if forward.tokens is not None:
            chosen = forward.tokens.tolist()  # ints at once, not a numpy scalar per row
            tokens, logprobs = [chosen[i] for i in picks], [None] * len(picks)
        else:
            # Rows of drafts or prompt logprobs beside the sampling ones, or forked
            # completions sampling from one row: one row of logits per token drawn.
            if picks != list(range(offset)):
                logits = logits[mx.array(picks, dtype=mx.int32)] if picks else None
            rows = [self._sample_row(seq) for seq in to_sample]
            sampled = sample(logits, rows, self.logprobs_mode) if to_sample else []
            tokens, logprobs = [p.token for p in sampled], [p.logprobs for p in sampled]
        now = self.clock.after(time.perf_counter() - start)
        outputs = [out for seq, got in verified for out in self._accept(seq, got, now)]
        for seq, token, token_logprobs in zip(to_sample, tokens, logprobs, strict=True):
            if token_logprobs is not None:
                self._add_logprobs(seq, token, token_logprobs)
            self._append(seq, token, now)
            outputs += self._progressed(seq)
        for (seq, _), row in zip(offering, candidates, strict=True):
            group = self._beams[seq.group_id]
            if group.offer(seq, row):
                outputs += self._next_beams(group, now)
            else:
                self.scheduler.park(seq)  # until its siblings have offered too
        return outputs

    def _verify(self, forward: Forward, at: dict[Seq, int]) -> list[tuple[Seq, Verified]]:
        """Accept or reject each sequence's drafts (harness/engine/speculative.py): against
        the target's logits, or the tokens a runner without a model chose."""
        chosen = forward.tokens
        table = np.array(forward.logits.astype(mx.float32)) if chosen is None else None
        verified = []
        for seq, i in at.items():
            proposal = self._proposals.pop(seq)
            n = len(proposal.tokens)
            if chosen is not None:
                got = verify_tokens(chosen[i : i + n + 1], proposal)
            else:
                got = verify(
                    table[i : i + n + 1],
                    proposal,
                    lambda j, s=seq, d=proposal.tokens: self._sample_row(s, d[:j]),
                    self.logprobs_mode,
                )
            counts = self._verifications
            counts.proposed += n
            counts.accepted += got.accepted
            counts.rejected += got.accepted < n
            counts.verifications += 1
            seq.spec_proposed += n
            seq.spec_accepted += got.accepted
            verified.append((seq, got))
        return verified
