"""The lower KV tiers' figures (docs/results.md) on tables counted by hand: prefix hit rates
by tier, bytes moved, reachable hits recovered, and the console and kvbench-compare rows that
show them only when a run has tiers."""

from __future__ import annotations

import math

import pytest
from test_compare import write_run
from test_metrics import _request, _step

from harness.analysis import compare
from harness.analysis.metrics import (
    format_summary,
    reachable_hits_recovered,
    requests_frame,
    steps_frame,
    summarize,
)
from harness.costmodel.work import StepWork

MIB = 2**20  # a block's bytes here: the MiB figures are the blocks
TIER_KEYS = (
    "prefix_hit_rate_device",
    "prefix_hit_rate_host",
    "prefix_hit_rate_disk",
    "tier_bytes_loaded",
    "tier_bytes_written",
)


def hits(rid, prompt, cached, *, device=0, host=0, disk=0, **kw):
    """A request row whose ``cached`` hit tokens came ``device``, ``host`` and ``disk``."""
    return _request(rid, 0.0, [1.0], prompt_tokens=prompt, cached_tokens=cached,
                    cached_tokens_device=device, cached_tokens_host=host,
                    cached_tokens_disk=disk, **kw)  # fmt: skip


@pytest.fixture
def tiered():
    """a: 100 prompt tokens, 64 hits (32 in the arena, 16 loaded from host, 16 from disk);
    b: 50, 16 hits in the arena; b/1: b's second completion, its prompt forked (looked
    nothing up: left out); c: 50, 32 hits loaded from host. 200 prompt tokens looked up.
    Steps: 2 blocks written to host; then 3 loaded from host, 1 from disk, 1 written to
    disk."""
    requests = [
        hits("a", 100, 64, device=32, host=16, disk=16),
        hits("b", 50, 16, device=16),
        hits("b/1", 50, 0, forked_tokens=50),
        hits("c", 50, 32, host=32),
    ]
    steps = [
        _step(0, 0, 0, 0, 0, host_blocks_written=2, host_bytes_written=2 * MIB),
        _step(1, 0, 0, 0, 0, host_blocks_loaded=3, disk_blocks_loaded=1, disk_blocks_written=1,
              host_bytes_loaded=3 * MIB, disk_bytes_loaded=MIB, disk_bytes_written=MIB),
    ]  # fmt: skip
    return summarize(requests_frame(requests), steps_frame(steps), clock="model")


def test_hit_rates_split_by_tier_and_sum_to_the_prefix_hit_rate(tiered):
    """112 hits of 200 tokens: 48 in the arena, 48 from host, 16 from disk."""
    s = tiered
    assert s["prefix_hit_rate"] == pytest.approx(112 / 200)
    got = [s[f"prefix_hit_rate_{t}"] for t in ("device", "host", "disk")]
    assert got == pytest.approx([48 / 200, 48 / 200, 16 / 200])


def test_bytes_loaded_and_written_sum_both_tiers(tiered):
    """Loaded 3 + 1 blocks, written 2 + 1, of 1 MiB each."""
    assert (tiered["tier_bytes_loaded"], tiered["tier_bytes_written"]) == (4 * MIB, 3 * MIB)


def test_reachable_hits_recovered_is_the_lower_tiers_share_of_what_the_arena_missed(tiered):
    """Bound 0.64 (an unbounded cache's hit rate), the arena 0.24: 0.40 missed, of which host
    0.24 and disk 0.08 recovered: 0.32 / 0.40 = 0.8."""
    assert reachable_hits_recovered({**tiered, "max_prefix_hit_rate_blocks": 0.64}) == (
        pytest.approx(0.8)
    )


