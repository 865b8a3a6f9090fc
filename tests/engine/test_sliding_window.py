"""Sliding-window and hybrid models (Gemma 3 text, gpt-oss) against mlx_lm's own rotating caches.

Window 16 tokens, block size 8: a ring holds k = ceil(16 / 8) + 1 = 3 blocks. Prompts of 3 to
90 tokens and 40 generated tokens slide the window in prefill and in decode; every allocator,
batches of mixed lengths; preemption by recompute and swap, chunked prefill, pipelined steps,
parallel sampling and beam search (a fork copies the ring), radix (no prefix hits: a cached
prefix holds no window KV). The reference is mlx_lm's ``generate_step`` over
``model.make_cache()`` (``RotatingKVCache`` for window layers); for beam search, a brute force
over mlx_lm's full forward.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import pandas as pd
import pytest
from reference import beam_search_reference, mlx_lm_tokens
from support import ALLOCATORS, assert_all_free, build_with_policy

from allocators.contiguous import ContiguousAllocator
from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from harness.engine import RequestError, build_engine
from harness.engine.beam_search import BeamSearchParams
from harness.engine.sampling_params import SamplingParams
from harness.engine.speculative import Speculation
from harness.platform.models import random_model
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler
from schedulers.kv_groups import ring_blocks

ARCHS = ["gemma3_text", "gpt_oss"]
WINDOW = 16
BLOCK_SIZE = 8
RING = ring_blocks(WINDOW, BLOCK_SIZE)  # 3
PROMPT_LENS = [3, 20, 45, 90]
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_SEED = 13


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request):
    return random_model(request.param, "tiny", seed=0, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(hybrid, prompts):
    return [mlx_lm_tokens(hybrid, p, MAX_TOKENS) for p in prompts]


def build(
    model,
    allocator=FreeListAllocator,
    scheduler=FCFSScheduler,
    num_blocks=128,
    *,
    engine_options=None,
    **kw,
):
    """Blocks of BLOCK_SIZE, 4 sequences at most; ``kw`` for the scheduler."""
    policy_options = {"max_num_seqs": 4, **kw}
    return build_with_policy(
        model,
        allocator,
        scheduler,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        engine_options=engine_options or {},
        **policy_options,
    )


def tokens(outputs):
    return [out.outputs[0].token_ids for out in outputs]


def assert_window_free(engine):
    assert_all_free(engine)
    engine.window.allocator.check()
    assert engine.window.allocator.stats().used_blocks == 0


def test_the_window_changes_the_tokens(hybrid, prompts, reference):
    """The prompts and generations are long enough that attending beyond the window would
    give other tokens: the identity tests below test the window."""
    wide = random_model(hybrid.model.model_type, "tiny", seed=0, sliding_window=4096)
    assert [mlx_lm_tokens(wide, p, MAX_TOKENS) for p in prompts][1:] != reference[1:]


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_greedy_tokens_identical_to_mlx_lm(hybrid, prompts, reference, allocator):
    engine = build(hybrid, allocator)
    assert tokens(engine.generate(prompts, GREEDY)) == reference
    assert_window_free(engine)


def test_a_ring_never_exceeds_k_blocks(hybrid, prompts, reference):
    engine = build(hybrid)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    window, longest = engine.window, 0
    while engine.has_unfinished_requests():
        engine.step()
        running = [s.request_id for s in engine.scheduler.running]
        for rid in running:
            assert len(window.allocator.block_table(rid)) == RING
            longest = max(longest, len(engine.allocator.block_table(rid)))
        assert window.allocator.stats().used_blocks == RING * len(running)
        window.allocator.check()
    assert longest >= (90 + MAX_TOKENS - 1) // BLOCK_SIZE > RING  # full layers grew on
    assert max(r["window_blocks_used"] for r in engine.recorder.steps) == RING * len(prompts)


def test_kv_memory_is_below_an_all_full_attention_run(hybrid, prompts):
    """Bytes of KV held at the peak: the hybrid model's full-attention blocks plus its rings,
    against a model of the same KV geometry with every layer full attention: Gemma 3 with
    every layer global; for gpt-oss (mlx_lm's needs a window layer) the tiny Llama."""
    if hybrid.model.model_type == "gemma3_text":
        full = random_model("gemma3_text", "tiny", seed=0, sliding_window_pattern=1)
    else:
        full = random_model("llama", "tiny", seed=0)
    assert not full.window_layers and full.num_layers == hybrid.num_layers
    assert full.layer_bytes_per_token() == hybrid.layer_bytes_per_token()

    def peak_bytes(model):
        engine = build(model)
        engine.generate(prompts, GREEDY)
        block = model.layer_bytes_per_token() * BLOCK_SIZE
        per_step = [
            r["blocks_used"] * len(model.full_layers) * block
            + r["window_blocks_used"] * len(model.window_layers) * block
            for r in engine.recorder.steps
        ]
        return max(per_step)

    assert peak_bytes(hybrid) < 0.8 * peak_bytes(full)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_tokens_identical(hybrid, prompts, reference, mode):
    # 24 blocks hold two of the longest sequences at once: the others are preempted.
    engine = build(hybrid, num_blocks=24, preemption_mode=mode)
    assert tokens(engine.generate(prompts, GREEDY)) == reference
    steps = engine.recorder.steps
    assert sum(r["preempted"] for r in steps) > 0
    assert (sum(r["swap_out_blocks"] for r in steps) > 0) == (mode == "swap")
    assert_window_free(engine)


@pytest.mark.parametrize("max_chunk", [5, 24])
def test_chunked_prefill_keeps_tokens_identical(hybrid, prompts, reference, max_chunk):
    engine = build(
        hybrid, scheduler=ChunkedPrefillScheduler, max_chunk=max_chunk, max_num_batched_tokens=32
    )
    assert tokens(engine.generate(prompts, GREEDY)) == reference


def test_pipelined_steps_keep_tokens_identical(hybrid, prompts, reference):
    engine = build(hybrid, engine_options={"pipeline": True})
    assert tokens(engine.generate(prompts, GREEDY)) == reference
    assert_window_free(engine)


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_parallel_sampling_forks_copy_the_ring(hybrid, prompts, allocator):
    """Completion i of n samples as a lone request seeded seed + i: the fork copied the
    parent's ring, and the parent's later writes do not reach the child's."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = build(hybrid, allocator)
    (out,) = engine.generate([prompts[2]], dataclasses.replace(params, n=3))
    for c in out.outputs:
        alone = build(hybrid, allocator)
        (ref,) = alone.generate([prompts[2]], dataclasses.replace(params, seed=5 + c.index))
        assert c.token_ids == ref.outputs[0].token_ids
    assert_window_free(engine)


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_completions_that_stop_on_their_first_token_still_got_the_ring(hybrid, prompts, max_tokens):
    """n = 3 completions of 1 (or 2) tokens: each stops on the token the fork's step samples
    (or the next), its ring given back in the same ``Scheduler.update`` that forked it; the
    fork's ring copy was taken at the fork, so each token is still a lone request's."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=True)
    engine = build(hybrid)
    (out,) = engine.generate([prompts[2]], dataclasses.replace(params, n=3))
    for c in out.outputs:
        (ref,) = build(hybrid).generate([prompts[2]], dataclasses.replace(params, seed=5 + c.index))
        assert c.token_ids == ref.outputs[0].token_ids
    assert_window_free(engine)


def test_radix_takes_no_prefix_hits(hybrid, prompts):
    """A cached prefix holds the full layers' KV but not the window's: hybrid models read
    no prefix cache, and the tokens stay mlx_lm's."""
    shared = prompts[3][:64]
    batch = [shared + [7, 8, 9], shared + [10, 11]]
    engine = build(hybrid, RadixAllocator, max_num_seqs=1)
    assert tokens(engine.generate(batch, GREEDY)) == [
        mlx_lm_tokens(hybrid, p, MAX_TOKENS) for p in batch
    ]
    assert all(r["cached_tokens"] == 0 for r in engine.recorder.requests)
    assert engine.allocator.stats().prefix_hit_tokens == 0


def test_speculative_decoding_is_refused(hybrid):
    with pytest.raises(ValueError, match="sliding-window layers: speculative"):
        build_engine(
            hybrid,
            FreeListAllocator,
            FCFSScheduler,
            num_blocks=64,
            speculative=Speculation(num_draft_tokens=2, draft=hybrid),
        )


def test_kv_files_are_refused(hybrid, tmp_path):
    engine = build(hybrid)
    with pytest.raises(RequestError, match="save_kv and restore_kv are not supported"):
        engine.add_request("a", [1, 2, 3], GREEDY, save_kv=tmp_path / "kv.safetensors")


def test_kv_cache_bytes_pays_for_the_rings_first(hybrid):
    engine = build_engine(
        hybrid,
        FreeListAllocator,
        partial(FCFSScheduler, max_num_seqs=4),
        block_size=BLOCK_SIZE,
        kv_cache_bytes=10_000_000,
    )
    rings = engine.window.arena.nbytes
    assert engine.window.allocator.num_blocks == 4 * RING
    full_block = hybrid.kv_bytes_per_token() * BLOCK_SIZE
    assert engine.allocator.num_blocks == (10_000_000 - rings) // full_block
    assert engine.arena.nbytes + rings <= 10_000_000


def test_a_max_len_region_allocator_reserves_only_the_ring(hybrid, prompts, reference):
    """contiguous_max_len reserves max_model_len slots per sequence in the full-attention
    arena; in the window group its region is the ring."""
    allocator = partial(ContiguousAllocator, reserve="max_len", max_len=256)
    engine = build(hybrid, allocator, num_blocks=4 * 256 // BLOCK_SIZE)
    assert engine.window.blocks_per_ring == RING
    assert tokens(engine.generate(prompts, GREEDY)) == reference
    assert_window_free(engine)


@pytest.mark.parametrize("name", ["tiny_gemma3", "tiny_gpt_oss"])
def test_kvbench_runs_the_model_configs(kvbench, tmp_path, name):
    proc = kvbench(f"model={name}", "allocator=radix")
    (run,) = (tmp_path / "results" / "default" / "runs").iterdir()
    steps = pd.read_parquet(run / "steps.parquet")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] == 6 and summary["prefix_hit_rate"] == 0
    assert summary["window_blocks_used_peak"] == steps["window_blocks_used"].max() > 0
    assert "Window ring blocks peak" in proc.stdout


def test_the_rings_follow_a_policy_default_max_num_seqs(hybrid):
    """max_num_seqs not bound in the partial: the policy's default (32) sizes the rings."""
    engine = build_engine(
        hybrid, FreeListAllocator, ChunkedPrefillScheduler, block_size=BLOCK_SIZE, num_blocks=64
    )
    assert engine.scheduler.max_num_seqs == engine.window.max_num_seqs == 32
    assert engine.window.allocator.num_blocks == 32 * RING


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_beam_search_forks_copy_the_ring(hybrid, prompts, allocator):
    """Beams fork at every round (each child a copy of its parent's ring): the results equal
    a brute-force search over mlx_lm's full forward, which masks the window itself."""
    params = BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True)
    engine = build(hybrid, allocator)
    (out,) = engine.generate([prompts[1]], params)
    ref = beam_search_reference(hybrid, prompts[1], 3, 20)
    assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in ref]
    assert_window_free(engine)
