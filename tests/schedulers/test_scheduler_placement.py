"""Schedulers ask the allocator (blocks_needed, can_allocate, reclaimable_blocks) instead of
doing block arithmetic, so admission and preemption are exact for region allocators too.

These tests drive schedulers without a model: a step applies the plan the way the engine
does (computed tokens advance, a finished prompt or decode appends a token, a sequence
that reaches max_tokens finishes), so only the decisions are under test.
"""

from __future__ import annotations

import copy
from functools import partial

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from support import allocator_options

from allocators.base import BlockAllocator
from allocators.buddy import BuddyAllocator
from allocators.contiguous import ContiguousAllocator
from allocators.radix import RadixAllocator
from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams
from schedulers.base import Scheduler, SchedulerOutput
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler
from schedulers.priority import PriorityScheduler

ALLOCATORS = allocator_options(max_len=32)
POLICIES = {
    "fcfs": FCFSScheduler,
    "fcfs_prefill_first": partial(FCFSScheduler, order="prefill_first"),
    "priority": PriorityScheduler,
    "chunked": partial(ChunkedPrefillScheduler, max_chunk=8, max_num_batched_tokens=16),
}


def request(rid: str, prompt: list[int], max_tokens: int, arrival: float = 0.0, priority=0):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Seq(rid, list(prompt), params, arrival_time=arrival, priority=priority)


def step(sched: Scheduler, now: float = 0.0, decide=None):
    """One engine step without a model: apply the plan (``decide(now)``, by default
    ``sched.schedule``), sample token 7, finish at length (max_tokens, or the longest a
    sequence may grow: ``max_seq_len``), as the engine does."""
    plan = (decide or sched.schedule)(now)
    for s in plan.scheduled:
        seq = s.seq
        seq.num_computed_tokens += s.num_new_tokens
        sched.allocator.commit(seq.request_id, seq.token_ids[: seq.num_computed_tokens])
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if (
                seq.num_output_tokens >= seq.params.max_tokens
                or seq.num_tokens >= sched.max_seq_len
            ):
                sched.finish(seq)
    return plan


def test_a_sequence_stops_at_the_longest_region_the_arena_has():
    # Buddy, 12 blocks of 4 = chunks of 8 + 4: one sequence holds at most 32 slots though
    # max_model_len is 48. It finishes at 32 tokens (length) instead of being preempted and
    # then rejected as a 33-token prompt.
    sched = FCFSScheduler(BuddyAllocator(num_blocks=12, block_size=4), max_model_len=48)
    assert sched.max_seq_len == 32
    sched.add(request("A", [1] * 4, 40))
    for t in range(40):
        plan = step(sched, float(t))
        assert not plan.preempted and not plan.rejected
    assert not sched.has_unfinished()


