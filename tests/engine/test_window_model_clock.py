"""A model with sliding-window layers on the model clock: the engine's own schedule, rings
included, priced with the window layers' attention over their rings, not the context.

The tiny Gemma 3 text model (4 layers: 0, 1 and 3 a window of 16 tokens, 2 full attention)
and a tiny Llama with Mistral-style windows (0 and 2), blocks of 8: a ring holds
k = ceil(16 / 8) + 1 = 3 blocks. Every request is queued before
the first step, so no schedule depends on a step's duration: the model clock (a roofline of
the model's shape) and the virtual clock (the model run) must run the same rows, hold the
same blocks and rings, and count the same work, step for step."""

from __future__ import annotations

from functools import partial

import pytest
from support import random_prompts

from allocators.free_list import FreeListAllocator
from harness.costmodel.profile import save
from harness.costmodel.roofline import derive
from harness.engine import RequestError, build_engine
from harness.engine.sampling_params import SamplingParams
from harness.engine.speculative import Speculation
from harness.engine.window import WindowGroup, WindowTables
from harness.platform.models import random_model
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler
from schedulers.kv_groups import ring_blocks
from schedulers.priority import PriorityScheduler

WINDOW, BLOCK_SIZE = 16, 8
RING = ring_blocks(WINDOW, BLOCK_SIZE)  # 3
PROMPT_LENS = [3, 20, 45, 90, 33, 12]
# What a step's row holds that the schedule alone decides (durations and MLX memory aside).
SCHEDULE = (
    "batch_size", "prefill_tokens", "decode_tokens", "preempted", "swap_out_blocks",
    "swap_in_blocks", "window_swap_blocks", "block_copies", "num_waiting", "num_running",
    "num_swapped", "blocks_used", "blocks_free", "window_blocks_used", "row_groups",
    "query_tokens_padded",
    "kv_slots_read", "kv_slots_attended", "attention_pairs", "window_kv_slots_read",
    "window_attention_pairs", "logit_rows", "single_token_rows",
)  # fmt: skip


# Gemma 3 (layers 0, 1, 3 windowed) and a Mistral-style Llama (0 and 2), as conf/model's
# tiny_gemma3 and tiny_llama_swa.
HYBRIDS = {
    "gemma3": ("gemma3_text", {}),
    "llama_swa": ("llama", {"layer_types": ["sliding_attention", "full_attention"] * 2}),
}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request):
    arch, fields = HYBRIDS[request.param]
    return random_model(arch, "tiny", seed=0, sliding_window=WINDOW, **fields)


@pytest.fixture(scope="module")
def gemma():
    return random_model("gemma3_text", "tiny", seed=0, sliding_window=WINDOW)


def roofline_of(model, folder) -> str:
    path = folder / "m4-max.json"
    save(derive(model.shape(), "m4-max", block_size=BLOCK_SIZE), path)
    return str(path)


def build(model, policy, clock: str, profile: str | None, num_blocks: int = 128):
    return build_engine(
        model,
        FreeListAllocator,
        policy,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        clock=clock,
        profile=profile,
    )


