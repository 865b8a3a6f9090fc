"""LLMEngine: the loop that ties scheduler, allocator, model runner and sampler together.

    step():  schedule -> copy blocks -> forward -> sample -> finish/stream -> record

Steps are pipelined one deep, as mlx_lm's BatchGenerator and vLLM's async scheduling do:
when every row of a step samples on the device (greedy, no penalties, bans or logprobs, no
drafts to verify), the step launches its forward and its ``argmax`` and returns without
waiting; the next step schedules, builds and launches its own forward, feeding those tokens
straight from the device, and only then reads them on the host, stamps them, and applies
stop conditions. A row computed for a sequence that turns out to have stopped is dropped,
never emitted. A sequence sure to stop on its pending token (its last by ``max_tokens`` or
the model length) gives its blocks back before that token is read. ``pipeline`` is off by
default (see ``LLMEngine.__init__``).
"""

from __future__ import annotations

import inspect
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import numpy as np

from allocators.base import BlockAllocator, blocks_for
from harness.engine import persistence
from harness.engine.beam_search import BeamGroup, BeamSearchParams, Hypothesis
from harness.engine.clock import Clock, VirtualClock
from harness.engine.kv_cache import HostBlocks, KVArena
from harness.engine.model_runner import ModelRunner, Row
from harness.engine.recorder import Recorder
from harness.engine.request import CompletionOutput, RequestOutput
from harness.engine.request import Sequence as Seq
from harness.engine.sampling import (
    LOGPROBS_MODES,
    LogprobsMode,
    SampleRow,
    SamplingParams,
    TokenLogprobs,
    logprob_dict,
    logprob_values,
    make_rng,
    sample,
)
from harness.engine.speculative import (
    DraftProposer,
    Proposal,
    Speculation,
    Verifications,
    Verified,
    verify,
)
from harness.engine.window import WindowGroup
from harness.platform.models import LoadedModel
from schedulers.base import Scheduled, Scheduler, SchedulerOutput
from schedulers.request import Status

DEFAULT_MAX_MODEL_LEN = 2048  # for a model whose config sets no max_position_embeddings
INFLIGHT = -1  # the place in token_ids of a sampled token still on the device
Params = SamplingParams | BeamSearchParams  # how a request generates


class RequestError(ValueError):
    """A request is malformed; the message names the field and the fix."""


