"""kvbench-load-sweep: rates spread from a measured saturation, the sweep's jobs as Hydra makes
them, one real tiny load sweep, and bad options named before any work."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support import ROOT, TINY

from harness.analysis import compare, plots, results
from harness.cli.load_sweep import RECORD_FILE, jobs, main, spread_rates, sweep


def test_rates_are_spread_evenly_up_to_a_multiple_of_the_saturation() -> None:
    assert spread_rates(10.0, 5) == [2.2, 4.4, 6.6, 8.8, 11.0]  # up to 1.1 x by default
    assert spread_rates(3.0, 4, up_to=1.0) == [0.75, 1.5, 2.25, 3.0]


def test_rates_keep_three_significant_digits_unless_that_merges_two() -> None:
    assert spread_rates(1 / 3, 3) == [0.122, 0.244, 0.367]
    many = spread_rates(1.0, 3000)
    assert len(set(many)) == 3000 and many == sorted(many) and many[-1] == 1.1


def test_jobs_expand_like_hydras_sweeper_with_the_command_line_last() -> None:
    params = {"allocator": "buddy", "scheduler": "fcfs,priority"}
    assert jobs(["allocator=free_list,radix", "trace=smoke"], params) == [
        ["allocator=free_list", "scheduler=fcfs", "trace=smoke"],
        ["allocator=free_list", "scheduler=priority", "trace=smoke"],
        ["allocator=radix", "scheduler=fcfs", "trace=smoke"],
        ["allocator=radix", "scheduler=priority", "trace=smoke"],
    ]


def test_a_tiny_load_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # Its kvbench subprocesses run this checkout's code (a git worktree tests its own).
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    folder = sweep([*TINY, "sweep_id=load"], num_rates=2)
    record = json.loads((folder / RECORD_FILE).read_text())
    (measured,) = record["saturation"]
    offline = results.read_summary(measured["run_dir"])
    assert Path(measured["run_dir"]).parent == Path(record["saturation_dir"])
    assert "trace.rate=inf" in offline["overrides"]
    assert measured["request_throughput"] == offline["request_throughput"]
    assert record["max_saturation"] == offline["request_throughput"]
    assert record["rates"] == spread_rates(offline["request_throughput"], 2)

    runs = results.load(folder).sort_values("trace.rate")
    assert runs["trace.rate"].tolist() == record["rates"]  # one run per rate, increasing
    for run_dir, rate in zip(runs["run_dir"], record["rates"], strict=True):
        assert f"trace.rate={rate}" in results.override_items(run_dir)

    # The same requests at every rate; only their arrivals differ (all at once when offline).
    def requests(run_dir: str):
        return results.load_tables(run_dir)[0].sort_values("request_id").reset_index()

    first = requests(measured["run_dir"])
    assert (first["arrival_time"] == first["arrival_time"].min()).all()
    for run_dir in runs["run_dir"]:
        other = requests(run_dir)
        assert other["arrival_time"].nunique() > 1
        for column in ("request_id", "prompt_tokens", "output_tokens"):
            assert other[column].tolist() == first[column].tolist()

    table = compare.table(folder)  # the sweep folder reads like any other
    assert table[compare.RUN].tolist() == [f"trace.rate={r}" for r in record["rates"]]
    assert plots.has_rate_dimension(plots.runs(folder))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rates", "1"], "argument --rates: must be a whole number >= 2, got '1'"),
        (["--up-to", "0"], "argument --up-to: must be a number > 0, got '0'"),
        (["trace.rate=2"], "trace.rate=2: kvbench-load-sweep sets trace.rate itself; remove it"),
        (["sweep_id=a,b"], "sweep_id=a,b: a load sweep has one sweep_id, not a list"),
        (["trace=offline"], "trace=offline has no trace.rate to vary: choose a trace with one"),
        (["trace=multi_turn"], "trace=multi_turn: at trace.rate=inf its requests still arrive"),
        (["allocator=nope"], "Could not find 'allocator/nope'"),
        (["+allocator.nope=1"], "allocator.nope is not a parameter of"),
    ],
)
def test_a_bad_option_is_named_before_any_work(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvbench-load-sweep: error: ") and message in last
    assert "Traceback" not in err
    assert not (tmp_path / "results").exists()
