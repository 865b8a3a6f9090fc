"""Speculative decoding as a policy wrapper: a base policy decides, decodes verify k drafts.

The wrapper delegates every decision to its base policy (admission, preemption, chunking)
and only widens decodes: after the base schedules a decode (one slot: its last token), the
wrapper asks the allocator for ``k`` more slots and marks it ``Scheduled(seq, k + 1,
num_draft_tokens=k)``. The engine runs the draft model and verifies; rejected slots are
trimmed there.

    computed      last token   k draft slots (trimmed back after verification)
    [.......... ][ t_{n-1} ][ x_1 .. x_k ]

Speculation only uses headroom: a decode is widened when at least one free block per running
sequence stays free, and never by preempting anyone. Widening after the base has allocated
may relocate a sequence twice in one step; ``simultaneous`` composes the copies.

Hydra: ``_target_: schedulers.speculative.SpeculativeScheduler``, ``_partial_: true``, with
``base`` a nested partial of any policy (``_partial_: true``) and ``draft`` a partial that
builds the draft model from the target (e.g. ``harness.models.noisy_copy``) or null for the
default small random draft. The engine calls the partial with the allocator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from allocators.base import BlockAllocator
from schedulers.base import Scheduled, Scheduler, SchedulerOutput
from schedulers.request import Request


@dataclass
class SpeculativeOutput(SchedulerOutput):
    """A step's decision plus what its verifications measured (filled in by the engine).

    ``spec_proposed`` draft tokens were verified, ``spec_accepted`` of them accepted;
    ``spec_rejected`` verifications stopped at a rejected draft token (at most one each),
    so the per-token acceptance rate is ``accepted / (accepted + rejected)``.
    """

    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_rejected: int = 0

    @property
    def num_verifications(self) -> int:
        return sum(1 for s in self.scheduled if s.num_draft_tokens)


class SpeculativeScheduler:
    """Wraps a base policy; decodes propose ``num_draft_tokens`` tokens and verify them."""

    def __init__(
        self,
        allocator: BlockAllocator,
        base: Scheduler | Callable[[BlockAllocator], Scheduler],
        *,
        num_draft_tokens: int = 4,
        draft: Callable[..., Any] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(
                f"scheduler.num_draft_tokens={num_draft_tokens!r} is invalid: it must be an "
                "int >= 1"
            )
        if isinstance(base, Scheduler):
            self.base = base
        else:  # built here with what the engine gives the policy
            limits = {} if max_model_len is None else {"max_model_len": max_model_len}
            self.base = base(allocator, **limits)
        if self.base.allocator is not allocator:
            raise ValueError(
                "the base scheduler must be built over the speculative one's allocator"
            )
        self.allocator = allocator
        self.num_draft_tokens = num_draft_tokens
        # How the engine builds the draft model: called with the target LoadedModel. The
        # scheduler only carries it; it never runs a model.
        self.draft = draft
        # Called with a request id whenever its draft KV must go (finish, abort, preemption).
        self.release_listeners: list[Callable[[str], None]] = []

    def __getattr__(self, name: str) -> Any:
        # Everything not speculative (queues, limits, swap state) is the base policy's.
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    # -- requests in and out -------------------------------------------------------------
    def add(self, seq: Request) -> None:
        self.base.add(seq)

    def abort(self, request_id: str) -> Request | None:
        seq = self.base.abort(request_id)
        if seq is not None:
            self._release(request_id)
        return seq

    def finish(self, seq: Request) -> None:
        self.base.finish(seq)
        self._release(seq.request_id)

    def has_unfinished(self) -> bool:
        return self.base.has_unfinished()

    def num_unfinished(self) -> int:
        return self.base.num_unfinished()

    # -- the step decision ---------------------------------------------------------------
    def schedule(self, now: float) -> SpeculativeOutput:
        plan = self.base.schedule(now)
        out = SpeculativeOutput(**{f.name: getattr(plan, f.name) for f in fields(plan)})
        for seq, _ in out.preempted:
            self._release(seq.request_id)
        alloc = self.allocator
        budget = self.base.max_num_batched_tokens - out.num_batched_tokens
        headroom = len(self.base.running) + self.base.watermark_blocks
        copies = list(out.copies)
        for i, s in enumerate(out.scheduled):
            k = self._num_drafts(s)
            if not k or k > budget:
                continue
            have = s.seq.num_computed_tokens + 1
            need = alloc.blocks_needed(s.seq.request_id, have + k)
            if not alloc.can_allocate(s.seq.request_id, have + k) or (
                alloc.num_free_blocks() - need < headroom
            ):
                continue
            grown = alloc.allocate(s.seq.request_id, have + k)
            if grown is None:
                continue
            copies.extend(grown.copies)
            out.scheduled[i] = Scheduled(s.seq, k + 1, num_draft_tokens=k)
            budget -= k
        out.copies = simultaneous(copies)
        return out

    def _num_drafts(self, s: Scheduled) -> int:
        """Draft tokens worth verifying for a scheduled sequence (0 unless it decodes)."""
        seq = s.seq
        if s.num_new_tokens != 1 or seq.num_uncomputed_tokens != 1:
            return 0
        # A verification yields up to k + 1 tokens: never propose past max_tokens or the
        # model length, where they would all be dropped.
        left = min(
            seq.params.max_tokens - seq.num_output_tokens,
            self.base.max_seq_len - seq.num_tokens,
        )
        return max(0, min(self.num_draft_tokens, left - 1))

    def _release(self, request_id: str) -> None:
        for listener in self.release_listeners:
            listener(request_id)


def simultaneous(copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Block copies made one after another, as one pass that reads the pre-step arena.

    A decode widened after the base scheduled it may relocate again (A->B by the base, then
    B->C): applied in one gather-then-scatter pass, C would get B's stale content. Composing
    gives A->B, A->C; a later writer of the same destination replaces an earlier one.
    """
    content: dict[int, int] = {}
    for src, dst in copies:
        content[dst] = content.get(src, src)
    return [(src, dst) for dst, src in content.items() if src != dst]
