"""Paged allocation plus a radix-tree prefix cache over full blocks (RadixAttention).

Each tree node is one full block, keyed by its ``block_size`` token ids; a path from
the root spells a token prefix whose KV is stored in the nodes' blocks::

    root ─ (1,2,3,4)#7 ─ (5,6,7,8)#3 ─ (9,9,9,9)#5        block_size = 4
                       └ (5,6,0,0)#12

``match_prefix`` walks the tree and shares the matched blocks; ``commit`` indexes a
sequence's newly full blocks. The tree holds no reference: a node whose block
nobody holds is *cached* (counted as free by ``num_free_blocks``) and is evicted,
least recently used leaf first, only when the free list is empty.

Invariant that makes every cached block evictable: the indexed blocks of a table
are a prefix of it and a path from the root, so a held node's ancestors are held
too, and an unheld node has no held descendant.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from allocators.free_list import FreeListAllocator


class _Node:
    __slots__ = ("key", "block", "parent", "children", "last_access")

    def __init__(self, key: tuple[int, ...], block: int, parent: _Node | None) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0


class RadixAllocator(FreeListAllocator):
    """Paged allocator sharing full-block prefixes through a radix tree, with LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._root = _Node((), -1, None)
        self._node_of: dict[int, _Node] = {}
        self._cached: set[int] = set()
        # Candidate leaves as (last_access, tie, node); entries go stale instead of being
        # removed, and are re-validated when popped.
        self._evictable: list[tuple[int, int, _Node]] = []
        self._tie = itertools.count()
        self._clock = 0
        # Per sequence: how many leading table blocks are known to be tree nodes.
        self._cursor: dict[str, int] = {}

    def _key(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(token_ids[i * bs : (i + 1) * bs])

    def _match(self, seq_id: str, token_ids: Sequence[int]) -> int:
        # The last token is always recomputed, so the engine gets its logits.
        limit = max(len(token_ids) - 1, 0) // self.block_size
        node, path = self._root, []
        for i in range(limit):
            child = node.children.get(self._key(token_ids, i))
            if child is None:
                break
            node = child
            path.append(child)
        self._clock += 1
        for node in path:
            node.last_access = self._clock
            self._cached.discard(node.block)
            self._hold(node.block)
        self._tables[seq_id].extend(node.block for node in path)
        self._num_tokens[seq_id] = len(path) * self.block_size
        self._cursor[seq_id] = len(path)
        return len(path) * self.block_size

    def _commit(self, seq_id: str, token_ids: Sequence[int]) -> None:
        table = self._tables[seq_id]
        i = self._cursor.get(seq_id, 0)
        node = self._node_of[table[i - 1]] if i else self._root
        self._clock += 1
        while i < len(token_ids) // self.block_size:
            block, key = table[i], self._key(token_ids, i)
            child = node.children.get(key)
            if (child is None or child.block != block) and block in self._node_of:
                raise ValueError(
                    f"commit: token_ids of {seq_id!r} disagree with the tokens cached in "
                    f"block {block}; commit the tokens that were written"
                )
            if child is None:
                child = node.children[key] = _Node(key, block, node)
                self._node_of[block] = child
            elif child.block != block:
                # The same tokens are cached in another block (computed concurrently): this
                # sequence keeps its own copy unindexed, which keeps the invariant above.
                break
            child.last_access = self._clock
            node = child
            i += 1
        self._cursor[seq_id] = i

    def _after_trim(self, seq_id: str, dropped: list[int]) -> None:
        # A partially kept indexed block stays in the table; the next allocate copies it.
        self._cursor[seq_id] = min(
            self._cursor.get(seq_id, 0), self._num_tokens[seq_id] // self.block_size
        )
        super()._after_trim(seq_id, dropped)

    def _fork(self, parent_id: str, child_id: str) -> list | None:
        self._cursor[child_id] = self._cursor.get(parent_id, 0)
        return super()._fork(parent_id, child_id)

    def _free_seq(self, seq_id: str) -> None:
        self._cursor.pop(seq_id, None)
        super()._free_seq(seq_id)

    def _needs_copy(self, block: int) -> bool:
        # Indexed KV must stay immutable: later matches read it.
        return self._ref[block] > 1 or block in self._node_of

    def _take(self) -> int:
        if self._free:
            return super()._take()
        block = self._evict()
        self._hold(block)
        return block

    def _evict(self) -> int:
        """Unindex the least recently used unreferenced leaf and return its block."""
        while True:
            stamp, _, node = heapq.heappop(self._evictable)
            if self._is_evictable(node) and node.last_access == stamp:
                break
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        del self._node_of[node.block]
        self._cached.discard(node.block)
        self._evictions += 1
        if parent is not self._root and self._is_evictable(parent):
            self._push(parent)
        return node.block

    def _is_evictable(self, node: _Node) -> bool:
        return (
            self._node_of.get(node.block) is node
            and self._ref[node.block] == 0
            and not node.children
        )

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._evictable, (node.last_access, next(self._tie), node))

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
        for block, node in self._node_of.items():
            assert node.block == block and len(node.key) == self.block_size, f"bad node {block}"
            assert node.parent is not None and node.parent.children.get(node.key) is node
            assert (self._ref[block] == 0) == (block in self._cached), f"block {block} cache flag"
            parent_held = node.parent is self._root or self._ref[node.parent.block] > 0
            assert parent_held or self._ref[block] == 0, f"held block {block} under a cached one"
        assert self._cached <= self._node_of.keys(), "a cached block is not in the tree"
        for seq_id, table in self._tables.items():
            parent = self._root
            for block in table[: self._cursor.get(seq_id, 0)]:
                node = self._node_of.get(block)
                assert node is not None and node.parent is parent, f"{seq_id}: not a tree path"
                parent = node
