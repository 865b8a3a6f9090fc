"""The offline optimum of prefix caching (Belady), and the same replay through a real allocator.

Why: an eviction policy's hit rate means little on its own. Two references bound it: the
trace bound (``harness.workload.traces.max_prefix_hit_rate``, an infinite cache) and, for a finite
cache, the best any policy could do knowing the future. This module computes the latter and
replays real allocators under the identical model, so the three numbers are comparable.

The model. Requests are replayed ONE AT A TIME, in order, through a cache of ``budget``
blocks of ``block_size`` tokens (no concurrency: the point is eviction, not memory pressure
from running sequences). A block is identified by its whole token prefix: block ``j`` of a
sequence is the key ``tokens[:(j+1)*block_size]``. For each ``(prompt, output)`` request:

1. match: the longest run of leading prompt blocks that are cached hits, at most
   ``(len(prompt) - 1) // block_size`` of them (the last prompt token is always computed
   for its logits, as ``RadixAllocator.match_prefix`` does); hit blocks are held;
2. allocate: the request holds ``ceil((len(prompt) + len(output)) / block_size)`` blocks at
   once; the unmatched ones are new blocks, taken from free space first, and only when none
   is free by evicting an unheld cached block;
3. finish: the FULL blocks of prompt+output stay cached, unheld; the partial last block is
   freed. A new block whose key is already cached (the last prompt block of a whole-block
   prompt, which is never matchable) is a duplicate and is freed too. (``RadixAllocator``
   also leaves the blocks after such a duplicate unindexed; with fresh output ids those are
   output blocks nobody matches, and caching them can only help the optimum.)

Belady's rule, evict the block whose next use is farthest in the future, is the classic
optimum for uniform-size pages fetched on demand; here every block is one page and every
hit is worth ``block_size`` tokens (tests/allocators/test_offline_cache.py checks it against every
radix eviction policy). The next use of a key is the next request whose *matchable* prompt
prefix contains it, unless a request recomputes the key before that (then it is dead until
recomputed, and its next use is "never"). A child's next use is never earlier than its
parent's (a request that can match the child can match the parent), and ties go deeper
first, so the victim is usually a leaf; a dead parent can go before its live child, which
is then unreachable until the parent is recomputed (it costs no hit the parent's loss did
not already cost).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from allocators.base import BlockAllocator, blocks_for

Request = tuple[Sequence[int], Sequence[int]]
"""``(prompt_token_ids, output_token_ids)``: what one request computes, in order."""


class TracedRequest(Protocol):
    """What ``trace_requests`` reads of a trace's request (``harness.workload.traces.
    TraceRequest`` has it); a protocol, so allocators/ imports nothing of harness/."""

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        """The prompt's token ids."""
        ...

    @property
    def max_tokens(self) -> int:
        """The output length the request asks for."""
        ...


