"""The model clock against the real engine: the same replays, measured and modelled.

``python -m harness.bench simulator [--sizes tiny,small] [--requests 60]
[--scenarios poisson,bursty,...] [--out DIR]``

Per model size, ``kvbench-calibrate``'s grid is run once (with ``speculative=draft``, so
verification steps are priced too) and fitted into a profile. Then each scenario replays twice
through ``kvbench``'s own ``run``: on the virtual clock (the real engine, every step measured)
and on the model clock with that profile. The profile never saw these traces: the grid's
cells are requests all at once and staggered chunked prefills, not these workloads.

    poisson        Poisson arrivals, uniform lengths, FCFS, free list
    bursty         Gamma arrivals (burstiness 0.25), FCFS, free list
    shared_prefix  4 system prompts x users, radix prefix cache
    chunked        ShareGPT-like lengths under chunked prefill (max_chunk 128)
    recompute      ShareGPT-like lengths all at once in 96 blocks, preemption by recompute
    swap           the same, preemption by swap
    speculative    Poisson, speculative decoding with the noisy-copy draft

For each: TTFT p50/p90, TPOT p50/p90, E2E p50, output throughput, preemptions, peak blocks and
prefix hit rate, real and modelled, with the relative error (modelled / real - 1). The error
goal: 5 % on medians and throughput, 10 % on p90s. Timed figures move with the machine's
load; run it on a quiet machine, and compare only side by side within one run.

Two more columns tell the profile's error from the machine's drift:

    fit     the profile's price of the real run's own steps over their measured durations,
            minus 1 (``priced_error``): the schedule held fixed, so the modelled schedule's
            divergence is out of it
    probe   ``priced_error`` of a fixed small real replay (``PROBE``) run just before the
            scenario: the same work each time, so its change since the probe run right after
            calibration is the machine's (a shared host's speed drifts by tens of percent
            within minutes), not the fit's
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from harness.analysis import results
from harness.bench.support.components import compose_config
from harness.bench.support.tables import format_table
from harness.cli.calibrate import PROFILE_FILE, calibrate
from harness.cli.run import CONFIG_DIR
from harness.cli.run import run as run_experiment
from harness.costmodel.profile import Profile, load
from harness.costmodel.work import StepWork

SCENARIOS: dict[str, list[str]] = {
    "poisson": ["trace=poisson", "trace.rate=8"],
    "bursty": ["trace=bursty", "trace.rate=8"],
    "shared_prefix": ["trace=shared_prefix", "allocator=radix", "trace.rate=8"],
    "chunked": ["trace=sharegpt", "trace.rate=4", "scheduler=chunked_prefill",
                "scheduler.max_chunk=128", "scheduler.max_num_batched_tokens=160"],
    "recompute": ["trace=sharegpt", "trace.rate=inf", "engine.num_blocks=96",
                  "scheduler.preemption_mode=recompute"],
    "swap": ["trace=sharegpt", "trace.rate=inf", "engine.num_blocks=96",
             "scheduler.preemption_mode=swap"],
    "speculative": ["trace=poisson", "trace.rate=4", "speculative=draft"],
}  # fmt: skip
# A fixed small real replay priced before each scenario: 8 requests at once (32-256 prompt
# tokens, 32-128 outputs), a few seconds of prefill, mixed and decode steps.
PROBE = ["trace=offline", "trace.num_requests=8"]
# (summary key, header, error goal: 5 % for medians and throughput, 10 % for p90s, exact
# for counts the schedule alone decides)
FIGURES = (
    ("ttft_p50", "TTFT p50", 0.05),
    ("ttft_p90", "TTFT p90", 0.10),
    ("tpot_p50", "TPOT p50", 0.05),
    ("tpot_p90", "TPOT p90", 0.10),
    ("e2e_p50", "E2E p50", 0.05),
    ("output_throughput", "tok/s", 0.05),
    ("preemptions", "preempt", None),
    ("blocks_used_peak", "peak blk", None),
    ("prefix_hit_rate", "hit rate", None),
)


def _requests(scenario: list[str], n: int) -> list[str]:
    """The scenario's trace limited to ``n`` requests (shared_prefix counts users)."""
    if "trace=shared_prefix" in scenario:
        return [f"trace.users_per_prompt={max(1, n // 4)}"]
    return [f"trace.num_requests={n}"]


