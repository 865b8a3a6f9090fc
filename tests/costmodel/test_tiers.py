"""The lower KV tiers' prices (harness/costmodel/tiers.py) on small profiles, counted by hand:
a block's seconds over each link, a step's loads and writes with and without prefetch, and
load-or-recompute against the profile's prefill price."""

from __future__ import annotations

import pytest

from harness.costmodel.profile import FORMAT, VERSION, ProfileError, RooflineProfile, load, save
from harness.costmodel.roofline import derive
from harness.costmodel.shape import shape_of
from harness.costmodel.tiers import TierCost
from harness.costmodel.work import PRICED, StepWork

BLOCK_BYTES = 1_000_000  # a block of 1 MB: easy seconds at round bandwidths


def measured(tmp_path):
    """A measured profile: a prefill step costs 50 ms + 1 ms per query token, a swapped block
    2 ms."""
    data = {
        "format": FORMAT,
        "version": VERSION,
        "kind": "measured",
        "model": {"name": "toy", "fingerprint": "f"},
        "block_size": 4,
        "features": list(PRICED),
        "kinds": {"prefill": {"coefficients": {"step": 0.05, "query_tokens_padded": 0.001}}},
        "moves": {"block_copies": 0.0, "swap_blocks": 0.002},
    }
    path = tmp_path / "measured.json"
    save(data, path)
    return load(path)


def roofline(disk_bandwidth: float | None = 2.5e8) -> RooflineProfile:
    """A roofline profile by hand: a query token costs 1e6 FLOPs at 1e9 FLOP/s (1 ms), the
    host link moves 1e9 bytes/s at efficiency 0.5 (a 1 MB block: 2 ms), the disk 2.5e8 bytes/s
    (4 ms) unless ``disk_bandwidth`` is None (the sheet has none)."""
    machine = {"name": "toy"}
    if disk_bandwidth is not None:
        machine["disk_bandwidth"] = disk_bandwidth
    data = {
        "format": FORMAT,
        "version": VERSION,
        "kind": "roofline",
        "model": {"name": "toy", "fingerprint": "f"},
        "block_size": 4,
        "machine": machine,
        "roofline": {
            "peak": {"compute": 1e9, "memory": 1e9, "host_link": 1e9},
            "efficiency": {"compute": 1.0, "memory": 1.0, "host_link": 0.5},
            "overhead": {"step": 0.0, "rows": 0.0},
            "operators": {"linear": {"compute": {"query_tokens_padded": 1e6}}},
        },
    }
    return RooflineProfile("toy.json", data)


def test_a_block_costs_its_bytes_over_each_link():
    """Host link: 1e6 B / (1e9 x 0.5) B/s = 2 ms; disk: 1e6 / 2.5e8 = 4 ms. A load from disk
    crosses the disk then the host link, 6 ms a block; a write to disk (a host block handed
    down) the disk alone."""
    cost = TierCost.of(roofline(), BLOCK_BYTES, 4, disk=True)
    assert (cost.host, cost.disk) == (pytest.approx(0.002), pytest.approx(0.004))
    assert cost.load_seconds("host", 3) == pytest.approx(0.006)
    assert cost.load_seconds("disk", 3) == pytest.approx(0.018)
    assert cost.write_seconds("host", 3) == pytest.approx(0.006)
    assert cost.write_seconds("disk", 3) == pytest.approx(0.012)


def test_a_measured_profile_prices_a_host_block_as_a_swapped_one(tmp_path):
    """The same copy over the same link: the 2 ms kvbench-calibrate measured per swapped block."""
    cost = TierCost.of(measured(tmp_path), BLOCK_BYTES, 4)
    assert cost.host == 0.002 and cost.disk is None


def test_a_disk_tier_needs_a_profile_that_prices_the_disk(tmp_path):
    """A measured profile timed no disk, a roofline without the sheet's disk_bandwidth has
    none: one line naming kv_tier.disk_blocks and the fix, no guessed default."""
    for profile in (measured(tmp_path), roofline(disk_bandwidth=None)):
        with pytest.raises(ProfileError, match=r"kv_tier\.disk_blocks needs a roofline") as e:
            TierCost.of(profile, BLOCK_BYTES, 4, disk=True)
        assert "\n" not in str(e.value)
        assert TierCost.of(profile, BLOCK_BYTES, 4).disk is None  # a host tier alone is fine


def test_a_derived_roofline_prices_the_host_tier_as_its_swaps_and_the_disk_from_its_sheet():
    """An H100 (devices.yaml: host link 64e9 B/s, disk 13e9 B/s): a block of the tiny model
    (4 layers x 2 KV heads x 64 x 4 bytes x 2 (K, V) x 16 slots = 65,536 bytes) costs over
    the host link what the profile's swap of one block costs, and 65,536 / 13e9 s on disk."""
    shape = shape_of("tiny", "float32")
    profile = RooflineProfile("h100.json", derive(shape, "h100", block_size=16))
    block = 4 * 2 * 64 * 4 * 2 * 16
    cost = TierCost.of(profile, block, 16, disk=True)
    swap = profile.predict(StepWork(swap_in_blocks=1)) - profile.predict(StepWork())
    assert cost.host == pytest.approx(swap) == pytest.approx(block / 64e9)
    assert cost.disk == pytest.approx(block / 13e9)