def test_without_tiers_nothing_is_recovered_and_at_the_bound_nothing_was_missed():
    """No lower tier: 0 of the 0.3 missed. The arena at the bound: 0 / 0, NaN."""
    s = dict.fromkeys(("prefix_hit_rate_host", "prefix_hit_rate_disk"), 0.0)
    assert reachable_hits_recovered(
        {**s, "prefix_hit_rate_device": 0.2, "max_prefix_hit_rate_blocks": 0.5}
    ) == (0.0)
    assert math.isnan(
        reachable_hits_recovered(
            {**s, "prefix_hit_rate_device": 0.5, "max_prefix_hit_rate_blocks": 0.5}
        )
    )


def test_a_run_without_tiers_has_every_hit_in_the_arena_and_nothing_moved():
    """Rows recorded before the tier columns existed: cached_tokens are the arena's."""
    requests = [_request("a", 0.0, [1.0], prompt_tokens=40, cached_tokens=16)]
    s = summarize(requests_frame(requests), steps_frame([_step(0, 0, 0, 0, 0)]), clock="model")
    assert s["prefix_hit_rate_device"] == s["prefix_hit_rate"] == pytest.approx(0.4)
    assert [s[k] for k in TIER_KEYS[1:]] == [0.0, 0.0, 0, 0]


def test_the_console_shows_tier_rows_only_for_a_run_with_tiers(tiered):
    with_tiers = format_summary({**tiered, "reachable_hits_recovered": 0.8}).splitlines()
    rows = [line for line in with_tiers if line.startswith(("Prefix hits", "Reachable", "Tier"))]
    assert [" ".join(r.split()) for r in rows] == [
        "Prefix hits device / host / disk 24.0 % / 24.0 % / 8.0 %",
        "Reachable hits recovered 80.0 %",
        "Tier loaded / written 4.0 / 3.0 MiB",
    ]
    plain = {**tiered, **dict.fromkeys(TIER_KEYS[1:], 0)}
    before = {k: v for k, v in plain.items() if k not in TIER_KEYS}  # a summary from before
    assert format_summary(plain) == format_summary(before)


def test_kvbench_compare_shows_tier_columns_only_when_a_run_has_tiers(tmp_path, tiered):
    plain = {**tiered, **dict.fromkeys(TIER_KEYS[1:], 0)}
    write_run(tmp_path / "none" / "run", ["kv_tier=none"], plain)
    headers = [c.header for c in compare.COLUMNS]
    none = compare.table(tmp_path / "none")
    assert [h for h in none.columns if "(" in h] == headers
    write_run(tmp_path / "both" / "a", ["kv_tier=none"], plain)
    write_run(
        tmp_path / "both" / "b", ["kv_tier=host"], {**tiered, "reachable_hits_recovered": 0.8}
    )
    both = compare.table(tmp_path / "both").set_index("run")
    assert [h for h in both.columns if "(" in h] == headers + [
        c.header for c in compare.TIER_COLUMNS
    ]
    assert both.loc["kv_tier=host", "device hit (%)"] == pytest.approx(24.0)
    assert both.loc["kv_tier=host", "host hit (%)"] == pytest.approx(24.0)
    assert both.loc["kv_tier=host", "recovered (%)"] == pytest.approx(80.0)
    assert both.loc["kv_tier=host", "tier loaded (MiB)"] == pytest.approx(4.0)
    assert both.loc["kv_tier=none", "tier written (MiB)"] == 0.0
    assert math.isnan(both.loc["kv_tier=none", "recovered (%)"])  # not in its summary


def test_a_steps_table_from_before_the_window_and_tier_columns_still_loads():
    """A table recorded before the sliding-window and tier columns existed reads them as 0,
    in the results' reader and in a step's work alike (a model without window layers, a
    cache without lower tiers)."""
    added = ("window_kv_slots_read", "window_attention_pairs", "window_swap_blocks",
             "host_blocks_loaded", "host_bytes_written", "tier_time")  # fmt: skip
    old = [{k: v for k, v in _step(0, 0, 0, 0, 0).items() if k not in added}]
    steps = steps_frame(old)
    assert all((steps[c] == 0).all() for c in added)
    work = StepWork.from_row(old[0])
    assert (work.window_swap_blocks, work.host_blocks_loaded) == (0, 0)
