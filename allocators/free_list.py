"""Paged allocation from a free list: any free block will do.

Blocks are taken from the head of a FIFO queue and returned to its tail, so the
block freed longest ago is reused first (LRU reuse): a block's stale KV lives as
long as possible, which helps debugging and mirrors vLLM's free-block queue.

The queue starts as every block in id order, but is never built: blocks never used yet
are those past the high-water mark ``len(self._ref)`` (the reference counts grow with
it), and they come before every recycled block, which waits in a deque in the order
it was freed. So the arena costs memory as its blocks are first used, not up front::

    ref  [1 2 0 1]  fresh 4 5 ... n-1        free deque [2]   (block 2 freed)
    take order: 4, 5, ..., n-1, then 2, then blocks as they are freed

Forks share blocks by reference count. The one block an ``allocate`` may write
into without having created it is the partial last block (slots
``[num_tokens, ...)``); it is copied first when another table or a prefix cache
also refers to it::

    parent  [7][3][5..]          fork          parent [7][3][5..]   child [7][3][5..]
    child allocate(+1) -> copies ((5, 9),)      parent [7][3][5..]   child [7][3][9..]
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from allocators.base import NO_COPIES, Allocation, BlockAllocator, SeqState, blocks_for


class FreeListAllocator(BlockAllocator):
    """Paged allocator: O(1) allocate and free per block, LRU reuse, copy-on-write forks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._ref: list[int] = []  # holders of blocks 0..high-water-1; past it, fresh (0)
        self._free: deque[int] = deque()  # recycled blocks, freed longest ago first

    def allocate_many(self, requests: Sequence[tuple[str, int]]) -> list[Allocation | None]:
        """``BlockAllocator.allocate_many``. A request that grows a known sequence with no
        copy takes its blocks here: never-used ones as the next ids of a run the whole call
        shares, whose reference counts are set in one go, then recycled ones (a cache first
        evicting into the free list what they lack, ``_evict_for``); any other request goes
        through ``allocate`` in its turn (same blocks, same order), and the first it cannot
        meet ends the call."""
        seqs, ref, bs, free = self._seqs, self._ref, self.block_size, self._free
        needs_copy, take = self._needs_copy, self._take_into
        top = len(ref)  # fresh blocks from len(ref) up to here are in tables, not yet held
        results: list[Allocation | None] = []
        append = results.append
        grown = 0  # token slots this loop added, not yet in ``_token_slots``
        try:
            for seq_id, num_tokens in requests:
                s = seqs.get(seq_id)
                if s is not None and s.num_tokens <= num_tokens <= s.limit:  # O(1) ``allocate``
                    grown += num_tokens - s.num_tokens
                    s.num_tokens = num_tokens
                    append(NO_COPIES)
                    continue
                if s is not None and type(num_tokens) is int and num_tokens > s.num_tokens:
                    table = s.table
                    new = -(-num_tokens // bs) - len(table)
                    # Past the write limit, no copy: the last block is full, taken by this
                    # call (past ``ref``: its sequence's own) or read by nobody else.
                    no_copy = (
                        not s.num_tokens % bs or table[-1] >= len(ref) or not needs_copy(table[-1])
                    )
                    if no_copy and new > self.num_blocks - top + len(free):
                        top = self._evict_for(new, top)  # a full arena with a cache (radix)
                    if no_copy and new <= self.num_blocks - top + len(free):
                        if new:
                            top = take(table, new, top)
                            self._changed(s)
                        grown += num_tokens - s.num_tokens
                        s.num_tokens = num_tokens
                        s.limit = len(table) * bs
                        append(NO_COPIES)
                        continue
                if top != len(ref):
                    self._hold_fresh(top)
                self._token_slots += grown
                grown = 0
                append(got := self.allocate(seq_id, num_tokens))
                top = len(ref)
                if got is None:
                    break
        finally:  # a wrong request raises after the ones before it took effect
            self._token_slots += grown
            self._hold_fresh(top)
        return results

    def _evict_for(self, count: int, top: int) -> int:
        """``allocate_many``, short of free blocks for a request of ``count``: the fresh
        blocks its loop took are held, then a cache evicts until the free list holds
        ``count``, as ``allocate`` would when they can all be found (a full arena's growth,
        one eviction a block boundary, without ``allocate``'s general path). Returns the
        loop's new ``top``."""
        self._hold_fresh(top)
        if count <= self.num_free_blocks():
            self._refill(count)
        return len(self._ref)

    def _take_into(self, table: list[int], count: int, top: int) -> int:
        """Append ``count`` free blocks to ``table`` (there are as many without evicting):
        never-used ones from ``top`` on, left for ``_hold_fresh`` to hold, then recycled
        ones, held now. Returns the new ``top``."""
        run = min(count, self.num_blocks - top)
        table.extend(range(top, top + run))
        if run < count:
            free, ref = self._free, self._ref
            for _ in range(count - run):
                block = free.popleft()
                ref[block] = 1
                table.append(block)
            self._used += count - run
        return top + run

    def _hold_fresh(self, top: int) -> None:
        """Hold every fresh block below ``top`` once (they were just put in tables)."""
        count = top - len(self._ref)
        self._ref.extend([1] * count)
        self._used += count

    def _take(self) -> int:
        """A free block, now held once by the caller (``_refill`` made sure there is one)."""
        ref = self._ref
        if len(ref) < self.num_blocks:
            block = len(ref)
            ref.append(1)
        else:
            block = self._free.popleft()
            ref[block] = 1
        self._used += 1
        return block

    def _on_free_list(self) -> int:
        """Blocks free to take without evicting: fresh and recycled."""
        return self.num_blocks - len(self._ref) + len(self._free)

    def _refill(self, count: int) -> None:
        """Make the free list hold ``count`` blocks (``_on_free_list``); a cache evicts to do
        so. The caller has checked ``count <= num_free_blocks()``."""

    def _drop(self, block: int, fill: int) -> None:
        """Release one reference to ``block``, whose holder filled ``fill`` slots of it."""
        ref = self._ref[block] - 1
        self._ref[block] = ref
        if ref:
            self._shared_slots -= fill
        else:
            self._used -= 1
            self._on_unreferenced([block])

    def _cow(self, s: SeqState) -> bool:
        """Whether growing ``s`` must first copy its partly written last block."""
        return s.num_tokens % self.block_size != 0 and self._needs_copy(s.table[-1])

    def _need(self, s: SeqState, new: int) -> int:
        return blocks_for(new, self.block_size) - len(s.table) + self._cow(s)

    def _fits(self, s: SeqState, new: int) -> bool:
        fresh = blocks_for(new, self.block_size) - len(s.table)
        return fresh + self._cow(s) <= self.num_blocks - self._used

    def _grow(self, s: SeqState, new: int) -> list | None:
        table, bs = s.table, self.block_size
        cow = s.num_tokens % bs != 0 and self._needs_copy(table[-1])  # ``_cow``, inlined
        fresh = -(-new // bs) - len(table)
        # Count everything first: a failed allocate must change nothing.
        if fresh + cow > self.num_blocks - self._used:
            return None
        if fresh + cow > self._on_free_list():
            self._refill(fresh + cow)
        copies = []
        if cow:
            src, dst = table[-1], self._take()
            table[-1] = dst
            # Drop only after taking: a cached source must not be evicted into its own copy.
            self._drop(src, s.num_tokens % bs)
            self._cow_copies += 1
            copies.append((src, dst))
        if fresh:
            self._hold_fresh(self._take_into(table, fresh, len(self._ref)))
        return copies

    def _after_trim(self, s: SeqState, dropped: list[int], old: int) -> None:
        bs = self.block_size
        first = len(s.table)
        for i in reversed(range(len(dropped))):
            self._drop(dropped[i], min(bs, old - (first + i) * bs))

    def _fork(self, parent: SeqState, child: SeqState) -> list | None:
        ref = self._ref
        for block in parent.table:
            ref[block] += 1
        child.table = list(parent.table)
        self._shared_slots += parent.num_tokens  # every slot of the parent is now held twice
        return []

    def _free_seq(self, s: SeqState) -> None:
        # Tail first, so the prefix (the part most likely to be shared again) is freed last
        # and stays in the cache longest where a subclass caches.
        table, ref, bs = s.table, self._ref, self.block_size
        fill = s.num_tokens - (len(table) - 1) * bs  # the last block's; full ones before it
        released = []
        for block in reversed(table):
            r = ref[block] - 1
            ref[block] = r
            if r:
                self._shared_slots -= fill
            else:
                released.append(block)
            fill = bs
        self._used -= len(released)
        self._on_unreferenced(released)

    def _reclaimable(self, s: SeqState) -> int:
        ref = self._ref
        return sum(ref[block] == 1 for block in s.table)

    def _on_unreferenced(self, blocks: list[int]) -> None:
        """These blocks lost their last reference (in this order): free them."""
        self._free.extend(blocks)

    def _needs_copy(self, block: int) -> bool:
        return self._ref[block] > 1

    def _ref_counts(self) -> Counter[int]:
        return Counter({block: ref for block, ref in enumerate(self._ref) if ref})

    def _free_blocks(self) -> set[int]:
        return set(self._free).union(range(len(self._ref), self.num_blocks))

    def _check_placement(self) -> None:
        assert len(self._free) == len(set(self._free)), "a block is twice in the free list"
        assert all(block < len(self._ref) for block in self._free), "a fresh block recycled"
