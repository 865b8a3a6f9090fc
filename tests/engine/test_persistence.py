"""KV save and restore: an agent's KV saved when its request finishes and restored by a later
engine for its next request, so the shared prefix is not computed again.

The tokens are always mlx_lm's (a restore never changes them), and the step rows show what
was computed: a restored request's prefill is only the part of its prompt the file lacks.
"""

from __future__ import annotations

import struct
from functools import partial

import numpy as np
import pytest
from reference import mlx_lm_tokens
from support import ALLOCATORS, run_alone

from allocators.base import blocks_for
from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from harness.engine import RequestError, build_engine, persistence
from harness.engine.persistence import KVFileError, KVRestoreWarning, KVSpec
from harness.engine.sampling_params import SamplingParams
from harness.platform.models import random_model
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler

FIRST, NEXT = 8, 6  # output tokens of the first and the next request


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make_engine(
    model, allocator=FreeListAllocator, *, block_size=16, scheduler=FCFSScheduler, **kw
):
    return build_engine(model, allocator, scheduler, block_size=block_size, num_blocks=64, **kw)


def run(engine, request_id, prompt, n, **kv) -> list[int]:
    """One request to completion; its output tokens."""
    return run_alone(engine, request_id, prompt, greedy(n), **kv)


def prefill(engine) -> int:
    return sum(row["prefill_tokens"] for row in engine.recorder.steps)


@pytest.fixture(scope="module")
def turns(model):
    """An agent's first prompt and its next one: the first, its answer, a new message."""
    rng = np.random.default_rng(3)
    first = rng.integers(1, 1024, 100).tolist()
    answer = mlx_lm_tokens(model, first, FIRST)
    return first, first + answer + rng.integers(1, 1024, 20).tolist()


@pytest.fixture(scope="module")
def saved(model, turns, tmp_path_factory):
    """The first turn's KV, saved by an engine when the request finished."""
    path = tmp_path_factory.mktemp("kv") / "agent.safetensors"
    first, _ = turns
    assert run(make_engine(model), "a", first, FIRST, save_kv=path) == mlx_lm_tokens(
        model, first, FIRST
    )
    return path


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_a_restored_request_computes_only_what_the_file_lacks(model, turns, saved, allocator):
    first, following = turns
    # A fresh engine over a fresh copy of the model (same seed): nothing shared but the file.
    engine = make_engine(random_model("llama", "tiny", seed=0), allocator)
    tokens = run(engine, "b", following, NEXT, restore_kv=saved)
    assert tokens == mlx_lm_tokens(model, following, NEXT)
    reused = len(first) + FIRST - 1  # the first turn's tokens but its last, never computed
    assert prefill(engine) == len(following) - reused
    swap_in = [row["swap_in_blocks"] for row in engine.recorder.steps]
    assert swap_in[0] == blocks_for(reused, 16) and sum(swap_in) == swap_in[0]
    assert engine.recorder.steps[0]["prefill_tokens"] == len(following) - reused
    recompute = make_engine(model, allocator)
    assert run(recompute, "b", following, NEXT) == tokens
    assert prefill(recompute) == len(following)
    engine.allocator.check()


@pytest.mark.parametrize("pipeline", [False, True])
def test_save_and_restore_under_chunked_prefill_and_pipelined_steps(
    model, turns, tmp_path, pipeline
):
    first, following = turns
    path = tmp_path / "kv.safetensors"
    chunked = partial(ChunkedPrefillScheduler, max_chunk=32, max_num_batched_tokens=32)
    engine = make_engine(model, scheduler=chunked, pipeline=pipeline)
    assert run(engine, "a", first, FIRST, save_kv=path) == mlx_lm_tokens(model, first, FIRST)
    engine = make_engine(model, scheduler=chunked, pipeline=pipeline)
    assert run(engine, "b", following, NEXT, restore_kv=path) == mlx_lm_tokens(
        model, following, NEXT
    )
    assert prefill(engine) == len(following) - (len(first) + FIRST - 1)


def test_a_prompt_sharing_part_of_the_file_reuses_that_part(model, turns, saved):
    first, _ = turns
    prompt = first[:50] + [7, 7, 7]
    engine = make_engine(model)
    assert run(engine, "b", prompt, NEXT, restore_kv=saved) == mlx_lm_tokens(model, prompt, NEXT)
    assert prefill(engine) == 3


