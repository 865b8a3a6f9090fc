"""The quantized KV arena (engine.kv_bits=8 | 4): blocks stored as mx.quantize's packed words,
scales and biases; attention through mlx_lm's quantized path; every path that moves KV
(copy-on-write, relocation, swap, KV files, speculative rollback, beam forks) on the stored
words. The reference is mlx_lm's own ``QuantizedKVCache`` (``tests/reference.py``)."""

from __future__ import annotations

import dataclasses
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from reference import beam_search_reference, mlx_lm_quantized_tokens, mlx_lm_tokens
from support import ALLOCATORS, assert_all_free, build_with_policy

from allocators.contiguous import ContiguousAllocator
from allocators.free_list import FreeListAllocator
from harness.engine import build_engine, persistence
from harness.engine.beam_search import BeamSearchParams
from harness.engine.kv_cache import KVArena, KVFormat
from harness.engine.persistence import KVRestoreWarning
from harness.engine.sampling_params import SamplingParams
from harness.engine.speculative import Speculation
from harness.platform.models import noisy_copy, random_model
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_LENS = (5, 37, 18, 60)
PROMPT_SEED = 11


@pytest.fixture(scope="module")
def references(model, prompts):
    """mlx_lm's greedy tokens over its QuantizedKVCache, per bits, per prompt."""
    return {
        bits: [mlx_lm_quantized_tokens(model, p, MAX_TOKENS, bits) for p in prompts]
        for bits in (8, 4)
    }


