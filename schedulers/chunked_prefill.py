"""Chunked prefill (Sarathi-Serve; the low-level design seed's algorithm 6).

Every step first gives each running decode its one token, then fills the rest of the token
budget with prefill chunks of at most ``max_chunk`` tokens, running prefills before new
admissions. A prefill spans as many steps as it needs, each chunk attending over the KV its
earlier chunks wrote::

    budget 8, max_chunk 4     step 1       step 2       step 3
    decode a                  a            a            a
    decode b                  b            b            b
    prompt c (10 tokens)      c[0:4]       c[4:8]       c[8:10] -> first token
    prompt d (3 tokens)       d[0:2]       d[2:3] ...

Admission and preemption are FCFS's (the latest admitted is the victim). A prompt gets all
its blocks when it is admitted and its chunks fill them (vLLM v0's choice), so chunked
prefills never preempt each other mid-prompt.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, eq, gt, sub

from allocators.base import BlockAllocator
from schedulers.fcfs import FCFSScheduler
from schedulers.limits import positive_int
from schedulers.request import Request

_TOKEN_IDS = attrgetter("token_ids")
_COMPUTED = attrgetter("num_computed_tokens")


class ChunkedPrefillScheduler(FCFSScheduler):
    """Decodes first, then prefill chunks of at most ``max_chunk`` tokens in the leftover
    budget. ``max_num_batched_tokens`` may be below ``max_model_len``; it must cover one
    token per running sequence so that no decode ever waits for a prefill."""

    chunked_prefill = True

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_chunk: int = 512,
        max_num_batched_tokens: int = 512,
        **kwargs,
    ) -> None:
        super().__init__(
            allocator,
            order="decode_first",
            max_num_batched_tokens=max_num_batched_tokens,
            **kwargs,
        )
        positive_int("max_chunk", max_chunk)
        if max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={max_num_batched_tokens} is below "
                f"max_num_seqs={self.max_num_seqs}: some decodes would wait for prefills; "
                "raise the budget or lower max_num_seqs"
            )
        self.max_chunk = max_chunk

    def _running_order(self) -> list[Request]:
        # Decodes (one uncomputed token) first, then prefills, each in running order; most
        # steps all decode. Counted in C (a Python loop a sequence costs more).
        running = self.running
        uncomputed = list(map(sub, map(len, map(_TOKEN_IDS, running)), map(_COMPUTED, running)))
        if uncomputed.count(1) == len(uncomputed):
            return list(running)
        decodes = compress(running, map(eq, uncomputed, repeat(1)))
        return [*decodes, *compress(running, map(gt, uncomputed, repeat(1)))]

    def _chunk(self, seq: Request, budget: int) -> int:
        n = len(seq.token_ids) - seq.num_computed_tokens  # num_uncomputed_tokens
        return min(n, budget, self.max_chunk)
