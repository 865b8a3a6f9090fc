"""Paged allocation plus a radix-tree prefix cache over full blocks (RadixAttention).

Each tree node is one full block, keyed by its parent's id (its block, which a node keeps for
life; with lower tiers, where a parent's block can leave the arena and be reused, a number of
its own) and its ``block_size`` token ids (packed as int32s, as vocabulary ids fit) in one
child map for the whole tree; a path from the root
spells a token prefix whose KV is stored in the nodes' blocks. A node exists while its block
is indexed: made by the commit that indexes it, dropped when it is evicted (or, with lower
tiers, when they drop it), so the tree costs memory with what is cached, not with the arena,
and no node carries a dict of its own::

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

Lower tiers (``kv_tier``, ``allocators.tiers``; HiCache's hierarchical radix tree). A leaf
the arena evicts is not dropped but goes to the host tier (``write_back``: a device->host
move now; ``write_through``: its host copy was written when it was committed, so the move is
free), a full host tier hands its victim down to disk, a full disk drops it: a node whose KV
is only in a lower tier stays in the tree. Down any path the tiers only go down (device,
host, disk), so ``match_prefix`` walks device hits, then host, then disk hits, and loads the
lower ones into arena blocks (host/disk->device moves; ``worth_loading`` may decline a tier,
whose tokens are then recomputed)::

    root ─ A#7 ─ B#3 ─ C@h2 ─ D@d0        # arena block, @h host slot, @d disk slot
                     └ E@h5

A lower tier evicts its policy's first node that has no child in the same tier (a leaf of
that tier, so a node handed down keeps the order), never one a load in progress reads; a node
dropped takes its subtree (lower-tier nodes only) with it. ``drain_tier_moves`` hands the
moves to the scheduler, in the order the engine makes them.
"""

from __future__ import annotations

import copy
import heapq
import struct
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import numpy as np

from allocators.base import SeqState, blocks_for
from allocators.free_list import FreeListAllocator
from allocators.tier_store import TierStore
from allocators.tiers import TIERS, KVTier, Tier, TierMove


def _id_bytes(token_ids: Sequence[int], start: int, end: int) -> bytes:
    """Ids ``start`` to ``end`` of ``token_ids`` as int32 bytes, a block's key body every
    ``4 * block_size`` bytes (the same bytes as ``struct``'s pack of them as ints): made in
    C once for a commit's or a match's blocks, a compact prompt's by numpy (0.4 against
    18 us a 512-token block)."""
    ids = token_ids[start:end]
    if not isinstance(ids, array):
        return array("i", ids).tobytes()
    if ids.typecode == "i":
        return ids.tobytes()
    return np.frombuffer(ids, dtype=ids.typecode).astype(np.int32).tobytes()


DEVICE, HOST, DISK = range(3)  # a node's ``tier``: an index into ``TIERS``
# Whether loading ``num_blocks`` blocks (``num_tokens`` tokens, after ``start`` tokens of the
# prompt) from a tier beats recomputing them; the builder prices it from the profile
# (kv_tier.min_load_ratio).
WorthLoading = Callable[[Tier, int, int, int], bool]


class _Node:
    """An indexed block's place in the tree (the root has no block, ``-1``, nor parent).
    ``key``: its parent's ``uid`` and its tokens, packed, its key in the tree's child map
    (``uid``: its block without lower tiers, where a node keeps its block for life; a number
    of its own with them, where a parent's block can leave the arena and be reused);
    ``block``: where its KV is in its ``tier`` (an arena block, or a lower tier's slot);
    ``fanout``: how many children it has on the device."""

    __slots__ = (
        "key", "block", "parent", "fanout", "last_access", "hits", "created", "entry", "uid",
        "tier",
    )  # fmt: skip

    def __init__(self, key: bytes, block: int, parent: _Node | None, now: int, uid: int) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.fanout = 0
        self.last_access = self.created = now
        self.hits = 0
        self.entry: int | None = None  # the key of its live heap entry, if a candidate
        self.uid = uid
        self.tier = 0  # DEVICE