def engine(model, allocator=FreeListAllocator, *, bits, num_blocks=128, block_size=8, **policy):
    return build_with_policy(
        model,
        allocator,
        block_size=block_size,
        num_blocks=num_blocks,
        engine_options={"kv_bits": bits},
        **policy,
    )


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# -- bytes, by hand ----------------------------------------------------------------------------
def test_a_block_costs_its_packed_values_scales_and_biases(model):
    # tiny: 4 layers, 2 KV heads, head_dim 64, float32. One head's row of one token:
    # 16: 64 x 4 bytes = 256; 8: 64 bytes + a float32 scale and bias per 64 = 72; 4: 32 + 8.
    # A block of 16 tokens, K and V: 2 x 4 layers x 2 heads x 16 x row.
    per_block = {16: 256 * 256, 8: 256 * 72, 4: 256 * 40}
    budget = 1 << 20
    for bits, block_bytes in per_block.items():
        assert model.kv_bytes_per_token(bits) * 16 == block_bytes
        e = build_engine(
            model,
            FreeListAllocator,
            FCFSScheduler,
            block_size=16,
            kv_cache_bytes=budget,
            kv_bits=bits,
        )
        assert e.allocator.num_blocks == budget // block_bytes  # 16, 56, 102
        assert e.arena.nbytes == e.allocator.num_blocks * block_bytes
    assert [budget // b for b in per_block.values()] == [16, 56, 102]


def test_group_size_changes_the_bytes_of_scales_and_biases(model):
    # 4 bits at group size 32: 32 bytes + 2 groups x (scale + bias) x 4 bytes = 48 a row.
    assert model.layer_bytes_per_token(4, 32) == 2 * 2 * 48
    arena = KVArena.for_model(model, 4, 8, KVFormat(4, 32))
    assert arena.keys[0].dtype == mx.uint32 and arena.width == 12


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_bits": 5}, r"^engine\.kv_bits=5 is invalid: choose 16"),
        ({"kv_bits": 8, "kv_group_size": 48}, r"^engine\.kv_group_size=48 is invalid: choose"),
        (
            {"kv_bits": 4, "kv_group_size": 128},
            r"^engine\.kv_group_size=128 does not divide model .* head_dim=64: choose",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_field(model, options, message):
    with pytest.raises(ValueError, match=message) as info:
        build_engine(model, FreeListAllocator, FCFSScheduler, num_blocks=8, **options)
    assert "\n" not in str(info.value)


def test_a_sliding_window_model_is_refused_in_one_line():
    gemma = random_model("gemma3_text", "tiny", seed=0)
    line = r"^engine\.kv_bits=8 is not supported .*: use engine\.kv_bits=16$"
    with pytest.raises(ValueError, match=line):
        build_engine(gemma, FreeListAllocator, FCFSScheduler, num_blocks=8, kv_bits=8)


# -- tokens ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_greedy_tokens_equal_mlx_lms_quantized_cache(model, prompts, references, allocator, bits):
    e = engine(model, allocator, bits=bits)
    assert tokens(e.generate(prompts, GREEDY)) == references[bits]
    assert_all_free(e)


@pytest.mark.parametrize(
    "options",
    [
        {"pipeline": True},
        {
            "scheduler": partial(
                ChunkedPrefillScheduler, max_chunk=16, max_num_batched_tokens=24, max_num_seqs=8
            )
        },
    ],
    ids=["pipelined", "chunked-prefill"],
)
def test_pipelined_steps_and_prefill_chunks_keep_the_quantized_tokens(
    model, prompts, references, options
):
    e = build_engine(
        model,
        FreeListAllocator,
        options.pop("scheduler", FCFSScheduler),
        block_size=8,
        num_blocks=128,
        kv_bits=4,
        **options,
    )
    assert tokens(e.generate(prompts, GREEDY)) == references[4]
    assert_all_free(e)


def test_quantization_changes_the_tokens_it_should(model, prompts, references):
    # The reference is not the unquantized model under another name: 4 bits moves tokens.
    plain = [mlx_lm_tokens(model, p, MAX_TOKENS) for p in prompts]
    assert references[4] != plain


# -- moving blocks -----------------------------------------------------------------------------
def test_copy_and_swap_move_the_stored_words_bit_for_bit(model):
    arena = KVArena.for_model(model, 8, 4, KVFormat(8))
    rng = np.random.default_rng(0)
    for pools in (arena.keys, arena.values):
        for i, pool in enumerate(pools):
            pools[i] = mx.array(rng.integers(0, 2**32, pool.shape, dtype=np.uint32))
    before = [np.array(arena.blocks(p)) for p in arena.keys + arena.values]
    host = arena.swap_out([1, 2, 5])
    assert host.keys[0].dtype == np.uint32 and host.keys[0].shape == (3, 2, 4, arena.width)
    arena.swap_in(host, [6, 7, 0])
    arena.copy_blocks([(3, 4)])
    after = [np.array(arena.blocks(p)) for p in arena.keys + arena.values]
    for old, new in zip(before, after, strict=True):
        assert np.array_equal(new[[6, 7, 0]], old[[1, 2, 5]])
        assert np.array_equal(new[4], old[3])
        assert np.array_equal(new[[1, 2, 3, 5]], old[[1, 2, 3, 5]])


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("allocator", [FreeListAllocator, ContiguousAllocator])
def test_preemption_keeps_the_quantized_tokens(model, prompts, references, mode, allocator):
    # 18 blocks of 8 slots: the four prompts (1 + 5 + 3 + 8 blocks) are all admitted, but
    # they end at 23 blocks: decodes preempt.
    e = engine(model, allocator, bits=8, num_blocks=18, preemption_mode=mode)
    assert tokens(e.generate(prompts, GREEDY)) == references[8]
    assert sum(r["preemptions"] for r in e.recorder.requests) > 0
    assert_all_free(e)


def test_forked_completions_share_blocks_and_keep_a_lone_requests_tokens(model, prompts):
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=5)
    e = engine(model, bits=4)
    (out,) = e.generate([prompts[1]], dataclasses.replace(sampled, n=3))
    assert max(r["blocks_shared"] for r in e.recorder.steps) > 0
    for c in out.outputs:
        alone = engine(model, bits=4).generate(
            [prompts[1]], dataclasses.replace(sampled, seed=5 + c.index)
        )
        assert c.token_ids == tokens(alone)[0]


@pytest.mark.parametrize("num_blocks", [128, 12], ids=["roomy", "pressed"])
def test_beam_search_equals_a_brute_force_search_over_mlx_lms_quantized_cache(
    model, prompts, num_blocks
):
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    e = engine(model, bits=8, num_blocks=num_blocks)
    outs = e.generate(prompts[:2], params)
    for out, prompt in zip(outs, prompts[:2], strict=True):
        ref = beam_search_reference(model, prompt, 2, 4, ignore_eos=True, kv_bits=8)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in ref]
        for c, (_, cum) in zip(out.outputs, ref, strict=True):
            assert c.cumulative_logprob == pytest.approx(cum, abs=1e-3)
    assert_all_free(e)


def test_speculative_rollback_keeps_the_quantized_tokens(model, prompts, references):
    e = build_engine(
        model,
        FreeListAllocator,
        FCFSScheduler,
        block_size=8,
        num_blocks=128,
        kv_bits=8,
        speculative=Speculation(num_draft_tokens=3, draft=partial(noisy_copy, scale=0.05)),
    )
    assert e.proposer.arena.format == KVFormat(8)
    assert tokens(e.generate(prompts, GREEDY)) == references[8]
    rows = e.recorder.requests
    assert sum(r["spec_accepted"] for r in rows) < sum(r["spec_proposed"] for r in rows)
    assert_all_free(e)


