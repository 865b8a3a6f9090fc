"""Lower KV tiers' moves (``SchedulerOutput.tier_moves``) counted, recorded and priced on the
model clock, on plans built by hand: counts by tier, bytes per block, the recorder's request
columns by tier, and token times that move by exactly the priced loads and writes.

The prefix cache that emits real moves is the allocator's (issue 36, items 1-2); here a
scheduler adds hand-made moves to its plans, so every figure is counted by hand.

Tiny model: 4 layers x 2 KV heads x head_dim 64 x 4 bytes (float32) x 2 (K and V) = 4,096
bytes a token, 65,536 a block of 16."""

from __future__ import annotations

from functools import partial

import pytest
from test_model_clock import greedy, toy_profile

from allocators.radix import RadixAllocator
from allocators.tiers import KVTier, TierMove
from harness.analysis.metrics import STEP_COLUMNS
from harness.costmodel.profile import ProfileError, load
from harness.costmodel.tiers import TierCost
from harness.costmodel.work import StepWork
from harness.engine import build_engine
from harness.engine.modelled import ModelClock, step_work
from harness.engine.recorder import Recorder
from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams
from schedulers.fcfs import FCFSScheduler
from schedulers.output import SchedulerOutput
from schedulers.stats import kv_stats

BLOCK_BYTES = 4 * 2 * 64 * 4 * 2 * 16  # 65,536
SWAP = 0.004  # the toy profile's seconds per swapped block: a host-tier block's price

TIER_COLUMNS = [c for c in STEP_COLUMNS if c.startswith(("host_", "disk_"))]
WRITE = TierMove("device", 3, "host", 0)
LOAD = TierMove("host", 0, "device", 5)


def test_step_work_counts_loads_by_source_tier_and_writes_by_destination_tier():
    """Two host loads, one disk load, one write to host, two to disk (a host block handed
    down, and a device block written straight to disk)."""
    plan = SchedulerOutput(
        tier_moves=[
            TierMove("host", 0, "device", 1),
            TierMove("host", 2, "device", 3),
            TierMove("disk", 7, "device", 4),
            TierMove("device", 5, "host", 0),
            TierMove("host", 6, "disk", 8),
            TierMove("device", 9, "disk", 9),
        ]
    )
    work = step_work(plan, StepWork())
    got = (
        work.host_blocks_loaded,
        work.disk_blocks_loaded,
        work.host_blocks_written,
        work.disk_blocks_written,
    )
    assert got == (2, 1, 1, 2)
    assert work.kind == "idle" and work.swap_in_blocks == 0  # moves, not a forward or swaps


def test_the_recorder_writes_each_tier_s_blocks_bytes_and_hits():
    """A step loading 3 host blocks and writing 2 to disk: 3 x 1,000 and 2 x 1,000 bytes. A
    request with 48 cached tokens of which 16 came from host and 8 from disk: 24 on device."""
    recorder = Recorder(measured=False, block_bytes=1000)
    work = StepWork(host_blocks_loaded=3, disk_blocks_written=2)
    idle = FCFSScheduler(RadixAllocator(num_blocks=8, block_size=4))  # nothing runs
    snapshot = recorder.snapshot(kv_stats(idle), SchedulerOutput(), {})
    recorder.step(SchedulerOutput(), snapshot, 0.0, 0.5, 0, 0, work=work)
    (row,) = recorder.steps
    moved = {c: row[c] for c in TIER_COLUMNS}
    assert moved == {
        "host_blocks_loaded": 3,
        "disk_blocks_loaded": 0,
        "host_blocks_written": 0,
        "disk_blocks_written": 2,
        "host_bytes_loaded": 3000,
        "disk_bytes_loaded": 0,
        "host_bytes_written": 0,
        "disk_bytes_written": 2000,
    }
    seq = Seq("a", [1] * 64, SamplingParams(max_tokens=1), arrival_time=0.0)
    seq.num_cached_tokens, seq.num_cached_tokens_host, seq.num_cached_tokens_disk = 48, 16, 8
    seq.finish_reason, seq.finish_time = "length", 1.0
    recorder.request(seq)
    (req,) = recorder.requests
    tiers = [req[f"cached_tokens_{t}"] for t in ("device", "host", "disk")]
    assert (req["cached_tokens"], tiers) == (48, [24, 16, 8])


