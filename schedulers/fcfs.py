"""First come, first served continuous batching."""

from __future__ import annotations

from allocators.base import BlockAllocator
from schedulers.base import Scheduler
from schedulers.request import Request

ORDERS = ("decode_first", "prefill_first")


class FCFSScheduler(Scheduler):
    """Admit in arrival order (preempted sequences first); preempt the latest admitted.

    ``order="decode_first"`` (default) grows the running sequences before admitting new
    ones; ``"prefill_first"`` admits first (keeping back the blocks this step's decodes
    need), so new prompts start sooner and decodes get the budget left over. Other keyword
    arguments are the batch constraints of ``Scheduler``.
    """

    batches = True  # decode-first, its steps are the base's: they may run over the batch

    def __init__(self, allocator: BlockAllocator, *, order: str = "decode_first", **kwargs):
        if order not in ORDERS:
            raise ValueError(f"scheduler.order={order!r}: use one of {list(ORDERS)}")
        self.prefill_first = order == "prefill_first"
        super().__init__(allocator, **kwargs)

    def _victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=self.running.index)