# -- KV files ----------------------------------------------------------------------------------
def test_a_kv_file_restores_quantized_blocks_and_refuses_another_format(
    model, prompts, references, tmp_path
):
    path = tmp_path / "agent.safetensors"
    prompt = prompts[3]
    first = engine(model, bits=8)
    first.add_request("save", prompt, GREEDY, save_kv=path)
    done = [o for _ in range(100) for o in first.step() if o.finished]
    assert tokens(done) == [references[8][3]]
    # The file holds the prompt and the output but its last token; 3 new tokens follow.
    following = prompt + references[8][3][:-1] + [7, 8, 9]
    restored = engine(random_model("llama", "tiny", seed=0), bits=8)
    restored.add_request("r", following, GREEDY, restore_kv=path)
    done = [o for _ in range(100) for o in restored.step() if o.finished]
    assert tokens(done) == [mlx_lm_quantized_tokens(model, following, MAX_TOKENS, 8)]
    assert sum(r["prefill_tokens"] for r in restored.recorder.steps) == 3
    for bits in (16, 4):
        other = engine(model, bits=bits)
        with pytest.warns(KVRestoreWarning) as caught:
            other.add_request("r", following, GREEDY, restore_kv=path)
        (line,) = [str(w.message) for w in caught]
        assert "saved with kv_bits=8 (group size 64)" in line
        assert "restore it with the same engine.kv_bits and engine.kv_group_size" in line


def test_the_model_clock_refuses_a_quantized_arena_its_profile_did_not_price(model):
    # a measured profile timed unquantized attention (a roofline names its kv_format:
    # tests/engine/test_shape_model.py)
    with pytest.raises(ValueError, match=r"^engine\.kv_bits=4 .* set engine\.kv_bits=16$"):
        build_engine(
            model,
            FreeListAllocator,
            FCFSScheduler,
            num_blocks=8,
            kv_bits=4,
            clock="model",
            profile="results/baselines/profile-llama-tiny.json",
        )


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_smollm2_greedy_tokens_equal_mlx_lms_quantized_cache(smollm2, bits):
    """The trained model (peaked logits, not a random model's flat ones) through the
    quantized arena, paged: each prompt alone gives mlx_lm's tokens over its
    QuantizedKVCache exactly. Batched, the rows' float arithmetic differs from one row's in
    the last bits, which can move a value across a 4-bit quantization step: the batched
    tokens match until the first near-tie, where each run's token is among the other's top
    5 (vLLM's ``check_logprobs_close``). On one Xeon the 4-bit batch diverges at token 10, a
    tie of 0.09 nats in mlx_lm's own logits; on an EPYC it did not."""
    prompts = [
        smollm2.tokenizer.encode(text)
        for text in ("The capital of France is", "Photosynthesis is the process by which")
    ]
    reference = [mlx_lm_quantized_tokens(smollm2, p, MAX_TOKENS, bits) for p in prompts]
    params = dataclasses.replace(GREEDY, logprobs=5)
    alone = [
        engine(smollm2, ContiguousAllocator, bits=bits, num_blocks=8, block_size=16).generate(
            [p], params
        )[0]
        for p in prompts
    ]
    assert tokens(alone) == reference
    batched = engine(smollm2, ContiguousAllocator, bits=bits, num_blocks=8, block_size=16)
    for ours, theirs in zip(batched.generate(prompts, params), alone, strict=True):
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=True)):
            if a != b:
                assert a in theirs.logprobs[i] and b in ours.logprobs[i], (i, a, b)
                break
    if bits == 8:  # 8-bit K/V keep the trained model's answer
        assert smollm2.tokenizer.decode(reference[0]).lstrip().startswith("Paris")


def test_a_file_from_before_kv_bits_reads_as_16_bits(model, tmp_path):
    path = tmp_path / "old.safetensors"
    spec = persistence.KVSpec.of(model, 8)
    host = KVArena.for_model(model, 2, 8).swap_out([0, 1])
    persistence.save(path, spec, list(range(1, 11)), host)
    arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
    del meta["kv_bits"], meta["kv_group_size"]  # as kvbench wrote files before them
    mx.save_safetensors(str(path), arrays, metadata=meta)
    assert persistence.load(path, spec).token_ids == tuple(range(1, 11))
    with pytest.raises(persistence.KVFileError, match=r"saved with kv_bits=16, this engine"):
        persistence.load(path, persistence.KVSpec.of(model, 8, KVFormat(8)))
