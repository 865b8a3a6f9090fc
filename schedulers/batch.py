"""The running batch: a step's rows as columns, kept from step to step (vLLM v1's
``InputBatch``), so that a step whose rows decode costs a few passes over lists, and
per-sequence Python runs only where a sequence has an event.

Rows are the running sequences in running order: first the ``decodes`` rows, each with one
token to compute past its prompt, then those still computing their prompt (chunked
prefill: admitted last, so last in running order too). A row's columns:

    seqs      the sequence                     limits    its allocator write limit
    ids       its request id                   held      slots of the blocks it holds
    stop_at   the length that stops it, 0      preempts  its preemptions (the recorder's
              when a token may stop it                    holding key)
              sooner (``Stopping.length_limit``)

Events: a row crossing its write limit asks the allocator for a block (contract version 5:
growth within the limit goes unreported), a sequence admitted gets a row at the end, one
that finishes loses its row (the rows close up, running order kept), a prompt computed
joins the decodes. Anything else that changes the running set or its order (a preemption,
an abort, a fork, a prompt finished before one admitted earlier) goes through the
scheduler's general step, after which the rows are read again from the sequences.

The scheduler side is the one writer of these columns; the engine and the recorder read
them for the step's shape and its row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from allocators.base import BlockAllocator
from schedulers.request import Request


def decodes(seq: Request) -> bool:
    """``seq`` has one token to compute, past its prompt: its row decodes (the recorder's
    rule for a decode token, too)."""
    computed = seq.num_computed_tokens
    return computed == len(seq.token_ids) - 1 and computed >= seq.num_prompt_tokens


def _prefills(seq: Request) -> bool:
    """``seq`` has more than one token of its prompt to compute: its row prefills."""
    return len(seq.token_ids) - seq.num_computed_tokens > 1


def _leading_decodes(seqs: Sequence[Request], start: int) -> int | None:
    """How many of ``seqs`` decode, all ahead of the rest (known to decode up to
    ``start``); None when a row that decodes comes after one that does not."""
    count = start
    while count < len(seqs) and decodes(seqs[count]):
        count += 1
    return count if all(map(_prefills, seqs[count:])) else None


class RunningBatch:
    """The running rows' columns (module docstring)."""

    def __init__(self, allocator: BlockAllocator, stop_at: Callable[[Request], int]) -> None:
        """``stop_at``: a sequence's length limit (0 when a token may stop it sooner)."""
        self.allocator = allocator
        self._stop_at = stop_at
        self.seqs: list[Request] = []
        self.ids: list[str] = []
        self.limits: list[int] = []
        self.held: list[int] = []
        self.stop_at: list[int] = []
        # Replaced, never changed in place, when the rows change: a reader may keep it to
        # tell the same rows from the step before.
        self.preempts: list[int] = []
        self.decodes = 0  # the first rows, that decode
        self.stale = True

    def read(self, running: Sequence[Request]) -> bool:
        """Read the columns of ``running`` again from its sequences; False (left stale)
        unless its rows decode, then prefill."""
        self.stale = True
        seqs = list(running)
        count = _leading_decodes(seqs, 0)
        if count is None:
            return False
        alloc = self.allocator
        self.seqs = seqs
        self.ids = [seq.request_id for seq in seqs]
        self.limits = list(map(alloc.write_limit, self.ids))
        self.held = list(map(alloc.held_slots, self.ids))
        self.stop_at = list(map(self._stop_at, seqs))
        self.preempts = [seq.preemptions for seq in seqs]
        self.decodes = count
        self.stale = False
        return True

    def admit(self, seq: Request) -> None:
        """A row for ``seq``, just admitted (its blocks taken)."""
        rid = seq.request_id
        self.seqs.append(seq)
        self.ids.append(rid)
        self.limits.append(self.allocator.write_limit(rid))
        self.held.append(self.allocator.held_slots(rid))
        self.stop_at.append(self._stop_at(seq))
        self.preempts = [*self.preempts, seq.preemptions]

    def grew(self, row: int) -> None:
        """Row ``row`` took a block: its write limit and held slots, read again."""
        rid = self.ids[row]
        self.limits[row] = self.allocator.write_limit(rid)
        self.held[row] = self.allocator.held_slots(rid)

    def drop(self, rows: Sequence[int]) -> None:
        """The rows ``rows`` (ascending) left: the rest close up."""
        for column in (self.seqs, self.ids, self.limits, self.held, self.stop_at):
            for row in reversed(rows):
                del column[row]
        gone = set(rows)
        self.preempts = [p for i, p in enumerate(self.preempts) if i not in gone]
        self.decodes -= sum(row < self.decodes for row in rows)

    def settle(self) -> None:
        """After a step with rows past the decodes: the prompts it finished join the
        decodes; stale if one finished before a row ahead of it."""
        count = _leading_decodes(self.seqs, self.decodes)
        if count is None:
            self.stale = True
        else:
            self.decodes = count
