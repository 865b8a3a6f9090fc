"""``model=shape model.config=PATH``: a model clock run of a config.json's shape, without
weights; refused on a measuring clock in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import ROOT, TINY

from harness.costmodel.profile import save
from harness.costmodel.roofline import SHAPES_DIR, derive
from harness.costmodel.shape import load, weight_bytes
from harness.engine.modelled import shape_model

LLAMA_8B = SHAPES_DIR / "llama-3.1-8b.json"


def test_a_shape_model_is_its_config_and_holds_no_weights():
    model = shape_model(str(LLAMA_8B))
    assert model.model is None and model.tokenizer is None
    assert model.shape() == load(LLAMA_8B)
    # 32 layers x 8 KV heads x 128 x 2 bytes (bf16), K and V
    assert model.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2
    assert (model.max_position_embeddings, model.vocab_size) == (131072, 128256)
    assert model.num_params == 8_030_261_248


def test_a_shape_is_refused_on_a_measuring_clock(kvbench):
    run = kvbench("model=shape", f"model.config={LLAMA_8B}", check=False)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1
    assert "model=shape" in run.stderr and "engine.clock=model" in run.stderr


def test_an_8b_shape_runs_on_the_model_clock_without_its_weights(tmp_path):
    shape = load(LLAMA_8B)
    profile = tmp_path / "h100-8b.json"
    save(derive(shape, "h100", block_size=16), profile)
    overrides = [*TINY, "model=shape", f"model.config={LLAMA_8B}", "engine.clock=model"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with open(tmp_path / "out", "w") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "harness.cli.run", *overrides, f"engine.profile={profile}"],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": path},
        )
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not its siblings'
    assert status == 0 and "TTFT (model clock)" in (tmp_path / "out").read_text()
    # The weights would take 16 GB in bfloat16; the run peaked far below that.
    weights = shape["num_params"] * weight_bytes(shape)
    peak = usage.ru_maxrss * 1024  # Linux reports KiB
    assert weights > 16e9 and peak < weights / 10


@pytest.mark.parametrize("bits, per_weight", [(8, 1 + 4 / 64), (4, 0.5 + 4 / 64)])
def test_bits_price_the_shapes_weights_quantized(bits, per_weight):
    model = shape_model(str(LLAMA_8B), bits=bits)
    assert weight_bytes(model.shape()) == per_weight


def test_the_model_clock_runs_quantized_kv_its_roofline_priced(tmp_path):
    from allocators.free_list import FreeListAllocator
    from harness.engine import build_engine
    from schedulers.fcfs import FCFSScheduler

    model = shape_model(str(LLAMA_8B))
    profile = tmp_path / "kv8.json"
    save(derive(model.shape(), "m3-ultra", block_size=16, kv_bits=8), profile)

    def build(kv_bits: int):
        return build_engine(
            model,
            FreeListAllocator,
            FCFSScheduler,
            kv_cache_bytes=2**30,
            kv_bits=kv_bits,
            clock="model",
            profile=str(profile),
        )

    # a head's K (or V) of a token at 8 bits: 128 values packed in 128 bytes, and a bf16
    # scale and bias for each of its two groups of 64: 136 bytes; 8 heads, K and V, 32
    # layers, 16 tokens a block
    assert build(8).allocator.num_blocks == 2**30 // (32 * 2 * 8 * 136 * 16)
    with pytest.raises(ValueError, match=r"^engine\.kv_bits=16 .* set engine\.kv_bits=8$"):
        build(16)
