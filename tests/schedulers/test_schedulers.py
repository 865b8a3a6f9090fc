"""Every scheduler policy x every allocator against mlx_lm, and the shared mechanics:
preemption by recompute and by swap, nothing lost under overload, abort in every state.

The reference is mlx_lm's own single-sequence ``generate_step`` on the same random model.
"""

from __future__ import annotations

import time
from functools import partial

import pytest
from support import ALLOCATORS, FakeTime, build_with_policy

import harness  # noqa: F401  (BLAS switch before mlx)
from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from harness.engine.sampling_params import SamplingParams
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler
from schedulers.priority import PriorityScheduler
from schedulers.request import Status

PROMPT_LENS = [1, 5, 17, 40, 30, 16]
PROMPT_SEED = 2
MAX_TOKENS = 12
BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LIMITS = dict(max_num_seqs=8)
MAX_MODEL_LEN = 256
POLICIES = {
    "fcfs": partial(FCFSScheduler, max_num_batched_tokens=256, **LIMITS),
    "fcfs_prefill_first": partial(
        FCFSScheduler, order="prefill_first", max_num_batched_tokens=256, **LIMITS
    ),
    "priority": partial(PriorityScheduler, max_num_batched_tokens=256, **LIMITS),
    # chunks smaller than a block, and larger than one
    "chunked_3": partial(ChunkedPrefillScheduler, max_chunk=3, max_num_batched_tokens=16, **LIMITS),
    "chunked_20": partial(
        ChunkedPrefillScheduler, max_chunk=20, max_num_batched_tokens=32, **LIMITS
    ),
}
# The longest request needs 7 blocks: 9 forces preemption, 64 holds everyone at once.
ARENAS = {
    "roomy": (64, "recompute"),
    "tight_recompute": (9, "recompute"),
    "tight_swap": (9, "swap"),
}


def build(model, allocator, policy, *, num_blocks, block_size=BLOCK, **kwargs):
    return build_with_policy(
        model,
        allocator,
        policy,
        block_size=block_size,
        num_blocks=num_blocks,
        engine_options={"max_model_len": MAX_MODEL_LEN},
        **kwargs,
    )


def assert_all_released(engine):
    """Every block free (or evictable), every queue and host copy empty, invariants hold."""
    engine.allocator.check()
    stats = engine.allocator.stats()
    assert stats.used_blocks == 0
    assert stats.free_blocks + stats.cached_blocks == stats.num_blocks
    sched = engine.scheduler
    assert not (sched.waiting or sched.running or sched.swapped or sched.swap_space.used)
    assert engine.host.num_blocks == 0


@pytest.mark.parametrize("arena", ARENAS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_greedy_tokens_identical_to_mlx_lm(model, prompts, reference, allocator, policy, arena):
    num_blocks, mode = ARENAS[arena]
    engine = build(model, allocator, POLICIES[policy], num_blocks=num_blocks, preemption_mode=mode)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    steps = engine.recorder.steps
    preemptions = sum(r["preemptions"] for r in engine.recorder.requests)
    swapped = sum(s["swap_out_blocks"] for s in steps)
    if arena == "roomy":
        assert preemptions == 0
    else:
        assert preemptions > 0
        assert (swapped > 0) == (mode == "swap")
        assert swapped == sum(s["swap_in_blocks"] for s in steps) or allocator is RadixAllocator
    budget = POLICIES[policy].keywords["max_num_batched_tokens"]
    assert max(s["prefill_tokens"] + s["decode_tokens"] for s in steps) <= budget
    assert_all_released(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "fcfs_prefill_first", "priority", "chunked_3"])
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_overload_loses_nothing(model, prompts, reference, allocator, policy, mode):
    """40 requests at once (prompts repeated, mixed priorities) into 12 blocks of 8 slots:
    about 10x what fits. Everything finishes with mlx_lm's tokens, or is rejected with a
    reason (a prompt longer than the arena), and every block comes back."""
    max_tokens = 6
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = build(model, allocator, POLICIES[policy], num_blocks=12, preemption_mode=mode)
    too_long = list(range(1, 12 * BLOCK + 2))
    for i in range(40):
        engine.add_request(f"r{i}", prompts[i % len(prompts)], params, priority=i % 3)
    engine.add_request("too_long", too_long, params)
    finished = {}
    for _ in range(3000):  # a livelock fails instead of hanging
        if not (engine.has_unfinished_requests() or engine.requests.owed):
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        assert engine.scheduler.swap_space.used == engine.host.num_blocks
    assert len(finished) == 41
    assert finished.pop("too_long").abort_reason.startswith("prompt of 97 tokens exceeds")
    for rid, out in finished.items():
        assert out.outputs[0].token_ids == reference[int(rid[1:]) % len(prompts)][:max_tokens]
    assert sum(r["preemptions"] for r in engine.recorder.requests) > 0
    assert_all_released(engine)


