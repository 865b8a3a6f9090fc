"""Speculative decoding's lookahead (``num_lookahead_slots = k > 0``, with a ``draft``
allocator when a draft model proposes; the engine sets both): after the step is decided, each
decode is widened to verify up to ``k`` draft tokens (``Scheduled(seq, 1 + k, True, k)``) when its
slots fit in the token budget, at least one free block per running sequence stays free, and
the draft's arena (if any) has room for the draft's own slots: speculation only uses
headroom, never preempts anyone. The slots are a reservation: a proposer may fill fewer
(n-gram lookup proposes what it finds), and ``Scheduler.update`` trims the target's to the
tokens kept."""

from __future__ import annotations

from allocators.base import BlockAllocator
from schedulers.kv_groups import DraftKV
from schedulers.output import Scheduled, SchedulerOutput, simultaneous


class Lookahead:
    """Widens a step's decodes into verifications (see the module docstring); the
    scheduler's part when it speculates."""

    def __init__(
        self, allocator: BlockAllocator, draft: DraftKV | None, num_slots: int, max_seq_len: int
    ) -> None:
        self.allocator = allocator
        self.draft = draft
        self.num_slots = num_slots  # draft tokens a verification checks at most
        self.max_seq_len = max_seq_len

    def widen(self, out: SchedulerOutput, budget: int, headroom: int) -> None:
        """Give ``out``'s decodes lookahead slots for draft tokens, from headroom only: at
        most ``budget`` tokens in all, keeping ``headroom`` blocks free."""
        alloc, draft = self.allocator, self.draft
        copies = list(out.copies)
        for i, s in enumerate(out.scheduled):
            k = self._num_drafts(s)
            if not k or k > budget:
                continue
            rid, have = s.seq.request_id, s.seq.num_computed_tokens + 1
            if not alloc.can_allocate(rid, have + k) or (
                alloc.num_free_blocks() - alloc.blocks_needed(rid, have + k) < headroom
            ):
                continue
            grown = alloc.allocate(rid, have + k)
            if grown is None:
                continue
            copies.extend(grown.copies)  # a region may have moved, even if the draft says no
            start = 0
            if draft is not None:  # a draft model: its KV grows too
                start = draft.computed.get(rid, 0)
                # The draft computes the sequence's tokens and its first k - 1 proposals.
                drafted = draft.grow(rid, s.seq.num_tokens + k - 1)
                if drafted is None:
                    alloc.trim(rid, have)
                    continue
                draft.computed[rid] = s.seq.num_tokens + k - 1
                out.draft_copies.extend(drafted.copies)
            out.scheduled[i] = Scheduled(s.seq, k + 1, True, k, start)
            budget -= k
        out.copies = simultaneous(copies)
        out.draft_copies = simultaneous(out.draft_copies)

    def _num_drafts(self, s: Scheduled) -> int:
        """Draft tokens worth verifying for a scheduled sequence (0 unless it decodes)."""
        seq = s.seq
        if s.num_new_tokens != 1 or seq.num_uncomputed_tokens != 1:
            return 0
        # A verification yields up to k + 1 tokens: never propose past max_tokens or the
        # model length, where they would all be dropped.
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_seq_len - seq.num_tokens)
        return max(0, min(self.num_slots, left - 1))
