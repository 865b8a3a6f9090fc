"""A run of decode steps: the running batch's steps taken one after another while every row
decodes and nothing happens but block crossings (``Scheduler.begin_run``), so that a row's
tokens, their times and its progress reach its sequence only at its events: a block it
fills (the allocator's ``commit`` reads its tokens) and the run's end. Similar in intent to
vLLM v0's multi-step scheduling (``--num-scheduler-steps``), which decides several decode
steps at once, reserving their slots and cutting what follows a stop; unlike it, a run's
steps are exactly those single steps would take, in the same order, because a run stops
wherever a single step would decide anything else:

    its last step    the first in which a row reaches its length limit (no row of a run may
                     stop on a token: a run is only begun when none can)
    blocks short     a step whose crossings outnumber the free blocks (a preemption: the
                     general step decides it)
    an arrival       the engine takes no step at or after the next arrival it is told of
                     (the driver adds the request first, as between single steps)

No request is let in during a run: it begins only when none can be (the batch is full, or
nobody waits). Its columns: per row in the batch's order, its start at the run's first step
(``starts``) and how many steps' tokens its sequence has taken (``take``); per step, its
tokens (a column of ``tokens``: a row's are contiguous) and when they exist (``times``).
The scheduler side is its one user (``Scheduler.run_step``, ``run_tokens``, ``end_run``;
``Progress.catch_up`` writes what a row takes to its sequence).
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
        stop_at: Sequence[int],
        block_size: int,
    ) -> None:
        """``seqs`` decode from ``starts`` (each of length ``start + 1``), each able to grow
        to its write limit in ``limits`` without a block, and stops at the length in
        ``stop_at`` (none may stop sooner). The run's ``last`` step (from 0) is the first in
        which a row reaches that: after step j a row is ``start + j + 2`` long."""
        self.seqs = list(seqs)
        self.starts = starts
        self._until = [limit - start - 2 for start, limit in zip(starts, stop_at, strict=True)]
        self.last = min(self._until)
        self.block_size = block_size
        self.steps = 0  # steps taken
        # A row's tokens, a step a column (a row's run of them is contiguous).
        self.tokens = np.empty((len(starts), min(self.last + 1, _FIRST_STEPS)), dtype=np.int32)
        self.times = array("d")
        self._written = [0] * len(starts)  # a row's steps whose tokens it has taken
        self._crossings: dict[int, list[int]] = {}  # step -> rows that take a block then
        self._fills: dict[int, list[int]] = {}  # step -> rows whose block it fills
        for row, (start, limit) in enumerate(zip(starts, limits, strict=True)):
            self._add(self._crossings, max(limit - start, 0), row)
            self._add(self._fills, -(start + 1) % block_size, row)

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

    def take(self, row: int, steps: int) -> tuple[bytes, array]:
        """Row ``row``'s tokens (int32 bytes) and times of the run's first ``steps`` steps
        that it has not taken yet, now taken."""
        have = self._written[row]
        self._written[row] = max(have, steps)
        return self.tokens[row, have:steps].tobytes(), self.times[have:steps]

    def step_starts(self) -> list[int]:
        """Where each row's token of the next step goes."""
        j = self.steps
        return [start + j for start in self.starts]

    def crossing(self) -> list[int]:
        """The rows the next step takes past their write limit, in row order."""
        return sorted(self._crossings.pop(self.steps, ()))

    def cross_at(self, row: int, limit: int) -> None:
        """Row ``row``, which took a block in the next step, can now grow to ``limit`` (past
        the slot that step writes): it crosses that in the step writing there."""
        self._add(self._crossings, limit - self.starts[row], row)

    def filled(self) -> list[int]:
        """The rows whose last block the step just taken filled, in row order."""
        j = self.steps - 1
        rows = sorted(self._fills.pop(j, ()))
        for row in rows:
            self._add(self._fills, j + self.block_size, row)
        return rows

    def stopped(self) -> list[int]:
        """The rows that reach their length limit at the run's last step, in row order."""
        last = self.last
        return [row for row, until in enumerate(self._until) if until == last]

    def _add(self, at: dict[int, list[int]], step: int, row: int) -> None:
        if step <= self.last:
            at.setdefault(step, []).append(row)