def test_a_step_pays_its_writes_and_what_the_previous_step_does_not_hide_of_its_loads():
    """3 host blocks and 1 disk block loaded: 3 x 2 + 6 = 12 ms; 2 host blocks and 1 disk
    block written: 2 x 2 + 4 = 8 ms. Without prefetch: 20 ms. Prefetched a step ahead: the
    writes, then the loads less the previous step's 5 ms (8 + 7 = 15 ms), or nothing of them
    after a 20 ms step (8 ms)."""
    work = StepWork(
        host_blocks_loaded=3, disk_blocks_loaded=1, host_blocks_written=2, disk_blocks_written=1
    )
    plain = TierCost.of(roofline(), BLOCK_BYTES, 4, disk=True, prefetch=False)
    ahead = TierCost.of(roofline(), BLOCK_BYTES, 4, disk=True, prefetch=True)
    assert plain.step_seconds(work, previous=0.005) == pytest.approx(0.020)
    assert ahead.step_seconds(work, previous=0.005) == pytest.approx(0.015)
    assert ahead.step_seconds(work, previous=0.020) == pytest.approx(0.008)
    assert ahead.step_seconds(StepWork(), previous=0.0) == 0.0  # nothing moved, nothing paid


def test_recomputing_tokens_costs_what_they_add_to_a_prefill(tmp_path):
    """Measured: 8 tokens add 8 x 1 ms to a prefill step (its 50 ms intercept is paid by the
    request's prefill anyway). Roofline: 8 tokens x 1e6 FLOPs / 1e9 FLOP/s = 8 ms."""
    assert TierCost.of(measured(tmp_path), BLOCK_BYTES, 4).recompute_seconds(8) == pytest.approx(
        0.008
    )
    assert TierCost.of(roofline(), BLOCK_BYTES, 4).recompute_seconds(8) == pytest.approx(0.008)


def test_recomputing_tokens_deep_in_a_prompt_costs_their_attention_to_the_tokens_before():
    """The hand-made roofline plus attention at 1e5 FLOPs a (query, key) pair (0.1 ms). 8
    tokens (block 4) from position 0: 8 ms of linear + 8 x 8 pairs = 6.4 ms. After 8 tokens
    of the prompt: their queries read 16 keys, 8 x 16 pairs = 12.8 ms: 20.8 ms in all."""
    base = roofline()
    data = {**base.data, "roofline": {**base.data["roofline"]}}
    data["roofline"]["operators"] = {
        **base.data["roofline"]["operators"],
        "attention": {"compute": {"attention_pairs": 1e5}},
    }
    cost = TierCost.of(RooflineProfile("toy.json", data), BLOCK_BYTES, 4)
    assert cost.recompute_seconds(8) == pytest.approx(0.0144)
    assert cost.recompute_seconds(8, start=8) == pytest.approx(0.0208)
    # 2 host blocks load in 4 ms: at a ratio of 4, worth it only deep in the prompt
    ratio = TierCost.of(RooflineProfile("toy.json", data), BLOCK_BYTES, 4, min_load_ratio=4)
    assert not ratio.worth_loading("host", 2, 8, start=0)  # 14.4 < 16
    assert ratio.worth_loading("host", 2, 8, start=8)  # 20.8 >= 16


@pytest.mark.parametrize(
    ("tier", "ratio", "worth"),
    [
        ("host", 1.0, True),  # load 2 x 2 = 4 ms <= recompute 8 ms
        ("host", 2.0, True),  # 8 >= 2 x 4: just worth it
        ("host", 2.5, False),  # 8 < 2.5 x 4 = 10: recompute
        ("disk", 1.0, False),  # load 2 x 6 = 12 ms > 8 ms: recompute
        ("disk", 0.5, True),  # 8 >= 0.5 x 12 = 6
        ("disk", 0.0, True),  # a ratio of 0 always loads
    ],
)
def test_blocks_are_loaded_only_when_recomputing_costs_min_load_ratio_times_more(
    tier, ratio, worth
):
    """2 blocks of 4 tokens (8 tokens, 8 ms to recompute on the hand-made roofline)."""
    cost = TierCost.of(roofline(), BLOCK_BYTES, 4, disk=True, min_load_ratio=ratio)
    assert cost.worth_loading(tier, 2, 8) is worth


def test_a_negative_min_load_ratio_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"kv_tier\.min_load_ratio=-1"):
        TierCost.of(measured(tmp_path), BLOCK_BYTES, 4, min_load_ratio=-1)
