"""Priority scheduling: lower ``priority`` values run first, ties by arrival.

With ``aging_rate`` r a request's effective priority is ``priority - r * (now - arrival)``:
it improves the longer the request has been in the system, so nothing starves. Every
request ages at the same rate, so the order this gives equals the order of the constant
key ``priority + r * arrival``; the scheduler sorts by that key and never needs ``now``,
and a preempted request never outranks the one it made room for.

Like vLLM's priority policy, a waiting request that outranks running ones preempts the
lowest-ranked of them when it cannot otherwise come in (``preempt_lower=True``): the fewest
that let it in this step, or none. When a count says it does not fit now, dry runs of the
step on a copy of the allocator decide (region placement, a prefix the head shares with a
victim, the others' decodes growing first, the token budget); they cost a copy of the
allocator's state each, paid only while such a request waits.

Victims under memory pressure (``victim``), as in the low-level design seed:

    priority            lowest rank (highest effective priority value, latest arrival)
    fcfs                the latest admitted
    shortest_remaining  the one closest to done (fewest output tokens left), as the seed
    recompute_cheapest  the one with the fewest computed tokens (cheapest to redo)
"""

from __future__ import annotations

import copy
from bisect import bisect_left, insort
from collections.abc import Callable
from operator import attrgetter

from allocators.base import BlockAllocator
from schedulers.admission import fits, never_fits
from schedulers.base import Scheduler, SchedulerOutput
from schedulers.request import Request, Status

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
        # Without aging the rank is the (priority, arrival) pair itself, read in C: the
        # running set is ranked every step, twice (``_rank_key``).
        self._pair = attrgetter("priority", "arrival_time") if not aging_rate else None
        # The incoming order (swapped, then waiting, stably sorted by rank), kept sorted as
        # the queues change instead of sorted every step (a saturated queue holds tens of
        # thousands, and ``_make_room`` reads its head every step): each queued sequence's
        # key is its rank, then 0 if swapped else 1, then its place in its queue, a count
        # that grows at the queues' ends and falls at the waiting queue's front.
        self._order: list[Request] = []
        self._keys: dict[Request, tuple] = {}
        self._back = self._front = 0

    def rank(self, seq: Request) -> tuple[float, float]:
        """Sort key: smaller runs first (effective priority up to a shared constant)."""
        return seq.priority + self.aging_rate * seq.arrival_time, seq.arrival_time

    def _rank_key(self) -> Callable[[Request], tuple[float, float]]:
        """``rank`` as a sort key (a bound method made per call: none kept, no cycle)."""
        return self._pair or self.rank

    def _incoming_order(self) -> list[Request]:
        # Swapped first among equals; otherwise a swapped request waits its turn. (The
        # order itself, read before anyone leaves the queues: ``_bring_in``.)
        return self._order

    def _queued(self, seq: Request, front: bool = False) -> None:
        if front:
            self._front -= 1
            place = self._front
        else:
            self._back += 1
            place = self._back
        self._keys[seq] = (*self.rank(seq), 0 if seq.status is Status.SWAPPED else 1, place)
        insort(self._order, seq, key=self._keys.__getitem__)

    def _unqueued(self, seq: Request) -> None:
        keys = self._keys
        del self._order[bisect_left(self._order, keys[seq], key=keys.__getitem__)]
        del keys[seq]

    def _running_order(self) -> list[Request]:
        # The most important grow first, so the least important are still unscheduled (and
        # so can be victims) when blocks run out.
        return sorted(self.running, key=self._rank_key())

    def _victim(self, candidates: list[Request]) -> Request:
        latest = self.running.index
        if self.victim == "priority":
            return max(candidates, key=lambda s: (self.rank(s), latest(s)))
        if self.victim == "fcfs":
            return max(candidates, key=latest)
        if self.victim == "shortest_remaining":
            return min(candidates, key=lambda s: (_remaining(s), -latest(s)))
        return min(candidates, key=lambda s: (s.num_computed_tokens, -latest(s)))

    def _make_room(self, out: SchedulerOutput) -> None:
        head = self.next_incoming()
        if not self.preempt_lower or head is None or not self.running:
            return
        rank = self._rank_key()
        top = rank(head)
        if max(map(rank, self.running)) <= top:  # nobody ranks below the head (most steps)
            return
        lower = sorted((s for s in self.running if rank(s) > top), key=rank)
        if never_fits(head, self.max_model_len, self.allocator) or self._fits_by_count(head):
            return
        # The fewest lowest-ranked victims after which the head comes in this step, found by
        # dry runs on a copy of the allocator; if all of them would not do, nobody goes.
        # Victims are freed lowest-ranked first, in the dry runs as for real: the order
        # decides which cached blocks a prefix cache evicts first.
        order = lower[::-1]
        if self._comes_in(head, []) or not self._comes_in(head, order):
            return
        k = 1
        while k < len(order) and not self._comes_in(head, order[:k]):
            k += 1
        for victim in order[:k]:
            self._preempt(victim, out)

    def _fits_by_count(self, head: Request) -> bool:
        """The cheap test first: ``head`` fits now, the others' decodes counted."""
        whole = head.num_computed_tokens if head.status is Status.SWAPPED else head.num_tokens
        swapped = head.status is Status.SWAPPED
        prefix = head.token_ids[: whole + 1] if swapped or self._reads_prefix_cache(head) else ()
        growth = sum(self._decode_blocks(s) for s in self.running)
        return len(self.running) < self.max_num_seqs and fits(
            self.allocator, head, prefix, self.watermark_blocks + growth
        )

    def _comes_in(self, head: Request, victims: list[Request]) -> bool:
        """Dry run of this step on a copy of the allocator once ``victims`` are freed: the
        others grow first (decode-first), then ``head`` is admitted as ``_bring_in`` would
        (seat, token budget, prefix match, placement, watermark)."""
        staying = [s for s in self._running_order() if s not in victims]
        if len(staying) >= self.max_num_seqs:
            return False
        trial = copy.deepcopy(self.allocator)
        for victim in victims:
            trial.free(victim.request_id)
        budget = self.max_num_batched_tokens
        for seq in staying:
            n = self._chunk(seq, budget)
            budget -= n
            if n and trial.allocate(seq.request_id, seq.num_computed_tokens + n) is None:
                return False
        swapped = head.status is Status.SWAPPED
        if not swapped and self._chunk(head, budget) <= 0:
            return False
        whole = head.num_computed_tokens if swapped else head.num_tokens
        rid = head.request_id
        if swapped or self._reads_prefix_cache(head):
            trial.match_prefix(rid, head.token_ids[: whole + 1])
        keep = self.watermark_blocks if staying else 0
        return trial.can_allocate(rid, whole) and (
            trial.num_free_blocks() - trial.blocks_needed(rid, whole) >= keep
        )


def _remaining(seq: Request) -> int:
    return seq.params.max_tokens - seq.num_output_tokens
