"""Model building: architectures beyond Llama run unmodified; unsupported caches fail clearly."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest
from reference import mlx_lm_tokens

from allocators.free_list import FreeListAllocator
from harness.engine import build_engine
from harness.engine.sampling_params import SamplingParams
from harness.platform.models import describe, random_model
from schedulers.fcfs import FCFSScheduler


def test_qwen2_with_gqa_is_token_identical_to_mlx_lm():
    loaded = random_model("qwen2", "tiny", seed=3, num_key_value_heads=1)
    assert loaded.num_kv_heads == 1  # 4 query heads share one KV head
    prompts = [list(range(5, 40)), list(range(100, 103))]
    engine = build_engine(loaded, FreeListAllocator, FCFSScheduler, block_size=8, num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        assert out.outputs[0].token_ids == mlx_lm_tokens(loaded, prompt, 8)


def test_same_seed_same_weights_and_sizes_differ():
    a, b = random_model(seed=7), random_model(seed=7)
    assert mx.array_equal(a.model.lm_head.weight, b.model.lm_head.weight)
    assert random_model(size="small").num_params > 5 * a.num_params


def test_sliding_window_layers_are_read_from_make_cache():
    # A Mistral-style Llama: mlx_lm gives its sliding layers a RotatingKVCache.
    loaded = random_model(
        "llama", "tiny", layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8
    )
    assert loaded.window == 8
    assert loaded.window_layers == (0, 2) and loaded.full_layers == (1, 3)
    assert loaded.kv_bytes_per_token() == 2 * loaded.layer_bytes_per_token()


def test_recurrent_model_is_rejected_at_load():
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        state_size=4,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    with pytest.raises(ValueError, match=r"ArraysCache.*not recurrent"):
        describe(mamba.Model(args), "mamba")


@pytest.mark.parametrize("field, value", [("arch", "gpt9"), ("size", "huge")])
def test_unknown_names_are_named(field, value):
    with pytest.raises(ValueError, match=f"model.{field}"):
        random_model(**{field: value})


def test_kv_cache_bytes_sizes_the_arena():
    loaded = random_model()
    per_block = 2 * loaded.num_layers * 16 * loaded.num_kv_heads * loaded.head_dim * 4
    engine = build_engine(
        loaded,
        partial(FreeListAllocator),
        FCFSScheduler,
        block_size=16,
        kv_cache_bytes=10 * per_block + 5,
    )
    assert engine.allocator.num_blocks == 10
    assert engine.arena.nbytes == 10 * per_block