class RadixState(SeqState):
    """``cursor``: how many leading table blocks are known to be tree nodes; ``commit_at``:
    the token count that fills the next block, ``(cursor + 1) * block_size`` (so the common
    commit, which fills no block, is one comparison)."""

    __slots__ = ("cursor", "commit_at", "loaded")

    def __init__(self) -> None:
        super().__init__()
        self.cursor = self.commit_at = 0
        self.loaded = (0, 0)  # tokens its match loaded from the host and the disk tier


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
    which unreferenced leaf to drop when the free list is empty (see the module docstring).
    ``kv_tier``: lower tiers the evicted leaves go to (None or none enabled: dropped);
    ``worth_loading``: whether a prefix hit in a lower tier is loaded (None: always)."""

    _State = RadixState
    caches_prefixes = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eviction: Eviction = "lru",
        kv_tier: KVTier | None = None,
        worth_loading: WorthLoading | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size)
        if eviction not in EVICTION:
            raise ValueError(f"eviction={eviction!r}: use one of {sorted(EVICTION)}")
        self.eviction = eviction
        self._priority = EVICTION[eviction]
        self._root = _Node(b"", -1, None, 0, -1)
        self._uid = 0  # the next node's uid (with lower tiers)
        # Indexed block (on the device) -> its node, None for any other block: a list, 8
        # bytes a block up to the highest indexed one (a dict entry costs ~40), grown by use.
        self._nodes: list[_Node | None] = []
        self._children: dict[bytes, _Node] = {}  # node.key -> node, for every node
        # A key: its parent's uid, then its tokens as int32 (``_id_bytes``), packed from the
        # uid and a block's body in one call (a pack of the uid, then a concatenation: 118
        # against 61 ns)
        self._key = struct.Struct(f"=q{4 * block_size}s").pack
        self._unpack = struct.Struct(f"=q{block_size}i").unpack
        # A key body's blocks, cut in C (a slice a block in the loop: 0.55 against 0.42 us)
        self._bodies = struct.Struct(f"{4 * block_size}s").iter_unpack
        self._stores: list[TierStore[_Node] | None] | None = None  # per tier; None: no tiers
        if kv_tier is not None and kv_tier.enabled:
            self._init_tiers(kv_tier, worth_loading)
            self.has_lower_tiers = True
        self._num_cached = 0  # indexed blocks nobody holds
        self._candidates: list[int] = []  # heap of keys of unreferenced leaves
        self._block_bits = (num_blocks - 1).bit_length()  # a heap key's low bits: the block
        self._block_mask = (1 << self._block_bits) - 1
        self._clock = 0

    def _init_tiers(self, kv_tier: KVTier, worth_loading: WorthLoading | None) -> None:
        if kv_tier.write_policy not in ("write_back", "write_through"):
            raise ValueError(
                f"kv_tier.write_policy={kv_tier.write_policy!r}: use write_back or write_through"
            )
        if kv_tier.eviction not in EVICTION:
            raise ValueError(
                f"kv_tier.eviction={kv_tier.eviction!r}: use one of {sorted(EVICTION)}"
            )
        if kv_tier.host_blocks < 1:
            raise ValueError(
                f"kv_tier.host_blocks={kv_tier.host_blocks}: a disk tier sits under a host tier; "
                "give host_blocks >= 1"
            )
        rank = EVICTION[kv_tier.eviction]
        disk = TierStore(kv_tier.disk_blocks, rank) if kv_tier.disk_blocks > 0 else None
        self._stores = [None, TierStore(kv_tier.host_blocks, rank), disk]
        self._write_through = kv_tier.write_policy == "write_through"
        self._worth_loading = worth_loading
        self._moves: list[TierMove] = []  # emitted, not yet drained
        self._kids: dict[int, dict[int, _Node]] = {}  # uid -> its children (every tier)
        self._backup: dict[int, int] = {}  # write-through: device node uid -> its host slot
        self._pinned: set[int] = set()  # uids of lower-tier nodes a load in progress reads

    def __deepcopy__(self, memo: dict) -> RadixAllocator:
        """A copy for what-if questions (priority's make-room). The tree is rebuilt from the
        node map, not walked recursively: deep trees would exhaust the stack."""
        olds = [self._root, *self._children.values()]
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
        """Every root-to-leaf path of the tree on the device (held or not): the tokens it
        spells and its blocks, in token order. A snapshot of the arena's prefix cache."""
        below: dict[int, list[_Node]] = {}  # parent uid -> its children on the device
        for node in self._device_nodes():
            below.setdefault(node.parent.uid, []).append(node)
        paths, stack = [], [(self._root, (), [])]
        while stack:
            node, tokens, blocks = stack.pop()
            if not node.fanout and node is not self._root:
                paths.append((tokens, blocks))
            for child in below.get(node.uid, ()):
                tokens_below = tokens + self._unpack(child.key)[1:]
                stack.append((child, tokens_below, [*blocks, child.block]))
        return sorted(paths)

    def cached_nodes(self) -> list[tuple[tuple[int, ...], Tier, int]]:
        """Every node of the tree, in every tier: the tokens of the prefix it ends, its tier
        and where its KV is there (an arena block, a host or disk slot), sorted. A
        write-through host copy of a device node is not listed: the node is on the device."""
        below: dict[int, list[_Node]] = {}  # parent uid -> its children
        for node in self._children.values():
            below.setdefault(node.parent.uid, []).append(node)
        nodes, stack = [], [(self._root, ())]
        while stack:
            node, tokens = stack.pop()
            for child in below.get(node.uid, ()):
                spelled = tokens + self._unpack(child.key)[1:]
                nodes.append((spelled, TIERS[child.tier], child.block))
                stack.append((child, spelled))
        return sorted(nodes)

    # -- lookups and indexing ----------------------------------------------------------

    def _path(self, token_ids: Sequence[int]) -> list[_Node]:
        """The cached nodes spelling the longest prefix of ``token_ids`` that leaves at
        least the last token to compute (so the engine gets its logits)."""
        bs, children, key = self.block_size, self._children, self._key
        end = max(len(token_ids) - 1, 0) // bs * bs
        parent, path = self._root.uid, []
        for (body,) in self._bodies(_id_bytes(token_ids, 0, end)):
            node = children.get(key(parent, body))  # the block's key
            if node is None:
                break
            path.append(node)
            parent = node.uid
        return path

    @staticmethod
    def _on_device(path: list[_Node]) -> list[_Node]:
        """The leading nodes of ``path`` whose KV is in the arena."""
        for i, node in enumerate(path):
            if node.tier:
                return path[:i]
        return path

    def _match(self, s: RadixState, token_ids: Sequence[int]) -> int:
        path = self._path(token_ids)
        lower = None
        if self._stores is not None:
            device = self._on_device(path)
            path, lower = device, path[len(device) :]
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
        if lower:
            s.loaded = self._load(lower, len(path) * self.block_size)
            s.table += [node.block for node in lower[: sum(s.loaded) // bs]]
        elif lower is not None:
            s.loaded = (0, 0)
        self._set_cursor(s, len(s.table))
        s.num_tokens = s.limit = len(s.table) * bs
        return s.num_tokens

    def _need_new(self, seq_id: str, num_tokens: int, token_ids: Sequence[int]) -> int:
        # match_prefix takes the matched blocks nobody holds out of the free count (cached
        # ones), shares the held ones for free; allocate then adds the blocks past the match.
        path = self._path(token_ids)
        if self._stores is not None:  # a lower-tier hit takes an arena block, as a new one
            path = self._on_device(path)
        cached = sum(self._ref[node.block] == 0 for node in path)
        return cached + max(0, blocks_for(num_tokens, self.block_size) - len(path))

    def _fits_new(self, seq_id: str, num_tokens: int, token_ids: Sequence[int]) -> bool:
        return self._need_new(seq_id, num_tokens, token_ids) <= self.num_free_blocks()

    def commit(self, seq_id: str, token_ids: Sequence[int]) -> None:
        s = self._seqs.get(seq_id)
        n = len(token_ids)
        if s is None or n > s.num_tokens:
            super().commit(seq_id, token_ids)  # reports the growth, or raises naming the fix
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
        bs, children, pack = self.block_size, self._children, self._key
        start, uid, tiered = i * bs, self._uid, self._stores is not None
        known = len(nodes)  # blocks the block map covers
        for (body,) in self._bodies(_id_bytes(token_ids, start, full * bs)):  # blocks i..full-1
            block, key = table[i], pack(node.uid, body)
            child, mine = children.get(key), nodes[block] if block < known else None
            if child is None and mine is None:  # the common case: index the block
                child = children[key] = _Node(key, block, node, now, uid if tiered else block)
                if block >= known:
                    known = self._cover(block)
                nodes[block] = child  # ``_index``, inlined
                node.fanout += 1
                if tiered:
                    uid += 1
                    self._indexed(child)
            elif child is not mine:
                if mine is not None:
                    self._uid = uid  # the nodes made before stay, with their uids
                    raise ValueError(
                        f"commit: token_ids disagree with the tokens cached in block "
                        f"{block}; commit the tokens that were written"
                    )
                if child.tier:  # recomputed, not loaded: its block is now the device copy
                    self._lift(child, block)
                    known = len(nodes)  # the lift may have grown the block map
                else:
                    # The same tokens are cached in another block: this sequence keeps its
                    # own copy unindexed, which keeps the invariant above.
                    break
            child.last_access = now
            node = child
            i += 1
            start += bs
        self._uid = uid
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
        nodes = self._nodes  # ``_node_of``, inlined: on every growth past a block
        return self._ref[block] > 1 or (block < len(nodes) and nodes[block] is not None)

    # -- caching and eviction ----------------------------------------------------------

    def _on_unreferenced(self, blocks: list[int]) -> None:
        nodes, free, cached = self._nodes, self._free, 0
        for block in blocks:
            node = nodes[block] if block < len(nodes) else None
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
        node = self._node_of(key & self._block_mask)
        return node is not None and node.entry == key

    def _push(self, node: _Node) -> None:
        """Make an unreferenced leaf an eviction candidate."""
        node.entry = key = self._priority(node) << self._block_bits | node.block
        heapq.heappush(self._candidates, key)

    def _refill(self, count: int) -> None:
        """Evict the leaves the policy ranks first until the free list holds ``count``."""
        heap, free, nodes, evicted = self._candidates, self._free, self._nodes, 0
        # Without tiers an evicted node leaves the tree; with them it stays, in a lower tier.
        tiered, children = self._stores is not None, self._children
        need = count - self._on_free_list()
        while evicted < need:
            key = heap[0]
            block = key & self._block_mask
            node = nodes[block] if block < len(nodes) else None
            if node is None or node.entry != key:
                heapq.heappop(heap)  # stale
                continue
            nodes[block] = None
            if not tiered:
                del children[node.key]
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
            if tiered:
                node.entry = None
                self._demote(node)
        self._num_cached -= evicted
        self._evictions += evicted

    # -- lower tiers -------------------------------------------------------------------

    def drain_tier_moves(self) -> list[TierMove]:
        """``BlockAllocator.drain_tier_moves``: the moves emitted since the last call."""
        if self._stores is None or not self._moves:
            return []
        moves, self._moves = self._moves, []
        return moves

    def lower_tier_hits(self, seq_id: str) -> tuple[int, int]:
        """``BlockAllocator.lower_tier_hits``."""
        return self._state(seq_id).loaded

    def _indexed(self, node: _Node) -> None:
        """A new device node (committed): known to its parent; written through if so."""
        self._kids.setdefault(node.parent.uid, {})[node.uid] = node
        if self._write_through:
            self._write_down(node)

    def _write_down(self, node: _Node) -> None:
        """Write-through: a host copy of a device node's block, if the host tier has room."""
        if self._room(HOST):
            slot = self._backup[node.uid] = self._stores[HOST].put(node)
            self._moves.append(TierMove("device", node.block, "host", slot))

    def _load(self, lower: list[_Node], start: int) -> tuple[int, int]:
        """Bring the leading lower-tier nodes of a match into arena blocks (the device part
        before them, ``start`` tokens, is held): a tier's run is loaded unless
        ``worth_loading`` declines it (then it and the tiers below are recomputed), as far as
        free blocks allow. Each loaded block is held by the matching sequence. Returns the
        tokens loaded per tier."""
        bs, take = self.block_size, []
        for tier in (HOST, DISK):
            run = [node for node in lower if node.tier == tier]
            worth, at = self._worth_loading, start + len(take) * bs
            if run and worth is not None and not worth(TIERS[tier], len(run), len(run) * bs, at):
                break
            take += run
        del take[self.num_free_blocks() :]
        if not take:
            return (0, 0)
        self._pinned = {node.uid for node in take}  # no eviction below hands them down
        if len(take) > self._on_free_list():
            self._refill(len(take))
        now, counts = self._clock, [0, 0, 0]
        for node in take:
            counts[node.tier] += bs
            block = self._take()
            self._moves.append(TierMove(TIERS[node.tier], node.block, "device", block))
            self._lift(node, block)
            node.last_access = now
            node.hits += 1
        self._pinned = set()
        return counts[HOST], counts[DISK]

    def _lift(self, node: _Node, block: int) -> None:
        """A lower-tier node's KV is now in arena ``block`` (loaded, or recomputed by a
        sequence that holds it). Write-through keeps a host slot as its copy."""
        tier, slot = node.tier, node.block
        if self._write_through and tier == HOST:
            self._backup[node.uid] = slot
        else:
            self._stores[tier].release(slot)
        node.tier, node.block, node.entry = DEVICE, block, None
        self._index(node)
        node.parent.fanout += 1
        if self._write_through and node.uid not in self._backup:
            self._write_down(node)

    def _demote(self, node: _Node) -> None:
        """The arena evicted ``node`` (its block is free): to the host tier, or dropped.
        Write-through moves nothing (its host copy, if the host tier kept it, is the node's
        KV; one it lost is dropped, as SGLang HiCache's write-through drops)."""
        block = node.block
        if self._write_through:
            slot = self._backup.pop(node.uid, None)
            if slot is None:
                self._forget_subtree(node)
            else:
                node.tier, node.block = HOST, slot
        elif self._room(HOST):
            node.tier, node.block = HOST, self._stores[HOST].put(node)
            self._moves.append(TierMove("device", block, "host", node.block))
        else:
            self._forget_subtree(node)

    def _room(self, tier: int) -> bool:
        """Make a slot free in ``tier``, evicting its first victim if it is full: a host copy
        of a device node is let go, a node is handed to the next tier or dropped. False when
        nothing there may go (every node a load in progress reads, or a parent of one)."""
        store = self._stores[tier]
        if not store.full():
            return True
        kids, pinned = self._kids, self._pinned

        def eligible(slot: int, node: _Node) -> bool:
            if node.tier == DEVICE:  # a write-through copy
                return True
            below = kids.get(node.uid)
            return node.uid not in pinned and not (
                below and any(kid.tier == tier for kid in below.values())
            )

        slot = store.victim(eligible)
        if slot is None:
            return False
        node = store[slot]
        if node.tier == DEVICE:
            del self._backup[node.uid]
            store.release(slot)
        else:
            self._sink(node)
        return True

    def _sink(self, node: _Node) -> None:
        """A lower tier evicts ``node``: to the next tier if it has room, else dropped."""
        tier, slot = node.tier, node.block
        below = tier + 1 if tier + 1 < len(TIERS) else None
        if below is not None and self._stores[below] is not None and self._room(below):
            node.tier, node.block = below, self._stores[below].put(node)
            self._moves.append(TierMove(TIERS[tier], slot, TIERS[below], node.block))
            self._stores[tier].release(slot)
        else:
            self._forget_subtree(node)

    def _forget_subtree(self, node: _Node) -> None:
        """Forget ``node`` (off the device now) and its subtree, all in lower tiers."""
        del self._kids[node.parent.uid][node.uid]
        stack = [node]
        while stack:
            gone = stack.pop()
            stack.extend(self._kids.pop(gone.uid, {}).values())
            if gone.tier:
                self._stores[gone.tier].release(gone.block)
            del self._children[gone.key]

    def _index(self, node: _Node) -> None:
        """``node`` is on the device, in its block: the block map knows it."""
        if node.block >= len(self._nodes):
            self._cover(node.block)
        self._nodes[node.block] = node

    def _cover(self, block: int) -> int:
        """Grow the block map over ``block`` (by doubling, amortized O(1) a block, to the
        arena's size at most); returns how many blocks it covers."""
        nodes = self._nodes
        size = min(max(block + 1, 2 * len(nodes)), self.num_blocks)
        nodes.extend([None] * (size - len(nodes)))
        return size

    def _node_of(self, block: int) -> _Node | None:
        """The node indexing arena ``block``, if any."""
        return self._nodes[block] if block < len(self._nodes) else None

    def _device_nodes(self) -> list[_Node]:
        """Every node on the device, by block."""
        return [node for node in self._nodes if node is not None]

    def _cached_blocks(self) -> set[int]:
        return {node.block for node in self._device_nodes() if self._ref[node.block] == 0}

    def _num_cached_blocks(self) -> int:
        return self._num_cached

    def _check_placement(self) -> None:
        super()._check_placement()
        mask = self._block_mask
        live = {key & mask for key in self._candidates if self._live(key)}
        leaves = {b for b in self._cached_blocks() if not self._nodes[b].fanout}
        assert live == leaves, f"eviction candidates {sorted(live)} != cached leaves"
        device = self._device_nodes()
        fanout = Counter(node.parent.uid for node in device)
        assert self._root.fanout == fanout[self._root.uid], "children of the root"
        if self._stores is None:
            assert len(self._children) == len(device), "child map and node map disagree"
        else:
            self._check_tiers()
        assert len(self._nodes) <= self.num_blocks, "the block map outgrew the arena"
        for node in device:
            block = node.block
            assert self._nodes[block] is node and len(node.key) == 4 * self.block_size + 8, block
            assert node.tier == DEVICE and self._children.get(node.key) is node, block
            parent = node.parent
            assert self._unpack(node.key)[0] == parent.uid, f"block {block}: parent in key"
            assert parent is self._root or self._node_of(parent.block) is parent, block
            assert node.fanout == fanout[node.uid], f"children of {block}"
            parent_held = parent is self._root or self._ref[parent.block] > 0
            assert parent_held or self._ref[block] == 0, f"held block {block} under a cached one"
        for seq_id, s in self._seqs.items():
            parent = self._root
            for block in s.table[: s.cursor]:
                node = self._node_of(block)
                assert node is not None and node.parent is parent, f"{seq_id}: not a tree path"
                parent = node

    def _check_tiers(self) -> None:
        """Every node in exactly one tier (a write-through host copy of a device node aside),
        tiers going down along every path, the stores holding what the nodes say."""
        assert not self._pinned, "a load left nodes pinned"
        kids = Counter(uid for uid, below in self._kids.items() for _ in below)
        assert sum(kids.values()) == len(self._children), "kids map and child map disagree"
        for node in self._children.values():
            parent = node.parent
            assert self._kids[parent.uid].get(node.uid) is node, f"node {node.uid}: not a kid"
            assert node.tier >= parent.tier, f"node {node.uid} in a tier above its parent's"
            if node.tier:
                assert self._stores[node.tier][node.block] is node, f"node {node.uid}: slot"
                assert node.uid not in self._backup, f"node {node.uid}: a copy off the device"
            else:
                assert self._node_of(node.block) is node, f"node {node.uid}: block"
        for tier in (HOST, DISK):
            store = self._stores[tier]
            if store is None:
                continue
            store.check()
            for slot, node in store.items():
                resident = node.tier == tier and node.block == slot
                copy_ = tier == HOST and node.tier == DEVICE and self._backup.get(node.uid) == slot
                assert resident or copy_, f"{TIERS[tier]} slot {slot}: stale"
                assert self._children.get(node.key) is node, f"{TIERS[tier]} slot {slot}: gone"
        assert not self._backup or self._write_through, "host copies under write-back"