def step_until(engine, condition, limit=200):
    for _ in range(limit):
        if condition():
            return
        engine.step()
    raise AssertionError("condition never reached")


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_abort_in_every_state_frees_everything(model, prompts, allocator):
    # max_num_seqs=2 keeps the third request waiting; the tiny arena swaps one of the two.
    engine = build(
        model, allocator, FCFSScheduler, num_blocks=9, preemption_mode="swap", max_num_seqs=2
    )
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, n in enumerate([2, 5, 1]):
        engine.add_request(f"r{i}", prompts[n], long)
    sched = engine.scheduler
    step_until(engine, lambda: sched.swapped and sched.running and sched.waiting)
    by_state = {
        "swapped": sched.swapped[0],
        "running": sched.running[0],
        "waiting": sched.waiting[0],
    }
    assert engine.host.num_blocks  # the swapped request's KV is in host memory
    for state, seq in by_state.items():
        held = engine.allocator.stats().used_blocks
        engine.abort_request(seq.request_id)
        assert seq.status is Status.FINISHED and seq.finish_reason == "abort"
        assert not engine.host.holds(seq.request_id), state
        if state == "running":
            assert engine.allocator.stats().used_blocks < held
        engine.allocator.check()
    outs = {o.request_id: o for o in engine.step()}
    assert {rid: o.outputs[0].finish_reason for rid, o in outs.items()} == dict.fromkeys(
        ("r0", "r1", "r2"), "abort"
    )
    assert not engine.has_unfinished_requests()
    assert_all_released(engine)


def test_swap_round_trip_is_exact_and_measured(model, prompts, reference, monkeypatch):
    """On injected time that only block moves take, 1 s a block, a step's swap_time is the
    blocks it swapped out and in, and 0 without swaps."""
    fake = FakeTime()
    monkeypatch.setattr(time, "perf_counter", fake.perf_counter)
    engine = build(model, FreeListAllocator, FCFSScheduler, num_blocks=9, preemption_mode="swap")
    runner = engine.runner
    swap_out, swap_in = runner.swap_out, runner.swap_in

    def out(blocks):
        fake.sleep(len(blocks))
        return swap_out(blocks)

    def back(host, blocks, first=0):
        fake.sleep(len(blocks))
        return swap_in(host, blocks, first)

    monkeypatch.setattr(runner, "swap_out", out)
    monkeypatch.setattr(runner, "swap_in", back)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    steps = engine.recorder.steps
    assert sum(s["swap_out_blocks"] for s in steps) > 0
    assert [s["swap_time"] for s in steps] == [
        s["swap_out_blocks"] + s["swap_in_blocks"] for s in steps
    ]
    assert sum(s["num_swapped"] for s in engine.recorder.steps) > 0


def test_swap_space_limit_falls_back_to_recompute(model, prompts, reference):
    engine = build(
        model,
        FreeListAllocator,
        FCFSScheduler,
        num_blocks=9,
        preemption_mode="swap",
        swap_blocks=2,
    )
    outputs = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert max(s["swap_out_blocks"] for s in engine.recorder.steps) <= 2
    assert_all_released(engine)