def test_a_radix_engine_caches_restored_blocks_and_skips_what_its_tree_holds(model, turns, saved):
    first, following = turns
    engine = make_engine(model, RadixAllocator)
    run(engine, "b", following, NEXT, restore_kv=saved)
    before = prefill(engine)
    # The tree now holds every full block of the first request: nothing is written back.
    assert run(engine, "c", following, NEXT, restore_kv=saved) == mlx_lm_tokens(
        model, following, NEXT
    )
    hit = (len(following) - 1) // 16 * 16
    assert prefill(engine) - before == len(following) - hit
    assert sum(row["swap_in_blocks"] for row in engine.recorder.steps) == blocks_for(
        len(first) + FIRST - 1, 16
    )


def _corrupt(path):
    raw = bytearray(path.read_bytes())
    header = struct.unpack("<Q", raw[:8])[0]
    raw[8 + header + 100] ^= 0xFF  # a bit pattern inside the first tensor
    path.write_bytes(bytes(raw))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _garbage(path):
    path.write_bytes(b"not a safetensors file" * 10)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_corrupt, "is corrupted: its tensors do not match its checksum"),
        (_truncate, "cannot be read .*incomplete download or corrupt file"),
        (_garbage, "cannot be read"),
        (lambda p: p.unlink(), "cannot be read"),
    ],
    ids=["corrupted", "truncated", "garbage", "missing"],
)
def test_a_damaged_file_warns_and_the_prompt_is_computed(
    model, turns, saved, tmp_path, damage, reason
):
    _, following = turns
    path = tmp_path / "kv.safetensors"
    path.write_bytes(saved.read_bytes())
    damage(path)
    engine = make_engine(model)
    with pytest.warns(KVRestoreWarning, match=f"KV file {path} {reason}.*computing the prompt"):
        tokens = run(engine, "b", following, NEXT, restore_kv=path)
    assert tokens == mlx_lm_tokens(model, following, NEXT)
    assert prefill(engine) == len(following)


def test_a_file_of_another_model_warns_and_the_prompt_is_computed(turns, saved):
    _, following = turns
    other = random_model("llama", "tiny", seed=1)
    engine = make_engine(other)
    with pytest.warns(KVRestoreWarning, match="saved from another model .*seed0.*seed1"):
        tokens = run(engine, "b", following, NEXT, restore_kv=saved)
    assert tokens == mlx_lm_tokens(other, following, NEXT)
    assert prefill(engine) == len(following)


def test_a_file_of_another_block_size_warns_and_the_prompt_is_computed(model, turns, saved):
    _, following = turns
    engine = make_engine(model, block_size=32)
    with pytest.warns(KVRestoreWarning, match="block_size=16, this engine uses 32"):
        tokens = run(engine, "b", following, NEXT, restore_kv=saved)
    assert tokens == mlx_lm_tokens(model, following, NEXT)
    assert prefill(engine) == len(following)


def test_a_file_sharing_no_prefix_warns(model, turns, saved):
    prompt = [5] + turns[0]
    engine = make_engine(model)
    with pytest.warns(KVRestoreWarning, match="shares no prefix with the prompt"):
        run(engine, "b", prompt, NEXT, restore_kv=saved)
    assert prefill(engine) == len(prompt)


def test_a_request_for_prompt_logprobs_reads_no_file(model, turns, saved):
    _, following = turns
    engine = make_engine(model)
    params = SamplingParams(temperature=0, max_tokens=NEXT, ignore_eos=True, prompt_logprobs=1)
    with pytest.warns(KVRestoreWarning, match="prompt_logprobs needs every prompt position"):
        engine.add_request("b", following, params, restore_kv=saved)
    while engine.has_unfinished_requests():
        engine.step()
    assert prefill(engine) == len(following)


def test_an_aborted_request_saves_nothing(model, turns, tmp_path):
    path = tmp_path / "kv.safetensors"
    engine = make_engine(model)
    engine.add_request("a", turns[0], greedy(FIRST), save_kv=path)
    engine.step()
    engine.abort_request("a")
    engine.step()
    assert not path.exists()


def test_a_save_path_in_no_folder_is_refused(model, tmp_path):
    with pytest.raises(RequestError, match="save_kv=.* is in no existing folder"):
        make_engine(model).add_request("a", [1, 2], save_kv=tmp_path / "no" / "kv.safetensors")


