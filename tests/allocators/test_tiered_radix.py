"""The radix allocator's lower KV tiers (kv_tier): unit scenarios, then a differential fuzz of
the tiered cache's state machine against a reference model, in the style of
test_allocator_state_machine.py.

The model plays the engine and a toy KV store: an arena slot, a host slot and a disk slot
hold the *prefix* whose KV they are (a position's KV depends on every token before it, as real
KV does), so a block copied to the wrong place, or read after it was reused, shows. After
every allocator call the model replays the moves it drained, in order, then writes the new
tokens. Invariants after each step:

- every live sequence reads its own prefixes back through its table (a load brought the
  right bytes);
- every node of the tree, in whichever tier ``cached_nodes`` says it is, is found there in
  the toy store (moves replayed reproduce every node's content); each prefix is listed once
  and each place holds one node: a node is in exactly one tier. A write-through host copy of
  a device node is a backup, not a residence: the node is listed on the device;
- no move reads a block a live sequence held before the call as an eviction (a held block is
  never written out, and never dropped: held blocks are device nodes);
- ``check()`` (reference counts, free/cached/held partition, tier stores) holds;
- ``match_prefix`` returns what the model predicts from ``cached_nodes`` and the load decision
  (device run, then the host run and the disk run unless declined, as far as free blocks go),
  and ``lower_tier_hits`` splits it; a forecast ``can_allocate`` is what ``allocate`` does, so
  a full tier never fails a request;
- a deep copy (priority's what-if) matches and allocates without touching the original.
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from allocators.radix import RadixAllocator
from allocators.tiers import KVTier, TierMove

BS = 2
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=12)


def tiered(
    num_blocks: int = 4, host: int = 2, disk: int = 0, policy: str = "write_back", **kw
) -> RadixAllocator:
    tier = KVTier(host_blocks=host, disk_blocks=disk, write_policy=policy)
    return RadixAllocator(num_blocks=num_blocks, block_size=BS, kv_tier=tier, **kw)


def serve(alloc: RadixAllocator, seq: str, tokens: list[int]) -> int:
    """Match, allocate, commit and free ``seq`` (a request that ran); returns its match."""
    matched = alloc.match_prefix(seq, tokens)
    assert alloc.allocate(seq, len(tokens)) is not None
    alloc.commit(seq, tokens)
    alloc.free(seq)
    return matched


# -- scenarios counted by hand ---------------------------------------------------------------


def test_an_evicted_leaf_goes_to_the_host_tier_and_is_loaded_back() -> None:
    alloc = tiered(num_blocks=2, host=2)
    serve(alloc, "a", [1, 1, 1, 1])  # blocks 0, 1: (1,1), (1,1,1,1)
    assert alloc.drain_tier_moves() == []
    assert alloc.allocate("b", 4) is not None  # two blocks: evicts the leaf, then its parent
    assert alloc.drain_tier_moves() == [
        TierMove("device", 1, "host", 0),
        TierMove("device", 0, "host", 1),
    ]
    assert alloc.cached_nodes() == [((1, 1), "host", 1), ((1, 1, 1, 1), "host", 0)]
    alloc.free("b")  # its table [1, 0], freed tail first: the free list is 0, 1
    assert alloc.match_prefix("c", [1, 1, 1, 1, 5]) == 4
    assert alloc.lower_tier_hits("c") == (4, 0)
    assert alloc.drain_tier_moves() == [
        TierMove("host", 1, "device", 0),
        TierMove("host", 0, "device", 1),
    ]
    assert alloc.block_table("c") == [0, 1]
    alloc.check()


def test_a_full_host_tier_hands_its_victim_to_disk_and_a_full_disk_drops() -> None:
    alloc = tiered(num_blocks=1, host=1, disk=1)
    serve(alloc, "a", [1, 1])  # block 0: (1,1)
    serve(alloc, "b", [2, 2])  # (1,1) to host 0; block 0: (2,2)
    serve(alloc, "c", [3, 3])  # (2,2) to host 0: (1,1) first goes to disk 0
    assert alloc.drain_tier_moves() == [
        TierMove("device", 0, "host", 0),
        TierMove("host", 0, "disk", 0),
        TierMove("device", 0, "host", 0),
    ]
    serve(alloc, "d", [4, 4])  # (3,3) to host: (2,2) to disk, where (1,1) is dropped
    assert alloc.drain_tier_moves() == [
        TierMove("host", 0, "disk", 0),
        TierMove("device", 0, "host", 0),
    ]
    assert alloc.cached_nodes() == [
        ((2, 2), "disk", 0),
        ((3, 3), "host", 0),
        ((4, 4), "device", 0),
    ]
    assert alloc.match_prefix("e", [1, 1, 5]) == 0
    # Loading (2,2) evicts (4,4) to host, whose (3,3) cannot go to a disk holding only the
    # block being loaded: (3,3) is dropped, never (2,2).
    assert alloc.match_prefix("f", [2, 2, 5]) == 2
    assert alloc.lower_tier_hits("f") == (0, 2)
    assert alloc.drain_tier_moves() == [
        TierMove("device", 0, "host", 0),
        TierMove("disk", 0, "device", 0),
    ]
    assert alloc.cached_nodes() == [((2, 2), "device", 0), ((4, 4), "host", 0)]
    alloc.check()


def test_write_through_writes_at_commit_and_evicts_for_free() -> None:
    alloc = tiered(num_blocks=2, host=4, policy="write_through")
    serve(alloc, "a", [1, 1, 2, 2])
    assert alloc.drain_tier_moves() == [
        TierMove("device", 0, "host", 0),
        TierMove("device", 1, "host", 1),
    ]
    assert alloc.allocate("b", 4) is not None
    assert alloc.drain_tier_moves() == []  # eviction: the host copies become the nodes
    assert alloc.cached_nodes() == [((1, 1), "host", 0), ((1, 1, 2, 2), "host", 1)]
    alloc.free("b")
    assert alloc.match_prefix("c", [1, 1, 2, 2, 9]) == 4
    assert alloc.drain_tier_moves() == [
        TierMove("host", 0, "device", 0),
        TierMove("host", 1, "device", 1),
    ]
    alloc.check()  # the host slots stay, as the loaded nodes' copies
    alloc.free("c")
    assert alloc.allocate("d", 4) is not None
    assert alloc.drain_tier_moves() == []  # evicted again, still for free


def test_a_declined_load_is_recomputed_and_its_block_becomes_the_node() -> None:
    asked = []

    def worth_loading(tier: str, num_blocks: int, num_tokens: int, start: int) -> bool:
        asked.append((tier, num_blocks, num_tokens))
        return False

    alloc = tiered(num_blocks=3, host=2, worth_loading=worth_loading)
    serve(alloc, "a", [1, 1, 2, 2])
    assert alloc.allocate("b", 6) is not None  # evicts both to host
    alloc.free("b")
    alloc.drain_tier_moves()
    assert serve(alloc, "c", [1, 1, 2, 2, 9]) == 0
    assert asked == [("host", 2, 4)]
    assert alloc.drain_tier_moves() == []  # recomputed into its own blocks: nothing moves
    assert [tier for _, tier, _ in alloc.cached_nodes()] == ["device", "device"]
    alloc.check()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("stops", [False, True])
def test_allocate_many_evicts_to_the_tiers_as_allocate_one_by_one(policy: str, stops: bool):
    # A full arena of cached blocks: growing two running sequences past their blocks evicts
    # leaves (write-back: to the host, and on to disk) in the same order as one allocate
    # after another; with a request too big for the arena the call ends there.
    alloc = tiered(num_blocks=6, host=2, disk=2, policy=policy)
    serve(alloc, "a", [1, 1, 1, 1])
    serve(alloc, "b", [2, 2, 2, 2])
    assert alloc.allocate("x", 1) is not None and alloc.allocate("y", 1) is not None
    alloc.drain_tier_moves()
    twin = copy.deepcopy(alloc)
    requests = [("x", 4), ("y", 3), ("x", 5), *([("z", 100)] if stops else []), ("y", 6)]
    expected = []
    for seq, num_tokens in requests:
        expected.append(twin.allocate(seq, num_tokens))
        if expected[-1] is None:
            break
    assert alloc.allocate_many(requests) == expected
    assert len(expected) == 4 and (expected[-1] is None) == stops  # stopped: y never grew
    moves = alloc.drain_tier_moves()
    assert moves == twin.drain_tier_moves()
    assert bool(moves) == (policy == "write_back")  # write-through wrote at commit
    assert (alloc.dump(), alloc.stats()) == (twin.dump(), twin.stats())
    assert alloc.cached_nodes() == twin.cached_nodes()
    alloc.check()


def test_without_tiers_nothing_moves_and_eviction_drops() -> None:
    alloc = RadixAllocator(num_blocks=2, block_size=BS, kv_tier=KVTier())
    serve(alloc, "a", [1, 1, 2, 2])
    assert alloc.allocate("b", 4) is not None
    assert alloc.drain_tier_moves() == [] and alloc.cached_nodes() == []
    assert alloc.lower_tier_hits("b") == (0, 0)


# -- the differential fuzz -------------------------------------------------------------------


class TieredMachine(RuleBasedStateMachine):
    """Drives one tiered radix allocator (``make``) against the model described above."""

    write_through = False
    disk = 0

    def __init__(self) -> None:
        super().__init__()
        self.decline: set[str] = set()  # tiers whose loads worth_loading declines now
        self.alloc = RadixAllocator(
            num_blocks=5,
            block_size=BS,
            kv_tier=KVTier(
                host_blocks=3,
                disk_blocks=self.disk,
                write_policy="write_through" if self.write_through else "write_back",
            ),
            worth_loading=lambda tier, n, tokens, start: tier not in self.decline,
        )
        self.store: dict[tuple[str, int], tuple[int, ...]] = {}  # (tier, slot) -> its prefix
        self.tokens: dict[str, list[int]] = {}  # what each live sequence has written
        self.prompts: list[list[int]] = []
        self.next_id = 0
        self.moves = 0

    # -- the engine's side

    def replay(self, held_before: set[int]) -> None:
        """Make the drained moves in order; an eviction never reads a block held before."""
        for move in self.alloc.drain_tier_moves():
            self.moves += 1
            if move.src_tier == "device":
                src = self.block_content(move.src)
                if not self.write_through:
                    assert move.src not in held_before, f"{move}: evicts a held block"
            else:
                src = self.store.get((move.src_tier, move.src))
            assert src is not None and len(src) % BS == 0, f"{move}: reads no full block"
            if move.dst_tier == "device":
                for pos in range(BS):  # the arena's slots of that block, each its prefix
                    self.store[("device", move.dst * BS + pos)] = src[: len(src) - BS + pos + 1]
            else:
                self.store[(move.dst_tier, move.dst)] = src

    def block_content(self, block: int) -> tuple[int, ...] | None:
        """A full arena block as a lower tier stores it: the prefix it ends."""
        return self.store.get(("device", block * BS + BS - 1))

    def held(self) -> set[int]:
        return {b for seq in self.tokens for b in self.alloc.block_table(seq)}

    def write(self, seq: str, new_tokens: list[int]) -> None:
        table, written = self.alloc.block_table(seq), self.tokens[seq]
        for token in new_tokens:
            written.append(token)
            pos = len(written) - 1  # its KV, as real KV, depends on its whole prefix
            self.store[("device", table[pos // BS] * BS + pos % BS)] = tuple(written)

    def allocate(self, seq: str, num_tokens: int, token_ids: list[int] = ()) -> bool:
        alloc, held = self.alloc, self.held()
        can = alloc.can_allocate(seq, num_tokens, token_ids)
        result = alloc.allocate(seq, num_tokens)
        assert (result is not None) == can, f"can_allocate said {can}"
        assert result is None or not result.copies  # no fork here: nothing to copy
        self.replay(held)
        return result is not None

    def expected_match(self, prompt: list[int]) -> tuple[int, int, int]:
        """Blocks matched on the device, loaded from host, from disk, by ``cached_nodes``."""
        where = {prefix: (tier, place) for prefix, tier, place in self.alloc.cached_nodes()}
        runs, held, unheld = {"device": 0, "host": 0, "disk": 0}, self.held(), 0
        for i in range((len(prompt) - 1) // BS):
            hit = where.get(tuple(prompt[: (i + 1) * BS]))
            if hit is None:
                break
            runs[hit[0]] += 1  # check() holds the tiers going down along the path
            unheld += hit[0] == "device" and hit[1] not in held
        device, host, disk = runs["device"], runs["host"], runs["disk"]
        if host and "host" in self.decline:
            host = disk = 0
        if disk and "disk" in self.decline:
            disk = 0
        room = self.alloc.num_free_blocks() - unheld
        host, disk = min(host, room), min(disk, max(room - host, 0))
        return device, host, disk

    # -- rules

    def begin(self, prompt: list[int], decline: set[str]) -> None:
        seq = f"s{self.next_id}"
        self.next_id += 1
        self.decline = decline
        device, host, disk = self.expected_match(prompt)
        held = self.held()
        matched = self.alloc.match_prefix(seq, prompt)
        self.replay(held)
        assert matched == (device + host + disk) * BS, (matched, device, host, disk)
        assert self.alloc.lower_tier_hits(seq) == (host * BS, disk * BS)
        self.tokens[seq] = list(prompt[:matched])
        if self.allocate(seq, len(prompt), prompt):
            self.write(seq, prompt[matched:])
        else:
            self.alloc.free(seq)  # as the scheduler does: the match's blocks stay cached
            del self.tokens[seq]

    @initialize(prompt=TOKENS)
    def first(self, prompt: list[int]) -> None:
        self.begin(prompt, set())

    @rule(prompt=TOKENS, decline=st.sets(st.sampled_from(["host", "disk"])))
    def start(self, prompt: list[int], decline: set[str]) -> None:
        if len(self.tokens) < 3:
            self.begin(prompt, decline)

    @rule(data=st.data(), suffix=TOKENS, decline=st.sets(st.sampled_from(["host", "disk"])))
    def start_on_a_shared_prefix(self, data: st.DataObject, suffix: list[int], decline) -> None:
        if self.prompts and len(self.tokens) < 3:
            self.begin([*data.draw(st.sampled_from(self.prompts)), *suffix], decline)

    def pick(self, data: st.DataObject) -> str | None:
        return data.draw(st.sampled_from(sorted(self.tokens))) if self.tokens else None

    @rule(data=st.data(), new_tokens=TOKENS)
    def extend(self, data: st.DataObject, new_tokens: list[int]) -> None:
        seq = self.pick(data)
        if seq is not None and self.allocate(seq, len(self.tokens[seq]) + len(new_tokens)):
            self.write(seq, new_tokens)

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        if seq is not None:
            written = self.tokens[seq]
            held = self.held()
            self.alloc.commit(seq, written[: data.draw(st.integers(0, len(written)))])
            self.replay(held)

    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data: st.DataObject, commit: bool) -> None:
        seq = self.pick(data)
        if seq is None:
            return
        held = self.held()
        if commit:
            self.alloc.commit(seq, self.tokens[seq])
            if len(self.tokens[seq]) >= BS and len(self.prompts) < 8:
                self.prompts.append(self.tokens[seq])
        self.alloc.free(seq)
        del self.tokens[seq]
        self.replay(held)

    @rule(prompt=TOKENS)
    def what_if(self, prompt: list[int]) -> None:
        """A copy answers a what-if (priority's make-room) and leaves the original as it was."""
        before = (self.alloc.dump(), self.alloc.cached_nodes(), self.alloc.stats())
        twin = copy.deepcopy(self.alloc)
        assert twin.cached_nodes() == before[1]
        twin.match_prefix("what-if", prompt)
        twin.allocate("what-if", len(prompt))
        twin.check()
        assert (self.alloc.dump(), self.alloc.cached_nodes(), self.alloc.stats()) == before

    # -- invariants

    @invariant()
    def consistent(self) -> None:
        self.alloc.check()
        for seq, written in self.tokens.items():
            table = self.alloc.block_table(seq)
            for pos in range(len(written)):
                got = self.store.get(("device", table[pos // BS] * BS + pos % BS))
                assert got == tuple(written[: pos + 1]), f"{seq} reads {got} at {pos}"
        nodes = self.alloc.cached_nodes()
        assert len({p for p, _, _ in nodes}) == len(nodes), "a prefix listed twice"
        assert len({(t, b) for _, t, b in nodes}) == len(nodes), "a place holds two nodes"
        for prefix, tier, place in nodes:
            found = self.block_content(place) if tier == "device" else self.store.get((tier, place))
            assert found == prefix, f"{prefix} not at {tier} {place}: {found}"

    def teardown(self) -> None:
        for seq in list(self.tokens):
            self.alloc.free(seq)
        self.alloc.check()
        assert self.alloc.num_free_blocks() == self.alloc.num_blocks


def _machine(name: str, **options: object) -> type:
    machine = type(f"tiered_{name}", (TieredMachine,), options)
    machine.TestCase.settings = settings(
        max_examples=150,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    return machine.TestCase


TestHostWriteBack = _machine("host_write_back")
TestHostWriteThrough = _machine("host_write_through", write_through=True)
TestHostDiskWriteBack = _machine("host_disk_write_back", disk=2)
TestHostDiskWriteThrough = _machine("host_disk_write_through", write_through=True, disk=2)