def test_a_max_len_region_arrival_preempts_exactly_one_sequence():
    # block_size 8, max_len 64: every sequence reserves an 8-block region; 3 fill the
    # 24-block arena. A priority-0 arrival needs one region: one victim's region is enough.
    alloc = ContiguousAllocator(num_blocks=24, block_size=8, reserve="max_len", max_len=64)
    sched = PriorityScheduler(alloc, max_model_len=64, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(request(f"low{i}", [i + 1] * 10, 40, arrival=i, priority=1))
    step(sched)
    assert alloc.num_free_blocks() == 0 and len(sched.running) == 3
    sched.add(request("high", [9] * 10, 4, arrival=5, priority=0))
    plan = step(sched)
    assert [seq.request_id for seq, _ in plan.preempted] == ["low2"]  # the lowest-ranked
    assert [s.seq.request_id for s in plan.scheduled if s.num_new_tokens > 1] == ["high"]


def test_admission_counts_the_region_a_prompt_reserves():
    # 16 blocks of 4 slots, max_len 32 -> 8-block regions. One running region leaves 8 free,
    # enough for exactly one more region, whatever the prompt's own length (2 blocks).
    alloc = ContiguousAllocator(num_blocks=16, block_size=4, reserve="max_len", max_len=32)
    sched = FCFSScheduler(alloc, max_model_len=32, max_num_batched_tokens=32)
    for i in range(3):
        sched.add(request(str(i), [i + 1] * 6, 8))
    plan = step(sched)
    assert [s.seq.request_id for s in plan.scheduled] == ["0", "1"]
    assert alloc.blocks_needed("2", 6) == 8 and not alloc.can_allocate("2", 6)


def test_buddy_admission_needs_a_free_region_of_the_rounded_size():
    # 12 blocks of 4 = buddies of 8 + 4. A 5-block prompt needs an 8-block region: with a
    # sequence in the 8-block chunk, 4 free blocks cannot take it though the count is 5 > 4.
    alloc = BuddyAllocator(num_blocks=12, block_size=4)
    sched = FCFSScheduler(alloc, max_model_len=32, max_num_batched_tokens=64)
    sched.add(request("a", [1] * 17, 8))  # 5 blocks -> region of 8
    sched.add(request("b", [2] * 17, 8))
    plan = step(sched)
    assert [s.seq.request_id for s in plan.scheduled] == ["a"]
    assert alloc.num_free_blocks() == 4 and alloc.blocks_needed("b", 17) == 8


def test_prefix_shared_with_a_running_sequence_is_not_counted_as_needed():
    # Radix, 8 blocks of 4: "a" holds 6 blocks (a 22-token prompt + growth). "b" repeats a's
    # first 20 tokens: 5 of its 6 blocks are a's, so it needs 1 block, and 2 are free.
    alloc = RadixAllocator(num_blocks=8, block_size=4)
    sched = FCFSScheduler(alloc, max_model_len=64, max_num_batched_tokens=64)
    shared = list(range(1, 21))
    sched.add(request("a", shared + [30, 31], 8))
    step(sched)
    b = shared + [40]
    assert alloc.blocks_needed("b", len(b), b) == 1 and alloc.can_allocate("b", len(b), b)
    sched.add(request("b", b, 4))
    plan = step(sched)
    assert {s.seq.request_id for s in plan.scheduled} == {"a", "b"}
    assert not plan.preempted


class PreemptionOracle:
    """Checks each preemption against an independent oracle: on a deep copy of the
    allocator taken just before it, the request it made room for must not have fitted; and
    a request priority made room for must come in in that same step (``made_room_for``).

    It sees the scheduler through its allocator alone: while ``schedule`` decides, freeing a
    sequence that was running when the step began is a preemption. One right after a failed
    allocate is the victim loop's (that allocate must fail still); one before any failure is
    priority's make-room for the head of the queue."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.allocator = sched.allocator
        self.last_failed: tuple[str, int] | None = None
        self.made_room_for: set[str] = set()
        self.running: list[Seq] = []  # at the start of the step being decided
        oracle = self

        class Recording(type(sched.allocator)):  # copies (dry runs) record nothing
            def allocate(self, seq_id: str, num_tokens: int):
                result = super().allocate(seq_id, num_tokens)
                if self is oracle.allocator:
                    oracle.last_failed = None if result is not None else (seq_id, num_tokens)
                return result

            def free(self, seq_id: str) -> int:
                if self is oracle.allocator:
                    oracle.check(seq_id)
                return super().free(seq_id)

        sched.allocator.__class__ = Recording

    def schedule(self, now: float) -> SchedulerOutput:
        """``sched.schedule(now)``, every preemption it makes checked."""
        self.running, self.last_failed = list(self.sched.running), None
        try:
            return self.sched.schedule(now)
        finally:
            self.running = []

    def check(self, seq_id: str) -> None:
        victim = next((s for s in self.running if s.request_id == seq_id), None)
        if victim is None:
            return  # not a preemption: a finish, or an admission given up
        sched = self.sched
        trial: BlockAllocator = copy.deepcopy(self.allocator)
        if self.last_failed is not None:
            assert trial.allocate(*self.last_failed) is None, "a victim nobody needed"
            return
        assert isinstance(sched, PriorityScheduler), "a make-room preemption"
        head = sched.next_incoming()
        self.made_room_for.add(head.request_id)
        # Decode-first: the running sequences (the victim still among them) take their tokens
        # and blocks first, the most important first; a sequence whose tokens exceed the
        # budget left computes none this step.
        running = [s for s in self.running if s in sched.running or s is victim]
        budget, grown = sched.max_num_batched_tokens, True
        for seq in sorted(running, key=sched.rank):
            n = seq.num_uncomputed_tokens if seq.num_uncomputed_tokens <= budget else 0
            budget -= n
            grown &= trial.allocate(seq.request_id, seq.num_computed_tokens + n) is not None
        whole = head.num_tokens
        trial.match_prefix(head.request_id, head.token_ids[: whole + 1])
        room = len(running) < sched.max_num_seqs and 0 < head.num_uncomputed_tokens <= budget
        fitted = grown and trial.allocate(head.request_id, whole) is not None
        kept = trial.num_free_blocks() >= sched.watermark_blocks
        assert not (room and fitted and kept), f"preempted though {head.request_id} fitted"


workloads = st.lists(
    st.tuples(
        st.integers(1, 3),  # prefix family (radix shares it)
        st.integers(1, 16),  # own prompt tokens after the 8-token family prefix
        st.integers(1, 12),  # output tokens
        st.integers(0, 2),  # priority
        st.integers(0, 6),  # arrival step
    ),
    min_size=1,
    max_size=10,
)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
@settings(max_examples=25, deadline=None)
@given(workload=workloads)
def test_a_victim_loop_never_preempts_a_sequence_it_did_not_need(kind, policy, workload):
    alloc = ALLOCATORS[kind](num_blocks=12, block_size=4)
    sched = POLICIES[policy](alloc, max_model_len=32, max_num_seqs=4)
    oracle = PreemptionOracle(sched)
    pending = sorted(  # prompt + output within max_model_len
        (arrival, i, request(f"r{i}", [family] * 8 + [i + 10] * n, min(out, 24 - n), arrival, prio))
        for i, (family, n, out, prio, arrival) in enumerate(workload)
    )
    for t in range(400):
        while pending and pending[0][0] <= t:
            sched.add(pending.pop(0)[2])
        plan = step(sched, float(t), oracle.schedule)
        came_in = {s.seq.request_id for s in plan.scheduled}
        came_in |= {s.seq.request_id for s in plan.swapped_in}
        assert oracle.made_room_for <= came_in, "preempted for a request that did not come in"
        oracle.made_room_for.clear()
        if not pending and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "the workload did not finish"
    assert alloc.num_free_blocks() == alloc.num_blocks
    alloc.check()
