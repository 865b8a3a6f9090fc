"""The engine against mlx_lm itself: same random model, same tokens, same logits.

Every allocator x block sizes 1, 16, 256 x batch 1 and 8 x prompts of 1 to 300 tokens.
The reference is mlx_lm's own single-sequence ``generate_step`` over its ``KVCache``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference import mlx_lm_tokens
from support import ALLOCATORS, FakeTime, LetterTokenizer, assert_all_free, build_with_policy

from allocators.buddy import BuddyAllocator
from allocators.contiguous import ContiguousAllocator
from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from harness.engine import RequestError, build_engine
from harness.engine.clock import VirtualClock
from harness.engine.intake import OutputCutWarning
from harness.engine.kv_cache import KVArena
from harness.engine.model_runner import ModelRunner, Row
from harness.engine.sampling import argmax_on_host, sample
from harness.engine.sampling_params import SamplingParams
from harness.platform.models import random_model
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler
from schedulers.priority import PriorityScheduler

PROMPT_LENS = [1, 7, 16, 17, 63, 128, 255, 300]
PROMPT_SEED = 1
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_engine(model, allocator, *, block_size, num_blocks, max_num_seqs=8, **alloc_kwargs):
    return build_with_policy(
        model,
        partial(allocator, **alloc_kwargs),
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
    )


def blocks_needed(block_size: int) -> int:
    return sum(-(-(n + MAX_TOKENS) // block_size) for n in PROMPT_LENS)


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_tokens_identical_to_mlx_lm(model, prompts, reference, allocator, block_size, batch):
    # Room for every sequence at once, with slack so regions can relocate instead of failing.
    num_blocks = 2 * blocks_needed(block_size) + 8
    engine = make_engine(
        model, allocator, block_size=block_size, num_blocks=num_blocks, max_num_seqs=batch
    )
    outputs = engine.generate(prompts, GREEDY)
    for out, ref in zip(outputs, reference, strict=True):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
    assert_all_free(engine)


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_teacher_forced_logits_match(model, prompts, allocator, block_size):
    """Prefill in two chunks (the second continues the cached prefix), then compare the
    logits at every position with mlx_lm's full forward, in fp32 within 1e-4."""
    alloc = allocator(num_blocks=blocks_needed(block_size) * 2 + 8, block_size=block_size)
    arena = KVArena(
        num_layers=model.num_layers,
        num_blocks=alloc.num_blocks,
        block_size=block_size,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
    )
    runner = ModelRunner(model, arena)
    cuts = [max(1, n // 3) for n in PROMPT_LENS]
    got: list[list[mx.array]] = [[] for _ in prompts]
    for lo_of, hi_of in [(lambda i: 0, lambda i: cuts[i]), (lambda i: cuts[i], lambda i: None)]:
        rows, owners = [], []
        for i, p in enumerate(prompts):
            lo, hi = lo_of(i), hi_of(i) or len(p)
            if hi <= lo:
                continue
            allocation = alloc.allocate(str(i), hi)
            runner.copy_blocks(allocation.copies)
            rows.append(Row(p[lo:hi], lo, alloc.block_table(str(i)), num_logits=hi - lo))
            owners.append((i, hi - lo))
        logits = runner.run(rows)
        k = 0
        for i, n in owners:
            got[i].append(logits[k : k + n])
            k += n
    for i, p in enumerate(prompts):
        ref = model.model(mx.array([p]))[0]
        assert mx.abs(mx.concatenate(got[i]) - ref).max().item() < 1e-4, PROMPT_LENS[i]
        alloc.free(str(i))
    alloc.check()


def test_prefix_cache_hit_gives_same_tokens(model, prompts, reference):
    engine = make_engine(model, RadixAllocator, block_size=16, num_blocks=256)
    engine.generate([prompts[7]], GREEDY)  # 300 tokens: 18 full blocks get cached
    again = engine.generate([prompts[7]], GREEDY)[0]
    assert again.outputs[0].token_ids == reference[7]
    cached = engine.recorder.requests[-1]["cached_tokens"]
    assert cached == 288  # 18 blocks; the last token (and its block tail) recomputed
    assert_all_free(engine)


@pytest.mark.parametrize(
    "allocator", [ContiguousAllocator, BuddyAllocator], ids=lambda c: c.__name__
)
def test_region_allocators_relocate_and_stay_identical(model, prompts, reference, allocator):
    # Tight arena: neighbours block each other's growth, so regions must move.
    engine = make_engine(model, allocator, block_size=1, num_blocks=blocks_needed(1) + 64)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert engine.allocator.stats().relocations > 0
    assert_all_free(engine)


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_preemption_under_a_tiny_arena_loses_nothing(model, allocator):
    # Eight 60-token prompts fill 32 of 34 blocks at admission; their decodes then cross
    # into a fifth block each, which only two of them can get: the rest are preempted.
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 1024, 60).tolist() for _ in range(8)]
    reference = [mlx_lm_tokens(model, p, MAX_TOKENS) for p in prompts]
    engine = make_engine(model, allocator, block_size=16, num_blocks=34)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert sum(r["preemptions"] for r in engine.recorder.requests) > 0
    assert_all_free(engine)


