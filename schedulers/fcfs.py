"""First come, first served continuous batching."""

from __future__ import annotations

from harness.request import Sequence
from schedulers.base import Scheduler


class FCFSScheduler(Scheduler):
    """Admit in arrival order (preempted sequences first); preempt the latest admitted."""

    def _waiting_order(self) -> list[Sequence]:
        return list(self.waiting)

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=self.running.index)
