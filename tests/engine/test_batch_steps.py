"""Steps over the running batch (``Scheduler.schedule_batch``, ``engine.batch_steps``) give
the tables and outputs the general step gives, column by column, and keep their rows as the
running set moves: admissions, finishes, prompts in chunks, preemptions, stops on a token,
forks, aborts.

Each case replays the same requests twice, batch steps on and off, and compares the
recorder's step and request columns and every output returned; it also checks that the
batch decided most of the steps (else the comparison says nothing). Most cases run on the
model clock; the real engine's (the tiny model's forward, sampling, logprobs, EOS and stop
ids) compare all but the columns a measuring clock times."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import numpy as np
import pytest
from support import ROOT, LetterTokenizer, random_prompts

from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from harness.engine import LLMEngine, build_engine
from harness.engine.sampling_params import SamplingParams
from schedulers.batch import RunningBatch
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler
from schedulers.priority import PriorityScheduler
from schedulers.request import Status

PROFILE = str(ROOT / "results/baselines/profile-llama-tiny.json")


class Replayed(NamedTuple):
    engine: LLMEngine
    decided: int  # steps the batch decided (``runs``: the steps runs took)
    returned: list[tuple]  # per output a step returned: step, request, finished, tokens, time
    computed: list[str]  # the real runner's launch and wait calls, in order


def replay(
    model,
    allocator,
    scheduler,
    requests,
    *,
    batch_steps,
    num_blocks=64,
    abort=None,
    real=False,
    runs=None,
):
    """Replay ``requests`` (id, prompt, params, arrival) on the model clock (``real``: the
    model's forward on a virtual clock, its times left out of what is returned); the engine
    and how many of its steps the batch decided. ``abort``: (step, request id) aborted then.
    ``runs`` (True or False): drive ``LLMEngine.steps`` with decode runs on or off, count the
    steps runs take, and return the finished outputs alone, without the call's index (a
    run's call takes many steps)."""
    clock = {"clock": "virtual"} if real else {"clock": "model", "profile": PROFILE}
    engine = build_engine(model, allocator, scheduler, num_blocks=num_blocks,
                          batch_steps=batch_steps, decode_runs=bool(runs), **clock)  # fmt: skip
    scheduler = engine.scheduler
    decided = []
    name = "run_step" if runs is not None else "schedule_batch"
    decide = getattr(scheduler, name)

    def counted(arg):
        step = decide(arg)
        decided.append(step is not None)
        return step

    setattr(scheduler, name, counted)
    computed = []  # a model clock's are no-ops, which a batch step skips
    for name in ("launch", "wait") if real else ():
        call = getattr(engine.runner, name)

        def counted_call(outputs, call=call, name=name):
            computed.append(name)
            return call(outputs)

        setattr(engine.runner, name, counted_call)
    pending = sorted(requests, key=lambda r: r[3])
    steps, returned = 0, []
    while pending or engine.has_unfinished_requests():
        now = engine.clock.now()
        while pending and pending[0][3] <= now:
            rid, prompt, params, arrival = pending.pop(0)
            engine.add_request(rid, prompt, params, arrival_time=arrival)
        if not engine.has_unfinished_requests():
            engine.clock.wait_until(pending[0][3])
            continue
        if abort is not None and steps == abort[0]:
            engine.abort_request(abort[1])
        step = engine.step if runs is None else engine.steps
        for out in step(pending[0][3] if pending else None):
            if runs is not None and not out.finished:
                continue
            tokens = [tuple(c.token_ids) for c in out.outputs]
            when = None if real else out.finished_time
            got = [(c.finish_reason, c.stop_reason, repr(c.logprobs)) for c in out.outputs]
            index = steps if runs is None else None
            returned.append((index, out.request_id, out.finished, tokens, got, when))
            returned.append(repr(out.prompt_logprobs))
        steps += 1
    return Replayed(engine, sum(decided), returned, computed)


def requests(n, seed, *, max_tokens=(1, 40), params=None, shared=0):
    """``n`` requests of random prompts (4-60 tokens, ``shared`` leading tokens common to
    all) and outputs, arriving over ~1 s."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 60, n).tolist()
    prefix = random_prompts([shared], seed + 1)[0]
    prompts = [prefix + p for p in random_prompts(lengths, seed)]
    arrivals = np.sort(rng.uniform(0, 1.0, n)).tolist()
    outputs = rng.integers(*max_tokens, n).tolist()
    return [
        (
            f"r{i}",
            prompt,
            (params or {}).get(i) or SamplingParams(max_tokens=out, ignore_eos=True),
            arrival,
        )
        for i, (prompt, out, arrival) in enumerate(zip(prompts, outputs, arrivals, strict=True))
    ]


# What a measuring clock times (the real engine's): left out of its comparison.
TIMED = {"start_time", "duration", "forward_time", "build_time", "mlx_active_bytes",
         "mlx_peak_bytes", "first_scheduled_time", "first_token_time", "finish_time",
         "token_times"}  # fmt: skip


def assert_same_tables(a: Replayed, b: Replayed, timed: bool = True) -> None:
    """The same step and request columns, and the same outputs returned at each step (not
    ``timed``: but the columns a measuring clock times, ``TIMED``)."""
    assert a.returned == b.returned
    assert a.computed == b.computed
    ra, rb = a.engine.recorder, b.engine.recorder
    for name, (x, y) in {
        "steps": (ra.step_columns(), rb.step_columns()),
        "requests": (ra.request_columns(), rb.request_columns()),
    }.items():
        assert list(x) == list(y)
        for column in set(x) if timed else set(x) - TIMED:
            left, right = x[column], y[column]
            if isinstance(left, np.ndarray):
                np.testing.assert_array_equal(left, right, err_msg=f"{name}.{column}")
            else:
                assert [np.asarray(v).tolist() for v in left] == [
                    np.asarray(v).tolist() for v in right
                ], f"{name}.{column}"


FCFS = partial(FCFSScheduler, max_num_seqs=8)
CHUNKED = partial(ChunkedPrefillScheduler, max_num_seqs=8, max_chunk=16,
                  max_num_batched_tokens=24)  # fmt: skip
CASES = {
    "fcfs_free_list": (FreeListAllocator, FCFS, {}, 256),
    "fcfs_radix_shared_prefix": (RadixAllocator, FCFS, {"shared": 32}, 256),
    "fcfs_small_arena_preempts": (FreeListAllocator, FCFS, {}, 24),
    "radix_small_arena_evicts": (RadixAllocator, FCFS, {"shared": 16}, 24),
    "chunked_radix": (RadixAllocator, CHUNKED, {"shared": 16}, 256),
    "chunked_small_arena": (FreeListAllocator, CHUNKED, {}, 24),
    "fcfs_watermark": (
        FreeListAllocator,
        partial(FCFSScheduler, max_num_seqs=6, watermark=0.1),
        {},
        96,
    ),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_batch_steps_give_the_general_steps_tables(model, case, seed):
    allocator, scheduler, extra, num_blocks = CASES[case]
    reqs = requests(40, seed, **extra)
    general = replay(model, allocator, scheduler, reqs, batch_steps=False, num_blocks=num_blocks)
    batched = replay(model, allocator, scheduler, reqs, batch_steps=True, num_blocks=num_blocks)
    assert general.decided == 0
    steps = batched.engine.recorder.step_columns()
    num_steps = len(steps["step"])
    assert batched.decided > num_steps // 2, f"the batch decided {batched.decided} of {num_steps}"
    assert_same_tables(batched, general)
    if "small" in case:
        assert steps["preempted"].sum() > 0
    batched.engine.allocator.check()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_runs_give_single_steps_tables(model, case, seed):
    """``LLMEngine.steps`` with decode runs takes the steps single batch steps take: the same
    step and request columns and finished outputs; runs take a good part of the steps."""
    allocator, scheduler, extra, num_blocks = CASES[case]
    reqs = requests(40, seed, **extra)
    single = replay(model, allocator, scheduler, reqs, batch_steps=True, runs=False,
                    num_blocks=num_blocks)  # fmt: skip
    runs = replay(model, allocator, scheduler, reqs, batch_steps=True, runs=True,
                  num_blocks=num_blocks)  # fmt: skip
    assert single.decided == 0
    num_steps = len(runs.engine.recorder.step_columns()["step"])
    assert runs.decided > num_steps // 3, f"runs took {runs.decided} of {num_steps} steps"
    assert_same_tables(runs, single)
    runs.engine.allocator.check()


def test_stops_on_a_token_forks_and_an_abort_give_the_general_steps_tables(model):
    """Requests that may stop on a token (a stop id) stop inside the batch; n = 2 and an
    abort mid-run take the general step around them; the tables stay the general step's."""
    stop = SamplingParams(max_tokens=30, stop_token_ids=list(range(3, 1024, 9)))
    params = {
        0: SamplingParams(max_tokens=300, ignore_eos=True, output_kind="final_only"),
        3: stop,
        7: stop,
        11: SamplingParams(max_tokens=12, n=2, ignore_eos=True),
    }
    reqs = requests(30, 5, params=params)
    general = replay(model, FreeListAllocator, FCFS, reqs, batch_steps=False, abort=(30, "r0"))
    batched = replay(model, FreeListAllocator, FCFS, reqs, batch_steps=True, abort=(30, "r0"))
    assert batched.decided > 0
    assert_same_tables(batched, general)
    finish = batched.engine.recorder.request_columns()["finish_reason"]
    assert "stop" in finish and "abort" in finish


def test_a_policy_that_orders_or_preempts_otherwise_takes_no_batch_step(model):
    engine = build_engine(model, FreeListAllocator, partial(PriorityScheduler, max_num_seqs=4),
                          num_blocks=64, clock="model", profile=PROFILE)  # fmt: skip
    assert engine.scheduler.batch is None
    prefill_first = build_engine(model, FreeListAllocator,
                                 partial(FCFSScheduler, order="prefill_first"),
                                 num_blocks=64, clock="model", profile=PROFILE)  # fmt: skip
    assert prefill_first.scheduler.batch is None


class _Seq:
    """What the batch reads of a sequence."""

    def __init__(self, rid, prompt, computed, tokens, preemptions=0):
        self.request_id = rid
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = computed
        self.token_ids = list(range(tokens))
        self.preemptions = preemptions
        self.status = Status.RUNNING


def _batch(seqs):
    alloc = FreeListAllocator(num_blocks=64, block_size=4)
    for seq in seqs:
        alloc.allocate(seq.request_id, len(seq.token_ids))
    return RunningBatch(alloc, lambda seq: 100), alloc


def test_the_batch_reads_decodes_then_prompts_and_refuses_any_other_order():
    a, b = _Seq("a", 4, 5, 6), _Seq("b", 3, 6, 7, preemptions=2)  # decode
    c = _Seq("c", 20, 8, 20)  # a prompt in progress
    batch, alloc = _batch([a, b, c])
    assert batch.read([a, b, c])
    assert batch.decodes == 2 and batch.ids == ["a", "b", "c"]
    assert batch.limits == [8, 8, 20] and batch.held == [8, 8, 20]
    assert batch.preempts == [0, 2, 0]
    assert not batch.read([a, c, b])  # a decode behind a prompt: the general step's order
    assert batch.stale


def test_rows_close_up_when_some_leave_and_the_preemptions_list_is_a_new_one():
    seqs = [_Seq(r, 4, 5, 6, preemptions=i) for i, r in enumerate("abcd")]
    batch, _ = _batch(seqs)
    batch.read(seqs)
    before = batch.preempts
    batch.drop([0, 2])
    assert batch.ids == ["b", "d"] and batch.decodes == 2
    assert batch.preempts == [1, 3] and before == [0, 1, 2, 3]  # the old list unchanged


def test_a_prompt_done_joins_the_decodes_unless_one_admitted_earlier_is_not():
    a, p, q = _Seq("a", 4, 5, 6), _Seq("p", 20, 8, 20), _Seq("q", 20, 8, 20)
    batch, _ = _batch([a, p, q])
    batch.read([a, p, q])
    p.num_computed_tokens, p.token_ids = 20, list(range(21))  # p's prompt done, a token out
    batch.settle()
    assert batch.decodes == 2 and not batch.stale
    batch2, _ = _batch([a, p, q])
    p.num_computed_tokens, p.token_ids = 8, list(range(20))
    batch2.read([a, p, q])
    q.num_computed_tokens, q.token_ids = 20, list(range(21))  # q done before p
    batch2.settle()
    assert batch2.decodes == 1 and batch2.stale


@pytest.mark.parametrize("seed", range(100))
def test_random_configurations_give_the_general_steps_tables(model, seed):
    """A configuration drawn from ``seed``: allocator, policy (chunk and budget), arena,
    batch, watermark, shared prefix, output lengths, a few requests that may stop on a token
    or ask for two completions; batch steps on and off give the same columns and outputs,
    and so do runs of decode steps (the finished outputs)."""
    rng = np.random.default_rng(100 + seed)
    allocator = [FreeListAllocator, RadixAllocator][seed % 2]
    max_num_seqs = int(rng.integers(1, 12))
    watermark = float(rng.choice([0.0, 0.05]))
    if seed % 3 == 2:
        budget = int(rng.integers(max_num_seqs, 64))
        scheduler = partial(ChunkedPrefillScheduler, max_num_seqs=max_num_seqs,
                            max_chunk=int(rng.integers(1, 40)), max_num_batched_tokens=budget,
                            watermark=watermark)  # fmt: skip
    else:
        scheduler = partial(FCFSScheduler, max_num_seqs=max_num_seqs, watermark=watermark)
    num_blocks = int(rng.choice([20, 40, 256]))
    shared = int(rng.choice([0, 8, 24]))
    n = int(rng.integers(10, 40))
    params = {}
    for i in rng.choice(n, size=int(rng.integers(0, 4)), replace=False).tolist():
        params[i] = (
            SamplingParams(max_tokens=40, stop_token_ids=list(range(3, 1024, 13)))
            if i % 2
            else SamplingParams(max_tokens=10, n=2, ignore_eos=True)
        )
    reqs = requests(n, seed, max_tokens=(1, int(rng.integers(3, 80))), shared=shared,
                    params=params)  # fmt: skip
    general = replay(model, allocator, scheduler, reqs, batch_steps=False, num_blocks=num_blocks)
    batched = replay(model, allocator, scheduler, reqs, batch_steps=True, num_blocks=num_blocks)
    assert batched.decided > 0
    assert_same_tables(batched, general)
    batched.engine.allocator.check()
    ran = replay(model, allocator, scheduler, reqs, batch_steps=True, runs=True,
                 num_blocks=num_blocks)  # fmt: skip
    assert ran.decided > 0  # runs take 65 % of these configurations' steps
    assert_same_tables(ran, finished_only(general))
    ran.engine.allocator.check()


def finished_only(replayed: Replayed) -> Replayed:
    """``replayed`` with the outputs ``replay(..., runs=...)`` returns: the finished ones,
    without the step's index."""
    pairs = zip(replayed.returned[::2], replayed.returned[1::2], strict=True)
    kept = [[(None, *out[1:]), logprobs] for out, logprobs in pairs if out[2]]
    return replayed._replace(returned=[x for pair in kept for x in pair])


REAL_CASES = {
    "fcfs_free_list": (FreeListAllocator, FCFS, {}, 256),
    "radix_small_arena_evicts": (RadixAllocator, FCFS, {"shared": 16}, 24),
    "chunked_radix": (RadixAllocator, CHUNKED, {"shared": 16}, 256),
}


@pytest.mark.parametrize("case", list(REAL_CASES))
def test_the_real_engine_takes_batch_steps_with_the_general_steps_tokens(model, case):
    """The tiny model's forward over batch steps: the same tokens, logprobs, prompt
    logprobs, stops (EOS, stop ids, stop strings, min_tokens, length), step and request
    columns (but the timed) and the runner's launches and waits as over the general step;
    requests that sample (seeded), ask for logprobs or prompt logprobs, or stop on a token,
    among greedy ones; every request arrives at once, so the schedule does not depend on
    the measured times. A letter a token (``LetterTokenizer``) gives stop strings a text."""
    allocator, scheduler, extra, num_blocks = REAL_CASES[case]
    model = dataclasses.replace(model, tokenizer=LetterTokenizer())
    stop_ids = list(range(3, 1024, 7))
    params = {
        1: SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True),
        2: SamplingParams(max_tokens=20, logprobs=2, ignore_eos=True),
        3: SamplingParams(max_tokens=30, stop=tuple("aeiou"), ignore_eos=True),
        4: SamplingParams(max_tokens=25, stop_token_ids=stop_ids),
        5: SamplingParams(max_tokens=25, min_tokens=8, stop_token_ids=stop_ids),
        6: SamplingParams(max_tokens=40),  # EOS may stop it
        9: SamplingParams(
            max_tokens=25, temperature=1.0, top_p=0.9, seed=3, stop_token_ids=stop_ids
        ),  # fmt: skip
        # Let in by a batch step (eight run at once): its prompt's logprobs in one.
        10: SamplingParams(max_tokens=12, prompt_logprobs=1, ignore_eos=True),
        11: SamplingParams(max_tokens=9, logprobs=1, temperature=0.5, seed=1, ignore_eos=True),
    }
    reqs = [(rid, p, sp, 0.0) for rid, p, sp, _ in requests(12, 3, params=params, **extra)]
    general = replay(model, allocator, scheduler, reqs, batch_steps=False,
                     num_blocks=num_blocks, real=True)  # fmt: skip
    batched = replay(model, allocator, scheduler, reqs, batch_steps=True,
                     num_blocks=num_blocks, real=True)  # fmt: skip
    assert general.decided == 0
    num_steps = len(batched.engine.recorder.step_columns()["step"])
    assert batched.decided > num_steps // 2, f"the batch decided {batched.decided} of {num_steps}"
    assert_same_tables(batched, general, timed=False)
    columns = batched.engine.recorder.request_columns()
    stops = {rid: r for rid, r in zip(columns["request_id"], columns["finish_reason"],
                                       strict=True)}  # fmt: skip
    assert stops["r3"] == "stop" and "length" in stops.values()
    assert sum(r == "stop" for r in stops.values()) >= 3
    batched.engine.allocator.check()