def validate(size: str, scenarios: list[str], requests: int, out: Path) -> list[dict]:
    """Calibrate on ``size``, then replay each scenario real and modelled: one row each."""
    grid = compose_config([f"model={size}", "speculative=draft", "progress=false"])
    calibration = OmegaConf.load(Path(CONFIG_DIR) / "calibrate.yaml").calibrate
    OmegaConf.set_struct(grid, False)
    grid.calibrate = calibration
    calibrate(grid, out / f"calibrate-{size}")
    profile = out / f"calibrate-{size}" / PROFILE_FILE
    prices = load(profile)
    probes = out / size / "probes"
    print(f"probe after calibration: {probe(size, prices, probes / 'calibration'):+.1%}")
    rows = []
    for name in scenarios:
        overrides = [f"model={size}", "progress=false", *SCENARIOS[name]]
        overrides += _requests(SCENARIOS[name], requests)
        clocks = {
            "real": [],
            "model": ["engine.clock=model", f"engine.profile={profile}"],
        }
        drift = probe(size, prices, probes / name)
        got = {
            clock: run_experiment(compose_config([*overrides, *extra]), out / size / name / clock)
            for clock, extra in clocks.items()
        }
        fit = priced_error(results.load_tables(out / size / name / "real")[1], prices)
        rows.append({"size": size, "scenario": name, **got, "fit": fit, "probe": drift})
        print(format_rows(rows[-1:]), flush=True)
    return rows


def priced_error(steps: pd.DataFrame, profile: Profile) -> float:
    """The profile's price of a real run's steps (a steps table: each step's counts, its
    measured ``duration``) over their measured total, minus 1."""
    priced = sum(profile.predict(StepWork.from_row(row)) for row in steps.to_dict("records"))
    return priced / steps["duration"].sum() - 1


def probe(size: str, profile: Profile, out: Path) -> float:
    """``priced_error`` of the ``PROBE`` replay on the real engine, run now."""
    run_experiment(compose_config([f"model={size}", "progress=false", *PROBE]), out)
    return priced_error(results.load_tables(out)[1], profile)


def _error(real: float, modelled: float) -> float:
    if real is None or modelled is None or (isinstance(real, float) and math.isnan(real)):
        return math.nan
    if real == 0:
        return 0.0 if modelled == 0 else math.inf
    return modelled / real - 1


def format_rows(rows: list[dict]) -> str:
    """One line per scenario: real -> modelled (error) per figure; a * marks a miss."""
    header = ["model", "scenario", *(h for _, h, _ in FIGURES), "fit", "probe"]
    lines = []
    for row in rows:
        cells = [row["size"], row["scenario"]]
        for key, _, goal in FIGURES:
            real, modelled = row["real"].get(key), row["model"].get(key)
            err = _error(real, modelled)
            miss = goal is not None and not abs(err) <= goal
            if key.endswith(("_p50", "_p90")):
                text = f"{real * 1e3:.1f}>{modelled * 1e3:.1f}ms"
            elif isinstance(real, float):
                text = f"{real:.3g}>{modelled:.3g}"
            else:
                text = f"{real}>{modelled}"
            cells.append(f"{text} {err:+.1%}{'*' if miss else ''}")
        lines.append([*cells, f"{row['fit']:+.1%}", f"{row['probe']:+.1%}"])
    return format_table(header, lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench simulator")
    parser.add_argument("--sizes", default="tiny", help="model sizes (conf/model), comma-separated")
    parser.add_argument("--requests", type=int, default=60, help="requests per scenario")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="scenarios (module docstring)"
    )
    parser.add_argument("--out", help="folder for the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    scenarios = args.scenarios.split(",")
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; choose from {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        rows = []
        for size in args.sizes.split(","):
            rows += validate(size, scenarios, args.requests, out)
    print(
        "\nreal (virtual clock, measured) > modelled (model clock), error; * misses its goal;"
        "\nfit: the profile's price of the real run's own steps, error; probe: the same for a"
        "\nfixed replay run just before (its change since calibration is the machine's drift)"
    )
    print(format_rows(rows))


if __name__ == "__main__":
    main()