@dataclass(frozen=True)
class HitStats:
    """What a replay measured: prompt tokens served from the cache, and blocks evicted."""

    hit_tokens: int
    prompt_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens (0.0 for no prompt tokens)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def trace_requests(trace: Iterable[TracedRequest]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A trace as ``(prompt, output)`` pairs, outputs being ``max_tokens`` fresh unique ids.

    Why fresh ids: the engine's real outputs differ from whatever a trace generator put in
    later prompts (``multi_turn`` resends placeholder answers), so a cached output block is
    never matched again, while the answer tokens a later prompt contains are reusable once
    that prompt has been computed. With fresh ids only prompts are reusable, which keeps the
    model honest about the engine and makes an infinite cache reach exactly the trace bound
    ``max_prefix_hit_rate(trace, block_size)``. Output blocks still take (and pollute)
    cache space, as they do in the engine. Ids start above the largest prompt id.
    """
    reqs = list(trace)
    next_id = 1 + max((max(r.prompt_token_ids, default=0) for r in reqs), default=0)
    out = []
    for r in reqs:
        out.append((tuple(r.prompt_token_ids), tuple(range(next_id, next_id + r.max_tokens))))
        next_id += r.max_tokens
    return out


def _check_fits(index: int, num_tokens: int, block_size: int, budget: int) -> None:
    need = blocks_for(num_tokens, block_size)
    if need > budget:
        raise ValueError(
            f"request {index} needs {need} blocks of {block_size} tokens for its {num_tokens} "
            f"prompt+output tokens, but the cache budget is {budget} blocks; raise the budget "
            f"to at least {need} (or drop/shorten the request)"
        )


def online_hit_rate(
    make_allocator: Callable[[], BlockAllocator], requests: Iterable[Request]
) -> HitStats:
    """Replay ``requests`` one at a time through a real allocator, as the engine drives it.

    ``make_allocator()`` builds it, e.g. ``lambda: RadixAllocator(num_blocks=budget,
    block_size=16, eviction="lfu")``; the calls are match_prefix -> allocate(prompt+output)
    -> commit(prompt+output) -> free. A non-caching allocator simply hits nothing.
    """
    alloc = make_allocator()
    hit = total = 0
    for i, (prompt, output) in enumerate(requests):
        tokens = [*prompt, *output]
        _check_fits(i, len(tokens), alloc.block_size, alloc.num_blocks)
        seq = f"req{i}"
        hit += alloc.match_prefix(seq, prompt)
        total += len(prompt)
        if alloc.allocate(seq, len(tokens)) is None:
            # Alone in a cache large enough for it, a request can only fail by an allocator bug.
            raise RuntimeError(f"{type(alloc).__name__} could not allocate request {i} alone")
        alloc.commit(seq, tokens)
        alloc.free(seq)
    return HitStats(hit, total, alloc.stats().evictions)


@dataclass
class _Blocks:
    """Every full block of a request sequence, interned (see ``_index``)."""

    keys: list[list[int]]  # per request: key ids of its full prompt+output blocks, in order
    depth: list[int]  # per key id: its block index j
    uses: list[list[int]]  # per key id: increasing requests whose matchable prefix has it
    seen: list[list[int]]  # per key id: increasing requests that have it as a full block
    first: list[int]  # per key id: the first request that has it as a full block


def _index(reqs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], block_size: int) -> _Blocks:
    # Chained keys (parent key id, block tokens) name a whole prefix in O(block_size), where
    # the prefix itself would make key building O(len^2) per request.
    intern: dict[tuple[int, tuple[int, ...]], int] = {}
    blocks = _Blocks([], [], [], [], [])
    for i, (prompt, output) in enumerate(reqs):
        tokens = prompt + output
        ids, parent = [], -1
        for j in range(len(tokens) // block_size):
            key = (parent, tokens[j * block_size : (j + 1) * block_size])
            parent = intern.get(key, -1)
            if parent < 0:
                parent = intern[key] = len(blocks.depth)
                blocks.depth.append(j)
                blocks.uses.append([])
                blocks.seen.append([])
                blocks.first.append(i)
            ids.append(parent)
            blocks.seen[parent].append(i)
        for kid in ids[: _matchable(prompt, block_size)]:
            blocks.uses[kid].append(i)
        blocks.keys.append(ids)
    return blocks


def reusable_blocks(requests: Iterable[Request], block_size: int) -> int:
    """Distinct blocks an infinite cache would hit at least once.

    Why: a budget of this plus the largest request's blocks is enough for Belady to reach
    the trace bound (every block with a future hit can stay while the request runs), so it
    is the natural 100 % of a trace's working set; blocks never matched again are not.
    """
    blocks = _index([(tuple(p), tuple(o)) for p, o in requests], block_size)
    return sum(bool(u) and u[-1] > f for u, f in zip(blocks.uses, blocks.first, strict=True))


def belady_hit_rate(requests: Iterable[Request], block_size: int, budget: int) -> HitStats:
    """Replay ``requests`` under the module's model, evicting by farthest next use.

    O(total tokens + total blocks * log): block keys are interned per sequence, next uses
    are precomputed per key, and the victim comes from a heap whose stale entries are skipped.
    """
    reqs = [(tuple(p), tuple(o)) for p, o in requests]
    for i, (prompt, output) in enumerate(reqs):
        _check_fits(i, len(prompt) + len(output), block_size, budget)
    blocks = _index(reqs, block_size)
    never = len(reqs)  # a next use later than any request
    cursor = [0] * len(blocks.depth)  # per key id: first of its uses not yet in the past
    seen_cursor = [0] * len(blocks.depth)

    def first_after(items: list[int], cursors: list[int], kid: int, now: int) -> int:
        c = cursors[kid]
        while c < len(items) and items[c] <= now:
            c += 1
        cursors[kid] = c
        return items[c] if c < len(items) else never

    def next_use(kid: int, now: int) -> int:
        """The next request that hits ``kid``; ``never`` if a request recomputes it first
        (a whole-block prompt's last block, or a matchable block behind a broken chain):
        keeping it until then saves nothing, the recomputation caches it anyway."""
        use = first_after(blocks.uses[kid], cursor, kid, now)
        seen = first_after(blocks.seen[kid], seen_cursor, kid, now)
        return use if use == seen else never

    cached: dict[int, int] = {}  # unheld cached key id -> its next use
    # (-next use, -depth, key id): farthest first, deeper first. An entry is stale once its
    # key is held or evicted; a live entry's next use cannot change while the key sits unheld.
    heap: list[tuple[int, int, int]] = []
    hit_blocks = prompt_tokens = evictions = 0
    for i, (prompt, output) in enumerate(reqs):
        ids, limit = blocks.keys[i], _matchable(prompt, block_size)
        h = 0
        while h < limit and ids[h] in cached:
            del cached[ids[h]]  # held by this request from here on
            h += 1
        hit_blocks += h
        prompt_tokens += len(prompt)
        new = blocks_for(len(prompt) + len(output), block_size) - h
        free = budget - h - len(cached)
        for _ in range(new - free):
            while True:
                neg_use, _, kid = heapq.heappop(heap)
                if cached.get(kid) == -neg_use:
                    break
            del cached[kid]
            evictions += 1
        for kid in ids:
            # A still-cached key is a duplicate: its new copy is freed, the cached one stays
            # with the next use seen from here.
            use = next_use(kid, i)
            if cached.get(kid) != use:
                cached[kid] = use
                heapq.heappush(heap, (-use, -blocks.depth[kid], kid))
    return HitStats(hit_blocks * block_size, prompt_tokens, evictions)


def _matchable(prompt: Sequence[int], block_size: int) -> int:
    # The last prompt token is always computed, so its logits exist.
    return max(len(prompt) - 1, 0) // block_size