def test_decode_crosses_block_boundaries(model):
    # 14-token prompt, 10 new tokens, block size 4: the table grows mid-decode 3 times.
    prompt = list(range(3, 17))
    ref = mlx_lm_tokens(model, prompt, 10)
    engine = make_engine(model, FreeListAllocator, block_size=4, num_blocks=16)
    assert engine.generate([prompt], GREEDY)[0].outputs[0].token_ids == ref


def test_seeded_sampling_is_reproducible(model, prompts):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=8, seed=s, ignore_eos=True)
        for s in (1, 2, 1)
    ]
    picks = prompts[1:4]

    def run(batch):
        engine = make_engine(
            model, FreeListAllocator, block_size=16, num_blocks=128, max_num_seqs=batch
        )
        return [o.outputs[0].token_ids for o in engine.generate(picks, params)]

    together, alone = run(8), run(1)
    assert together == alone  # a request's tokens do not depend on its batch
    assert together[0] != together[1]


def test_abort_frees_blocks_at_once(model, prompts):
    engine = make_engine(model, FreeListAllocator, block_size=16, num_blocks=128)
    engine.add_request("a", prompts[6], GREEDY)
    engine.add_request("b", prompts[7], GREEDY)
    engine.step()
    assert engine.allocator.stats().used_blocks > 0
    engine.abort_request("a")
    engine.abort_request("b")
    assert_all_free(engine)
    outs = engine.step()
    assert {o.request_id: o.outputs[0].finish_reason for o in outs} == {"a": "abort", "b": "abort"}
    assert not engine.has_unfinished_requests()


def test_prompt_that_can_never_fit_is_aborted_with_a_reason(model, prompts):
    engine = make_engine(model, FreeListAllocator, block_size=16, num_blocks=8)  # 128 slots
    outs = engine.generate([prompts[7], prompts[1]], GREEDY)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert "KV arena" in outs[0].abort_reason
    assert outs[1].outputs[0].finish_reason == "length"


def test_an_output_cut_to_fit_max_model_len_is_said_once_per_engine(model):
    engine = build_engine(model, FreeListAllocator, FCFSScheduler, num_blocks=8, max_model_len=40)
    asks = SamplingParams(temperature=0, max_tokens=10**9)
    with pytest.warns(OutputCutWarning) as said:
        outs = engine.generate([[1, 2, 3], [4, 5]], asks)
    assert [str(w.message) for w in said] == [
        "request 'gen-0': max_tokens=1000000000 does not fit max_model_len=40 after its "
        "3-token prompt: its output stops at 37 tokens (finish_reason='length'); said once, "
        "for this engine's first such request"
    ]
    assert [len(o.outputs[0].token_ids) for o in outs] == [37, 38]
    assert {o.outputs[0].finish_reason for o in outs} == {"length"}


@pytest.mark.parametrize(
    "prompt, match",
    [([], "empty"), ([5, 99999], "outside the vocabulary"), ("text", "tokenizer")],
)
def test_bad_requests_name_the_problem(model, prompt, match):
    engine = make_engine(model, FreeListAllocator, block_size=16, num_blocks=8)
    with pytest.raises(RequestError, match=match):
        engine.add_request("x", prompt, GREEDY)


