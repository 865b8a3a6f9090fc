"""Priority scheduling: lower ``priority`` values run first, ties by arrival.

With ``aging_rate`` r a request's effective priority is ``priority - r * (now - arrival)``:
it improves the longer the request has been in the system, so nothing starves. Every
request ages at the same rate, so the order this gives equals the order of the constant
key ``priority + r * arrival``; the scheduler sorts by that key and never needs ``now``,
and a preempted request never outranks the one it made room for.

Like vLLM's priority policy, a waiting request that outranks running ones preempts the
lowest-ranked of them when it cannot otherwise come in (``preempt_lower=True``): one at a
time until the allocator says it fits, and only when the blocks all of them would give back
cover its need. That test counts blocks: with region placement, a prefix it shares with a
victim, or running decodes that take the freed room first, it can preempt and still not
admit the head this step (known limitation; an exact test needs a what-if on the allocator).

Victims under memory pressure (``victim``), as in the low-level design seed:

    priority            lowest rank (highest effective priority value, latest arrival)
    fcfs                the latest admitted
    shortest_remaining  the one closest to done (fewest output tokens left), as the seed
    recompute_cheapest  the one with the fewest computed tokens (cheapest to redo)
"""

from __future__ import annotations

from allocators.base import BlockAllocator
from harness.request import Sequence, Status
from schedulers.base import Scheduler, SchedulerOutput

VICTIMS = ("priority", "fcfs", "shortest_remaining", "recompute_cheapest")


class PriorityScheduler(Scheduler):
    """Lower priority value first, ties by arrival; selectable victims; optional aging."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        victim: str = "priority",
        aging_rate: float = 0.0,
        preempt_lower: bool = True,
        **kwargs,
    ) -> None:
        if victim not in VICTIMS:
            raise ValueError(f"scheduler.victim={victim!r}: use one of {list(VICTIMS)}")
        if not aging_rate >= 0:
            raise ValueError(f"scheduler.aging_rate={aging_rate!r} must be >= 0 per second")
        super().__init__(allocator, **kwargs)
        self.victim = victim
        self.aging_rate = aging_rate
        self.preempt_lower = preempt_lower

    def rank(self, seq: Sequence) -> tuple[float, float]:
        """Sort key: smaller runs first (effective priority up to a shared constant)."""
        return seq.priority + self.aging_rate * seq.arrival_time, seq.arrival_time

    def _waiting_order(self) -> list[Sequence]:
        return sorted(self.waiting, key=self.rank)  # stable: equal keys keep queue order

    def _incoming_order(self) -> list[Sequence]:
        # Swapped first among equals; otherwise a swapped request waits its turn.
        return sorted(self.swapped + list(self.waiting), key=self.rank)

    def _running_order(self) -> list[Sequence]:
        # The most important grow first, so the least important are still unscheduled (and
        # so can be victims) when blocks run out.
        return sorted(self.running, key=self.rank)

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        latest = self.running.index
        if self.victim == "priority":
            return max(candidates, key=lambda s: (self.rank(s), latest(s)))
        if self.victim == "fcfs":
            return max(candidates, key=latest)
        if self.victim == "shortest_remaining":
            return min(candidates, key=lambda s: (_remaining(s), -latest(s)))
        return min(candidates, key=lambda s: (s.num_computed_tokens, -latest(s)))

    def _make_room(self, out: SchedulerOutput) -> None:
        incoming = self._incoming_order()
        if not self.preempt_lower or not incoming or not self.running:
            return
        head = incoming[0]
        if self._never_fits(head):
            return
        alloc, rid = self.allocator, head.request_id
        whole = head.num_computed_tokens if head.status is Status.SWAPPED else head.num_tokens
        prefix = head.token_ids[: whole + 1]  # what its admission will match in a prefix cache

        def fits() -> bool:
            return (
                alloc.can_allocate(rid, whole, prefix)
                and (
                    alloc.num_free_blocks() - alloc.blocks_needed(rid, whole, prefix)
                    >= self.watermark_blocks
                )
                and len(self.running) < self.max_num_seqs
            )

        lower = sorted((s for s in self.running if self.rank(s) > self.rank(head)), key=self.rank)
        reclaimable = sum(alloc.reclaimable_blocks(s.request_id) for s in lower)
        need = alloc.blocks_needed(rid, whole, prefix) + self.watermark_blocks
        if (
            alloc.num_free_blocks() + reclaimable < need
            or len(self.running) - len(lower) >= self.max_num_seqs
        ):
            return  # preempting every lower-ranked request would still not let it in
        # One victim at a time, asking again after each: a region allocator may need one
        # region freed, not the blocks of many.
        while lower and not fits():
            self._preempt(lower.pop(), out)


def _remaining(seq: Sequence) -> int:
    return seq.params.max_tokens - seq.num_output_tokens
