"""``model=shape model.config=PATH``: a model clock run of a config.json's shape, without
weights; refused on a measuring clock in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

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


# The run's own peak, read inside it: a child's ru_maxrss from wait4 starts at the parent's
# peak (its memory is the parent's until exec, and exec keeps that high-water mark), so in a
# long test session it says how large pytest grew, not the run. VmHWM is the exec'd
# program's own; macOS, without /proc, spawns afresh and reports bytes.
PEAK_OF_RUN = """
import atexit, resource, runpy, sys
out = sys.argv.pop(1)
def peak():
    try:
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmHWM:"))
    except OSError:
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024
atexit.register(lambda: open(out, "w").write(str(peak())))
runpy.run_module("harness.cli.run", run_name="__main__")
"""


def test_an_8b_shape_runs_on_the_model_clock_without_its_weights(tmp_path):
    shape = load(LLAMA_8B)
    profile = tmp_path / "h100-8b.json"
    save(derive(shape, "h100", block_size=16), profile)
    overrides = [*TINY, "model=shape", f"model.config={LLAMA_8B}", "engine.clock=model"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", PEAK_OF_RUN, str(tmp_path / "peak"), *overrides,
         f"engine.profile={profile}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0 and "TTFT (model clock)" in done.stdout, done.stderr[-2000:]
    # The weights would take 16 GB in bfloat16; the run peaked far below that.
    weights = shape["num_params"] * weight_bytes(shape)
    peak = int((tmp_path / "peak").read_text())
    assert weights > 16e9 and 0 < peak < weights / 10, f"peak {peak / 2**20:.0f} MiB"


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


GEMMA3_1B = SHAPES_DIR / "gemma-3-1b.json"


def test_gemma_3s_shape_runs_its_window_layers_on_the_model_clock(tmp_path):
    """Gemma 3 1B: 26 layers, every sixth full (5, 11, 17, 23), the other 22 a 512-token
    window; 999,885,952 parameters (Hugging Face's safetensors total for gemma-3-1b-it).
    Blocks of 16: a ring of ceil(512 / 16) + 1 = 33 blocks per running sequence, 4 of them
    (max_num_seqs). A
    600-token prompt and 40 tokens: its 39 decodes, at positions 600 to 638, read the 32 or 33
    ring blocks holding the 511 positions before the new one in a window layer (at 600:
    positions 89..599, blocks 5..37), never the context's ceil(601 / 16) = 38 to
    ceil(639 / 16) = 40 blocks a full layer reads; the steps hold one ring."""
    from allocators.free_list import FreeListAllocator
    from harness.engine import build_engine
    from harness.engine.sampling_params import SamplingParams
    from schedulers.fcfs import FCFSScheduler

    model = shape_model(str(GEMMA3_1B))
    assert model.full_layers == (5, 11, 17, 23) and len(model.window_layers) == 22
    assert (model.window, model.num_params) == (512, 999_885_952)
    profile = tmp_path / "m4-max.json"
    save(derive(model.shape(), "m4-max", block_size=16), profile)
    engine = build_engine(
        model,
        FreeListAllocator,
        partial(FCFSScheduler, max_num_seqs=4),
        num_blocks=256,
        clock="model",
        profile=str(profile),
    )
    assert engine.window.allocator.num_blocks == 4 * 33
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request("a", list(range(1, 601)), params, arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    (row,) = engine.recorder.requests
    assert row["output_tokens"] == 40
    decodes = engine.recorder.steps[1:]
    assert {s["window_kv_slots_read"] // 16 for s in decodes} == {32, 33}
    assert {s["kv_slots_read"] // 16 for s in decodes} == {38, 39, 40}
    assert {s["window_blocks_used"] for s in engine.recorder.steps} == {33}
    # A byte budget pays for the rings first: 4 rings x 33 blocks x 16 tokens x 22 window
    # layers x 1,024 bytes a token (K and V, 1 KV head of 256 bf16 values) = 47,579,136;
    # the rest buys full-attention blocks of 4 layers x 1,024 x 16 = 65,536 bytes: 15,658.
    budget = build_engine(
        model,
        FreeListAllocator,
        partial(FCFSScheduler, max_num_seqs=4),
        kv_cache_bytes=2**30,
        clock="model",
        profile=str(profile),
    )
    assert budget.allocator.num_blocks == (2**30 - 47_579_136) // 65_536 == 15_658
