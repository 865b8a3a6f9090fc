"""What a scheduler decides each step: the ``SchedulerOutput`` the engine applies.

Re-exported by ``schedulers.base``, the scheduler contract.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from allocators.base import AllocatorStats, Holdings
from allocators.tiers import TierMove
from schedulers.request import Request


class Preemption(enum.Enum):
    """How a preempted sequence gives back its blocks."""

    RECOMPUTE = "recompute"  # free the blocks, requeue at the front, recompute prompt + output
    SWAP = "swap"  # copy the computed blocks to a host-side copy, free them, copy back later


class Scheduled(NamedTuple):
    """A sequence that runs this step, computing ``num_new_tokens`` from its computed prefix.

    ``num_draft_tokens > 0`` marks a speculative verification: the last ``num_draft_tokens``
    of the ``num_new_tokens`` slots are reserved for proposals, not yet in ``seq`` (a proposer
    may fill fewer: n-gram lookup). A draft model first catches up from ``draft_start`` (its
    tokens with draft KV) and has slots for the sequence's tokens and its first
    ``num_draft_tokens - 1`` proposals. ``samples``: the row computes the sequence's last
    token, so its logits give the next one; decided when the plan is made, never recomputed
    from the sequence as the step changes it.

    Immutable, as every record of the plan; a named tuple, not a frozen dataclass, because
    one is made per running sequence per step, and a frozen dataclass costs 2.4x as much to
    build (1.6 against 0.7 us here).
    """

    seq: Request
    num_new_tokens: int
    samples: bool  # its row ends at the sequence's end: it yields a token
    num_draft_tokens: int = 0
    draft_start: int = 0


@dataclass(frozen=True)
class SwapOut:
    """Copy device ``blocks`` (``seq``'s table, in order) to a host copy of ``seq``.

    The allocator already counts them free and may hand them out in this same step, so the
    engine reads them before it applies any block copy, swap-in or forward. ``ring``: the
    sliding-window ring it gave back, copied alike (a model with window layers).
    """

    seq: Request
    blocks: tuple[int, ...]
    ring: tuple[int, ...] = ()


@dataclass(frozen=True)
class SwapIn:
    """Write host blocks ``first, first + 1, ...`` of ``seq``'s host copy into the new device
    ``blocks``, then drop the host copy. Host blocks before ``first`` came back from the
    allocator's prefix cache and need no copy. ``ring``: the new sliding-window ring its
    host ring is written into, slot for slot (a model with window layers)."""

    seq: Request
    blocks: tuple[int, ...]
    first: int = 0
    ring: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    """One step's decision.

    The engine applies ``swapped_out`` first (read), then ``tier_moves`` in order (the
    prefix cache's writes to and loads from lower tiers, ``allocators.tiers``), then
    ``copies``, then ``swapped_in`` (write), then the forward over ``scheduled`` (a sequence
    swapped in runs from the next step). ``rejected`` sequences can never run and hold
    nothing. ``hold_until`` is set when nothing runs on purpose (a batch of
    ``min_batch_size`` is forming): nothing changes before that time unless a request
    arrives. ``draft_copies``: block copies in the draft model's arena (speculative
    decoding), applied before the draft proposes.
    """

    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[tuple[Request, Preemption]] = field(default_factory=list)
    rejected: list[tuple[Request, str]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[SwapOut] = field(default_factory=list)
    swapped_in: list[SwapIn] = field(default_factory=list)
    hold_until: float | None = None
    draft_copies: list[tuple[int, int]] = field(default_factory=list)
    tier_moves: list[TierMove] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class BatchStep(NamedTuple):
    """A step of the running batch (``Scheduler.schedule_batch``): its first rows are the
    batch's decodes, each computing one token from position ``starts[i]``; ``events`` holds
    its other rows, after those (chunks of prompts in progress, then the prompts of the
    requests let in this step), and the requests rejected; None when it has none."""

    starts: list[int]
    events: SchedulerOutput | None


class Fork(NamedTuple):
    """``child`` joined ``parent`` on its KV (``Scheduler.fork``): the block copies the
    allocator asked for (copy-on-write, a region's copy) and, for a model with sliding-window
    layers, the ring copies (parent's ring block, child's), taken at the fork, so the engine
    can make them even if either has since stopped (their blocks unwritten until it does)."""

    parent: Request
    child: Request
    copies: tuple[tuple[int, int], ...]
    ring_copies: tuple[tuple[int, int], ...] = ()


INFLIGHT = -1  # a sampled token still on the device (pipelined steps): its place in token_ids


@dataclass
class StepResults:
    """What a step's rows produced, handed back to ``Scheduler.update``.

    ``tokens``: per sequence, in order, the tokens to append: a verification's accepted
    drafts and then its correction or bonus token (or any sequence's tokens). ``sampled``
    and ``sampled_tokens``: the sampling rows' sequences and their one token each, as two
    lists in order (no list a token), appended after ``tokens``'s. ``forks``:
    (parent, child) completions forked off a parent whose prompt just finished (n > 1),
    after its progress and before any token is appended. ``now``: when the tokens exist on
    the host; None when they are still on the device (``pending``, pipelined steps: each
    gets an ``INFLIGHT`` placeholder that ``Scheduler.resolve`` replaces a step later)."""

    tokens: dict[Request, list[int]] = field(default_factory=dict)
    sampled: list[Request] = field(default_factory=list)
    sampled_tokens: list[int] = field(default_factory=list)
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    now: float | None = None
    pending: bool = False


class KVStats(NamedTuple):
    """The scheduler's view of memory and queues for one step (``kv_stats``; a named tuple:
    one is built every step): what the recorder reads, so it touches neither the allocator
    nor the queues.

    ``unusable_free_blocks``: free blocks that cannot serve the request next in line (runs
    or buddies too small for its region; 0 when nobody waits)."""

    blocks: AllocatorStats
    running: tuple[Request, ...]
    # Per running sequence, in order, as three columns: slots allocated, slots of the blocks
    # it holds (region slack included), its live block table (read it before the allocator
    # changes again).
    holdings: Holdings
    num_waiting: int
    num_swapped: int
    unusable_free_blocks: int
    draft_blocks_used: int
    window_blocks_used: int


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