class LLMEngine:
    """Continuous-batching engine over a paged KV arena (the API of DESIGN.md)."""

    def __init__(
        self,
        model: LoadedModel,
        allocator: BlockAllocator,
        scheduler: Scheduler,
        *,
        proposer: DraftProposer | None = None,
        window: WindowGroup | None = None,
        clock: Clock | None = None,
        seed: int = 0,
        record: bool = True,
        pipeline: bool = False,
        logprobs_mode: LogprobsMode = "raw_logprobs",
    ) -> None:
        """``logprobs_mode`` (vLLM's, engine-wide as there): what ``SamplingParams.logprobs``
        report, raw (before any processing, the default) or processed (what the token was
        drawn from), as log-probabilities or logits; see ``harness/engine/sampling.py``.
        ``window``: the sliding-window layers' group of a model that has them
        (harness/engine/window.py; ``build`` makes it)."""
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
                "a speculative engine with LLMEngine.build(..., speculative=Speculation(...))"
            )
        if (window is None) != (not model.window_layers):
            raise ValueError(
                f"model {model.name!r} has sliding-window layers {model.window_layers}: build "
                "its engine with LLMEngine.build, which makes their window group"
                if window is None
                else f"model {model.name!r} has no sliding-window layers: give no window group"
            )
        self.model = model
        self.window = window
        self.allocator = allocator
        self.scheduler = scheduler
        self.clock = clock or VirtualClock()
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        # Steps one deep (see the module docstring), off by default. On MLX's CPU build
        # async_eval returns only when all but the graph's last few dozen ops have run, and
        # the host then competes with the BLAS threads: pipelined decode measured 1-25 %
        # slower, side by side. On Metal it is unmeasured, and a step's arena writes
        # dispatched while the previous step's reads are pending may copy whole layers.
        self.pipeline = pipeline
        self.arena = KVArena.for_model(model, allocator.num_blocks, allocator.block_size)
        self.runner = ModelRunner(model, self.arena, window)
        self.proposer = proposer  # the draft model, when speculating
        if proposer is not None:
            scheduler.release_listeners.append(proposer.release)
        if window is not None:
            scheduler.release_listeners.append(window.release)
        draft_allocator = proposer.allocator if proposer is not None else None
        window_allocator = window.allocator if window is not None else None
        self.recorder = Recorder(allocator, draft_allocator, window_allocator, enabled=record)
        self._verifications = Verifications()  # this step's, filled by _verify
        self._proposals: dict[Seq, Proposal] = {}  # this step's drafts, from _rows to _postprocess
        self._lock = threading.RLock()
        self._requests: dict[str, Seq] = {}
        self._pending: list[RequestOutput] = []  # aborts and rejections, returned next step
        self._num_added = 0
        self._host: dict[str, HostBlocks] = {}  # KV of swapped-out and restored requests
        self._save_to: dict[str, Path] = {}  # request -> file its KV is saved to at finish
        # Pipelined steps: the tokens the last step sampled, still on the device, with the
        # sequence and place each goes to; sequences already released to stop on theirs.
        self._inflight: list[tuple[Seq, int]] = []
        self._inflight_tokens: mx.array | None = None
        self._draining: set[Seq] = set()
        self._groups: dict[str, list[Seq]] = {}  # completions of requests with n > 1
        self._beams: dict[str, BeamGroup] = {}  # beam searches, by request id
        self._waited = 0.0  # this step's seconds blocked on MLX

    @classmethod
    def build(
        cls,
        model: LoadedModel,
        allocator: Callable[..., BlockAllocator],
        scheduler: Callable[..., Scheduler],
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        speculative: Speculation | None = None,
        **kwargs,
    ) -> LLMEngine:
        """Size the arena (from ``num_blocks`` or a byte budget), then build the parts.

        ``max_model_len`` (prompt + output tokens at most) is the model's, given to the
        scheduler: at most the model's ``max_position_embeddings``, which is also the default
        (``DEFAULT_MAX_MODEL_LEN`` when the model sets none), as vLLM derives it.

        ``speculative``: a draft model proposes tokens the target verifies. Its KV lives on
        an allocator built like the target's, with as many blocks, and counts in the budget:
        ``kv_cache_bytes`` then sizes both arenas (target + draft bytes per block).

        A model with sliding-window layers gets a window group (harness/engine/window.py): a
        ring per running sequence, ``max_num_seqs`` of them, in an arena of its own;
        ``num_blocks`` counts the full-attention layers' blocks, and ``kv_cache_bytes`` pays
        for the rings first. Its scheduler reads no prefix cache."""
        limit = model.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit or DEFAULT_MAX_MODEL_LEN
        elif limit is not None and max_model_len > limit:
            raise ValueError(
                f"engine.max_model_len={max_model_len} exceeds model {model.name!r}'s "
                f"max_position_embeddings={limit}: lower it to {limit} or less"
            )
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise ValueError("set exactly one of engine.num_blocks and engine.kv_cache_bytes")
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"engine.num_blocks={num_blocks} must be at least 1")
        if speculative is not None and model.window_layers:
            raise ValueError(
                f"model {model.name!r} has sliding-window layers: speculative decoding is not "
                "supported with them (a rollback would have to restore overwritten ring "
                "slots); run it without speculative"
            )
        draft = speculative.draft_for(model) if speculative is not None else None
        if draft is not None and draft.window_layers:
            raise ValueError(
                f"draft model {draft.name!r} has sliding-window layers: speculative decoding "
                "needs a draft of full-attention layers only"
            )
        window = None
        if model.window_layers:
            window = WindowGroup(
                model, allocator, block_size=block_size, max_num_seqs=_max_num_seqs(scheduler)
            )
        if num_blocks is None:
            if window is not None:
                kv_cache_bytes -= window.arena.nbytes
            per_token = model.kv_bytes_per_token() + (draft.kv_bytes_per_token() if draft else 0)
            per_block = per_token * block_size
            num_blocks = kv_cache_bytes // per_block
            if num_blocks < 1:
                rings = f" after {window.arena.nbytes} for the window rings" if window else ""
                raise ValueError(
                    f"engine.kv_cache_bytes leaves {kv_cache_bytes} bytes{rings}: no block of "
                    f"{per_block} bytes; raise it"
                )
        alloc = allocator(num_blocks=num_blocks, block_size=block_size)
        lookahead = speculative.num_draft_tokens if speculative is not None else 0
        policy = scheduler(
            alloc,
            max_model_len=max_model_len,
            num_lookahead_slots=lookahead,
            read_prefix_cache=window is None,
        )
        if window is not None and policy.max_num_seqs != window.max_num_seqs:
            raise ValueError(
                f"the scheduler runs {policy.max_num_seqs} sequences, the window group has "
                f"rings for {window.max_num_seqs}: bind scheduler.max_num_seqs in its partial"
            )
        proposer = None
        if draft is not None:
            proposer = DraftProposer(draft, allocator(num_blocks=num_blocks, block_size=block_size))
        return cls(model, alloc, policy, proposer=proposer, window=window, **kwargs)

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
        computed (harness/engine/persistence.py)."""
        # Arrival is when the caller hands the request over, not when the lock is free.
        arrived = self.clock.now() if arrival_time is None else arrival_time
        params = sampling_params or SamplingParams()
        beam = params if isinstance(params, BeamSearchParams) else None
        if beam is not None:
            params = beam.beam_params()
        tokens = self._tokenize(request_id, prompt)
        if (params.n > 1 or beam) and self.proposer is not None:
            what = "beam search" if beam else f"SamplingParams.n={params.n}"
            raise RequestError(
                f"request {request_id!r}: {what} with speculative decoding is not supported; "
                "use n=1 sampling or run without speculative"
            )
        if beam and save_kv is not None:
            raise RequestError(
                f"request {request_id!r}: save_kv with beam search is not supported (which "
                "beam's KV?); save from a sampling request"
            )
        if save_kv is not None and not Path(save_kv).parent.is_dir():
            raise RequestError(
                f"request {request_id!r}: save_kv={str(save_kv)!r} is in no existing folder; "
                "create the folder first"
            )
        if (save_kv is not None or restore_kv is not None) and self.window is not None:
            raise RequestError(
                f"request {request_id!r}: save_kv and restore_kv are not supported for model "
                f"{self.model.name!r}, which has sliding-window layers; drop them"
            )
        if params.stop and self.model.tokenizer is None:
            raise RequestError(
                f"request {request_id!r}: SamplingParams.stop needs a tokenizer, and model "
                f"{self.model.name!r} has none; use stop_token_ids instead"
            )
        restored = self._restorable(request_id, restore_kv, tokens, params) if restore_kv else None
        with self._lock:
            # Completions 1.. of a request with n > 1 take the ids ID/1, ID/2, ...; a beam
            # search's beams ID/beam1, ID/beam2, ...: any ID/... may be taken later.
            ids = [request_id, *(f"{request_id}/{i}" for i in range(1, params.n))]
            taken = [i for i in ids if i in self._requests or self._completion_id(i)]
            if request_id in self._groups or request_id in self._beams:
                taken.append(request_id)  # its first sequence finished, the request runs
            if beam is not None:
                taken += [i for i in self._requests if i.startswith(f"{request_id}/")]
            if taken:
                raise RequestError(
                    f"request_id {request_id!r} is already in use ({taken[0]!r}): pick a new one"
                )
            seed = self.seed * 1_000_003 + self._num_added
            seq = Seq(
                request_id=request_id,
                token_ids=tokens,
                params=params,
                arrival_time=arrived,
                priority=priority,
                rng=make_rng(params, seed),
                seed=params.seed if params.seed is not None else seed,
                ttft_slo=ttft_slo,
                tpot_slo=tpot_slo,
            )
            self._num_added += params.n  # completion i falls back to seed + i: no overlap
            self._requests[request_id] = seq
            if params.n > 1:
                self._groups[request_id] = [seq]
            if beam is not None:
                self._beams[request_id] = BeamGroup(beam, self.model.eos_token_ids, seq)
            if save_kv is not None:
                self._save_to[request_id] = Path(save_kv)
            num_restored = 0
            if restored is not None:
                num_restored, self._host[request_id] = restored
            self.scheduler.add(seq, restored=num_restored)

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state; its blocks are free when this returns."""
        with self._lock:
            if request_id in self._beams:
                self._pending += self._end_beams(
                    self._beams[request_id], "abort", self.clock.now(), "aborted by the user"
                )
                return
            if request_id.rpartition("/")[0] in self._beams:
                return  # a beam's own id: the engine's, not a request (vLLM ignores those)
            group = self._groups.get(request_id)
            ids = [s.request_id for s in group if not s.finished] if group else [request_id]
            for rid in ids:
                seq = self.scheduler.abort(rid) or self._released_early(rid)
                if seq is None:
                    continue
                if seq.token_ids[-1] == INFLIGHT:  # its pending token is never emitted
                    seq.token_ids.pop()
                self._finish(seq, "abort", self.clock.now(), abort_reason="aborted by the user")
                self._pending.append(self._output(seq))

    def _released_early(self, request_id: str) -> Seq | None:
        """The sequence ``request_id`` if it already gave its blocks back to stop on a token
        still on the device (pipelined steps); it leaves that set."""
        seq = next((s for s in self._draining if s.request_id == request_id), None)
        self._draining.discard(seq)
        return seq

    def _completion_id(self, request_id: str) -> bool:
        """``request_id`` is (or will be) a completion of a running request with n > 1, or a
        beam of a running beam search (any ``ID/...``)."""
        parent, _, index = request_id.rpartition("/")
        if parent in self._beams:
            return True
        group = self._groups.get(parent)
        return group is not None and index.isdigit() and 0 < int(index) < group[0].params.n

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or an abort's output is not yet returned."""
        with self._lock:
            return self.scheduler.has_unfinished() or bool(self._pending or self._inflight)

    def get_num_unfinished_requests(self) -> int:
        """Requests (not completions of n > 1) still running or waiting."""
        with self._lock:
            sched = self.scheduler
            queued = [*sched.waiting, *sched.running, *sched.swapped, *self._draining]
            return len({seq.group_id for seq in queued})

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
            if pipelined and forward.logits is not None:
                tokens = mx.argmax(forward.logits, axis=-1)
            wanted = tokens if pipelined else forward.logits
            launched = time.perf_counter()
            self.runner.launch([] if wanted is None else [wanted])  # blocks on MLX's CPU build
            self._waited += time.perf_counter() - launched
        snapshot = self.recorder.snapshot(self.scheduler, plan)
        outputs += self._resolve(start)
        if forward is not None:
            if pipelined:
                self._carry(plan, tokens)
            else:
                waited = time.perf_counter()
                self.runner.wait([] if forward.logits is None else [forward.logits])
                self._waited += time.perf_counter() - waited
                outputs += self._postprocess(plan, forward.logits, start)
        duration = time.perf_counter() - start
        self.clock.advance(duration)
        self.recorder.step(
            plan,
            snapshot,
            now,
            duration,
            forward_time=(forward.graph_time if forward else 0.0) + self._waited,
            build_time=forward.build_time if forward else 0.0,
            swap_time=swap_time,
            verifications=self._verifications,
            work=forward.work if forward else None,
        )
        return outputs

    def _on_device(self, plan: SchedulerOutput) -> bool:
        """Every row that samples this step can sample on the device, from logits alone."""
        for s in plan.scheduled:
            seq, p = s.seq, s.seq.params
            if s.num_draft_tokens:
                return False
            if _prompt_positions(seq, s.num_new_tokens):
                return False
            samples = seq.num_computed_tokens + s.num_new_tokens == seq.num_tokens
            if samples and seq.group_id in self._beams:
                return False  # its candidates are chosen on the host
            if samples and not (
                p.greedy
                and not p.penalised
                and not p.min_tokens
                and p.logprobs is None
                and p.n == 1
            ):
                return False
        return True

    def _carry(self, plan: SchedulerOutput, tokens: mx.array | None) -> None:
        """A pipelined step's bookkeeping: its KV is written, and each sampling row's token
        (row k of ``tokens``, on the device) gets its place in the sequence, a placeholder
        until the next step reads it. A sequence that stopped on the previous step's token
        drops this step's row."""
        k = 0
        for s in plan.scheduled:
            seq = s.seq
            samples = seq.num_computed_tokens + s.num_new_tokens == seq.num_tokens
            if not seq.finished:
                before = seq.num_computed_tokens
                seq.num_computed_tokens += s.num_new_tokens
                self._commit(seq, before)
                if samples:
                    seq.token_ids.append(INFLIGHT)
                    self._inflight.append((seq, k))
                    if self._last_token(seq):
                        self._release(seq)
                        self._draining.add(seq)
            k += samples
        self._inflight_tokens = tokens if self._inflight else None

    def _resolve(self, start: float) -> list[RequestOutput]:
        """Read the tokens still on the device (waiting for them), stamp them when they
        exist on the host, and apply stop conditions."""
        if not self._inflight:
            return []
        waited = time.perf_counter()
        tokens = self._inflight_tokens.tolist()
        self._waited += time.perf_counter() - waited
        now = self.clock.after(time.perf_counter() - start)
        outputs = []
        for seq, k in self._inflight:
            if seq.finished:  # aborted while its token computed
                continue
            seq.token_ids[-1] = tokens[k]
            self._emitted(seq, tokens[k], now)
            outputs.append(self._output(seq))
        self._inflight, self._inflight_tokens = [], None
        return outputs

    def _idle(self, plan: SchedulerOutput, next_arrival: float | None) -> None:
        """The scheduler lets a bigger batch form: idle until it stops holding, or until the
        next arrival the driver knows of, whichever comes first."""
        if plan.hold_until is not None:
            wake = plan.hold_until if next_arrival is None else min(plan.hold_until, next_arrival)
            self.clock.wait_until(wake)

    def _move_blocks(self, plan: SchedulerOutput) -> float:
        """Swap-outs, block copies, swap-ins: each block is read before a later op (or the
        forward) reuses it. Returns the seconds the swaps took."""
        swap_time = 0.0
        if plan.swapped_out:
            start = time.perf_counter()
            for s in plan.swapped_out:
                self._host[s.seq.request_id] = self.runner.swap_out(s.blocks)
                if self.window is not None:
                    self.window.swap_out(s.seq.request_id)
            swap_time += time.perf_counter() - start
        self.runner.copy_blocks(plan.copies)  # a source may be a block a swap-in reuses
        if plan.swapped_in:
            start = time.perf_counter()
            for s in plan.swapped_in:
                self.runner.swap_in(self._host.pop(s.seq.request_id), s.blocks, s.first)
                if self.window is not None:
                    self.window.swap_in(s.seq.request_id)
            swap_time += time.perf_counter() - start
        if self.window is not None:
            self.window.moved()
        return swap_time

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

    # -- inside a step -------------------------------------------------------------------
    def _rows(self, plan: SchedulerOutput) -> list[Row]:
        spec = [(s.seq, s.num_draft_tokens) for s in plan.scheduled if s.num_draft_tokens]
        proposals = self.proposer.propose(spec, self._sample_row) if spec else []
        self._proposals = dict(zip([seq for seq, _ in spec], proposals, strict=True))
        self._shrink(plan)
        inflight = {seq: k for seq, k in self._inflight}
        rows = []
        for s in plan.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens - s.num_draft_tokens
            # A verification feeds the last token and the drafts, and wants logits for each.
            drafts = self._proposals[seq].tokens if s.num_draft_tokens else []
            # The previous step's token, not yet on the host, is fed from the device (it is
            # the sequence's last; a recomputed prefix chunk that stops short never feeds it).
            fed = seq in inflight and end == seq.num_tokens
            carried = ((end - 1 - start, inflight[seq]),) if fed else ()
            # Prompt logprobs want logits at the prompt positions before the sampling one.
            num_prompt = len(_prompt_positions(seq, s.num_new_tokens))
            rows.append(
                Row(
                    tokens=seq.token_ids[start:end] + drafts,
                    start=start,
                    table=self.allocator.block_table(seq.request_id),
                    num_logits=num_prompt + (1 + len(drafts) if end == seq.num_tokens else 0),
                    carried=carried,
                    ring=self.window.table(seq.request_id) if self.window is not None else (),
                )
            )
        return rows

    def _shrink(self, plan: SchedulerOutput) -> None:
        """A draft with no room proposes fewer tokens than the slots reserved: the plan (and
        so the figures) and the allocation keep only what is verified; none is a decode."""
        for i, s in enumerate(plan.scheduled):
            if not s.num_draft_tokens:
                continue
            seq, n = s.seq, len(self._proposals[s.seq].tokens)
            if n < s.num_draft_tokens:
                plan.scheduled[i] = Scheduled(seq, 1 + n, num_draft_tokens=n)
                self.allocator.trim(seq.request_id, seq.num_computed_tokens + 1 + n)
                if not n:
                    del self._proposals[seq]

    def _postprocess(
        self, plan: SchedulerOutput, logits: mx.array | None, start: float
    ) -> list[RequestOutput]:
        """Sample (and verify drafts), then stamp: a token's time is when it exists, so the
        clock is read after sampling, ``start`` being the step's ``perf_counter`` start."""
        to_sample, picks, verifying, offset = [], [], {}, 0
        offering: list[tuple[Seq, int]] = []  # beams offering candidates, and their row
        for s in plan.scheduled:
            seq = s.seq
            if s.num_draft_tokens:
                verifying[seq] = offset
                offset += len(self._proposals[seq].tokens) + 1
                continue
            if positions := _prompt_positions(seq, s.num_new_tokens):
                self._prompt_logprobs(seq, positions, logits[offset : offset + len(positions)])
                offset += len(positions)
            before = seq.num_computed_tokens
            seq.num_computed_tokens += s.num_new_tokens
            self._commit(seq, before)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            if seq.group_id in self._beams:
                offering.append((seq, offset))
            else:
                # The prompt is done: n > 1 forks the other completions off it, each
                # sampling its first token from the same logits.
                fork = seq.params.n > 1 and len(self._groups[seq.group_id]) == 1
                for completion in [seq, *self._fork(seq)] if fork else [seq]:
                    to_sample.append(completion)
                    picks.append(offset)
            offset += 1
        verified = self._verify(plan, logits, verifying) if verifying else []
        candidates = []
        if offering:
            rows = mx.array([i for _, i in offering], dtype=mx.int32)
            candidates = np.array(logits[rows].astype(mx.float32))
        # Rows of drafts or prompt logprobs beside the sampling ones, or forked completions
        # sampling from one row: the sampler gets one row of logits per token it draws.
        if picks != list(range(offset)):
            logits = logits[mx.array(picks, dtype=mx.int32)] if picks else None
        rows = [self._sample_row(seq) for seq in to_sample]
        sampled = sample(logits, rows, self.logprobs_mode) if to_sample else []
        now = self.clock.after(time.perf_counter() - start)
        outputs = [self._accept(seq, got, now) for seq, got in verified]
        for seq, pick in zip(to_sample, sampled, strict=True):
            if pick.logprobs is not None:
                self._add_logprobs(seq, pick.token, pick.logprobs)
            self._append(seq, pick.token, now)
            outputs.append(self._output(seq))
        for (seq, _), row in zip(offering, candidates, strict=True):
            group = self._beams[seq.group_id]
            if group.offer(seq, row):
                outputs += self._next_beams(group, now)
            else:
                self.scheduler.park(seq)  # until its siblings have offered too
        return outputs

    def _fork(self, parent: Seq) -> list[Seq]:
        """The other n - 1 completions of ``parent``'s request, on its prompt's KV (shared
        or copied by the allocator); completion i samples with seed ``seed + i`` (vLLM)."""
        group = self._groups[parent.group_id]
        for i in range(1, parent.params.n):
            group.append(self._child(parent, f"{parent.request_id}/{i}", i, parent.seed + i))
        return group[1:]

    def _child(self, parent: Seq, request_id: str, index: int, seed: int) -> Seq:
        """A sequence forked off ``parent``'s tokens and KV (shared or copied by the
        allocator; without room it waits and recomputes them), seeded with ``seed``."""
        child = Seq(
            request_id=request_id,
            token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            params=parent.params,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            rng=make_rng(replace(parent.params, seed=seed), 0),
            seed=seed,
            ttft_slo=parent.ttft_slo,
            tpot_slo=parent.tpot_slo,
            cumulative_logprob=parent.cumulative_logprob,
            index=index,
            group_id=parent.group_id,
        )
        child.first_scheduled_time = parent.first_scheduled_time
        self._requests[child.request_id] = child
        allocation = self.scheduler.fork(parent, child)
        if allocation is not None:  # its KV is the parent's
            child.num_cached_tokens = parent.num_computed_tokens
            self.runner.copy_blocks(allocation.copies)
            if self.window is not None:  # a ring is copied, never shared
                self.window.fork(parent.request_id, child.request_id)
        return child

    def _next_beams(self, group: BeamGroup, now: float) -> list[RequestOutput]:
        """Every beam has offered: the round's selection becomes KV operations. A parent
        not chosen is dropped first (its blocks free), one chosen k times forks k - 1
        children on its KV, then each beam appends its token. The search ends after
        ``max_tokens`` rounds, at the model length, or when no candidate is left."""
        chosen = group.select()
        group.round_times.append(now)
        kept = {parent for parent, _, _ in chosen}
        for beam in group.beams:
            if beam not in kept:
                self._drop_beam(group, beam)
        beams, seen = [], set()
        for parent, token, total in chosen:
            beam = self._fork_beam(group, parent) if parent in seen else parent
            seen.add(parent)
            beams.append((beam, token, total))
        for beam, token, total in beams:
            beam.token_ids.append(token)
            beam.cumulative_logprob = total
            self.scheduler.unpark(beam)
        group.beams = [beam for beam, _, _ in beams]
        if not group.beams:
            return self._end_beams(group, "stop", now)
        if self._last_token(group.beams[0]):  # the beams are all one length
            return self._end_beams(group, "length", now)
        return []

    def _fork_beam(self, group: BeamGroup, parent: Seq) -> Seq:
        group.forks += 1
        return self._child(parent, f"{group.root.request_id}/beam{group.forks}", 0, parent.seed)

    def _drop_beam(self, group: BeamGroup, beam: Seq) -> None:
        """A beam leaves the search: its blocks (and any host copy) go, it records no row."""
        self.scheduler.finish(beam)
        self._host.pop(beam.request_id, None)
        beam.status = Status.FINISHED
        self._requests.pop(beam.request_id, None)
        group.preemptions += beam.preemptions

    def _end_beams(
        self, group: BeamGroup, reason: str, now: float, abort_reason: str | None = None
    ) -> list[RequestOutput]:
        """Finish a beam search: its live beams are dropped and join the completed; the
        request records one row (its output tokens and token times are its rounds') and
        returns its best ``beam_width`` hypotheses, best first."""
        for beam in group.beams:
            self._drop_beam(group, beam)
        best = group.finish(reason)
        root = group.root
        del self._beams[root.request_id]
        times = group.round_times
        self.recorder.request(
            root,
            first_token_time=times[0] if times else float("nan"),
            finish_time=now,
            output_tokens=len(times),
            token_times=list(times),
            preemptions=group.preemptions,
            finish_reason=reason,
            abort_reason=abort_reason,
        )
        outputs = [self._hypothesis(i, h) for i, h in enumerate(best)]
        return [
            RequestOutput(
                root.request_id, root.prompt_token_ids, outputs, True, abort_reason=abort_reason
            )
        ]

    def _hypothesis(self, index: int, h: Hypothesis) -> CompletionOutput:
        tokenizer = self.model.tokenizer
        ids = h.output_token_ids[:-1] if h.finish_reason == "stop" else h.output_token_ids
        return CompletionOutput(
            index=index,
            text=tokenizer.decode(ids) if tokenizer is not None else "",
            token_ids=list(h.output_token_ids),
            logprobs=None,
            finish_reason=h.finish_reason,
            cumulative_logprob=h.cumulative_logprob,
        )

    def _prompt_logprobs(self, seq: Seq, positions: range, logits: mx.array) -> None:
        """Append the prompt logprobs ``logits`` [len(positions), vocab] give: position p's
        raw log-probabilities of prompt token p + 1 and the top-n (vLLM: raw, whatever the
        ``logprobs_mode``)."""
        table = np.array(logits.astype(mx.float32))
        n = seq.params.prompt_logprobs
        for row, p in zip(table, positions, strict=True):
            values = logprob_values(row, row, None, seq.params, "raw_logprobs")
            seq.prompt_logprobs.append(self._decoded(logprob_dict(values, seq.token_ids[p + 1], n)))

    def _verify(
        self, plan: SchedulerOutput, logits: mx.array, at: dict[Seq, int]
    ) -> list[tuple[Seq, Verified]]:
        """Accept or reject each sequence's drafts (harness/engine/speculative.py)."""
        table = np.array(logits.astype(mx.float32))
        verified = []
        for seq, i in at.items():
            proposal = self._proposals.pop(seq)
            n = len(proposal.tokens)
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

    def _accept(self, seq: Seq, got: Verified, now: float) -> RequestOutput:
        """Append a verification's tokens; roll back the slots of rejected drafts."""
        before = seq.num_computed_tokens
        # The last token's KV and the accepted drafts' KV are in place; the rest is not.
        seq.num_computed_tokens += got.accepted + 1
        # Offered to the prefix cache now: a stop below would free the blocks uncached.
        self._commit(seq, before, seq.token_ids + got.tokens[: got.accepted])
        finished = False
        for j, token in enumerate(got.tokens):  # stop conditions drop what follows a stop
            if got.logprobs is not None:
                self._add_logprobs(seq, token, got.logprobs[j])
            if finished := self._append(seq, token, now):
                break
        if not finished:
            self.allocator.trim(seq.request_id, seq.num_computed_tokens)
            self.proposer.rollback(seq.request_id, seq.num_computed_tokens)
        return self._output(seq)

    def _commit(self, seq: Seq, before: int, token_ids: Sequence[int] | None = None) -> None:
        """Tell the allocator about newly full blocks of written KV (prefix caches share them);
        ``token_ids`` when the sequence's own list does not hold them all yet."""
        block_size = self.allocator.block_size
        if seq.num_computed_tokens // block_size > before // block_size:
            tokens = seq.token_ids if token_ids is None else token_ids
            self.allocator.commit(seq.request_id, tokens[: seq.num_computed_tokens])

    def _append(self, seq: Seq, token: int, now: float) -> bool:
        """Append a generated token; finish the sequence if it stops here (True)."""
        seq.token_ids.append(token)
        return self._emitted(seq, token, now)

    def _emitted(self, seq: Seq, token: int, now: float) -> bool:
        """``token``, the sequence's last, exists on the host at ``now``: stamp it and
        finish the sequence if it stops here (True)."""
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        reason, stop_reason = self._stop(seq, token)
        if reason:
            if seq in self._draining:
                self._draining.discard(seq)
            else:
                self._release(seq)
            self._finish(seq, reason, now, stop_reason=stop_reason)
        return reason is not None

    def _last_token(self, seq: Seq) -> bool:
        """The sequence stops on its last token whatever it is (max_tokens, model length)."""
        limit = self.scheduler.max_seq_len
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= limit

    # -- KV save and restore (harness/engine/persistence.py) ------------------------------
    @cached_property
    def kv_spec(self) -> persistence.KVSpec:
        """What this engine's KV is (model fingerprint, block size, dtype): a KV file saved
        for another spec is refused."""
        return persistence.KVSpec.of(self.model, self.allocator.block_size)

    def _restorable(
        self, request_id: str, path: str | Path, prompt: list[int], params: SamplingParams
    ) -> tuple[int, HostBlocks] | None:
        """The KV a file holds for a prefix of ``prompt`` (tokens, host blocks); None, with a
        warning, when it cannot be used. A request for prompt logprobs reads no file, as it
        reads no prefix cache: it needs logits at every prompt position."""
        if params.skip_reading_prefix_cache:
            reason = f"KV file {path} is not read: prompt_logprobs needs every prompt position"
        else:
            try:
                saved = persistence.load(path, self.kv_spec)
            except persistence.KVFileError as e:
                reason = str(e)
            else:
                if n := saved.reusable(prompt):
                    return n, saved.blocks
                reason = f"KV file {path} shares no prefix with the prompt"
        warnings.warn(
            f"request {request_id!r}: {reason}; computing the prompt instead",
            persistence.KVRestoreWarning,
            stacklevel=3,
        )
        return None

    def save_prefix_cache(self, folder: str | Path) -> int:
        """Snapshot the radix allocator's whole prefix cache into ``folder`` (created): one
        KV file per root-to-leaf path of the tree, its tokens and blocks (the format of
        ``save_kv``). Returns the number of paths. Between steps, like every engine call."""
        with self._lock:
            paths = self._radix("save_prefix_cache").cached_paths()
            folder = Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            for i, (tokens, blocks) in enumerate(paths):
                host = self.runner.swap_out(blocks)
                persistence.save(folder / f"path-{i:05d}.safetensors", self.kv_spec, tokens, host)
            return len(paths)

    def restore_prefix_cache(self, folder: str | Path) -> int:
        """Load a ``save_prefix_cache`` snapshot into the prefix cache: each path's blocks
        that the tree lacks are written into free blocks and indexed, cached and held by
        nobody, so later requests hit them. A file that cannot be used warns
        (``KVRestoreWarning``) and is skipped; when the free blocks run out the restore stops
        with a warning rather than evict what it restored. Returns the tokens restored."""
        with self._lock:
            alloc = self._radix("restore_prefix_cache")
            files = sorted(Path(folder).glob("path-*.safetensors"))
            if not files:
                raise ValueError(f"{folder} holds no prefix-cache snapshot (path-*.safetensors)")
            bs, restored = alloc.block_size, 0
            for i, path in enumerate(files):
                try:
                    saved = persistence.load(path, self.kv_spec)
                except persistence.KVFileError as e:
                    warnings.warn(f"{e}; skipped", persistence.KVRestoreWarning, stacklevel=2)
                    continue
                tokens = saved.token_ids[: len(saved.token_ids) // bs * bs]
                slot = f"\0restore-prefix-cache/{i}"  # a scratch sequence no request is
                have = alloc.match_prefix(slot, [*tokens, -1])  # every full block may match
                if alloc.stats().free_blocks < blocks_for(len(tokens) - have, bs):
                    alloc.free(slot)
                    warnings.warn(
                        f"prefix-cache restore stopped at {path.name} ({i} of {len(files)} "
                        "paths): the arena's free blocks are used up",
                        persistence.KVRestoreWarning,
                        stacklevel=2,
                    )
                    break
                alloc.allocate(slot, len(tokens))
                first = have // bs
                self.runner.swap_in(saved.blocks, alloc.block_table(slot)[first:], first)
                alloc.commit(slot, tokens)
                alloc.free(slot)
                restored += len(tokens) - have
            return restored

    def _radix(self, what: str):
        if not hasattr(self.allocator, "cached_paths"):
            raise ValueError(
                f"{what} needs a prefix cache: allocator {type(self.allocator).__name__} "
                "keeps none; use the radix allocator"
            )
        return self.allocator

    def _release(self, seq: Seq) -> None:
        """Give a finishing sequence's blocks back, saving its KV first if asked (save_kv)."""
        path = self._save_to.pop(seq.request_id, None)
        if path is not None:
            self._save_kv(seq, path)
        self.scheduler.finish(seq)

    def _save_kv(self, seq: Seq, path: Path) -> None:
        """Save the KV of ``seq``'s computed tokens (all but its last, sampled token). A
        failure warns: the request itself has finished fine."""
        n = seq.num_computed_tokens
        if seq.status is Status.RUNNING:
            table = self.allocator.block_table(seq.request_id)
            blocks = self.runner.swap_out(table[: blocks_for(n, self.allocator.block_size)])
        else:  # preempted after its last token was sampled (pipelined steps)
            blocks = self._host.get(seq.request_id)
        if blocks is None:
            reason = "it was preempted by recompute and holds no KV"
        else:
            try:
                persistence.save(path, self.kv_spec, seq.token_ids[:n], blocks)
                return
            except (OSError, RuntimeError) as e:
                reason = " ".join(str(e).split())
        warnings.warn(
            f"request {seq.request_id!r}: its KV was not saved to {path} ({reason})",
            persistence.KVRestoreWarning,
            stacklevel=2,
        )

    def _sample_row(self, seq: Seq, drafts: Sequence[int] = ()) -> SampleRow:
        """The sampler's view of ``seq``, with ``drafts`` appended when verifying them."""
        banned = ()
        if seq.num_output_tokens + len(drafts) < seq.params.min_tokens:
            eos = () if seq.params.ignore_eos else self.model.eos_token_ids
            banned = tuple(eos) + seq.params.stop_token_ids
        tokens = seq.token_ids + list(drafts) if drafts else seq.token_ids
        return SampleRow(seq.params, tokens, seq.num_prompt_tokens, seq.rng, banned)

    def _stop(self, seq: Seq, token: int) -> tuple[str | None, str | int | None]:
        p = seq.params
        n = seq.num_output_tokens
        if n >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop", token
            if not p.ignore_eos and token in self.model.eos_token_ids:
                return "stop", None
            if p.stop:
                text = self._text(seq)
                for s in p.stop:
                    if s in text:
                        return "stop", s
        if self._last_token(seq):
            return "length", None
        return None, None

    def _finish(self, seq: Seq, reason: str, now: float, **why) -> None:
        seq.status = Status.FINISHED
        self._host.pop(seq.request_id, None)  # a swapped request's host copy goes too
        self._save_to.pop(seq.request_id, None)  # an aborted request's KV is not saved
        seq.finish_reason = reason
        seq.finish_time = now
        seq.abort_reason = why.get("abort_reason")
        seq.stop_reason = why.get("stop_reason")
        self._requests.pop(seq.request_id, None)
        self.recorder.request(seq)

    def _output(self, seq: Seq) -> RequestOutput:
        """The request's output: all its completions (n > 1), finished when all are."""
        group = self._groups.get(seq.group_id, [seq])
        finished = all(s.finished for s in group)
        if finished:
            self._groups.pop(seq.group_id, None)
        first = group[0]  # computed the prompt, and so its logprobs
        prompt = first.params.prompt_logprobs is not None
        return RequestOutput(
            seq.group_id,
            seq.prompt_token_ids,
            [self._completion(s) for s in group],
            finished,
            abort_reason=next((s.abort_reason for s in group if s.abort_reason), None),
            prompt_logprobs=list(first.prompt_logprobs) if prompt else None,
        )

    def _completion(self, seq: Seq) -> CompletionOutput:
        text = self._text(seq) if seq.finished else ""
        stop = seq.stop_reason
        if isinstance(stop, str):
            text = text[: text.index(stop)]
        logprobs = cumulative = None
        if seq.params.logprobs is not None:
            # Copies: an output the caller holds must not grow with the sequence.
            logprobs = list(seq.logprobs)
            cumulative = seq.cumulative_logprob
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=seq.output_token_ids,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=stop,
            cumulative_logprob=cumulative,
        )

    def _add_logprobs(self, seq: Seq, token: int, logprobs: TokenLogprobs) -> None:
        """An output token's logprobs, and its share of the cumulative logprob (vLLM's)."""
        seq.logprobs.append(self._decoded(logprobs))
        seq.cumulative_logprob += logprobs[token].logprob

    def _decoded(self, logprobs: TokenLogprobs) -> TokenLogprobs:
        """``logprobs`` with each token's text (vLLM's ``decoded_token``), if a tokenizer."""
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            return logprobs
        return {t: replace(lp, decoded_token=tokenizer.decode([t])) for t, lp in logprobs.items()}

    def _text(self, seq: Seq) -> str:
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            return ""
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str):
            ids = ids[:-1]  # as vLLM, the EOS or stop token id that ended it is not text
        return tokenizer.decode(ids)

    def _tokenize(self, request_id: str, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.model.tokenizer is None:
                raise RequestError(
                    f"request {request_id!r}: a text prompt needs a tokenizer and model "
                    f"{self.model.name!r} has none; pass token ids"
                )
            tokens = list(self.model.tokenizer.encode(prompt))
        else:
            tokens = [int(t) for t in prompt]
        if not tokens:
            raise RequestError(f"request {request_id!r}: the prompt is empty; give >= 1 token")
        vocab = self.model.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(
                f"request {request_id!r}: prompt token id {bad} is outside the vocabulary "
                f"[0, {vocab})"
            )
        return tokens


def _max_num_seqs(scheduler: Callable[..., Scheduler]) -> int:
    """The ``max_num_seqs`` a scheduler partial builds with: bound, else the default of the
    first class up its MRO that names it (policies pass ``**kwargs`` up)."""
    bound = getattr(scheduler, "keywords", {})
    if "max_num_seqs" in bound:
        return bound["max_num_seqs"]
    func = getattr(scheduler, "func", scheduler)
    for cls in getattr(func, "__mro__", ()):
        param = inspect.signature(cls.__init__).parameters.get("max_num_seqs")
        if param is not None:
            return param.default
    raise ValueError(
        f"cannot tell {func!r}'s max_num_seqs, which sizes the window rings: bind it in the "
        "scheduler partial (scheduler.max_num_seqs)"
    )


def _prompt_positions(seq: Seq, num_new_tokens: int) -> range:
    """The positions of a step's chunk whose logits give prompt logprobs not yet taken
    (position p's logits score prompt token p + 1): none after the prompt's last but one, and
    none twice, so a recompute after preemption takes none; none for completions 1.. of a
    request with n > 1 (completion 0 reports them)."""
    if seq.params.prompt_logprobs is None or seq.index:
        return range(0)
    first = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
    end = min(seq.num_computed_tokens + num_new_tokens, seq.num_prompt_tokens - 1)
    return range(first, end)
