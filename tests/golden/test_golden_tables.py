"""A redesign changes no result: each golden replay (tests/golden/cases.py) gives the same
``requests.parquet`` and ``steps.parquet`` as when its golden was written, column by column.
A new column is allowed; a golden column that is missing or differs fails, named. Each also
leaves no reference cycle behind (the cyclic collector is off while a trace replays:
harness/platform/collector.py), which ``run`` would warn of."""

from __future__ import annotations

import logging

import pandas as pd
import pytest
from cases import CASES, HERE, run_case


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_replay_gives_its_golden_tables(name, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="harness.cli.run"):
        tables = run_case(name, tmp_path)
    cycles = [r.getMessage() for r in caplog.records if "reference cycles" in r.getMessage()]
    assert not cycles, cycles
    for table, df in tables.items():
        golden = pd.read_parquet(HERE / f"{name}.{table}.parquet")
        assert len(df) == len(golden), f"{table}: {len(df)} rows, golden {len(golden)}"
        missing = [c for c in golden.columns if c not in df.columns]
        assert not missing, f"{table}: columns {missing} are gone"
        for column in golden.columns:
            pd.testing.assert_series_equal(
                df[column], golden[column], check_names=False, obj=f"{table}.{column}"
            )


def test_the_goldens_cover_preemption_speculation_and_forks():
    """The cases exercise what a redesign of the step path could break: preemption, swaps,
    speculation, forks, prefix caching, windows, KV tiers, pipelined steps and stops."""
    steps = {n: pd.read_parquet(HERE / f"{n}.steps.parquet") for n in CASES}
    assert steps["priority_recompute"].preempted.sum() > 0
    assert steps["priority_swap"].swap_out_blocks.sum() > 0
    assert steps["swap_real"].swap_in_blocks.sum() > 0
    assert steps["spec_draft"].spec_accepted.sum() > 0
    assert steps["spec_layerskip"].spec_verifications.sum() > 0
    assert steps["n2"].blocks_shared.sum() > 0
    assert steps["alloc_radix"].blocks_cached.max() > 0
    assert steps["sliding_window"].window_blocks_used.max() > 0
    window = steps["sliding_window_model"]
    assert window.window_blocks_used.max() > 0 and window.swap_in_blocks.sum() > 0
    assert window.window_attention_pairs.sum() > 0
    assert steps["tiers_host"].host_blocks_loaded.sum() > 0
    assert steps["tiers_write_through"].host_blocks_written.sum() > 0
    assert steps["tiers_host_disk"].disk_blocks_loaded.sum() > 0
    assert steps["pipeline_real"].preempted.sum() > 0
    for name in ("stops_model", "stops_pipeline"):
        requests = pd.read_parquet(HERE / f"{name}.requests.parquet")
        assert (requests.finish_reason == "stop").sum() > len(requests) // 2
