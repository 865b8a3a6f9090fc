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