def test_a_file_round_trips_bit_identical_in_bfloat16(tmp_path):
    model = random_model("llama", "tiny", seed=0, dtype="bfloat16")
    engine = make_engine(model)
    run(engine, "a", list(range(1, 40)), 2)  # some KV in the arena
    blocks = engine.runner.swap_out([0, 1, 2])
    path = tmp_path / "kv.safetensors"
    persistence.save(path, engine.host.kv_spec, list(range(1, 40)), blocks)
    loaded = persistence.load(path, engine.host.kv_spec)
    assert loaded.token_ids == tuple(range(1, 40))
    back = loaded.blocks
    for a, b in zip(blocks.keys + blocks.values, back.keys + back.values, strict=True):
        assert a.dtype == np.uint16 and np.array_equal(a, b)
    fp32 = KVSpec.of(random_model("llama", "tiny", seed=0), 16)
    with pytest.raises(KVFileError, match="dtype=bfloat16"):
        persistence.load(path, fp32)


def test_the_fingerprint_tells_models_apart_and_is_stable(model):
    same = persistence.model_fingerprint(random_model("llama", "tiny", seed=0))
    assert persistence.model_fingerprint(model) == same
    for other in (
        random_model("llama", "tiny", seed=1),
        random_model("qwen2", "tiny", seed=0),
        random_model("llama", "tiny", seed=0, dtype="float16"),
    ):
        assert persistence.model_fingerprint(other) != same


# -- the whole radix tree -------------------------------------------------------------------
@pytest.fixture(scope="module")
def snapshot(model, tmp_path_factory):
    """A radix engine's prefix cache after three requests, two sharing a 48-token system
    prompt, saved whole; the engine's output tokens alongside."""
    rng = np.random.default_rng(9)
    system = rng.integers(1, 1024, 48).tolist()
    prompts = [system + rng.integers(1, 1024, n).tolist() for n in (20, 37)]
    prompts.append(rng.integers(1, 1024, 70).tolist())
    engine = make_engine(model, RadixAllocator)
    for i, p in enumerate(prompts):
        run(engine, f"r{i}", p, FIRST)
    folder = tmp_path_factory.mktemp("tree")
    paths = engine.save_prefix_cache(folder)
    return folder, prompts, paths, engine.allocator.stats().cached_blocks


def test_a_saved_tree_restores_and_later_requests_hit_it(model, snapshot):
    folder, prompts, paths, cached = snapshot
    # Full blocks of prompt + output but the last token, per request: 48 shared, then each
    # own: (48+20+7)//16 = 4, (48+37+7)//16 = 5, (70+7)//16 = 4 blocks; 3 shared.
    assert paths == 3 and cached == 4 + 5 + 4 - 3
    engine = make_engine(model, RadixAllocator)
    assert engine.restore_prefix_cache(folder) == cached * 16
    assert engine.allocator.stats().cached_blocks == cached
    for i, p in enumerate(prompts):
        assert run(engine, f"again{i}", p, NEXT) == mlx_lm_tokens(model, p, NEXT)
    rows = engine.recorder.requests
    # Every full block of each prompt, short of its last token, came from the snapshot.
    assert [r["cached_tokens"] for r in rows] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert prefill(engine) == sum(len(p) - (len(p) - 1) // 16 * 16 for p in prompts)


def test_a_tree_restore_skips_bad_files_and_stops_when_blocks_run_out(model, snapshot, tmp_path):
    folder, prompts, _, _ = snapshot
    for f in sorted(folder.iterdir()):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    first, *_ = sorted(tmp_path.iterdir())
    _corrupt(first)
    engine = build_engine(model, RadixAllocator, FCFSScheduler, block_size=16, num_blocks=6)
    with pytest.warns(KVRestoreWarning) as caught:
        restored = engine.restore_prefix_cache(tmp_path)
    messages = [str(w.message) for w in caught]
    assert any("is corrupted" in m and "skipped" in m for m in messages)
    assert any("restore stopped" in m for m in messages)
    # What was restored stays: nothing it restored was evicted to restore the rest.
    assert engine.allocator.stats().cached_blocks * 16 == restored > 0
    engine.allocator.check()


def test_a_tree_snapshot_needs_the_radix_allocator(model, tmp_path):
    engine = make_engine(model, FreeListAllocator)
    with pytest.raises(ValueError, match="allocator FreeListAllocator keeps none; use the radix"):
        engine.save_prefix_cache(tmp_path)
    with pytest.raises(ValueError, match="holds no prefix-cache snapshot"):
        make_engine(model, RadixAllocator).restore_prefix_cache(tmp_path)
