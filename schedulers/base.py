"""The scheduler contract and the mechanics every policy shares (docs/design.md, section 5).

A scheduler decides, never touching tensors: each step a ``SchedulerOutput`` (who runs and
how many tokens, who is preempted and how, who comes back, the block copies). Block
questions go to the allocator (``blocks_needed``, ``can_allocate``).

One step, decode-first (the default)::

    hold?     nothing runs and fewer than min_batch_size wait, none for max_wait: run nothing
    running   in _running_order, each grows by _chunk tokens (one allocate_many for them
              all); when the allocator says no, _victim picks a not-yet-scheduled running
              sequence (or the asking one) to preempt (recompute: free and requeue; swap:
              copy to host, free)
    bring in  only if nothing was preempted for lack of memory: swapped, then waiting, in
              _incoming_order, while max_num_seqs, the token budget and the free blocks
              above the watermark allow; the first that does not fit stops it
    widen     speculative decoding: decodes verify drafts in the headroom (lookahead.py)

Prefill-first (``prefill_first = True``) brings in before the running sequences. Parked
sequences (a beam waiting for its siblings) need no step until ``resume`` and are the first
victims; a step that would run nothing while they hold blocks and others wait preempts them.

The scheduler side is the one owner of every allocation and of each sequence's state: the
engine hands a step's results back through ``update`` (``Progress``: KV progress, tokens,
stops), and every way a sequence leaves goes through ``finish``. The draft model's KV and a
sliding-window model's rings live on allocators of their own (``kv_groups.py``).

Policies override the hooks that differ: ``_waiting_order`` / ``_incoming_order`` (who comes
in first), ``_victim`` (who is preempted), ``_running_order`` and ``_chunk`` (chunking), and
``_make_room`` (preempting to admit a more important request); ``_queued`` / ``_unqueued``
hear every change to the waiting and swapped queues (a policy that keeps its incoming order
sorted as they change, rather than sorting them every step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, ge

from allocators.base import NO_COPIES, Allocation, BlockAllocator, blocks_for
from schedulers.admission import fits, never_fits, take_blocks, write_back
from schedulers.batch import RunningBatch
from schedulers.decode_run import DecodeRun
from schedulers.kv_groups import DraftKV, WindowRings
from schedulers.limits import check_limits
from schedulers.lookahead import Lookahead
from schedulers.output import (  # noqa: F401  (re-exported: part of the contract)
    INFLIGHT,
    BatchStep,
    Fork,
    KVStats,
    Preemption,
    Scheduled,
    SchedulerOutput,
    StepResults,
    SwapIn,
    SwapOut,
)
from schedulers.progress import LENGTH, Progress, Stop
from schedulers.request import Request, Status
from schedulers.stopping import Stopping
from schedulers.swap_space import SwapSpace

_NUM_NEW = attrgetter("num_new_tokens")


class Scheduler(ABC):
    """Continuous batching mechanics under the batch constraints; subclasses choose order,
    victims and chunking (see the module docstring for one step).

    Args: the batch constraints (``limits.check_limits`` says what each is), and what the
        engine sets: ``num_lookahead_slots`` (draft tokens a decode may verify), ``draft``
        (the draft model's allocator; None for n-gram lookup), ``window`` (builds the
        sliding-window rings; admission then reads no prefix cache, which lacks the window
        layers' KV), ``stopping`` (the model's EOS ids and detokenizer; without, sequences
        stop by length and stop_token_ids alone).
    """

    chunked_prefill = False
    prefill_first = False
    max_chunk: int | None = None  # the most tokens a row computes (None: all uncomputed)
    # Its steps whose rows all decode may run over the running batch (``schedule_batch``):
    # the policy's hooks change nothing in such a step (running order, chunks, make_room).
    batches = False

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int | None = None,
        max_model_len: int = 2048,
        watermark: float = 0.0,
        min_batch_size: int = 1,
        max_wait: float = 0.0,
        preemption_mode: str = "recompute",
        swap_blocks: int | None = None,
        num_lookahead_slots: int = 0,
        draft: BlockAllocator | None = None,
        window: Callable[..., WindowRings] | None = None,
        stopping: Stopping | None = None,
    ) -> None:
        max_num_batched_tokens = check_limits(
            chunked_prefill=self.chunked_prefill,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            watermark=watermark,
            min_batch_size=min_batch_size,
            max_wait=max_wait,
            preemption_mode=preemption_mode,
            swap_blocks=swap_blocks,
            num_lookahead_slots=num_lookahead_slots,
            draft=draft is not None,
        )
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # The longest a sequence may grow here: a buddy arena's largest region can be
        # shorter than max_model_len, and a sequence reaching it finishes with 'length'.
        self.max_seq_len = min(max_model_len, allocator.max_seq_tokens)
        self.watermark_blocks = int(watermark * allocator.num_blocks)
        self.min_batch_size = min_batch_size
        self.max_wait = max_wait
        self.preemption_mode = Preemption(preemption_mode)
        self.swap_space = SwapSpace(swap_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.swapped: list[Request] = []  # in swap-out order
        # Waiting request -> leading tokens whose KV the engine holds in host memory
        # (restored from a file), written back when it is admitted instead of computed.
        self.restored: dict[str, int] = {}
        self.parked: set[Request] = set()  # need no step until resumed (see park)
        # Released to stop on a token still on the device (pipelined steps), by request id.
        self.draining: dict[str, Request] = {}
        self.num_lookahead_slots = num_lookahead_slots
        self.draft = DraftKV(draft) if draft is not None else None
        self.progress = Progress(allocator, self.draft, stopping or Stopping(), self.max_seq_len)
        self.lookahead = None
        if num_lookahead_slots:
            self.lookahead = Lookahead(allocator, self.draft, num_lookahead_slots, self.max_seq_len)
        self.rings = window(max_num_seqs=max_num_seqs) if window is not None else None
        self.read_prefix_cache = window is None
        # The last all-decode order's rows and ids (``_whole_rows``): a named tuple a row is
        # the costliest part of a step's plan, and most steps repeat the one before.
        self._last_decodes: tuple[list[Request], list[Scheduled], list[str]] = ([], [], [])
        # The running rows as columns, for steps whose rows all decode (``schedule_batch``):
        # a policy that orders, chunks or preempts no differently from the base's decode-first
        # step, over a paged allocator (a row's growth takes one block, never a copy).
        self.batch: RunningBatch | None = None
        if (
            self.batches
            and not self.prefill_first
            and not allocator.fragments_free_space
            and not allocator.has_lower_tiers
            and self.draft is None
            and self.rings is None
            and self.lookahead is None
        ):
            length_limit, max_seq_len = self.progress.stopping.length_limit, self.max_seq_len
            self.batch = RunningBatch(allocator, lambda seq: length_limit(seq, max_seq_len))

    # -- requests in and out -------------------------------------------------------------
    def add(self, seq: Request, restored: int = 0, keep_kv: bool = False) -> None:
        """Queue a request. ``restored``: the engine holds its first ``restored`` tokens' KV
        (a file), written back at admission (a ``SwapIn``). ``keep_kv``: the engine saves its
        KV when it stops (``Progress.hand_over``)."""
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self._queued(seq)
        self.allocator.expect(seq.request_id, self._final_slots(seq))
        if restored:
            self.restored[seq.request_id] = restored
        if keep_kv:
            self.progress.keep(seq.request_id)

    def abort(self, request_id: str, now: float, reason: str) -> Request | None:
        """Stop a request in any state, its blocks free when this returns; None if it is not
        here. A token still on the device (pipelined steps) is never emitted."""
        if self.batch is not None:  # the running rows change outside a batch step
            self.batch.stale = True
        seq = self.draining.get(request_id)
        if seq is None:
            seq = next((s for s in self.unfinished() if s.request_id == request_id), None)
        if seq is not None:
            self.progress.drop_pending(seq)
            self.finish(seq, "abort", now, abort_reason=reason)
        return seq

    def fork(self, parent: Request, child: Request) -> Fork | None:
        """Run ``child`` on ``parent``'s KV (n > 1, beams), shared or copied by the allocator;
        without room, at ``max_num_seqs`` or off a preempted parent, the child waits first in
        line to recompute."""
        alloc = None
        self.allocator.expect(child.request_id, self._final_slots(child))
        if parent.status is Status.RUNNING and len(self.running) < self.max_num_seqs:
            alloc = self.allocator.fork(parent.request_id, child.request_id)
        if alloc is None:  # first in line: its request is already in
            child.num_computed_tokens = 0
            child.status = Status.WAITING
            self.waiting.appendleft(child)
            self._queued(child, front=True)
            return None
        child.num_computed_tokens = child.num_forked_tokens = parent.num_computed_tokens
        child.num_cached_tokens = 0  # on the device by a fork: it looks nothing up
        child.status = Status.RUNNING
        self.running.append(child)
        self.progress.admit(child)
        rings = ()
        if self.rings is not None:  # a ring is copied, never shared
            ring = self.rings.take(child.request_id)
            rings = tuple(zip(self.rings.table(parent.request_id), ring, strict=True))
        return Fork(parent, child, tuple(alloc.copies), rings)

    def park(self, seq: Request) -> None:
        """``seq`` needs no step until ``resume``; it keeps its blocks while memory allows."""
        self.parked.add(seq)

    def resume(self, seq: Request, token: int) -> None:
        """A parked beam goes on with ``token``, the one its search chose for it."""
        self.progress.append_chosen(seq, token)
        self.parked.discard(seq)

    def finish(
        self,
        seq: Request,
        reason: str | None = None,
        now: float | None = None,
        *,
        stop_reason: str | int | None = None,
        abort_reason: str | None = None,
    ) -> None:
        """The way a sequence leaves, whatever ends it (a stop, an abort, a beam dropped:
        ``reason`` None; a rejection, met while a queue is read, takes ``_let_go`` alone): its
        blocks go back, the queues forget it, it is FINISHED at ``now`` (``Progress.close``)."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                if queue is not self.running:
                    self._unqueued(seq)
                break
        self._let_go(seq, reason, now, stop_reason, abort_reason)

    def _let_go(
        self,
        seq: Request,
        reason: str | None,
        now: float | None,
        stop_reason: object = None,
        abort_reason: str | None = None,
    ) -> None:
        """``finish`` once ``seq`` is out of its queue."""
        rid = seq.request_id
        if self.draining.pop(rid, None) is None:  # a drained sequence gave its blocks back
            self.progress.hand_over(seq, keep=reason != "abort")  # an abort saves no KV
            self._release(rid)
        self._forget(seq)
        self.progress.close(seq, reason, now, stop_reason, abort_reason)

    def _forget(self, seq: Request) -> None:
        """``seq`` needs no hint, host copy, restore or park any more."""
        rid = seq.request_id
        self.allocator.expect(rid, None)
        self.swap_space.release(rid)
        self.restored.pop(rid, None)
        self.parked.discard(seq)

    def _final_slots(self, seq: Request) -> int:
        """The KV slots ``seq`` holds when it finishes: its prompt and ``max_tokens`` outputs
        but the last, at most ``max_seq_len`` (an upper bound where a stop ends it sooner)."""
        prompt = seq.num_tokens - seq.num_output_tokens
        return min(prompt + seq.params.max_tokens - 1, self.max_seq_len)

    def _release(self, request_id: str) -> tuple[int, ...]:
        """Give back all ``request_id`` holds on the device; returns its window ring, if any."""
        self.allocator.free(request_id)
        if self.draft is not None:
            self.draft.release(request_id)
        return self.rings.release(request_id) if self.rings is not None else ()

    def has_unfinished(self) -> bool:
        """A request waits, runs, is swapped out or drains (pipelined)."""
        return bool(self.waiting or self.running or self.swapped or self.draining)

    def unfinished(self) -> list[Request]:
        """Every request waiting, running, swapped out or draining."""
        return [*self.waiting, *self.running, *self.swapped, *self.draining.values()]

    def next_incoming(self) -> Request | None:
        """The request that comes in next when room allows (the head of the line)."""
        return next(self._incoming(), None)

    # -- a step's results ----------------------------------------------------------------
    def update(self, plan: SchedulerOutput, results: StepResults) -> list[Fork]:
        """The plan's rows ran (vLLM v1's ``update_from_output``): KV progress, then the
        forks on their parents' KV, then each sequence's tokens up to a stop, which finishes
        it. Pending tokens (pipelined) are placeholders; one sure to be the last drains its
        blocks now. Returns the forks that got KV, with their allocations."""
        progress = self.progress
        progress.advance(plan, results.tokens)
        forked = []
        for parent, child in results.forks:
            fork = self.fork(parent, child)
            if fork is not None:
                forked.append(fork)
        if results.pending:
            for seq in chain(results.tokens, results.sampled):
                if seq.status is not Status.FINISHED:
                    progress.append_pending(seq)
                    if progress.at_length(seq):
                        self._drain(seq)
            return forked
        now = results.now
        stopped = progress.append_all(results.tokens, now) if results.tokens else []
        if results.sampled:
            stopped += progress.append_each(results.sampled, results.sampled_tokens, now)
        for seq, (reason, why) in stopped:
            self.finish(seq, reason, now, stop_reason=why)
        return forked

    def resolve(self, seq: Request, token: int, now: float) -> None:
        """``seq``'s pending token (pipelined) is ``token``, on the host at ``now``."""
        stop = self.progress.resolve(seq, token, now)
        if stop is not None:
            self.finish(seq, stop[0], now, stop_reason=stop[1])

    def _drain(self, seq: Request) -> None:
        """``seq`` stops on its pending token: its blocks go back before that token is read."""
        self.running.remove(seq)
        self.progress.hand_over(seq, keep=True)
        self._release(seq.request_id)
        self._forget(seq)
        self.draining[seq.request_id] = seq

    # -- the step decision ---------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """Decide one step at time ``now`` (see the module docstring)."""
        if self.batch is not None:  # a general step: the batch reads its rows again
            self.batch.stale = True
        out = SchedulerOutput()
        out.hold_until = self._hold_until(now)
        if out.hold_until is not None:
            out.tier_moves = self.allocator.drain_tier_moves()  # write-through of a commit
            return out
        self._make_room(out)
        budget = self.max_num_batched_tokens
        running = self._running_order()
        if self.prefill_first:
            growth = sum(self._decode_blocks(s) for s in running)
            budget = self._bring_in(out, budget, now, reserve=growth)
            self._schedule_running(out, budget, running)
        else:
            budget, pressure = self._schedule_running(out, budget, running)
            if not pressure:
                self._bring_in(out, budget, now, reserve=0)
        if not (out.scheduled or out.swapped_in) and self._stalled_by_parked():
            for seq in [s for s in self.running if s in self.parked]:
                self._preempt(seq, out)
            self._bring_in(out, self.max_num_batched_tokens, now, reserve=0)
        if self.lookahead is not None:
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            self.lookahead.widen(out, budget, len(self.running) + self.watermark_blocks)
        out.tier_moves = self.allocator.drain_tier_moves()  # lower KV tiers, in order
        return out

    def schedule_batch(self, now: float) -> BatchStep | None:
        """``schedule`` of a step over the running batch (``RunningBatch``), for a policy
        whose step it is (``batches``): the rows that decode each compute one token, those
        still in their prompt a chunk each in the budget left (chunked prefill), and
        requests come in as ``schedule`` lets them (``_bring_in``). Only rows that cross
        their write limit ask the allocator (contract version 5: the general step's
        ``allocate_many`` gives the same blocks in the same order).

        None, deciding nothing, when the step is another kind: rows out of the order the
        batch keeps, memory short of the decodes' blocks (a preemption), queues or holds the
        batch does not keep; then ``schedule`` decides it."""
        batch = self._ready_batch()
        if batch is None:
            return None
        seqs, limits, d = batch.seqs, batch.limits, batch.decodes
        left = self.max_num_batched_tokens - d
        if left < 0:
            return None
        starts = [seq.num_computed_tokens for seq in seqs[:d]]
        # A decode writes slot ``start``: past its write limit it takes a block (paged: one,
        # never a copy).
        crossing = list(compress(range(d), map(ge, starts, limits)))
        events = None
        if d < len(seqs):  # prompts in progress, a chunk each while the budget lasts
            events = SchedulerOutput()
            chunk = self._chunk
            for row in range(d, len(seqs)):
                if left <= 0:
                    break
                seq = seqs[row]
                n = chunk(seq, left)
                if n > 0:
                    end = seq.num_computed_tokens + n
                    if end > limits[row]:
                        return None  # not its blocks from admission: the general step
                    events.scheduled.append(Scheduled(seq, n, end == len(seq.token_ids)))
                    left -= n
        if crossing and not self._cross(crossing, starts):
            return None  # someone is preempted: the general step decides whom
        if self.waiting and len(seqs) < self.max_num_seqs:
            events = events or SchedulerOutput()
            chunks = len(events.scheduled)
            self._bring_in(events, left, now, reserve=0)
            if events.swapped_in:
                raise RuntimeError("a batch step swapped a sequence in")
            for row in events.scheduled[chunks:]:
                batch.admit(row.seq)
        return BatchStep(starts, events)

    def _ready_batch(self) -> RunningBatch | None:
        """The running batch, its rows read, when a step over it may be taken: every queue
        but the waiting one empty, the rows in the order the batch keeps; else None."""
        batch = self.batch
        if (
            batch is None
            or not self.running
            or self.swapped
            or self.parked
            or self.draining
            or self.restored
        ):
            return None
        if batch.stale and not batch.read(self.running):
            return None
        return batch

    def _cross(self, rows: list[int], starts: Sequence[int]) -> bool:
        """The batch's decode rows ``rows`` write slot ``starts[row]``, past their write
        limits: one block each, in one call, unless they outnumber the free blocks (False,
        nothing taken)."""
        alloc, batch = self.allocator, self.batch
        if len(rows) > alloc.num_free_blocks():
            return False
        ids = batch.ids
        got = alloc.allocate_many([(ids[i], starts[i] + 1) for i in rows])
        if got.count(NO_COPIES) != len(rows):
            raise RuntimeError("a decode took a copy, or no block with blocks free")
        for i in rows:
            batch.grew(i)
        return True

    def update_batch(self, step: BatchStep, tokens: list[int], now: float) -> None:
        """``update`` of a ``schedule_batch`` step: its decodes' tokens (the first of
        ``tokens``, in row order) and its other rows' (``step.events``: chunks, admitted
        prompts; the rest), all on the host at ``now``. A sequence that stops finishes, its
        row dropped."""
        batch, progress = self.batch, self.progress
        n = len(step.starts)
        seqs = batch.seqs
        stops = progress.decode(seqs[:n], tokens, now, batch.stop_at)  # (row, stop)
        events = step.events
        if events is not None and events.scheduled:
            progress.advance(events, {})
            sampled = [row.seq for row in events.scheduled if row.samples]
            for seq, stop in progress.append_each(sampled, tokens[n:], now):
                stops.append((seqs.index(seq, n), stop))
        if stops:  # most steps stop nobody
            self._stop_rows(stops, now)
        if events is not None:
            batch.settle()

    def _stop_rows(self, stops: list[tuple[int, Stop]], now: float) -> None:
        """The batch's rows that stopped at ``now`` (ascending, each with its stop) finish,
        their rows dropped."""
        seqs = self.batch.seqs
        stopped = [(seqs[row], stop) for row, stop in stops]
        self.batch.drop([row for row, _ in stops])
        for seq, (reason, why) in stopped:
            self.finish(seq, reason, now, stop_reason=why)

    # -- runs of decode steps (schedulers/decode_run.py) ---------------------------------
    def begin_run(self) -> DecodeRun | None:
        """A run of decode steps over the running batch from now, when the steps to come
        are sure to be such steps until one of its rows stops: every row decodes, none may
        stop on a token, nobody can be let in (the batch is full, or nobody waits), the
        budget holds a token a row. Else None: ``schedule_batch`` or ``schedule`` decides."""
        batch = self._ready_batch()
        if batch is None:
            return None
        seqs, stop_at = batch.seqs, batch.stop_at
        if batch.decodes != len(seqs) or len(seqs) > self.max_num_batched_tokens:
            return None
        if 0 in stop_at or (self.waiting and len(seqs) < self.max_num_seqs):
            return None
        starts = [seq.num_computed_tokens for seq in seqs]
        return DecodeRun(seqs, starts, batch.limits, stop_at, self.allocator.block_size)

    def run_step(self, run: DecodeRun) -> list[int] | None:
        """``run``'s next step (at most its last), as ``schedule_batch`` decides a step of
        decodes alone: where each row's token goes, the rows crossing their write limit
        given their blocks. None, nothing taken, when the crossings outnumber the free
        blocks: the run ends there (``end_run``) and the general step decides the next."""
        starts = run.step_starts()
        crossing = run.crossing()
        if crossing:
            if not self._cross(crossing, starts):
                return None
            limits = self.batch.limits
            for row in crossing:
                run.cross_at(row, limits[row])
        return starts

    def run_tokens(self, run: DecodeRun, tokens: Sequence[int], now: float) -> bool:
        """The tokens of ``run``'s step just taken, one a row, on the host at ``now``: the
        blocks the step filled are offered to the allocator (``Progress.commit_filled``), as
        ``update_batch`` offers them. True when the step was the run's last (``end_run``
        stops the rows that reached their limit)."""
        run.took(tokens, now)
        filled = run.filled()
        if filled:
            self.progress.commit_filled(run, filled)
        return run.steps > run.last

    def end_run(self, run: DecodeRun) -> None:
        """``run`` takes no more steps: each row's sequence catches up with it; after its
        last step, the rows that reached their length limit stop (``update_batch``'s way)."""
        self.progress.catch_up(run, range(len(run.starts)), run.steps)
        if run.steps > run.last:
            self._stop_rows([(row, LENGTH) for row in run.stopped()], run.times[-1])

    def _stalled_by_parked(self) -> bool:
        """Parked sequences hold blocks while others wait to come in."""
        return any(s in self.parked for s in self.running) and self.next_incoming() is not None

    def _hold_until(self, now: float) -> float | None:
        if self.running or self.swapped or not self.waiting:
            return None
        if len(self.waiting) >= self.min_batch_size:
            return None
        deadline = min(s.arrival_time for s in self.waiting) + self.max_wait
        return deadline if now < deadline else None

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, order: list[Request]
    ) -> tuple[int, bool]:
        """Grow running sequences; returns the budget left and whether memory ran out.

        The allocator is asked for every row's growth in one call (``allocate_many``: the
        sequences crossing a block boundary take their blocks there); from the first it
        cannot meet on, one by one, preempting to make room."""
        rows, requests = self._whole_rows(order, budget) or self._chunked_rows(order, budget)
        got = self.allocator.allocate_many(requests)
        fit = len(got) if not got or got[-1] is not None else len(got) - 1
        if fit == len(rows):
            return self._add_rows(out, rows, got, budget), False
        budget = self._add_rows(out, rows[:fit], got[:fit], budget)
        queue = deque(order[order.index(rows[fit].seq) :])  # from the one that did not fit
        pressure = False
        allocate = self.allocator.allocate
        while queue and budget > 0:
            seq = queue.popleft()
            n = self._chunk(seq, budget)
            if n <= 0:
                continue
            while (alloc := allocate(seq.request_id, seq.num_computed_tokens + n)) is None:
                pressure = True
                parked = [s for s in self.running if s in self.parked] if self.parked else []
                victim = parked[-1] if parked else self._victim([*queue, seq])
                if victim in queue:
                    queue.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if alloc is not None:
                budget = self._add_rows(out, [self._row(seq, n)], [alloc], budget)
        return budget, pressure

    def _whole_rows(
        self, order: list[Request], budget: int
    ) -> tuple[list[Scheduled], list[tuple[str, int]]] | None:
        """Most steps: every sequence of ``order`` computes all its uncomputed tokens, which
        the budget holds and no chunk cap cuts (decodes). Then its rows (each samples) and
        allocation requests; else None (``_chunked_rows`` decides)."""
        ends, sizes = [], []
        for seq in order:  # a loop: faster in CPython 3.11 than chained maps of attrgetters
            end = len(seq.token_ids)
            ends.append(end)
            sizes.append(end - seq.num_computed_tokens)
        if not sizes or min(sizes) <= 0 or sum(sizes) > budget:
            return None
        if self.max_chunk is not None and max(sizes) > self.max_chunk:
            return None
        decodes = sizes.count(1) == len(sizes)
        last_order, rows, ids = self._last_decodes
        if not decodes or order != last_order:
            # Each row a Scheduled built in C (its class's __new__ is a Python call a row)
            fields = zip(order, sizes, repeat(True), repeat(0), repeat(0))
            rows = list(map(tuple.__new__, repeat(Scheduled), fields))
            ids = [seq.request_id for seq in order]
            if decodes:  # the same sequences decoding next step have the same rows
                self._last_decodes = (order, rows, ids)
        return rows, list(zip(ids, ends, strict=True))

    def _chunked_rows(
        self, order: list[Request], budget: int
    ) -> tuple[list[Scheduled], list[tuple[str, int]]]:
        """Each sequence of ``order`` grows by ``_chunk`` tokens while the budget lasts: its
        rows and allocation requests, in order."""
        rows, requests, left, chunk = [], [], budget, self._chunk
        for seq in order:
            if left <= 0:
                break
            n = chunk(seq, left)
            if n > 0:
                end = seq.num_computed_tokens + n
                rows.append(Scheduled(seq, n, end == len(seq.token_ids)))
                requests.append((seq.request_id, end))
                left -= n
        return rows, requests

    def _bring_in(self, out: SchedulerOutput, budget: int, now: float, reserve: int) -> int:
        """Swap in, then admit, in ``_incoming_order``; the first that does not fit stops it.
        A swapped-in sequence runs from the next step (the engine writes it after this step's
        block copies, whose sources may be its blocks). The order is read lazily (a saturated
        queue holds tens of thousands), so those leaving the queues go after the loop."""
        if len(self.running) >= self.max_num_seqs:  # the batch is full: nobody comes in
            return budget  # (the loop's first test; a policy's order is not even built)
        just_preempted = {id(s) for s, _ in out.preempted}
        leaving: list[tuple[deque[Request] | list[Request], Request]] = []  # admitted, rejected
        for seq in self._incoming():
            swapped = seq.status is Status.SWAPPED
            if len(self.running) >= self.max_num_seqs or (budget <= 0 and not swapped):
                break
            if id(seq) in just_preempted:
                break  # it made room for someone this step; do not undo that
            if not swapped and (reason := never_fits(seq, self.max_model_len, self.allocator)):
                leaving.append((self.waiting, seq))
                self._let_go(seq, "abort", now, abort_reason=reason)
                out.rejected.append((seq, reason))
                continue
            # Blocks still in the prefix cache come back without a copy (radix). A request
            # for prompt logprobs reads none of it: it needs logits at every prompt position.
            computed = seq.num_computed_tokens if swapped else seq.num_tokens
            reads = swapped or self._reads_prefix_cache(seq)
            prefix = seq.token_ids[: computed + 1] if reads else ()
            keep = reserve + (self.watermark_blocks if self.running else 0)
            # With lower tiers a lookup loads blocks: only for a request that comes in
            lower = self.allocator.has_lower_tiers
            comes_in = not lower or fits(self.allocator, seq, prefix, keep)
            cached = 0
            if comes_in and reads:
                cached = self.allocator.match_prefix(seq.request_id, prefix)
            if not swapped:
                seq.num_computed_tokens = max(cached, self.restored.get(seq.request_id, 0))
            n = 0 if swapped else self._chunk(seq, budget)
            alloc = (
                take_blocks(self.allocator, seq, keep) if comes_in and (n > 0 or swapped) else None
            )
            if alloc is None:
                self.allocator.free(seq.request_id)  # drop the prefix references taken above
                if not swapped:
                    seq.num_computed_tokens = 0
                if (n > 0 or swapped) and not self.running:
                    # Nothing else holds blocks: it will never fit.
                    leaving.append((self.swapped if swapped else self.waiting, seq))
                    need = seq.num_computed_tokens if swapped else seq.num_tokens
                    reason = f"{need} KV slots do not fit in the empty arena"
                    self._let_go(seq, "abort", now, abort_reason=reason)
                    out.rejected.append((seq, reason))
                    continue
                break
            self.running.append(seq)
            seq.status = Status.RUNNING
            self.progress.admit(seq)
            ring = self.rings.take(seq.request_id) if self.rings is not None else ()
            if swapped:
                leaving.append((self.swapped, seq))
                host = self.swap_space.release(seq.request_id)
                first = cached // self.allocator.block_size
                table = self.allocator.block_table(seq.request_id)
                out.swapped_in.append(SwapIn(seq, tuple(table[first:host]), first, ring))
                continue
            leaving.append((self.waiting, seq))
            if seq.request_id in self.restored:
                restored = self.restored.pop(seq.request_id)
                out.swapped_in.append(write_back(self.allocator, seq, cached, restored))
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached  # every tier's hit, of which lower tiers':
                host, disk = self.allocator.lower_tier_hits(seq.request_id)
                seq.num_cached_tokens_host, seq.num_cached_tokens_disk = host, disk
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            budget = self._add_rows(out, [self._row(seq, n)], [alloc], budget)
        for queue, seq in leaving:
            queue.remove(seq)
            self._unqueued(seq)
        return budget

    def _reads_prefix_cache(self, seq: Request) -> bool:
        """A waiting ``seq`` takes prefix-cache hits (a swapped one always does: its host
        copy holds the rest, and every layer's blocks)."""
        return self.read_prefix_cache and not seq.params.skip_reading_prefix_cache

    def _decode_blocks(self, seq: Request) -> int:
        """Blocks ``seq`` takes to compute one more token."""
        return self.allocator.blocks_needed(seq.request_id, seq.num_computed_tokens + 1)

    @staticmethod
    def _row(seq: Request, n: int) -> Scheduled:
        """``seq``'s row computing ``n`` new tokens (it samples if they reach its end)."""
        return Scheduled(seq, n, seq.num_computed_tokens + n == len(seq.token_ids))

    @staticmethod
    def _add_rows(
        out: SchedulerOutput, rows: list[Scheduled], allocs: list[Allocation], budget: int
    ) -> int:
        """Schedule ``rows``, which got ``allocs``; returns the budget they leave."""
        if allocs.count(NO_COPIES) != len(allocs):  # most steps copy nothing: no pass then
            for alloc in allocs:
                out.copies.extend(alloc.copies)
        out.scheduled += rows
        return budget - sum(map(_NUM_NEW, rows))

    def _preempt(self, seq: Request, out: SchedulerOutput) -> None:
        """Take a running sequence off the device, by swap when configured and room allows."""
        self.running.remove(seq)
        seq.preemptions += 1
        num_blocks = blocks_for(seq.num_computed_tokens, self.allocator.block_size)
        if (
            self.preemption_mode is Preemption.SWAP
            and num_blocks > 0
            and self.swap_space.fits(num_blocks)
        ):
            blocks = tuple(self.allocator.block_table(seq.request_id)[:num_blocks])
            ring = self._release(seq.request_id)
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
            self._queued(seq)
            self.swap_space.hold(seq.request_id, num_blocks)
            out.swapped_out.append(SwapOut(seq, blocks, ring))
            out.preempted.append((seq, Preemption.SWAP))
            return
        self._release(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self._queued(seq, front=True)
        out.preempted.append((seq, Preemption.RECOMPUTE))

    # -- policy hooks --------------------------------------------------------------------
    def _waiting_order(self) -> Iterable[Request]:
        """Admission order of the waiting queue: the queue itself, arrival order (read
        lazily, and not changed while it is read). A policy that orders all its incoming
        requests itself overrides ``_incoming_order`` instead."""
        return self.waiting

    @abstractmethod
    def _victim(self, candidates: list[Request]) -> Request:
        """Whom to preempt among running sequences not yet scheduled (and the one asking)."""

    def _incoming_order(self) -> Iterable[Request]:
        """Who comes in first: swapped sequences (earliest swapped first), then waiting."""
        return chain(self.swapped, self._waiting_order())

    def _queued(self, seq: Request, front: bool = False) -> None:  # noqa: B027 (optional hook)
        """``seq`` joined ``swapped`` (SWAPPED: at its end) or ``waiting`` (at its end, or at
        its front if ``front``): a policy that keeps its own incoming order hears it here."""

    def _unqueued(self, seq: Request) -> None:  # noqa: B027 (optional hook)
        """``seq`` left ``waiting`` or ``swapped``."""

    def _incoming(self) -> Iterator[Request]:
        """``_incoming_order`` without the parked sequences, lazily: the head of a long
        queue costs no copy of it."""
        order = iter(self._incoming_order())
        return (s for s in order if s not in self.parked) if self.parked else order

    def _running_order(self) -> list[Request]:
        """Order in which running sequences claim the token budget and blocks."""
        return list(self.running)

    def _make_room(self, out: SchedulerOutput) -> None:  # noqa: B027 (optional hook)
        """Preempt running sequences before scheduling (priority preemption); none here."""

    def _chunk(self, seq: Request, budget: int) -> int:
        """Tokens ``seq`` computes this step: all that remain, if the budget holds them. An
        override cuts a row only past ``budget`` or ``max_chunk`` (``_whole_rows`` takes
        the rows within both whole without asking)."""
        n = len(seq.token_ids) - seq.num_computed_tokens  # num_uncomputed_tokens, a call less
        return n if n <= budget else 0
