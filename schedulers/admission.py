"""Admission's block mechanics, apart from the policy: whether an incoming request can ever
run, the blocks it takes at admission, and the write-back of a KV file's blocks."""

from __future__ import annotations

from collections.abc import Sequence

from allocators.base import Allocation, BlockAllocator, blocks_for
from schedulers.output import SwapIn
from schedulers.request import Request, Status


def never_fits(seq: Request, max_model_len: int, alloc: BlockAllocator) -> str | None:
    """Why a waiting ``seq`` can never run (too long for the model or for the arena's
    longest sequence), or None."""
    if seq.num_tokens > max_model_len:
        return f"prompt of {seq.num_tokens} tokens exceeds max_model_len={max_model_len}"
    capacity = alloc.max_seq_tokens
    if seq.num_tokens > capacity:
        return (
            f"prompt of {seq.num_tokens} tokens exceeds the {capacity} KV slots one "
            "sequence can hold in the KV arena"
        )
    return None


def fits(alloc: BlockAllocator, seq: Request, prefix: Sequence[int], keep: int) -> bool:
    """Whether an incoming ``seq`` would get its blocks with ``keep`` left free, its
    prefix-cache match on ``prefix`` counted, before anything is looked up: a lookup has
    effects (it loads a lower tier's hits into the arena, kv_tier), which a request that
    does not come in this step must not cause."""
    rid = seq.request_id
    whole = seq.num_computed_tokens if seq.status is Status.SWAPPED else seq.num_tokens
    return (
        alloc.can_allocate(rid, whole, prefix)
        and alloc.num_free_blocks() - alloc.blocks_needed(rid, whole, prefix) >= keep
    )


def take_blocks(alloc: BlockAllocator, seq: Request, keep: int) -> Allocation | None:
    """Blocks for all the tokens of an incoming ``seq`` (its prefix-cache match already
    taken), if ``keep`` blocks stay free (those running sequences need, the watermark).

    A prompt gets all its blocks at admission even when it computes only a chunk now (as
    vLLM v0 does with chunked prefill): chunked prefills that each hold part of their
    prompt could otherwise preempt each other forever, and a region allocator could
    leave a lone prefill unable to grow."""
    rid = seq.request_id
    whole = seq.num_computed_tokens if seq.status is Status.SWAPPED else seq.num_tokens
    if not alloc.can_allocate(rid, whole) or (
        alloc.num_free_blocks() - alloc.blocks_needed(rid, whole) < keep
    ):
        return None
    return alloc.allocate(rid, whole)


def write_back(alloc: BlockAllocator, seq: Request, cached: int, restored: int) -> SwapIn:
    """An admitted request's host copy of its first ``restored`` tokens (a KV file): its
    blocks past the prefix-cache hit (``cached`` tokens) are written back before the forward
    computes the rest of the prompt."""
    first = cached // alloc.block_size
    last = blocks_for(restored, alloc.block_size)
    table = alloc.block_table(seq.request_id)
    return SwapIn(seq, tuple(table[first:last]), first)
