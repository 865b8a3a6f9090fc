"""Records what the engine did: one row per step and one row per finished request.

Column names are those of ``harness.metrics`` (REQUEST_COLUMNS, STEP_COLUMNS); the summary
is computed from these rows alone, so every figure in it can be recomputed from the tables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from allocators.base import BlockAllocator
from harness.kv_cache import KVArena
from harness.request import Sequence

if TYPE_CHECKING:
    from schedulers.base import Scheduler, SchedulerOutput


class Recorder:
    """Collects per-step and per-request rows (a no-op when disabled, e.g. in benchmarks)."""

    def __init__(self, allocator: BlockAllocator, arena: KVArena, *, enabled: bool = True):
        self.allocator = allocator
        self.arena = arena
        self.enabled = enabled
        self.steps: list[dict] = []
        self.requests: list[dict] = []

    def request(self, seq: Sequence) -> None:
        if not self.enabled:
            return
        nan = float("nan")
        self.requests.append(
            {
                "request_id": seq.request_id,
                "priority": seq.priority,
                "arrival_time": seq.arrival_time,
                "first_scheduled_time": _or_nan(seq.first_scheduled_time),
                "first_token_time": _or_nan(seq.first_token_time),
                "finish_time": seq.finish_time,
                "prompt_tokens": seq.num_prompt_tokens,
                "output_tokens": seq.num_output_tokens,
                "cached_tokens": seq.num_cached_tokens or 0,
                "preemptions": seq.preemptions,
                "finish_reason": seq.finish_reason,
                "abort_reason": seq.abort_reason,
                "ttft_slo": nan if seq.ttft_slo is None else seq.ttft_slo,
                "tpot_slo": nan if seq.tpot_slo is None else seq.tpot_slo,
                "token_times": list(seq.token_times),
                "spec_proposed": seq.spec_proposed,
                "spec_accepted": seq.spec_accepted,
            }
        )

    def snapshot(self, scheduler: Scheduler) -> dict | None:
        """KV memory and queue figures of the step being run (taken while its forward
        computes, so the bookkeeping overlaps the model instead of adding to the step)."""
        if not self.enabled:
            return None
        alloc = self.allocator
        stats = alloc.stats()
        bs = stats.block_size
        future = 0
        for seq in scheduler.running:
            final = min(seq.num_prompt_tokens + seq.params.max_tokens, scheduler.max_seq_len)
            held = alloc.held_slots(seq.request_id)  # region slack included
            future += max(0, min(held, final) - seq.num_computed_tokens)
        spare = max(0, stats.reserved_slots - stats.used_slots)
        future = min(future, spare)
        # External fragmentation as the vLLM paper means it: free blocks that cannot serve
        # the request next in line (runs or buddies too small for its region).
        head = scheduler.next_incoming()
        unusable = alloc.unusable_free_blocks(head.num_tokens) if head is not None else 0
        return {
            "num_waiting": len(scheduler.waiting),
            "num_running": len(scheduler.running),
            "num_swapped": len(scheduler.swapped),
            "blocks_used": stats.used_blocks,
            "blocks_free": stats.free_blocks,
            "blocks_cached": stats.cached_blocks,
            "slots_tokens": stats.used_slots,
            "slots_future": future,
            "slots_internal": spare - future,
            "slots_external": unusable * bs,
            "slots_total": stats.num_blocks * bs,
            "external_fragmentation": unusable / stats.free_blocks if stats.free_blocks else 0.0,
            "mlx_active_bytes": mx.get_active_memory(),
        }

    def step(
        self,
        plan: SchedulerOutput,
        snapshot: dict | None,
        start: float,
        duration: float,
        forward_time: float,
        build_time: float,
        swap_time: float = 0.0,
    ) -> None:
        """One row per step: the plan, its timings, and the ``snapshot`` taken during it."""
        if not self.enabled:
            return
        # A speculative verification computes 1 + k tokens but is a decode, not a prefill.
        prefill = sum(n for s in plan.scheduled if (n := s.num_new_tokens - s.num_draft_tokens) > 1)
        self.steps.append(
            {
                "step": len(self.steps),
                "start_time": start,
                "duration": duration,
                "forward_time": forward_time,
                "build_time": build_time,
                "batch_size": len(plan.scheduled),
                "prefill_tokens": prefill,
                "decode_tokens": plan.num_batched_tokens - prefill,
                "preempted": len(plan.preempted),
                "swap_out_blocks": sum(len(s.blocks) for s in plan.swapped_out),
                "swap_in_blocks": sum(len(s.blocks) for s in plan.swapped_in),
                "swap_time": swap_time,  # host copies of swapped KV, synchronised
                **snapshot,
                "mlx_peak_bytes": mx.get_peak_memory(),
                "spec_proposed": getattr(plan, "spec_proposed", 0),
                "spec_accepted": getattr(plan, "spec_accepted", 0),
            }
        )


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else x