def test_requests_added_and_aborted_from_another_thread(model, prompts, reference):
    engine = make_engine(model, FreeListAllocator, block_size=16, num_blocks=256)
    engine.add_request("first", prompts[0], GREEDY)
    finished: dict[str, list[int]] = {}

    def client():
        for i in range(1, 6):
            engine.add_request(f"r{i}", prompts[i], GREEDY)
        engine.add_request("doomed", prompts[7], GREEDY)
        engine.abort_request("doomed")

    thread = threading.Thread(target=client)
    thread.start()
    while thread.is_alive() or engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    thread.join()
    assert finished["first"] == reference[0]
    assert all(finished[f"r{i}"] == reference[i] for i in range(1, 6))
    assert "doomed" in finished
    assert_all_free(engine)


def test_a_token_is_stamped_when_it_exists_after_sampling(model, prompts, monkeypatch):
    """A sampler that takes 0.2 s (of injected time, the only time that passes) delays the
    first token: TTFT is those 0.2 s (stamped before sampling, it would be 0)."""
    fake = FakeTime()
    monkeypatch.setattr(time, "perf_counter", fake.perf_counter)

    def slow(*args, **kwargs):
        fake.sleep(0.2)
        return sample(*args, **kwargs)

    monkeypatch.setattr("harness.engine.step_sampler.sample", slow)
    engine = make_engine(model, FreeListAllocator, block_size=16, num_blocks=64)
    # A sampled request: the host sampler runs (greedy ones sample on the device).
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=1)
    engine.add_request("a", prompts[1], sampled, 0.0)
    engine.step()
    (row,) = engine.recorder.requests
    (step,) = engine.recorder.steps
    assert row["first_token_time"] - row["arrival_time"] == pytest.approx(0.2)
    assert step["start_time"] + step["duration"] == pytest.approx(0.2)


class HandOver(VirtualClock):
    """Reads 0 s until the engine's lock is let go, 5 s after; says when it was read."""

    def __init__(self) -> None:
        super().__init__()
        self.read, self.released = threading.Event(), threading.Event()

    def now(self) -> float:
        self.read.set()
        return 5.0 if self.released.is_set() else 0.0


def test_a_request_from_another_thread_arrives_when_it_is_handed_over(model, prompts):
    """Arrival is stamped before add_request waits for the engine's lock, not after: at 0 s,
    while a step holds the lock, not at the 5 s the clock reads once it is let go."""
    engine = build_engine(model, FreeListAllocator, FCFSScheduler, num_blocks=64)
    engine.clock = clock = HandOver()
    with engine.lock:  # a step in progress
        client = threading.Thread(target=engine.add_request, args=("a", prompts[1], GREEDY))
        client.start()
        # Read while the lock is held, or (stamped after the lock) never: the wait only bounds
        # how long a wrong engine holds the test up before it fails below.
        clock.read.wait(timeout=60)
        clock.released.set()
    client.join()
    assert engine.scheduler.waiting[0].arrival_time == 0.0


