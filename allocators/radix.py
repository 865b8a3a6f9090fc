"""Paged allocation plus a radix-tree prefix cache over full blocks (RadixAttention).

Each tree node is one full block, keyed by its ``block_size`` token ids; a path from
the root spells a token prefix whose KV is stored in the nodes' blocks::

    root ─ (1,2,3,4)#7 ─ (5,6,7,8)#3 ─ (9,9,9,9)#5        block_size = 4
                       └ (5,6,0,0)#12

``match_prefix`` walks the tree and shares the matched blocks; ``commit`` indexes a
sequence's newly full blocks. The tree holds no reference: a node whose block
nobody holds is *cached* (counted as free by ``num_free_blocks``) and is evicted,
an unreferenced leaf at a time, only when the free list is empty.

Which leaf goes first is the ``eviction`` policy, SGLang's set and keys (smallest
evicted first; a node's clock ticks on every match and commit that touches it)::

    lru   last access              mru   -last access
    lfu   (hits, last access)      filo  -creation
    fifo  creation                 slru  (hits >= 2, last access): probationary first

Candidates sit in a heap whose entries go stale instead of being removed: an entry
counts only while its node still carries the entry's tie (a match that holds the
node again, or its eviction, clears it). A touch is O(1), an eviction O(log n)
amortised (vLLM v1 reaches O(1) for LRU alone with a linked free queue; a heap
serves every policy).

Invariant that makes every cached block evictable: the indexed blocks of a table
are a prefix of it and a path from the root, so a held node's ancestors are held
too, and an unheld node has no held descendant.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from allocators.base import SeqState
from allocators.free_list import FreeListAllocator


class _Node:
    __slots__ = ("key", "block", "parent", "children", "last_access", "hits", "created", "tie")

    def __init__(self, key: tuple[int, ...], block: int, parent: _Node | None, now: int) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = self.created = now
        self.hits = 0
        self.tie = -1  # the tie of its live heap entry; -1 while it is no eviction candidate


class RadixState(SeqState):
    """``cursor``: how many leading table blocks are known to be tree nodes."""

    __slots__ = ("cursor",)

    def __init__(self) -> None:
        super().__init__()
        self.cursor = 0


EVICTION: dict[str, Callable[[_Node], object]] = {
    "lru": lambda n: n.last_access,
    "lfu": lambda n: (n.hits, n.last_access),
    "fifo": lambda n: n.created,
    "mru": lambda n: -n.last_access,
    "filo": lambda n: -n.created,
    "slru": lambda n: (n.hits >= 2, n.last_access),
}


class RadixAllocator(FreeListAllocator):
    """Paged allocator sharing full-block prefixes through a radix tree; ``eviction`` picks
    which unreferenced leaf to drop when the free list is empty (see the module docstring)."""

    _State = RadixState

    def __init__(self, num_blocks: int, block_size: int, eviction: str = "lru") -> None:
        super().__init__(num_blocks, block_size)
        if eviction not in EVICTION:
            raise ValueError(f"eviction={eviction!r}: use one of {sorted(EVICTION)}")
        self.eviction = eviction
        self._priority = EVICTION[eviction]
        self._root = _Node((), -1, None, 0)
        self._node_of: dict[int, _Node] = {}
        self._cached: set[int] = set()
        self._evictable: list[tuple[object, int, _Node]] = []  # (priority, tie, node)
        self._tie = itertools.count()
        self._clock = 0

    def _key(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(token_ids[i * bs : (i + 1) * bs])

    def _path(self, token_ids: Sequence[int]) -> list[_Node]:
        """The cached nodes spelling the longest prefix of ``token_ids`` that leaves at
        least the last token to compute (so the engine gets its logits)."""
        limit = max(len(token_ids) - 1, 0) // self.block_size
        node, path = self._root, []
        for i in range(limit):
            node = node.children.get(self._key(token_ids, i))
            if node is None:
                break
            path.append(node)
        return path

    def _match(self, s: RadixState, token_ids: Sequence[int]) -> int:
        path = self._path(token_ids)
        self._clock += 1
        ref, bs = self._ref, self.block_size
        for node in path:
            node.last_access = self._clock
            node.hits += 1
            block = node.block
            if ref[block]:
                self._shared_slots += bs
            else:
                self._cached.discard(block)
                self._used += 1
                node.tie = -1  # held again: its heap entry goes stale
            ref[block] += 1
        s.table = [node.block for node in path]
        s.cursor = len(path)
        s.num_tokens = s.limit = len(path) * bs
        return s.num_tokens

    def _shared_by_others(self, token_ids: Sequence[int]) -> int:
        """Blocks ``match_prefix(token_ids)`` would share with sequences holding them."""
        return sum(self._ref[node.block] > 0 for node in self._path(token_ids))

    def _need_new(self, num_tokens: int, token_ids: Sequence[int]) -> int:
        return super()._need_new(num_tokens, token_ids) - self._shared_by_others(token_ids)

    def _fits_new(self, num_tokens: int, token_ids: Sequence[int]) -> bool:
        return self._need_new(num_tokens, token_ids) <= self.num_free_blocks()

    def commit(self, seq_id: str, token_ids: Sequence[int]) -> None:
        s = self._seqs.get(seq_id)
        # The common call (no block became full since the last commit) returns at once.
        n = len(token_ids)
        if s is None or n // self.block_size > s.cursor or n > s.num_tokens:
            super().commit(seq_id, token_ids)

    def _commit(self, s: RadixState, token_ids: Sequence[int]) -> None:
        full = len(token_ids) // self.block_size
        i = s.cursor
        if full <= i:
            return
        table = s.table
        node = self._node_of[table[i - 1]] if i else self._root
        self._clock += 1
        while i < full:
            block, key = table[i], self._key(token_ids, i)
            child = node.children.get(key)
            if (child is None or child.block != block) and block in self._node_of:
                raise ValueError(
                    f"commit: token_ids disagree with the tokens cached in block {block}; "
                    "commit the tokens that were written"
                )
            if child is None:
                child = node.children[key] = _Node(key, block, node, self._clock)
                self._node_of[block] = child
            elif child.block != block:
                # The same tokens are cached in another block (computed concurrently): this
                # sequence keeps its own copy unindexed, which keeps the invariant above.
                break
            child.last_access = self._clock
            node = child
            i += 1
        s.cursor = i

    def _after_trim(self, s: RadixState, dropped: list[int], old: int) -> None:
        # A partially kept indexed block stays in the table; the next allocate copies it.
        s.cursor = min(s.cursor, s.num_tokens // self.block_size)
        super()._after_trim(s, dropped, old)

    def _fork(self, parent: RadixState, child: RadixState) -> list | None:
        child.cursor = parent.cursor
        return super()._fork(parent, child)

    def _needs_copy(self, block: int) -> bool:
        # Indexed KV must stay immutable: later matches read it.
        return self._ref[block] > 1 or block in self._node_of

    def _take(self) -> int:
        if not self._free:
            self._free.append(self._evict())
        block = self._free.popleft()
        self._ref[block] = 1
        self._used += 1
        return block

    def _evict(self) -> int:
        """Unindex the unreferenced leaf the policy ranks first and return its block."""
        heap = self._evictable
        while True:
            _, tie, node = heapq.heappop(heap)
            if node.tie == tie:
                break
        node.tie = -1
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        block = node.block
        del self._node_of[block]
        self._cached.discard(block)
        self._evictions += 1
        if parent is not self._root and not parent.children and self._ref[parent.block] == 0:
            self._push(parent)
        return block

    def _push(self, node: _Node) -> None:
        """Make an unreferenced leaf an eviction candidate."""
        heap = self._evictable
        if len(heap) > 2 * len(self._cached) + 64:
            # Mostly stale entries: keep the live ones, O(n) now and then.
            heap[:] = [entry for entry in heap if entry[2].tie == entry[1]]
            heapq.heapify(heap)
        node.tie = tie = next(self._tie)
        heapq.heappush(heap, (self._priority(node), tie, node))

    def _on_unreferenced(self, block: int) -> None:
        node = self._node_of.get(block)
        if node is None:
            super()._on_unreferenced(block)
            return
        self._cached.add(block)
        if not node.children:
            self._push(node)

    def _cached_blocks(self) -> set[int]:
        return set(self._cached)

    def _num_cached(self) -> int:
        return len(self._cached)

    def _check_placement(self) -> None:
        super()._check_placement()
        live = {entry[2].block for entry in self._evictable if entry[2].tie == entry[1]}
        leaves = {b for b in self._cached if not self._node_of[b].children}
        assert live == leaves, f"eviction candidates {sorted(live)} != cached leaves"
        for block, node in self._node_of.items():
            assert node.block == block and len(node.key) == self.block_size, f"bad node {block}"
            assert node.parent is not None and node.parent.children.get(node.key) is node
            assert (self._ref[block] == 0) == (block in self._cached), f"block {block} cache flag"
            parent_held = node.parent is self._root or self._ref[node.parent.block] > 0
            assert parent_held or self._ref[block] == 0, f"held block {block} under a cached one"
        assert self._cached <= self._node_of.keys(), "a cached block is not in the tree"
        for seq_id, s in self._seqs.items():
            parent = self._root
            for block in s.table[: s.cursor]:
                node = self._node_of.get(block)
                assert node is not None and node.parent is parent, f"{seq_id}: not a tree path"
                parent = node
