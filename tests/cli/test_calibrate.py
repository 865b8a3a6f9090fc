"""kvbench-calibrate end to end on a small grid: a profile that loads, prices this model's
steps and drives a model-clock replay; a bad grid value is one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from support import ROOT

from harness.cli.calibrate import PROFILE_FILE, STEPS_FILE, Grid, calibrate, format_residuals
from harness.cli.run import CONFIG_DIR, run
from harness.costmodel.profile import fingerprint, load
from harness.platform.models import random_model

# 9 decode cells at one context and 4 at unequal ones: each one prefill step whatever the load
# (every request at t=0), so the prefill kind has its 8 steps; the mixed cell's steps depend
# on timing, its kind's count too.
SMALL_GRID = (
    "calibrate.batches=[1,2,4]",
    "calibrate.contexts=[16,40,64]",
    "calibrate.decode_tokens=12",
    "calibrate.chunks=[16]",
    "calibrate.mixed_requests=6",
    "calibrate.move_blocks=[1,2]",
    "calibrate.repeats=2",
    "engine.num_blocks=64",
    "progress=false",
)


def compose_calibrate(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="test"):
        return compose(config_name="calibrate", overrides=[*SMALL_GRID, *overrides])


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calibrate")
    calibrate(compose_calibrate(), out)
    return out


def test_a_calibration_writes_a_profile_of_this_model_with_its_residuals(calibrated):
    profile = load(calibrated / PROFILE_FILE)
    shape = random_model("llama", "tiny").shape()
    assert profile.kind == "measured"
    assert profile.data["model"]["fingerprint"] == fingerprint(shape)
    assert profile.data["block_size"] == 16
    assert profile.data["machine"]["mlx"]  # where it was measured
    assert {"decode", "prefill", "mixed"} <= set(profile.data["kinds"])
    for fit in profile.data["kinds"].values():
        r = fit["residuals"]
        assert r["steps"] >= 8 and r["median_abs"] >= 0 and r["p90_abs"] >= r["median_abs"]
        assert all(c > 0 for c in fit["coefficients"].values())
    assert set(profile.data["moves"]) == {"block_copies", "swap_blocks"}
    assert all(v > 0 for v in profile.data["moves"].values())
    assert profile.data["acceptance_rate"] is None  # no speculative cells
    assert (calibrated / STEPS_FILE).exists()
    printed = format_residuals(profile.data)
    assert printed.splitlines()[0].split()[:2] == ["kind", "steps"]
    assert {line.split()[0] for line in printed.splitlines()[1:]} == set(profile.data["kinds"])


def test_the_profile_drives_a_model_clock_replay(calibrated, compose_cfg, tmp_path):
    profile = calibrated / PROFILE_FILE
    summary = run(compose_cfg(["engine.clock=model", f"engine.profile={profile}"]), tmp_path)
    assert summary["clock"] == "model" and summary["completed"] == 6
    assert summary["profile"]["path"] == str(profile)
    assert summary["profile"]["kind"] == "measured"
    assert summary["warmup_requests"] == 0


def test_decode_cells_run_batches_at_one_context_and_at_unequal_ones():
    grid = Grid(batches=[1, 3], contexts=[16, 512], decode_tokens=8, spread=2)
    cells = grid.decode_cells(vocab=100, max_len=300)
    lengths = {t.metadata["cell"]: [len(r.prompt_token_ids) for r in t] for t in cells}
    assert lengths == {
        "decode-b1-c16": [16],
        "decode-b3-c16": [16] * 3,
        "decode-b1-c292": [292],  # the context leaves room for the decode tokens
        "decode-b3-c292": [292] * 3,
        "decode-b3-spread0": lengths["decode-b3-spread0"],
        "decode-b3-spread1": lengths["decode-b3-spread1"],
    }
    for name in ("decode-b3-spread0", "decode-b3-spread1"):
        assert all(16 <= n <= 292 for n in lengths[name]) and len(set(lengths[name])) == 3
    assert all(r.max_tokens == 8 and r.arrival_time == 0 for t in cells for r in t)
    assert [t.metadata["cell"] for t in Grid(batches=[2], contexts=[16], spread=0)
            .decode_cells(100, 300)] == ["decode-b2-c16"]  # fmt: skip


def test_a_bad_grid_value_is_one_line_and_exit_2(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli.calibrate", "calibrate.batches=[0]"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvbench-calibrate: error: calibrate.batches=[0] is invalid: a list of ints >= 1"
    ]
    assert "Traceback" not in proc.stdout


@pytest.mark.parametrize("option", ["ngram", "layerskip"])
def test_drafts_the_model_clock_cannot_run_are_refused_before_any_cell(option, tmp_path):
    with pytest.raises(ValueError, match=f"not speculative={option}: use speculative=draft"):
        calibrate(compose_calibrate(f"speculative={option}"), tmp_path)
    assert list(tmp_path.iterdir()) == []
