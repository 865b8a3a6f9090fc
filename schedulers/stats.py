"""A scheduler's KV memory and queues for one step, as the recorder reads them
(``KVStats``): read from the scheduler's and its allocators' public state, never changing it."""

from __future__ import annotations

from schedulers.base import Scheduler
from schedulers.output import KVStats
from schedulers.request import Status


def kv_stats(scheduler: Scheduler) -> KVStats:
    """``scheduler``'s memory and queues as its plan leaves them (the recorder's one view of
    both, taken each step while the forward computes)."""
    alloc = scheduler.allocator
    running = tuple(scheduler.running)
    holdings = alloc.holdings([seq.request_id for seq in running])
    unusable = 0
    # Only an allocator whose free blocks can be unusable needs the head of the line (for any
    # other the answer is 0, whoever it is: no queue is read).
    if alloc.fragments_free_space and (head := scheduler.next_incoming()) is not None:
        need = head.num_computed_tokens if head.status is Status.SWAPPED else head.num_tokens
        unusable = alloc.unusable_free_blocks(need, head.request_id)
    return KVStats(
        blocks=alloc.stats(),
        running=running,
        holdings=holdings,
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        unusable_free_blocks=unusable,
        draft_blocks_used=scheduler.draft.allocator.stats().used_blocks if scheduler.draft else 0,
        window_blocks_used=scheduler.rings.allocator.stats().used_blocks if scheduler.rings else 0,
    )
