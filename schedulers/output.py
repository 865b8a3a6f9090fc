"""What a scheduler decides each step: the ``SchedulerOutput`` the engine applies.

Re-exported by ``schedulers.base``, the scheduler contract.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from schedulers.request import Request


class Preemption(enum.Enum):
    """How a preempted sequence gives back its blocks."""

    RECOMPUTE = "recompute"  # free the blocks, requeue at the front, recompute prompt + output
    SWAP = "swap"  # copy the computed blocks to a host-side copy, free them, copy back later


@dataclass(frozen=True)
class Scheduled:
    """A sequence that runs this step, computing ``num_new_tokens`` from its computed prefix.

    ``num_draft_tokens > 0`` marks a speculative verification: the last ``num_draft_tokens``
    of the ``num_new_tokens`` slots are a draft model's proposals, not yet in ``seq``.
    """

    seq: Request
    num_new_tokens: int
    num_draft_tokens: int = 0


@dataclass(frozen=True)
class SwapOut:
    """Copy device ``blocks`` (``seq``'s table, in order) to a host copy of ``seq``.

    The allocator already counts them free and may hand them out in this same step, so the
    engine reads them before it applies any block copy, swap-in or forward.
    """

    seq: Request
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class SwapIn:
    """Write host blocks ``first, first + 1, ...`` of ``seq``'s host copy into the new device
    ``blocks``, then drop the host copy. Host blocks before ``first`` came back from the
    allocator's prefix cache and need no copy."""

    seq: Request
    blocks: tuple[int, ...]
    first: int = 0


@dataclass
class SchedulerOutput:
    """One step's decision.

    The engine applies ``swapped_out`` first (read), then ``copies``, then ``swapped_in``
    (write), then the forward over ``scheduled`` (a sequence swapped in runs from the next
    step). ``rejected`` sequences can never run and hold nothing. ``hold_until`` is set when
    nothing runs on purpose (a batch of ``min_batch_size`` is forming): nothing changes
    before that time unless a request arrives.
    """

    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[tuple[Request, Preemption]] = field(default_factory=list)
    rejected: list[tuple[Request, str]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[SwapOut] = field(default_factory=list)
    swapped_in: list[SwapIn] = field(default_factory=list)
    hold_until: float | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
