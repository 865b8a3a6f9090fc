"""Policy behaviour: priority order, victims, aging and preemption for priority; chunked
prefill's budget and decode fairness; prefill-first; batch constraints; the swap copy."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import mlx.core as mx
import pytest
from reference import mlx_lm_tokens
from support import build_with_policy, random_prompts

import harness  # noqa: F401  (BLAS switch before mlx)
from allocators.free_list import FreeListAllocator
from harness.engine.builder import build_engine
from harness.engine.kv_cache import KVArena
from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler
from schedulers.priority import PriorityScheduler
from schedulers.request import Status

PROFILE = Path(__file__).resolve().parents[2] / "results/baselines/profile-llama-tiny.json"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    (drawn,) = random_prompts([n], seed)
    return drawn


def build(model, policy, *, num_blocks, block_size=4, max_model_len=None, **kwargs):
    return build_with_policy(
        model,
        FreeListAllocator,
        policy,
        block_size=block_size,
        num_blocks=num_blocks,
        engine_options={"max_model_len": max_model_len},
        **kwargs,
    )


def run(engine, limit=2000):
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("requests did not finish")


# -- priority -------------------------------------------------------------------------------
def test_priority_order_ties_by_arrival():
    sched = PriorityScheduler(FreeListAllocator(num_blocks=8, block_size=4))
    for i, (prio, arrival) in enumerate(zip([2, 1, 1, 0], [1, 3, 2, 4], strict=True)):
        sched.add(Seq(str(i), [1, 2], greedy(1), arrival_time=arrival, priority=prio))
    # Room for all four: one step admits them, in the waiting order.
    assert [s.seq.request_id for s in sched.schedule(5.0).scheduled] == ["3", "2", "1", "0"]


def test_priority_admission_order_in_the_engine(model):
    engine = build(model, PriorityScheduler, num_blocks=64, max_num_seqs=1)
    for i, (prio, arrival) in enumerate(zip([2, 1, 1, 0], [1, 3, 2, 4], strict=True)):
        engine.add_request(str(i), prompt(5, i), greedy(2), arrival_time=arrival, priority=prio)
    run(engine)
    rows = sorted(engine.recorder.requests, key=lambda r: r["first_scheduled_time"])
    assert [r["request_id"] for r in rows] == ["3", "2", "1", "0"]


def test_aging_lets_an_old_low_priority_request_go_first():
    def order(rate):
        sched = PriorityScheduler(FreeListAllocator(num_blocks=8, block_size=4), aging_rate=rate)
        sched.add(Seq("old", [1], greedy(1), arrival_time=0.0, priority=5))
        sched.add(Seq("new", [1], greedy(1), arrival_time=10.0, priority=0))
        return [s.seq.request_id for s in sched.schedule(10.0).scheduled]

    assert order(0.0) == ["new", "old"]
    assert order(1.0) == ["old", "new"]  # effective 5 - 10 beats 0 - 0 after 10 s of waiting


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_head_of_the_line_is_the_queues_sorted_by_rank_at_every_step(model, mode):
    """The policy keeps its incoming order as the queues change (not sorted every step):
    after every step of a churning replay (tied arrivals and priorities, n > 1 forks that
    wait first in line, preemptions by recompute or swap, aborts), the request it brings in
    next is the first of swapped + waiting stably sorted by rank."""
    rng = random.Random(mode)
    engine = build_engine(
        model,
        partial(FreeListAllocator),
        partial(PriorityScheduler, preemption_mode=mode, swap_blocks=64, max_num_seqs=4),
        block_size=16,
        num_blocks=6,
        max_model_len=64,
        clock="model",
        profile=str(PROFILE),
    )
    sched, added, checked, swapped = engine.scheduler, 0, 0, 0
    for step in range(300):
        if rng.random() < 0.4 and added < 50:
            params = SamplingParams(
                max_tokens=rng.randrange(1, 30), n=rng.choice([1, 1, 3]), ignore_eos=True
            )
            tokens = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 24))]
            arrival = rng.choice([0.0, step / 100])
            engine.add_request(
                f"r{added}", tokens, params, arrival_time=arrival, priority=rng.choice([0, 1])
            )
            added += 1
        if rng.random() < 0.03 and added:
            engine.abort_request(f"r{rng.randrange(added)}")
        if engine.has_unfinished_requests():
            engine.step()
            swapped += bool(sched.swapped)
            queued = sorted(sched.swapped + list(sched.waiting), key=sched.rank)
            head = next((s for s in queued if s not in sched.parked), None)
            assert sched.next_incoming() is head, step
            checked += head is not None
    assert checked > 100  # steps with someone in line
    assert engine.recorder.step_columns()["preempted"].sum() > 0
    assert (swapped > 0) == (mode == "swap")


@pytest.mark.parametrize("victim, expected", [("priority", "low"), ("fcfs", "mid")])
def test_memory_pressure_preempts_the_chosen_victim(model, victim, expected):
    """'low' (priority 2) is admitted first and runs long; 'high' and 'mid' (0 and 1) join
    later. When blocks run out, the priority victim is 'low' (although admitted first);
    the fcfs victim is the latest admitted, 'mid'. Tokens stay mlx_lm's either way."""
    engine = build(
        model,
        PriorityScheduler,
        num_blocks=10,
        victim=victim,
        preempt_lower=False,
        max_model_len=64,
        max_num_batched_tokens=64,
    )
    lens = {"low": (8, 20), "high": (8, 8), "mid": (8, 8)}
    engine.add_request("low", prompt(8, 0), greedy(20), priority=2)
    engine.step()
    engine.add_request("high", prompt(8, 1), greedy(8), priority=0)
    engine.add_request("mid", prompt(8, 2), greedy(8), priority=1)
    done = run(engine)
    preempted = {r["request_id"] for r in engine.recorder.requests if r["preemptions"]}
    assert preempted == {expected}
    for rid, (n, m) in lens.items():
        seed = list(lens).index(rid)
        assert done[rid].outputs[0].token_ids == mlx_lm_tokens(model, prompt(n, seed), m)