class MovingScheduler(FCFSScheduler):
    """FCFS whose ``k``-th plan also carries ``moves[k]`` (the test's hand-made moves)."""

    def __init__(self, *args, moves: dict[int, list[TierMove]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.moves = moves
        self.steps = 0

    def schedule(self, now: float) -> SchedulerOutput:
        plan = super().schedule(now)
        plan.tier_moves += self.moves.get(self.steps, [])
        self.steps += 1
        return plan


def replay(model, tmp_path, moves, kv_tier: KVTier | None) -> tuple[list[float], list[dict]]:
    """One request (4 prompt tokens, 3 out) on the toy profile: its token times and steps."""
    profile = toy_profile(model, tmp_path, moves={"block_copies": 0.0, "swap_blocks": SWAP})
    engine = build_engine(
        model,
        RadixAllocator,  # tiers are a prefix cache's; one request in 64 blocks evicts nothing
        partial(MovingScheduler, max_num_seqs=8, moves=moves),
        num_blocks=64,
        clock="model",
        profile=profile,
        kv_tier=kv_tier,
    )
    engine.add_request("a", [1, 2, 3, 4], greedy(3), arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    (row,) = engine.recorder.requests
    return list(row["token_times"]), engine.recorder.steps


@pytest.mark.parametrize(
    ("prefetch", "times"),
    [
        # prefill 100 ms + 1 write 4 ms; decode 10 ms; decode 10 ms + 3 loads 12 ms
        (False, [0.104, 0.114, 0.136]),
        # the loads were issued a step ahead: the previous 10 ms decode hides 10 of their 12
        (True, [0.104, 0.114, 0.126]),
    ],
)
def test_a_step_waits_for_its_writes_and_its_loads_unless_a_prefetch_hid_them(
    model, tmp_path, prefetch, times
):
    """Block bytes: 65,536 a block, as the profile's host link measured them (4 ms a block)."""
    moves = {0: [WRITE], 2: [LOAD, LOAD, LOAD]}
    tier = KVTier(host_blocks=8, prefetch=prefetch)
    got, steps = replay(model, tmp_path, moves, tier)
    assert got == pytest.approx(times)
    assert [s["host_blocks_written"] for s in steps] == [1, 0, 0]
    assert [s["host_blocks_loaded"] for s in steps] == [0, 0, 3]
    assert [s["host_bytes_loaded"] for s in steps] == [0, 0, 3 * BLOCK_BYTES]
    assert [s["host_bytes_written"] for s in steps] == [BLOCK_BYTES, 0, 0]
    assert {s["tier_time"] for s in steps} == {0.0}  # priced into duration, not measured


def test_without_tiers_the_clock_prices_no_move_and_the_tables_are_unchanged(model, tmp_path):
    """kv_tier none (or absent): the same token times as before tiers existed (prefill 100
    ms, decodes 10 ms), every tier column 0."""
    for tier in (None, KVTier()):
        got, steps = replay(model, tmp_path, {}, tier)
        assert got == pytest.approx([0.100, 0.110, 0.120])
        assert all(s[c] == 0 for s in steps for c in (*TIER_COLUMNS, "tier_time"))


def test_a_prefetch_hides_loads_behind_the_previous_step_but_not_behind_an_idle_wait(
    model, tmp_path
):
    """Toy profile: a decode step costs 10 ms, a host block 4 ms. 3 loads (12 ms) after a
    decode: 2 ms paid. The same after the clock idled to a later arrival: all 12 ms (no step
    computed while the request could have been prefetched)."""
    profile = load(toy_profile(model, tmp_path, moves={"block_copies": 0.0, "swap_blocks": SWAP}))
    tiers = TierCost.of(profile, BLOCK_BYTES, 16)
    decode = StepWork(batch_size=1, row_groups=1, query_tokens_padded=1, single_token_rows=1)
    loading = decode._replace(host_blocks_loaded=3)
    clock = ModelClock(profile, tiers=tiers)
    clock.charge(decode)
    assert clock.advance(0.0) == pytest.approx(0.010)
    clock.charge(loading)
    assert clock.advance(0.0) == pytest.approx(0.012)
    clock.wait_until(1.0)
    clock.charge(loading)
    assert clock.advance(0.0) == pytest.approx(0.022)


def test_a_disk_tier_on_a_profile_without_a_disk_is_refused_in_one_line(model, tmp_path):
    """The toy profile is measured: it timed no disk."""
    with pytest.raises(ProfileError, match=r"kv_tier\.disk_blocks needs a roofline profile"):
        build_engine(
            model,
            RadixAllocator,
            partial(FCFSScheduler, max_num_seqs=8),
            num_blocks=64,
            clock="model",
            profile=toy_profile(model, tmp_path),
            kv_tier=KVTier(host_blocks=8, disk_blocks=8),
        )
