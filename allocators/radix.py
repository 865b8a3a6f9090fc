"""Paged allocation plus a radix-tree prefix cache over full blocks (RadixAttention).

Each tree node is one full block, keyed by its parent's block and its ``block_size``
token ids (packed as int32s, as vocabulary ids fit) in one child map for the whole
tree; a path from the root spells a token prefix whose KV is stored in the nodes'
blocks. A node exists while its block is indexed: made by the commit that indexes it,
dropped when it is evicted, so the tree costs memory with what is cached, not with the
arena, and no node carries a dict of its own::

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
counts only while its node still carries the entry's key (a match that holds the
node again, or its eviction, clears it). A touch is O(1), an eviction O(log n)
amortised (vLLM v1 reaches O(1) for LRU alone with a linked free queue; a heap
serves every policy). A key is one int, the policy's value then the block id in as many
low bits as the arena's ids need (ties go to the lower block): the heap holds no Python
container the garbage collector would have to walk, and its keys stay small ints, cheap
to compare, while the clock is young.

Invariant that makes every cached block evictable: the indexed blocks of a table
are a prefix of it and a path from the root, so a held node's ancestors are held
too, and an unheld node has no held descendant.
"""

from __future__ import annotations

import copy
import heapq
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal, get_args

from allocators.base import SeqState, blocks_for
from allocators.free_list import FreeListAllocator


class _Node:
    """An indexed block's place in the tree (the root has no block, ``-1``, nor parent).
    ``key``: its parent's block and its tokens, packed, its key in the tree's child map;
    ``fanout``: how many children it has."""

    __slots__ = ("key", "block", "parent", "fanout", "last_access", "hits", "created", "entry")

    def __init__(self, key: bytes, block: int, parent: _Node | None, now: int) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.fanout = 0
        self.last_access = self.created = now
        self.hits = 0
        self.entry: int | None = None  # the key of its live heap entry, if a candidate


class RadixState(SeqState):
    """``cursor``: how many leading table blocks are known to be tree nodes; ``commit_at``:
    the token count that fills the next block, ``(cursor + 1) * block_size`` (so the common
    commit, which fills no block, is one comparison)."""

    __slots__ = ("cursor", "commit_at")

    def __init__(self) -> None:
        super().__init__()
        self.cursor = self.commit_at = 0


Eviction = Literal["lru", "lfu", "fifo", "mru", "filo", "slru"]
_CLOCK = 40  # bits for a clock value inside a policy's value
EVICTION: dict[str, Callable[[_Node], int]] = {
    "lru": lambda n: n.last_access,
    "lfu": lambda n: n.hits << _CLOCK | n.last_access,
    "fifo": lambda n: n.created,
    "mru": lambda n: -n.last_access,
    "filo": lambda n: -n.created,
    "slru": lambda n: (n.hits >= 2) << _CLOCK | n.last_access,
}
assert tuple(EVICTION) == get_args(Eviction)