VICTIM_SPECS = {  # id: (priority, arrival, computed tokens, output tokens of max_tokens=10)
    "a": (0, 0.0, 30, 2),
    "b": (1, 1.0, 12, 9),
    "c": (1, 2.0, 5, 1),
}


def decoding_in_a_full_arena(victim: str, specs: dict) -> PriorityScheduler:
    """``specs``' sequences running (admitted in their order), each with one token left to
    compute, their computed tokens filling an arena of blocks of 2 exactly: one whose tokens
    fill its last block needs another to grow, and only a victim can give it one."""
    blocks = sum(computed // 2 + computed % 2 for _, _, computed, _ in specs.values())
    sched = PriorityScheduler(FreeListAllocator(num_blocks=blocks, block_size=2), victim=victim)
    for rid, (prio, arrival, computed, outputs) in specs.items():
        seq = Seq(rid, [1] * (computed + 1 - outputs), greedy(10), arrival, prio)
        seq.token_ids += [1] * outputs
        seq.num_computed_tokens = computed
        seq.status = Status.RUNNING
        sched.allocator.allocate(rid, computed)
        sched.running.append(seq)
    return sched


@pytest.mark.parametrize(
    "victim, expected",
    [
        ("priority", "c"),  # lowest rank: priority 1, latest arrival
        ("fcfs", "c"),  # latest admitted
        ("shortest_remaining", "b"),  # 1 output token left
        ("recompute_cheapest", "c"),  # 5 computed tokens
    ],
)
def test_victim_policies_pick_as_documented(victim, expected):
    # 'a' (30 computed tokens: 15 full blocks) grows first and finds no free block; every
    # running sequence is a candidate. The victim's blocks are enough for all the rest.
    sched = decoding_in_a_full_arena(victim, VICTIM_SPECS)
    assert [seq.request_id for seq, _ in sched.schedule(0.0).preempted] == [expected]


def test_a_victim_is_picked_among_the_sequences_not_yet_scheduled():
    # 'c' outranks the others here, so it grows first (its 6th slot is in its 3rd block);
    # when 'a' then finds no free block, the cheapest to recompute among 'a' and 'b' goes.
    specs = {**VICTIM_SPECS, "c": (-1, 2.0, 5, 1)}
    sched = decoding_in_a_full_arena("recompute_cheapest", specs)
    plan = sched.schedule(0.0)
    assert [seq.request_id for seq, _ in plan.preempted] == ["b"]
    assert [s.seq.request_id for s in plan.scheduled] == ["c", "a"]


@pytest.mark.parametrize("victim", ["priority", "fcfs", "shortest_remaining", "recompute_cheapest"])
def test_every_victim_policy_keeps_mlx_lm_tokens(model, victim):
    engine = build(model, PriorityScheduler, num_blocks=10, victim=victim)
    prompts = [prompt(n, i) for i, n in enumerate([9, 14, 5, 11])]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(10), priority=i % 2)
    done = run(engine)
    assert sum(r["preemptions"] for r in engine.recorder.requests) > 0
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == mlx_lm_tokens(model, p, 10)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_higher_priority_arrival_preempts_a_lower_running_one(model, mode):
    engine = build(model, PriorityScheduler, num_blocks=8, preemption_mode=mode)
    engine.add_request("low", prompt(14, 0), greedy(10), priority=5)
    engine.step()  # 'low' holds 4 of 8 blocks
    engine.add_request("high", prompt(20, 1), greedy(4), priority=0)  # 5 blocks: 4 are free
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["high"]
    done = run(engine)
    assert done["low"].outputs[0].token_ids == mlx_lm_tokens(model, prompt(14, 0), 10)
    assert done["high"].outputs[0].token_ids == mlx_lm_tokens(model, prompt(20, 1), 4)
    rows = {r["request_id"]: r for r in engine.recorder.requests}
    assert rows["low"]["preemptions"] == 1 and rows["high"]["preemptions"] == 0
    assert rows["high"]["finish_time"] < rows["low"]["finish_time"]


