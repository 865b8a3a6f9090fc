"""The lower KV tiers on the real engine (kv_tier): blocks the radix cache evicts are copied
to host memory or to disk files and copied back for a later prefix hit. The restored KV is
the KV: greedy tokens equal those of an arena that never evicts, and a loaded block's bytes
equal the evicted block's."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from support import run_alone

from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from allocators.tiers import KVTier, TierMove
from harness.engine import build_engine
from harness.engine.sampling_params import SamplingParams
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler
from schedulers.priority import PriorityScheduler

BS = 16
OUT = 6  # output tokens per request


def greedy(n: int = OUT) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make_engine(model, num_blocks: int, kv_tier: KVTier | None = None, **kw):
    return build_engine(
        model, RadixAllocator, FCFSScheduler, block_size=BS, num_blocks=num_blocks,
        kv_tier=kv_tier, **kw,
    )  # fmt: skip


def watch(engine) -> list[TierMove]:
    """The moves the engine makes, as it makes them (its TierKV's ``apply``)."""
    made, apply = [], engine.host.tiers.apply

    def recording(moves):
        made.extend(moves)
        apply(moves)

    engine.host.tiers.apply = recording
    return made


def run(engine, request_id: str, prompt: list[int]) -> list[int]:
    """One request to completion, alone; its output tokens."""
    return run_alone(engine, request_id, prompt, greedy())


def conversations(seed: int = 0) -> list[list[int]]:
    """Three chats of three turns (a turn's prompt: the one before, its answer stand-in and a
    new message), interleaved so that a small arena evicts a chat before its next turn."""
    rng = np.random.default_rng(seed)
    chats = [rng.integers(1, 1000, 40).tolist() for _ in range(3)]
    prompts = []
    for _ in range(3):
        for chat in chats:
            chat += rng.integers(1, 1000, 14).tolist()
            prompts.append(list(chat))
    return prompts


@pytest.fixture(scope="module")
def reference(model) -> dict[int, list[list[int]]]:
    """Tokens from an arena that never evicts, per kv_bits."""
    return {
        bits: [
            run(engine, f"r{i}", p)
            for engine in [make_engine(model, 256, kv_bits=bits)]
            for i, p in enumerate(conversations())
        ]
        for bits in (16, 8)
    }


# Write-through's host copies are taken at commit, so a host tier smaller than the chats lets
# its copies go before their blocks are evicted (then dropped, as HiCache's): 6 slots keep some.
TIERS = {
    "host_write_back": KVTier(host_blocks=64),
    "host_write_through": KVTier(host_blocks=64, write_policy="write_through"),
    "host_disk_write_back": KVTier(host_blocks=2, disk_blocks=64),
    "host_disk_write_through": KVTier(host_blocks=6, disk_blocks=64, write_policy="write_through"),
}


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("name", TIERS)
def test_tokens_with_tiers_equal_an_arena_that_never_evicts(
    model, reference, name, bits, tmp_path
) -> None:
    kv_tier = TIERS[name]
    if kv_tier.disk_blocks:
        kv_tier = KVTier(**{**vars(kv_tier), "dir": str(tmp_path)})
    engine = make_engine(model, 9, kv_tier, kv_bits=bits)  # one chat's last turn: 9 blocks
    made = watch(engine)
    tokens = [run(engine, f"r{i}", p) for i, p in enumerate(conversations())]
    assert tokens == reference[bits]
    loads = {m.src_tier for m in made if m.dst_tier == "device"}
    assert loads == ({"host", "disk"} if kv_tier.disk_blocks else {"host"}), made
    assert engine.allocator.stats().evictions > 0
    # the steps table counts the moves made, and times them (measured, as swaps are)
    steps = engine.recorder.steps
    moved = (
        "host_blocks_loaded",
        "disk_blocks_loaded",
        "host_blocks_written",
        "disk_blocks_written",
    )
    assert sum(r[c] for r in steps for c in moved) == len(made)
    assert all(r["tier_time"] > 0 for r in steps if any(r[c] for c in moved))
    engine.close()
    assert list(tmp_path.iterdir()) == []  # the disk tier's folder is gone


@pytest.mark.parametrize(
    "options",
    [{"pipeline": True}, {"scheduler": ChunkedPrefillScheduler}, {"scheduler": PriorityScheduler}],
    ids=["pipelined", "chunked_prefill", "priority"],
)
def test_tokens_with_tiers_hold_under_other_step_loops_and_policies(model, reference, options):
    scheduler = options.pop("scheduler", FCFSScheduler)
    engine = build_engine(
        model, RadixAllocator, scheduler, block_size=BS, num_blocks=9,
        kv_tier=TIERS["host_write_back"], **options,
    )  # fmt: skip
    made = watch(engine)
    assert [run(engine, f"r{i}", p) for i, p in enumerate(conversations())] == reference[16]
    assert any(m.dst_tier == "device" for m in made)


def test_an_allocator_without_a_prefix_cache_refuses_tiers(model) -> None:
    with pytest.raises(ValueError, match="keeps no prefix cache: use the radix allocator"):
        build_engine(model, FreeListAllocator, FCFSScheduler, num_blocks=8, kv_tier=KVTier(8))


def checksums(engine, blocks: dict[tuple[int, ...], int]) -> dict[tuple[int, ...], str]:
    """sha256 of each arena block's stored bytes (every layer's keys and values)."""
    sums = {}
    for prefix, block in blocks.items():
        host = engine.runner.swap_out([block])
        digest = hashlib.sha256()
        for a in (*host.keys, *host.values):
            digest.update(np.ascontiguousarray(a).tobytes())
        sums[prefix] = digest.hexdigest()
    return sums


def on_device(engine) -> dict[tuple[int, ...], int]:
    return {p: b for p, tier, b in engine.allocator.cached_nodes() if tier == "device"}


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("host_blocks", [8, 1], ids=["host", "host_disk"])
def test_a_loaded_block_holds_the_evicted_blocks_bytes(model, bits, host_blocks, tmp_path):
    kv_tier = KVTier(host_blocks=host_blocks, disk_blocks=8, dir=str(tmp_path), keep=True)
    engine = make_engine(model, 6, kv_tier, kv_bits=bits)
    rng = np.random.default_rng(1)
    first = rng.integers(1, 1000, 64).tolist()
    run(engine, "a", first)
    before = checksums(engine, on_device(engine))
    assert len(before) == 4  # 64 + 5 computed tokens: four full blocks indexed
    run(engine, "b", rng.integers(1, 1000, 80).tolist())  # 6 blocks: evicts all of a's
    tiers = {p: tier for p, tier, _ in engine.allocator.cached_nodes() if p in before}
    assert set(tiers.values()) == ({"host"} if host_blocks == 8 else {"host", "disk"})
    run(engine, "c", first + rng.integers(1, 1000, 10).tolist())
    after = checksums(engine, {p: b for p, b in on_device(engine).items() if p in before})
    assert after == before
    engine.close()
    assert [p.name[:8] for p in tmp_path.iterdir()] == ["kv-tier-"]  # kept