class RadixAllocator(FreeListAllocator):
    """Paged allocator sharing full-block prefixes through a radix tree; ``eviction`` picks
    which unreferenced leaf to drop when the free list is empty (see the module docstring)."""

    _State = RadixState
    caches_prefixes = True

    def __init__(self, num_blocks: int, block_size: int, eviction: Eviction = "lru") -> None:
        super().__init__(num_blocks, block_size)
        if eviction not in EVICTION:
            raise ValueError(f"eviction={eviction!r}: use one of {sorted(EVICTION)}")
        self.eviction = eviction
        self._priority = EVICTION[eviction]
        self._root = _Node(b"", -1, None, 0)
        self._nodes: dict[int, _Node] = {}  # indexed block -> its node
        self._children: dict[bytes, _Node] = {}  # node.key -> node, for every node
        key = struct.Struct(f"={block_size + 1}i")  # (parent block, *tokens) -> key, and back
        self._pack, self._unpack = key.pack, key.unpack
        self._num_cached = 0  # indexed blocks nobody holds
        self._candidates: list[int] = []  # heap of keys of unreferenced leaves
        self._block_bits = (num_blocks - 1).bit_length()  # a heap key's low bits: the block
        self._block_mask = (1 << self._block_bits) - 1
        self._clock = 0

    def __deepcopy__(self, memo: dict) -> RadixAllocator:
        """A copy for what-if questions (priority's make-room). The tree is rebuilt from the
        node map, not walked recursively: deep trees would exhaust the stack."""
        olds = [self._root, *self._nodes.values()]
        news = [copy.copy(node) for node in olds]
        memo.update((id(old), new) for old, new in zip(olds, news, strict=True))
        for old, new in zip(olds, news, strict=True):
            new.parent = None if old.parent is None else memo[id(old.parent)]
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for name, value in vars(self).items():
            setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    def cached_paths(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """Every root-to-leaf path of the tree (held or not): the tokens it spells and its
        blocks, in token order. A snapshot of the whole prefix cache."""
        below: dict[int, list[_Node]] = {}  # parent block -> its children
        for node in self._nodes.values():
            below.setdefault(node.parent.block, []).append(node)
        paths, stack = [], [(self._root, (), [])]
        while stack:
            node, tokens, blocks = stack.pop()
            if not node.fanout and node is not self._root:
                paths.append((tokens, blocks))
            for child in below.get(node.block, ()):
                tokens_below = tokens + self._unpack(child.key)[1:]
                stack.append((child, tokens_below, [*blocks, child.block]))
        return sorted(paths)

    # -- lookups and indexing ----------------------------------------------------------

    def _path(self, token_ids: Sequence[int]) -> list[_Node]:
        """The cached nodes spelling the longest prefix of ``token_ids`` that leaves at
        least the last token to compute (so the engine gets its logits)."""
        bs, pack, children = self.block_size, self._pack, self._children
        end = max(len(token_ids) - 1, 0) // bs * bs
        parent, path = self._root.block, []
        for start in range(0, end, bs):
            node = children.get(pack(parent, *token_ids[start : start + bs]))
            if node is None:
                break
            path.append(node)
            parent = node.block
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
                self._num_cached -= 1
                self._used += 1
                node.entry = None  # held again: its heap entry goes stale
            ref[block] += 1
        s.table = [node.block for node in path]
        self._set_cursor(s, len(path))
        s.num_tokens = s.limit = len(path) * bs
        return s.num_tokens

    def _need_new(self, seq_id: str, num_tokens: int, token_ids: Sequence[int]) -> int:
        # match_prefix takes the matched blocks nobody holds out of the free count (cached
        # ones), shares the held ones for free; allocate then adds the blocks past the match.
        path = self._path(token_ids)
        cached = sum(self._ref[node.block] == 0 for node in path)
        return cached + max(0, blocks_for(num_tokens, self.block_size) - len(path))

    def _fits_new(self, seq_id: str, num_tokens: int, token_ids: Sequence[int]) -> bool:
        return self._need_new(seq_id, num_tokens, token_ids) <= self.num_free_blocks()

    def commit(self, seq_id: str, token_ids: Sequence[int]) -> None:
        s = self._seqs.get(seq_id)
        n = len(token_ids)
        if s is None or n > s.num_tokens:
            super().commit(seq_id, token_ids)  # raises, naming the fix
        elif n >= s.commit_at:  # most calls fill no block and stop here
            self._commit(s, token_ids)

    def _set_cursor(self, s: RadixState, cursor: int) -> None:
        s.cursor = cursor
        s.commit_at = (cursor + 1) * self.block_size

    def _commit(self, s: RadixState, token_ids: Sequence[int]) -> None:
        full = len(token_ids) // self.block_size
        i, table, nodes = s.cursor, s.table, self._nodes
        if full <= i:  # a fresh state's commit_at is 0: set it without ticking the clock
            self._set_cursor(s, i)
            return
        node = nodes[table[i - 1]] if i else self._root
        self._clock = now = self._clock + 1
        bs, pack, children = self.block_size, self._pack, self._children
        start = i * bs
        while i < full:
            block, key = table[i], pack(node.block, *token_ids[start : start + bs])
            child, mine = children.get(key), nodes.get(block)
            if child is None and mine is None:  # the common case: index the block
                child = nodes[block] = children[key] = _Node(key, block, node, now)
                node.fanout += 1
            elif child is not mine:
                if mine is not None:
                    raise ValueError(
                        f"commit: token_ids disagree with the tokens cached in block "
                        f"{block}; commit the tokens that were written"
                    )
                # The same tokens are cached in another block: this sequence keeps its own
                # copy unindexed, which keeps the invariant above.
                break
            child.last_access = now
            node = child
            i += 1
            start += bs
        s.cursor, s.commit_at = i, start + bs  # ``_set_cursor``, inlined

    def _after_trim(self, s: RadixState, dropped: list[int], old: int) -> None:
        # Dropped indexed blocks stay cached; the kept ones stay a tree path.
        self._set_cursor(s, min(s.cursor, s.num_tokens // self.block_size))
        super()._after_trim(s, dropped, old)

    def _fork(self, parent: RadixState, child: RadixState) -> list | None:
        self._set_cursor(child, parent.cursor)
        return super()._fork(parent, child)

    def _needs_copy(self, block: int) -> bool:
        # Indexed KV must stay immutable: later matches read it.
        return self._ref[block] > 1 or block in self._nodes

    # -- caching and eviction ----------------------------------------------------------

    def _on_unreferenced(self, blocks: list[int]) -> None:
        nodes, free, cached = self._nodes, self._free, 0
        for block in blocks:
            node = nodes.get(block)
            if node is None:
                free.append(block)
                continue
            cached += 1
            if not node.fanout:
                self._push(node)
        self._num_cached += cached
        heap = self._candidates
        if len(heap) > 2 * self._num_cached + 64:
            # Mostly stale entries: keep the live ones, O(n) now and then.
            heap[:] = [key for key in heap if self._live(key)]
            heapq.heapify(heap)

    def _live(self, key: int) -> bool:
        """Whether a heap key is its node's live entry (not stale)."""
        node = self._nodes.get(key & self._block_mask)
        return node is not None and node.entry == key

    def _push(self, node: _Node) -> None:
        """Make an unreferenced leaf an eviction candidate."""
        node.entry = key = self._priority(node) << self._block_bits | node.block
        heapq.heappush(self._candidates, key)

    def _refill(self, count: int) -> None:
        """Evict the leaves the policy ranks first until the free list holds ``count``."""
        heap, free, nodes, evicted = self._candidates, self._free, self._nodes, 0
        need = count - self._on_free_list()
        while evicted < need:
            key = heap[0]
            node = nodes.get(key & self._block_mask)
            if node is None or node.entry != key:
                heapq.heappop(heap)  # stale
                continue
            del nodes[node.block], self._children[node.key]
            parent = node.parent
            parent.fanout -= 1
            free.append(node.block)
            evicted += 1
            if parent is not self._root and not parent.fanout and not self._ref[parent.block]:
                # A cached parent is now a leaf: a candidate in the evicted leaf's place
                # (``_push``, inlined; one sift instead of a pop and a push).
                parent.entry = key = self._priority(parent) << self._block_bits | parent.block
                heapq.heapreplace(heap, key)
            else:
                heapq.heappop(heap)
        self._num_cached -= evicted
        self._evictions += evicted

    def _cached_blocks(self) -> set[int]:
        return {block for block in self._nodes if self._ref[block] == 0}

    def _num_cached_blocks(self) -> int:
        return self._num_cached

    def _check_placement(self) -> None:
        super()._check_placement()
        mask = self._block_mask
        live = {key & mask for key in self._candidates if self._live(key)}
        leaves = {b for b in self._cached_blocks() if not self._nodes[b].fanout}
        assert live == leaves, f"eviction candidates {sorted(live)} != cached leaves"
        fanout = Counter(node.parent.block for node in self._nodes.values())
        assert self._root.fanout == fanout[self._root.block], "children of the root"
        assert len(self._children) == len(self._nodes), "child map and node map disagree"
        for block, node in self._nodes.items():
            assert node.block == block and len(node.key) == 4 * (self.block_size + 1), block
            assert self._children.get(node.key) is node, f"block {block} not a child"
            parent = node.parent
            assert self._unpack(node.key)[0] == parent.block, f"block {block}: parent in key"
            assert parent is self._root or self._nodes.get(parent.block) is parent, block
            assert node.fanout == fanout[block], f"children of {block}"
            parent_held = parent is self._root or self._ref[parent.block] > 0
            assert parent_held or self._ref[block] == 0, f"held block {block} under a cached one"
        for seq_id, s in self._seqs.items():
            parent = self._root
            for block in s.table[: s.cursor]:
                node = self._nodes.get(block)
                assert node is not None and node.parent is parent, f"{seq_id}: not a tree path"
                parent = node