# -- chunked prefill ------------------------------------------------------------------------
def test_chunked_prefill_keeps_the_budget_and_never_starves_decodes(model):
    budget, chunk = 16, 8
    engine = build(
        model,
        ChunkedPrefillScheduler,
        num_blocks=128,
        max_chunk=chunk,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        max_model_len=512,
    )
    plans = []  # per step, each row's (request id, tokens computed), from either decision
    scheduler = engine.scheduler
    schedule, schedule_batch = scheduler.schedule, scheduler.schedule_batch

    def general(now):
        plan = schedule(now)
        plans.append([(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled])
        return plan

    def over_the_batch(now):
        step = schedule_batch(now)
        if step is not None:
            rows = [(rid, 1) for rid in scheduler.batch.ids[: len(step.starts)]]
            events = step.events.scheduled if step.events is not None else []
            plans.append(rows + [(s.seq.request_id, s.num_new_tokens) for s in events])
        return step

    scheduler.schedule, scheduler.schedule_batch = general, over_the_batch
    for i in range(3):
        engine.add_request(f"d{i}", prompt(4, i), greedy(30))
    engine.step()  # the three short prompts prefill; from now on they decode
    engine.add_request("long", prompt(200, 9), greedy(3))
    done = run(engine)
    steps = engine.recorder.steps
    assert all(s["prefill_tokens"] + s["decode_tokens"] <= budget for s in steps)
    assert all(n <= chunk for p in plans for _, n in p)
    # While the long prompt prefills (25 chunks of 8), each short request decodes every step.
    long_steps = [p for p in plans if any(rid == "long" and n > 1 for rid, n in p)]
    assert len(long_steps) == 200 // chunk
    for p in long_steps:
        assert {rid for rid, n in p if n == 1} == {"d0", "d1", "d2"}
    assert done["long"].outputs[0].token_ids == mlx_lm_tokens(model, prompt(200, 9), 3)
    for i in range(3):
        assert done[f"d{i}"].outputs[0].token_ids == mlx_lm_tokens(model, prompt(4, i), 30)


def test_chunked_budget_must_cover_one_decode_per_sequence():
    with pytest.raises(ValueError, match="decodes would wait"):
        ChunkedPrefillScheduler(
            FreeListAllocator(num_blocks=8, block_size=4),
            max_num_batched_tokens=8,
            max_num_seqs=16,
        )


# -- FCFS order -----------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["decode_first", "prefill_first"])
def test_prefill_first_admits_before_decodes_take_the_budget(model, order):
    """Budget 64 = max_model_len; four requests decode when a 62-token prompt arrives.
    Decode-first runs the 4 decodes and leaves 60 tokens: the prompt waits a step.
    Prefill-first runs the prompt at once and 2 of the 4 decodes."""
    engine = build(
        model,
        FCFSScheduler,
        num_blocks=128,
        order=order,
        max_model_len=64,
        max_num_batched_tokens=64,
    )
    for i in range(4):
        engine.add_request(f"d{i}", prompt(3, i), greedy(6))
    engine.step()
    engine.add_request("p", prompt(62, 7), greedy(2))
    engine.step()
    last = engine.recorder.steps[-1]
    if order == "decode_first":
        assert (last["prefill_tokens"], last["decode_tokens"]) == (0, 4)
    else:
        assert (last["prefill_tokens"], last["decode_tokens"]) == (62, 2)
    done = run(engine)
    assert done["p"].outputs[0].token_ids == mlx_lm_tokens(model, prompt(62, 7), 2)
    for i in range(4):
        assert done[f"d{i}"].outputs[0].token_ids == mlx_lm_tokens(model, prompt(3, i), 6)


# -- batch constraints ----------------------------------------------------------------------
def test_a_hold_ends_at_the_next_arrival(model):
    engine = build(model, FCFSScheduler, num_blocks=64, min_batch_size=3, max_wait=10.0)
    engine.add_request("a", prompt(5, 0), greedy(2), arrival_time=0.0)
    engine.step(next_arrival=0.2)
    assert engine.recorder.steps[-1]["batch_size"] == 0
    assert 0.2 <= engine.clock.now() < 10.0  # woke for the arrival, not at max_wait


def test_min_batch_size_waits_for_a_batch_but_not_forever(model):
    engine = build(model, FCFSScheduler, num_blocks=64, min_batch_size=3, max_wait=0.5)
    engine.add_request("a", prompt(5, 0), greedy(2), arrival_time=0.0)
    engine.step()
    assert engine.recorder.steps[-1]["batch_size"] == 0  # held: one request, not three
    assert engine.clock.now() >= 0.5  # the virtual clock idled to the end of max_wait
    run(engine)
    assert engine.recorder.requests[0]["first_scheduled_time"] >= 0.5

    engine = build(model, FCFSScheduler, num_blocks=64, min_batch_size=3, max_wait=0.5)
    for i in range(3):
        engine.add_request(str(i), prompt(5, i), greedy(2), arrival_time=0.0)
    engine.step()
    assert engine.recorder.steps[0]["batch_size"] == 3  # a full batch runs at once


def test_watermark_keeps_blocks_free_for_running_sequences(model):
    # 16 blocks, watermark 50 %: a 12-token prompt (3 blocks) is admitted only while
    # 8 blocks stay free, so at most two run together; the first comes in regardless.
    engine = build(model, FCFSScheduler, num_blocks=16, watermark=0.5)
    for i in range(4):
        engine.add_request(str(i), prompt(12, i), greedy(4))
    done = run(engine)
    assert max(s["num_running"] for s in engine.recorder.steps) == 2
    for i in range(4):
        assert done[str(i)].outputs[0].token_ids == mlx_lm_tokens(model, prompt(12, i), 4)


@pytest.mark.parametrize(
    "policy, kwargs, match",
    [
        (FCFSScheduler, {"preemption_mode": "drop"}, "preemption_mode"),
        (FCFSScheduler, {"order": "random"}, "order"),
        (FCFSScheduler, {"min_batch_size": 64, "max_num_seqs": 8}, "min_batch_size"),
        (FCFSScheduler, {"max_wait": -1.0}, "max_wait"),
        (FCFSScheduler, {"swap_blocks": 0}, "swap_blocks"),
        (PriorityScheduler, {"victim": "oldest"}, "victim"),
        (PriorityScheduler, {"aging_rate": -0.1}, "aging_rate"),
        (ChunkedPrefillScheduler, {"max_chunk": 0}, "max_chunk"),
    ],
)
def test_bad_options_name_the_field(policy, kwargs, match):
    with pytest.raises(ValueError, match=match):
        policy(FreeListAllocator(num_blocks=8, block_size=4), **kwargs)


# -- the host copy --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_arena_swap_round_trip_is_bit_exact(dtype):
    arena = KVArena(
        num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype
    )
    for arrays in (arena.keys, arena.values):
        for layer in range(2):
            arrays[layer] = mx.random.normal(arrays[layer].shape).astype(dtype)
    before = [arena.blocks(mx.array(a)) for a in arena.keys + arena.values]
    host = arena.swap_out([4, 1, 2])
    assert host.nbytes == 3 * arena.nbytes // arena.num_blocks  # three blocks' K and V
    arena.swap_in(host, [0, 5], first=1)  # host blocks 1, 2 (device 1, 2) -> device 0, 5
    after = [arena.blocks(a) for a in arena.keys + arena.values]
    for old, new in zip(before, after, strict=True):
        assert mx.array_equal(new[0], old[1]) and mx.array_equal(new[5], old[2])
        assert mx.array_equal(new[1:5], old[1:5])


def test_arena_copy_blocks_reads_every_source_before_writing():
    """A relocation onto an overlapping run (2..4 -> 3..5) and a scattered copy (0 -> 7)."""
    arena = KVArena(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    for arrays in (arena.keys, arena.values):
        for layer in range(2):
            arrays[layer] = mx.random.normal(arrays[layer].shape)
    before = [arena.blocks(mx.array(a)) for a in arena.keys + arena.values]
    arena.copy_blocks([(2, 3), (3, 4), (4, 5), (0, 7)])
    after = [arena.blocks(a) for a in arena.keys + arena.values]
    for old, new in zip(before, after, strict=True):
        assert mx.array_equal(new[3:6], old[2:5]) and mx.array_equal(new[7], old[0])
        assert mx.array_equal(new[:3], old[:3]) and mx.array_equal(new[6], old[6])
