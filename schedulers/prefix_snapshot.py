"""A prefix-cache snapshot coming back (``LLMEngine.restore_prefix_cache``): each path's
blocks that the cache lacks are claimed in the scheduler's allocator, written by the engine,
then indexed and let go, cached and held by nobody. On the scheduler side: only it calls the
allocator."""

from __future__ import annotations

from collections.abc import Sequence

from allocators.base import blocks_for
from schedulers.base import Scheduler

PREFIX_SLOT = "\0restore-prefix-cache"  # a scratch sequence no request is


def claim_prefix(scheduler: Scheduler, token_ids: Sequence[int]) -> tuple[int, list[int]] | None:
    """Blocks for one path of a prefix-cache snapshot, ``token_ids`` (whole blocks): the
    tokens the cache already holds and the blocks to write the rest into, after which
    ``index_prefix`` caches them, held by nobody. None, holding nothing, when the free
    blocks cannot take the rest (the caller stops rather than evict what it restored)."""
    alloc = scheduler.allocator
    have = alloc.match_prefix(PREFIX_SLOT, [*token_ids, -1])  # every full block may match
    if alloc.stats().free_blocks < blocks_for(len(token_ids) - have, alloc.block_size):
        alloc.free(PREFIX_SLOT)
        return None
    alloc.allocate(PREFIX_SLOT, len(token_ids))
    return have, alloc.block_table(PREFIX_SLOT)[have // alloc.block_size :]


def index_prefix(scheduler: Scheduler, token_ids: Sequence[int]) -> None:
    """The claimed blocks hold ``token_ids``' KV: cache them and let go."""
    scheduler.allocator.commit(PREFIX_SLOT, token_ids)
    scheduler.allocator.free(PREFIX_SLOT)