def schedule(engine, max_tokens: int = 30) -> list[tuple]:
    """Queue every prompt at t=0, run to the end; per step: the running requests with their
    block tables and rings, and the step row's schedule columns."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(PROMPT_LENS, 7)):
        engine.add_request(str(i), prompt, params, arrival_time=0.0)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        ids = sorted(s.request_id for s in engine.scheduler.running)
        tables = engine.allocator.block_tables(ids)
        rings = [tuple(engine.window.table(i)) for i in ids]
        held = list(zip(ids, map(tuple, tables), rings, strict=True))
        steps.append((held, {c: engine.recorder.steps[-1][c] for c in SCHEDULE}))
    return steps


POLICIES = {
    "fcfs": partial(FCFSScheduler, max_num_seqs=4),
    "chunked": partial(
        ChunkedPrefillScheduler, max_num_seqs=4, max_chunk=12, max_num_batched_tokens=32
    ),
    "swap": partial(PriorityScheduler, max_num_seqs=4, preemption_mode="swap"),
    "recompute": partial(PriorityScheduler, max_num_seqs=4, preemption_mode="recompute"),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_model_clock_schedules_a_window_model_as_the_engine_does(hybrid, tmp_path, policy):
    """Same rows, blocks, rings and work counts each step; the preempting policies run on 24
    blocks (two of the longest sequences at once), so rings are given back and taken again
    (by swap: their KV goes to the host and back on the real engine, nowhere on the model
    clock)."""
    blocks = 24 if policy in ("swap", "recompute") else 128
    real = build(hybrid, POLICIES[policy], "virtual", None, blocks)
    modelled = build(hybrid, POLICIES[policy], "model", roofline_of(hybrid, tmp_path), blocks)
    assert isinstance(real.window, WindowGroup)
    assert type(modelled.window) is WindowTables and modelled.arena is None
    ours, theirs = schedule(modelled), schedule(real)
    assert ours == theirs
    rows = [row for _, row in ours]
    assert max(r["window_blocks_used"] for r in rows) == RING * 4
    assert sum(r["window_attention_pairs"] for r in rows) > 0
    if policy in ("swap", "recompute"):
        assert sum(r["preempted"] for r in rows) > 0
        assert (sum(r["swap_out_blocks"] for r in rows) > 0) == (policy == "swap")
        # each sequence swapped out takes its ring of 3 blocks to the host and back
        swapped = 2 * RING * sum(r["preempted"] for r in rows) if policy == "swap" else 0
        assert sum(r["window_swap_blocks"] for r in rows) == swapped
    assert modelled.window.allocator.stats().used_blocks == 0
    assert modelled.scheduler.rings.allocator.stats().used_blocks == 0


def test_a_window_layers_reads_are_counted_by_hand(gemma, tmp_path):
    """One 40-token prompt, 3 tokens, blocks of 8, window 16.

    Prefill from 0: a full layer reads ceil(40/8) = 5 blocks, 40 slots, and scores 40 x 40 =
    1600 pairs; a window layer has nothing before position 0 but reads one (scratch) block,
    8 slots, and scores 40 queries x (8 + 40 new keys) = 1920 pairs.
    Decode at 40: full, 41 positions in 6 blocks: 48 slots, 48 pairs; window, positions
    25..39 in logical blocks 3..4: 16 slots, 16 + 1 = 17 pairs.
    Decode at 41: full, 42 positions still 6 blocks: 48, 48; window, positions 26..40 in
    blocks 3..5: 24 slots, 25 pairs (the window straddles three blocks, as a ring of k = 3
    allows)."""
    engine = build(
        gemma, partial(FCFSScheduler, max_num_seqs=4), "model", roofline_of(gemma, tmp_path)
    )
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(1, 41)), params, arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    counts = [
        (s["kv_slots_read"], s["attention_pairs"], s["window_kv_slots_read"],
         s["window_attention_pairs"])
        for s in engine.recorder.steps
    ]  # fmt: skip
    assert counts == [(40, 1600, 8, 1920), (48, 48, 16, 17), (48, 48, 24, 25)]


def test_a_model_without_window_layers_counts_no_window_work(model, tmp_path):
    engine = build_engine(model, FreeListAllocator, FCFSScheduler, num_blocks=64)
    engine.generate([[1, 2, 3, 4] * 10], SamplingParams(max_tokens=4, ignore_eos=True))
    assert {
        s["window_kv_slots_read"] + s["window_attention_pairs"] for s in engine.recorder.steps
    } == {0}


def test_what_the_engine_refuses_for_a_window_model_the_model_clock_refuses(gemma, tmp_path):
    """Speculative decoding, at build, in the real engine's words; KV files, per request, as
    the model clock refuses them for any model (it holds no KV to save)."""
    profile = roofline_of(gemma, tmp_path)
    with pytest.raises(ValueError, match="sliding-window layers: speculative decoding is not"):
        build_engine(
            gemma,
            FreeListAllocator,
            FCFSScheduler,
            num_blocks=64,
            block_size=BLOCK_SIZE,
            clock="model",
            profile=profile,
            speculative=Speculation(num_draft_tokens=2, draft=gemma),
            acceptance=0.5,
        )
    engine = build(gemma, FCFSScheduler, "model", profile)
    with pytest.raises(RequestError, match="save_kv needs a model's logits or KV"):
        engine.add_request("a", [1, 2, 3], SamplingParams(), save_kv=tmp_path / "kv.safetensors")
