"""The scheduler with a tiered prefix cache (kv_tier): the allocator's tier moves reach the
plan in order, and an admitted request's cached tokens are split by tier. Driven without a
model: a step applies the plan as the engine does (progress, commit, one token, finish)."""

from __future__ import annotations

from allocators.radix import RadixAllocator
from allocators.tiers import KVTier
from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams
from schedulers.base import SchedulerOutput
from schedulers.fcfs import FCFSScheduler


def request(rid: str, prompt: list[int]) -> Seq:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return Seq(rid, list(prompt), params, arrival_time=0.0)


def step(sched: FCFSScheduler) -> SchedulerOutput:
    """One step: every scheduled prompt is computed, committed, gets one token and finishes."""
    plan = sched.schedule(0.0)
    for s in plan.scheduled:
        seq = s.seq
        seq.num_computed_tokens += s.num_new_tokens
        sched.allocator.commit(seq.request_id, seq.token_ids[: seq.num_computed_tokens])
        seq.token_ids.append(7)
        sched.finish(seq)
    return plan


def kinds(plan: SchedulerOutput) -> list[tuple[str, str]]:
    return [(m.src_tier, m.dst_tier) for m in plan.tier_moves]


def test_moves_reach_the_plan_and_cached_tokens_are_split_by_tier() -> None:
    alloc = RadixAllocator(num_blocks=3, block_size=2, kv_tier=KVTier(host_blocks=4))
    sched = FCFSScheduler(alloc, max_num_seqs=1)
    for seq in (a := request("a", [1, 1, 2, 2])), (b := request("b", [3, 3, 4, 4, 5])):
        sched.add(seq)
    assert kinds(step(sched)) == []  # a: blocks 0, 1 indexed, cached once it finishes
    # b takes the fresh block 2 and evicts a's two blocks to the host tier, leaf first.
    assert kinds(step(sched)) == [("device", "host")] * 2
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
    sched.add(c := request("c", [1, 1, 2, 2, 6]))
    # c's match loads a's blocks: into b's unindexed block and b's leaf (evicted to host
    # first); c's third block evicts b's first.
    plan = step(sched)
    assert kinds(plan) == [
        ("device", "host"),
        ("host", "device"),
        ("host", "device"),
        ("device", "host"),
    ]
    assert c.num_cached_tokens == 4
    assert (c.num_cached_tokens_host, c.num_cached_tokens_disk) == (4, 0)
    assert b.num_cached_tokens_host == 0
    alloc.check()


def test_without_tiers_the_plan_moves_nothing() -> None:
    sched = FCFSScheduler(RadixAllocator(num_blocks=3, block_size=2), max_num_seqs=1)
    sched.add(request("a", [1, 1, 2, 2]))
    sched.add(request("b", [3, 3, 4, 4, 5]))
    assert [step(sched).tier_moves for _ in range(2)] == [[], []]


def test_a_request_that_does_not_come_in_loads_nothing() -> None:
    """A lookup loads a lower tier's hits into the arena: the scheduler checks that the
    request fits first, so a waiting request moves no block into the arena until the step
    it comes in, and its host hits are counted as host hits then."""
    alloc = RadixAllocator(num_blocks=5, block_size=2, kv_tier=KVTier(host_blocks=8))
    sched = FCFSScheduler(alloc, max_num_seqs=4)

    def decode_step() -> SchedulerOutput:
        plan = sched.schedule(0.0)
        for s in plan.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            sched.allocator.commit(seq.request_id, seq.token_ids[: seq.num_computed_tokens])
            if seq.num_computed_tokens >= len(seq.token_ids):
                seq.token_ids.append(7)
                if len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
        return plan

    long = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sched.add(request("a", [1, 1, 1, 1, 9]))
    decode_step()  # a finishes: its blocks (1, 1), (1, 1) stay cached
    sched.add(request("y", [3] * 9))
    decode_step()  # y's 5 blocks send a's two to the host tier
    sched.add(Seq("x", [5] * 6, long, arrival_time=0.0))  # holds 3-4 blocks for 5 steps
    decode_step()
    sched.add(b := request("b", [1, 1, 1, 1, 6, 6, 6]))  # a's two blocks, then its own
    waited = []
    while b.num_cached_tokens is None:
        waited.append(kinds(decode_step()))
    # b came in on the last of these steps: only then were a's blocks loaded
    assert len(waited) > 1 and all(("host", "device") not in m for m in waited[:-1]), waited
    assert waited[-1].count(("host", "device")) == 2
    assert (b.num_cached_tokens, b.num_cached_tokens_host, b.num_cached_tokens_disk) == (4, 4, 0)
