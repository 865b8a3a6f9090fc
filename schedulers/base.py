"""The scheduler contract and the mechanics every policy shares.

A scheduler decides; it never touches tensors. Each step it returns a ``SchedulerOutput``:
which sequences run and how many new tokens each computes, who was preempted, and the block
copies the runner applies first. It asks the allocator for blocks through the allocator's
contract (``match_prefix``/``allocate``/``free``) and nothing else.

Policies override the hooks that differ: ``_waiting_order`` (who is admitted first),
``_victim`` (who is preempted under memory pressure) and ``_chunk`` (how many tokens a
sequence computes this step).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from allocators.base import BlockAllocator
from harness.request import Sequence, Status


class Preemption(enum.Enum):
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Scheduled:
    """A sequence that runs this step, computing ``num_new_tokens`` from its computed prefix.

    ``num_draft_tokens > 0`` marks a speculative verification: the last ``num_draft_tokens``
    of the ``num_new_tokens`` slots are a draft model's proposals, not yet in ``seq``.
    """

    seq: Sequence
    num_new_tokens: int
    num_draft_tokens: int = 0


@dataclass
class SchedulerOutput:
    """One step's decision."""

    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[tuple[Sequence, Preemption]] = field(default_factory=list)
    rejected: list[tuple[Sequence, str]] = field(default_factory=list)  # can never run
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler(ABC):
    """Continuous batching mechanics; subclasses choose order, victims and chunking.

    Each step: running sequences first, in admission order, each growing its blocks (when the
    allocator says no, ``_victim`` picks a running sequence to preempt by recompute: blocks
    freed, requeued at the front, generated tokens kept); then waiting sequences are admitted
    in ``_waiting_order`` while the batch constraints and free blocks allow.
    """

    chunked_prefill = False

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
        watermark: float = 0.0,
    ) -> None:
        for name, value in [
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"scheduler.{name}={value!r} is invalid: it must be an int >= 1")
        if not self.chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={max_num_batched_tokens} is below "
                f"max_model_len={max_model_len}: a long prompt could never be scheduled; raise "
                "it or use the chunked_prefill scheduler"
            )
        if not 0 <= watermark < 1:
            raise ValueError(f"scheduler.watermark={watermark!r} must be a fraction in [0, 1)")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * allocator.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- requests in and out -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request in any state and free its blocks; None if it is not here."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.allocator.free(seq.request_id)
                    return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: release its blocks (cached blocks may stay shared)."""
        self.running.remove(seq)
        self.allocator.free(seq.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step decision ---------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._admit_waiting(out, budget, now)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            n = self._chunk(seq, budget)
            if n <= 0:
                continue
            while (
                alloc := self.allocator.allocate(seq.request_id, seq.num_computed_tokens + n)
            ) is None:
                victim = self._victim(queue + [seq])
                if victim is not seq:
                    queue.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if alloc is None:
                continue
            out.copies.extend(alloc.copies)
            out.scheduled.append(Scheduled(seq, n))
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        allocator = self.allocator
        for seq in self._waiting_order():
            if len(self.running) >= self.max_num_seqs or budget <= 0:
                return
            reason = self._never_fits(seq)
            if reason:
                self.waiting.remove(seq)
                out.rejected.append((seq, reason))
                continue
            cached = allocator.match_prefix(seq.request_id, seq.token_ids)
            seq.num_computed_tokens = cached
            n = self._chunk(seq, budget)
            need = -(-(cached + n) // allocator.block_size) - cached // allocator.block_size
            alloc = None
            if n > 0 and allocator.num_free_blocks() - need >= self.watermark_blocks:
                alloc = allocator.allocate(seq.request_id, cached + n)
            if alloc is None:
                allocator.free(seq.request_id)  # drop the prefix references taken above
                seq.num_computed_tokens = 0
                return
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = Status.RUNNING
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            out.copies.extend(alloc.copies)
            out.scheduled.append(Scheduled(seq, n))
            budget -= n

    def _never_fits(self, seq: Sequence) -> str | None:
        if seq.num_tokens > self.max_model_len:
            return f"prompt of {seq.num_tokens} tokens exceeds max_model_len={self.max_model_len}"
        capacity = self.allocator.num_blocks * self.allocator.block_size
        if seq.num_tokens > capacity:
            return f"prompt of {seq.num_tokens} tokens exceeds the KV arena ({capacity} slots)"
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append((seq, Preemption.RECOMPUTE))

    # -- policy hooks --------------------------------------------------------------------
    @abstractmethod
    def _waiting_order(self) -> list[Sequence]:
        """Admission order of the waiting queue."""

    @abstractmethod
    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """Whom to preempt among running sequences not yet scheduled (and the one asking)."""

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens ``seq`` computes this step: all that remain, if the budget holds them."""
        n = seq.num_uncomputed_tokens
        return n if n <= budget else 0
