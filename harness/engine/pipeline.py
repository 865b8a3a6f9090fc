"""Pipelined steps, one deep, as mlx_lm's BatchGenerator and vLLM's async scheduling do.

When every row of a step samples on the device (greedy, no penalties, bans or logprobs, no
drafts to verify, no beams), the step launches its forward and its ``argmax`` and returns
without waiting; the next step schedules, builds and launches its own forward, feeding those
tokens straight from the device, and only then reads them on the host, and the scheduler
stamps them and applies stop conditions (``Scheduler.resolve``)::

    step t:    schedule -> launch forward_t + argmax_t -> carry (placeholders)
    step t+1:  schedule -> launch forward_{t+1} (feeds argmax_t) -> resolve argmax_t -> carry

A row computed for a sequence that turns out to have stopped is dropped, never emitted. A
sequence sure to stop on its pending token (its last by ``max_tokens`` or the model length)
gives its blocks back before that token is read (the scheduler "drains" it).

``Pipeline`` is the one writer of the tokens in flight.
"""

from __future__ import annotations

import time

import mlx.core as mx

from harness.engine.outputs import prompt_positions
from harness.engine.request import Seq
from harness.engine.request_table import RequestTable
from schedulers.base import Scheduler
from schedulers.output import SchedulerOutput, StepResults


class Pipeline:
    """The step's sampled tokens left on the device and read one step later."""

    def __init__(self, scheduler: Scheduler, requests: RequestTable) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self._inflight: list[tuple[Seq, int]] = []  # (sequence, its row of ``tokens``)
        self.tokens: mx.array | None = None  # the last step's tokens, on the device

    @property
    def busy(self) -> bool:
        """Tokens of the last step are still on the device."""
        return bool(self._inflight)

    def rows(self) -> dict[Seq, int]:
        """Each sequence whose last token is on the device, and its row of ``tokens``."""
        return dict(self._inflight)

    def on_device(self, plan: SchedulerOutput) -> bool:
        """Every row that samples this step can sample on the device, from logits alone."""
        beams = self.requests.beams
        for s in plan.scheduled:
            seq, p = s.seq, s.seq.params
            if s.num_draft_tokens:
                return False
            if prompt_positions(seq, s.num_new_tokens):
                return False
            if s.samples and seq.group_id in beams:
                return False  # its candidates are chosen on the host
            if s.samples and not (
                p.greedy
                and not p.penalised
                and not p.min_tokens
                and p.logprobs is None
                and p.n == 1
            ):
                return False
        return True

    def carry(self, plan: SchedulerOutput, tokens: mx.array | None) -> None:
        """A pipelined step's results: the scheduler counts its KV as written and gives each
        sampling row's token (row k of ``tokens``, on the device) a placeholder until the
        next step reads it. A sequence that stopped on the previous step's token drops this
        step's row."""
        sampling = [s.seq for s in plan.scheduled if s.samples]
        self.scheduler.update(plan, StepResults(sampled=sampling, pending=True))
        self._inflight = [(seq, k) for k, seq in enumerate(sampling) if not seq.finished]
        self.tokens = tokens if self._inflight else None

    def resolve(self, stamp) -> tuple[list[Seq], float]:
        """Read the tokens still on the device (waiting for them) and hand them to the
        scheduler, stamped ``stamp()`` (when they exist on the host). Returns the sequences
        that got theirs and the seconds waited."""
        waited = time.perf_counter()
        tokens = self.tokens.tolist()
        waited = time.perf_counter() - waited
        now = stamp()
        resolved = []
        for seq, k in self._inflight:
            if seq.finished:  # aborted while its token computed
                continue
            self.scheduler.resolve(seq, tokens[k], now)
            resolved.append(seq)
        self._inflight, self.tokens = [], None
        return resolved, waited
