"""A run of decode steps: the running batch's steps taken one after another while every row
decodes and nothing happens but block crossings (``Scheduler.begin_run``), so that a row's
tokens, their times and its progress reach its sequence only at its events: a block it
fills (the allocator's ``commit`` reads its tokens) and the run's end. vLLM's multi-step
scheduling (``--num-scheduler-steps``) decides several decode steps at once in the same
way; here the steps are the ones single steps would take, in the same order, because a run
stops where a single step would decide anything else:

    its last step    the first in which a row reaches its length limit (no row of a run may
                     stop on a token: a run is only begun when none can)
    blocks short     a step whose crossings outnumber the free blocks (a preemption: the
                     general step decides it)
    an arrival       the engine takes no step at or after the next arrival it is told of
                     (the driver adds the request first, as between single steps)

No request is let in during a run: it begins only when none can be (the batch is full, or
nobody waits). The run's columns, per row in the batch's order: ``starts`` (at its first
step), the steps whose tokens its sequence holds (``written``); per step: its tokens (a row
of ``tokens``) and when they exist (``times``). The scheduler side is their one writer
(``Scheduler.run_step``, ``run_tokens``, ``end_run``; ``Progress.catch_up``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from schedulers.request import Request

_FIRST_STEPS = 64  # steps the tokens' rows hold at first (a run's last may be far)


class DecodeRun:
    """A run's columns and the steps at which its rows have events (module docstring)."""

    def __init__(
        self,
        seqs: Sequence[Request],
        starts: list[int],
        limits: Sequence[int],
        last: int,
        block_size: int,
    ) -> None:
        """``seqs`` decode from ``starts``, each able to grow to its write limit in
        ``limits`` without a block; ``last``: the run's last step (from 0), when its first
        row stops."""
        self.seqs = list(seqs)
        self.starts = starts
        self.last = last
        self.block_size = block_size
        self.steps = 0  # steps taken
        # A row's tokens, a step a column (a row's run of them is contiguous).
        self.tokens = np.empty((len(starts), min(last + 1, _FIRST_STEPS)), dtype=np.int32)
        self.times = array("d")
        self.written = [0] * len(starts)
        self._crossings: dict[int, list[int]] = {}  # step -> rows that take a block then
        self._fills: dict[int, list[int]] = {}  # step -> rows whose block it fills
        crossings, fills = self._crossings, self._fills
        for row, (start, limit) in enumerate(zip(starts, limits, strict=True)):
            at = limit - start if limit > start else 0
            if at <= last:
                crossings.setdefault(at, []).append(row)
            at = -(start + 1) % block_size
            if at <= last:
                fills.setdefault(at, []).append(row)

    def took(self, tokens: Sequence[int], now: float) -> None:
        """The next step is taken: its ``tokens`` (one a row), existing at ``now``."""
        j = self.steps
        if j == self.tokens.shape[1]:  # room for twice the steps, up to the last
            more = np.empty((len(self.starts), min(2 * j, self.last + 1)), dtype=np.int32)
            more[:, :j] = self.tokens
            self.tokens = more
        self.tokens[:, j] = tokens
        self.times.append(now)
        self.steps = j + 1

    def step_starts(self) -> list[int]:
        """Where each row's token of the next step goes."""
        j = self.steps
        return [start + j for start in self.starts]

    def crossing(self) -> list[int]:
        """The rows the next step takes past their write limit, in row order."""
        return sorted(self._crossings.pop(self.steps, ()))

    def cross_at(self, row: int, limit: int) -> None:
        """Row ``row`` can now grow to ``limit``: it crosses that in the step writing there."""
        self._add(self._crossings, max(limit - self.starts[row], self.steps), row)

    def filled(self) -> list[int]:
        """The rows whose last block the step just taken filled, in row order."""
        j = self.steps - 1
        rows = sorted(self._fills.pop(j, ()))
        for row in rows:
            self._add(self._fills, j + self.block_size, row)
        return rows

    def stopped(self, stop_at: Sequence[int]) -> list[int]:
        """The rows that reach their length limit (``stop_at``) at the run's last step."""
        last, starts = self.last, self.starts
        return [row for row, limit in enumerate(stop_at) if limit - starts[row] - 2 == last]

    def _add(self, at: dict[int, list[int]], step: int, row: int) -> None:
        if step <= self.last:
            at.setdefault(step, []).append(row)