def test_stop_strings_and_text_prompts_with_a_tokenizer(model):
    loaded = dataclasses.replace(model, tokenizer=LetterTokenizer())
    engine = make_engine(loaded, FreeListAllocator, block_size=16, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = engine.generate(["hello"], params)[0].outputs[0]
    assert ref.token_ids == mlx_lm_tokens(model, LetterTokenizer().encode("hello"), 30)
    assert ref.text == LetterTokenizer().decode(ref.token_ids)
    # The first two-letter string that appears after the third token: it stops there.
    stop = ref.text[3:5]
    cut = ref.text.index(stop)
    out = engine.generate(["hello"], dataclasses.replace(params, stop=(stop,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ref.token_ids[: cut + 2]
    assert out.text == ref.text[:cut]


SMOLLM2_QUESTIONS = [
    "What is 2+2?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea, then one about mountains, and end with a question.",
]


@pytest.mark.slow
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "scheduler",
    [
        FCFSScheduler,
        PriorityScheduler,
        partial(ChunkedPrefillScheduler, max_chunk=16, max_num_batched_tokens=24, max_num_seqs=8),
    ],
    ids=["fcfs", "priority", "chunked16"],
)
def test_smollm2_greedy_tokens_identical_to_mlx_lm(smollm2, allocator, scheduler):
    """The real trained model (model=smollm2) through every allocator and scheduler: greedy
    tokens equal mlx_lm's own single-sequence generation, with peaked logits, not flat ones."""
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer.encode("The capital of France is")] + [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in SMOLLM2_QUESTIONS
    ]
    reference = _smollm2_reference(smollm2, prompts)
    engine = build_engine(
        smollm2, allocator, scheduler, block_size=16, num_blocks=2 * blocks_for(prompts, 16) + 8
    )
    params = SamplingParams(temperature=0, max_tokens=SMOLLM2_TOKENS, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert [out.outputs[0].token_ids for out in outputs] == reference
    assert tokenizer.decode(reference[0]).lstrip().startswith("Paris")
    assert_all_free(engine)


SMOLLM2_TOKENS = 12
_SMOLLM2_REFERENCE: dict[tuple, list[int]] = {}


def _smollm2_reference(smollm2, prompts) -> list[list[int]]:
    """mlx_lm's tokens for each prompt, computed once per session."""
    for p in prompts:
        if tuple(p) not in _SMOLLM2_REFERENCE:
            _SMOLLM2_REFERENCE[tuple(p)] = mlx_lm_tokens(smollm2, p, SMOLLM2_TOKENS)
    return [_SMOLLM2_REFERENCE[tuple(p)] for p in prompts]


def blocks_for(prompts, block_size: int) -> int:
    return sum(-(-(len(p) + SMOLLM2_TOKENS) // block_size) for p in prompts)


def test_a_greedy_row_below_min_tokens_skips_its_banned_argmax(model, prompts, reference):
    """Greedy rows whose argmax is a stop token they may not take yet (below ``min_tokens``)
    leave the one-argmax path: the second token differs from mlx_lm's, whose argmax it was."""
    stop = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=4,
        stop_token_ids=(reference[0][1],),
    )  # fmt: skip
    engine = make_engine(
        model, FreeListAllocator, block_size=16, num_blocks=2 * blocks_needed(16) + 8
    )
    (out,) = engine.generate([prompts[0]], stop)
    tokens = out.outputs[0].token_ids
    assert tokens[0] == reference[0][0] and tokens[1] != reference[0][1]
    assert len(tokens) >= 4


def host_draws(engine) -> list[bool]:
    """Per step that draws tokens from now on: whether its sampler read the logits on the
    host (no ``Forward.tokens`` from the forward's graph)."""
    draws = []
    draw = engine.sampler.draw_rows  # every step's here: no drafts, prompt logprobs or beams

    def drawn(sampled, forward):
        draws.append(forward.tokens is None)
        return draw(sampled, forward)

    engine.sampler.draw_rows = drawn
    return draws


def test_greedy_steps_take_the_argmax_in_the_forwards_graph_where_mlx_takes_it(model, prompts):
    """Where MLX takes the argmax (bfloat16 logits here; any on a GPU), a step whose every
    sampling row is greedy, and that needs its logits for nothing else, takes it in the
    forward's graph: no step reads its logits on the host, and the tokens are those the host
    sampler draws for the same requests asking logprobs (which need the logits). Over
    float32 logits numpy takes it on the host on MLX's CPU build (12x faster there), MLX in
    the graph on a GPU."""
    bf16 = random_model("llama", "tiny", seed=0, dtype="bfloat16")
    engine = make_engine(bf16, FreeListAllocator, block_size=16, num_blocks=2 * blocks_needed(16))
    draws = host_draws(engine)
    greedy = [out.outputs[0].token_ids for out in engine.generate(prompts[:3], GREEDY)]
    assert draws and not any(draws)
    draws.clear()
    logprobs = dataclasses.replace(GREEDY, logprobs=1)
    assert [out.outputs[0].token_ids for out in engine.generate(prompts[:3], logprobs)] == greedy
    assert draws and all(draws)

    engine = make_engine(model, FreeListAllocator, block_size=16, num_blocks=2 * blocks_needed(16))
    draws = host_draws(engine)
    engine.generate(prompts[:3], GREEDY)
    assert draws and all(host == argmax_on_host(mx.float32) for host in draws)


def test_a_steps_active_memory_holds_the_weights_and_the_arena(model, prompts):
    """``mlx_active_bytes``, read at the snapshot (the forward dispatched), counts MLX's
    buffers in use: at least the weights and the KV arena, which live for the whole run."""
    engine = make_engine(model, FreeListAllocator, block_size=16, num_blocks=64)
    engine.generate(prompts[:2], GREEDY)
    weights = sum(w.nbytes for _, w in tree_flatten(model.model.parameters()))
    active = engine.recorder.step_columns()["mlx_active_bytes"]
    assert len(active) > 1 and (active >= weights + engine.arena.nbytes).all()
