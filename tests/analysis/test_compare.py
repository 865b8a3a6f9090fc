"""Runs side by side: the table of a hand-built results folder checked cell by cell, its
labels, kvbench-compare's options and errors, and the table at the end of a real sweep."""

from __future__ import annotations

import csv
import io
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from support import ROOT

from harness.analysis import compare, results

SWEEP = ("allocator", "trace.rate")
# (overrides, figures): three finished jobs of one sweep, in folder order. The figures are
# what summary.json holds (seconds, fractions); the table shows ms and %.
JOBS = [
    (
        ["allocator=free_list", "trace.rate=16", "progress=false"],
        dict(completed_requests=6, request_throughput=2.5, output_throughput=20.0, ttft_p50=0.0125,
             ttft_p99=0.25, tpot_p50=0.004, itl_p99=0.02, goodput=2.0,
             kv_tokens_frac_mean=0.5, kv_utilisation=0.875, preemptions=3,
             prefix_hit_rate=0.0),
    ),
    (
        ["allocator=free_list", "trace.rate=4", "progress=false"],
        dict(completed_requests=5, request_throughput=1.25, output_throughput=1234.5,
             ttft_p50=0.002, ttft_p99=0.0035, tpot_p50=0.001, itl_p99=math.nan, goodput=1.0,
             kv_tokens_frac_mean=0.25, kv_utilisation=0.5, preemptions=0,
             prefix_hit_rate=math.nan),
    ),
    (
        ["allocator=radix", "trace.rate=4", "progress=false"],
        dict(completed_requests=6, request_throughput=1.5, output_throughput=12.0, ttft_p50=0.001,
             ttft_p99=0.002, tpot_p50=0.003, itl_p99=0.004, goodput=1.5,
             kv_tokens_frac_mean=0.125, kv_utilisation=1.0, preemptions=1,
             prefix_hit_rate=0.375),
    ),
]  # fmt: skip


def write_run(run_dir: Path, overrides: list[str], figures: dict) -> None:
    """A finished run as Hydra and harness.cli.run leave it: overrides.yaml and summary.json."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    results.write_summary(run_dir, {**figures, "clock": "virtual", "overrides": overrides})


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """Three finished jobs and a failed one (no summary.json) in one sweep folder."""
    root = tmp_path / "multiruns" / "s"
    for overrides, figures in JOBS:
        write_run(root / ",".join(overrides), overrides, figures)
    results.write_failure(root / "allocator=buddy,trace.rate=4", RuntimeError("boom"))
    return root


def test_table_holds_each_figure_in_its_unit(sweep: Path) -> None:
    frame = compare.table(sweep)
    # Ordered by the varying overrides' values, numbers as numbers (4 before 16).
    assert list(frame["run"]) == [
        "allocator=free_list,trace.rate=4",
        "allocator=free_list,trace.rate=16",
        "allocator=radix,trace.rate=4",
    ]
    row = frame.iloc[1]  # JOBS[0]
    assert row["done (req)"] == 6 and row["preempt (count)"] == 3
    assert row["thruput (req/s)"] == 2.5 and row["goodput (req/s)"] == 2.0
    assert row["output (tok/s)"] == 20.0
    assert row["TTFT p50 (ms)"] == pytest.approx(12.5)
    assert row["TTFT p99 (ms)"] == pytest.approx(250.0)
    assert row["TPOT p50 (ms)"] == pytest.approx(4.0)
    assert row["ITL p99 (ms)"] == pytest.approx(20.0)
    assert row["KV tokens (%)"] == pytest.approx(50.0)
    assert row["KV util (%)"] == pytest.approx(87.5)
    assert row["prefix hit (%)"] == 0.0
    assert row["clock"] == "virtual"
    assert row["run_dir"] == str(sweep / "allocator=free_list,trace.rate=16,progress=false")
    assert math.isnan(frame.iloc[0]["ITL p99 (ms)"]) and math.isnan(frame.iloc[0]["prefix hit (%)"])


def test_text_table_cell_by_cell(sweep: Path) -> None:
    lines = compare.format_text(compare.table(sweep), sweep).splitlines()
    assert lines[0] == f"3 finished runs in {sweep}"
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines[1:6]]
    assert cells[0] == [
        "run",
        "done",
        "thruput",
        "output",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "ITL p99",
        "goodput",
        "noise",
        "KV tokens",
        "KV util",
        "preempt",
        "prefix hit",
    ]
    assert cells[1] == [
        "req",
        "req/s",
        "tok/s",
        "ms",
        "ms",
        "ms",
        "ms",
        "req/s",
        "%",
        "%",
        "%",
        "count",
        "%",
    ]
    assert cells[2] == [
        "allocator=free_list,trace.rate=4",
        "5",
        "1.25",
        "1,234.5",
        "2.0",
        "3.5",
        "1.0",
        "n/a",
        "1.00",
        "n/a",
        "25.0",
        "50.0",
        "0",
        "n/a",
    ]
    assert cells[3] == [
        "allocator=free_list,trace.rate=16",
        "6",
        "2.50",
        "20.0",
        "12.5",
        "250.0",
        "4.0",
        "20.0",
        "2.00",
        "n/a",
        "50.0",
        "87.5",
        "3",
        "0.0",
    ]
    assert cells[4] == [
        "allocator=radix,trace.rate=4",
        "6",
        "1.50",
        "12.0",
        "1.0",
        "2.0",
        "3.0",
        "4.0",
        "1.50",
        "n/a",
        "12.5",
        "100.0",
        "1",
        "37.5",
    ]
    # Columns line up: every cell ends where its header ends.
    assert len({len(line) for line in lines[1:6]}) == 1
    note = " ".join(lines[6:])
    assert "summary.json's completed_requests, request_throughput" in note
    assert "docs/results.md" in note
    assert "virtual clock" in note


def test_labels_show_only_what_differs_and_stay_distinct(tmp_path: Path) -> None:
    figures = JOBS[0][1]
    write_run(tmp_path / "a", ["allocator=radix", "model=tiny"], figures)
    write_run(tmp_path / "b", ["allocator=radix", "model=tiny"], figures)  # same overrides
    write_run(tmp_path / "c" / "deep", ["allocator=buddy", "model=tiny"], figures)
    write_run(tmp_path / "d", ["model=tiny"], figures)  # allocator not overridden
    assert sorted(compare.table(tmp_path)["run"]) == [
        "allocator=buddy",
        "allocator=radix @ a",
        "allocator=radix @ b",
        "d",  # nothing that differs: its folder
    ]


def test_csv_is_unrounded_with_counts_as_integers(sweep: Path, capsys) -> None:
    compare.main([str(sweep), "--csv"])
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == [
        "run",
        "done (req)",
        "thruput (req/s)",
        "output (tok/s)",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "TPOT p50 (ms)",
        "ITL p99 (ms)",
        "goodput (req/s)",
        "noise (%)",
        "KV tokens (%)",
        "KV util (%)",
        "preempt (count)",
        "prefix hit (%)",
        "clock",
        "run_dir",
        "same work",
    ]
    assert rows[1] == [
        "allocator=free_list,trace.rate=4",
        "5",
        "1.25",
        "1234.5",
        "2.0",
        "3.5",
        "1.0",
        "",
        "1.0",
        "",
        "25.0",
        "50.0",
        "0",
        "",
        "virtual",
        str(sweep / "allocator=free_list,trace.rate=4,progress=false"),
        "",
    ]  # fmt: skip  (NaN cells are empty)
    assert len(rows) == 4


def test_markdown_table(sweep: Path, capsys) -> None:
    compare.main([str(sweep), "--markdown"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | done (req) | thruput (req/s) |")
    assert lines[1] == "|---" + "|---:" * len(compare.COLUMNS) + "|"
    assert lines[3] == (
        "| `allocator=free_list,trace.rate=16` | 6 | 2.50 | 20.0 | 12.5 | 250.0 | 4.0 | 20.0 "
        "| 2.00 | n/a | 50.0 | 87.5 | 3 | 0.0 |"
    )
    assert lines[6].startswith(f"Runs in `{sweep}`.")


def test_csv_and_markdown_exclude_each_other(sweep: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        compare.main([str(sweep), "--csv", "--markdown"])
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_a_folder_without_a_finished_run_says_so_and_exits_1(tmp_path: Path, capsys) -> None:
    results.write_failure(tmp_path / "job", RuntimeError("boom"))
    with pytest.raises(SystemExit) as exit_:
        compare.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 1
    assert err == (
        f"kvbench-compare: no finished run in {tmp_path} (a run is finished once its folder "
        "holds summary.json)\n"
    )


def test_a_missing_path_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "harness.analysis.compare", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"kvbench-compare: error: {tmp_path / 'nope'} does not exist\n"


@pytest.mark.parametrize("launcher", [(), ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")])
def test_a_sweep_ends_with_its_table(kvbench, tmp_path: Path, launcher: tuple[str, ...]) -> None:
    proc = kvbench("-m", "allocator=free_list,buddy", "sweep_id=s", *launcher)
    lines = proc.stdout.strip().splitlines()
    start = lines.index("2 finished runs in results/default/multiruns/s")
    table = lines[start:]
    assert table[1].split()[:3] == ["run", "done", "thruput"]
    labels = sorted(line.split()[0] for line in table[3:5])
    assert labels == ["allocator=buddy", "allocator=free_list"]
    assert [line.split()[1] for line in table[3:5]] == ["6", "6"]  # completed
    assert "Columns are summary.json's" in table[5]
    assert not any("results:" in line for line in table)  # no job output after it


def test_a_run_without_clock_is_listed_with_its_clock_missing(sweep: Path, capsys) -> None:
    # summary.json from before the clock was recorded
    overrides = ["allocator=buddy", "trace.rate=16", "progress=false"]
    old = sweep / "old"
    (old / ".hydra").mkdir(parents=True)
    (old / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    results.write_summary(old, JOBS[0][1])
    compare.main([str(sweep)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"4 finished runs in {sweep}"
    assert any(line.startswith("allocator=buddy,trace.rate=16 ") for line in lines)
    assert "clock not recorded for 1 run" in " ".join(lines)


def test_done_counts_requests_not_their_completions(tmp_path: Path) -> None:
    write_run(tmp_path / "n4", ["sampling.n=4"], dict(completed=48, completed_requests=12))
    assert compare.table(tmp_path)["done (req)"].tolist() == [12]


def test_headline_figures_come_first(sweep: Path) -> None:
    frame = compare.table(sweep, headline=["kv_sharing_saving", "prefix_hit_rate"])
    assert list(frame.columns[:4]) == ["run", "KV shared (%)", "prefix hit (%)", "done (req)"]
    assert list(frame.columns).count("prefix hit (%)") == 1  # moved, not repeated


def test_a_headline_without_a_column_names_those_there_are() -> None:
    with pytest.raises(
        compare.CompareError, match=r"headline kv_sharing: no column.*kv_sharing_saving"
    ):
        compare.CompareCallback(headline=["kv_sharing"])


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf/experiment").glob("*.yaml")))
def test_every_experiment_shows_its_headline_figures(name: str, tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from harness.cli.run import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", [f"experiment={name}"], return_hydra_config=True)
    callback = instantiate(cfg.hydra.callbacks.compare)
    assert callback.headline
    write_run(tmp_path / "a", ["allocator=radix"], dict.fromkeys(callback.headline, 0.5))
    text = compare.format_text(compare.table(tmp_path, callback.headline), tmp_path)
    shown = {c.key for c in compare.columns(callback.headline) if c.name in text}
    assert set(callback.headline) <= shown


def test_an_interrupted_sweep_lists_its_unfinished_jobs_after_the_table(
    sweep: Path, capsys
) -> None:
    def job(allocator: str, rate: int) -> list[str]:
        return [f"allocator={allocator}", f"trace.rate={rate}", "progress=false"]

    # what the sweep's launch planned: the three finished, the failed one, one whose process
    # was killed (left under .partial/) and one it never reached
    planned = [*(o for o, _ in JOBS), job("buddy", 4), job("buddy", 16), job("radix", 16)]
    results.write_jobs(sweep, planned, ignore=["progress", "sweep_id"])
    for folder, overrides in ((".partial/allocator=buddy,trace.rate=16", job("buddy", 16)),
                              ("allocator=buddy,trace.rate=4", job("buddy", 4))):  # fmt: skip
        (sweep / folder / ".hydra").mkdir(parents=True, exist_ok=True)
        (sweep / folder / ".hydra" / "overrides.yaml").write_text(
            "".join(f"- {o}\n" for o in overrides)
        )
    compare.main([str(sweep)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"3 finished runs in {sweep}"
    assert lines[-4:] == [
        "3 unfinished runs (not in the table):",
        "  .partial/allocator=buddy,trace.rate=16: no result: still running, or its process "
        "was killed",
        "  allocator=buddy,trace.rate=4: failed: RuntimeError: boom",
        "  allocator=radix,trace.rate=16: not started",
    ]
    compare.main([str(sweep), "--markdown"])
    markdown = capsys.readouterr().out.splitlines()
    assert markdown[-1] == "- allocator=radix,trace.rate=16: not started"


@pytest.mark.parametrize(
    ("text", "said"),
    [('{"done": 6', "is not JSON (Expecting"), ("[1, 2]", "holds a JSON list, not an object")],
    ids=["truncated", "list"],
)
def test_a_damaged_summary_is_one_line_naming_the_file(
    sweep: Path, capsys, text: str, said: str
) -> None:
    damaged = sweep / ",".join(JOBS[0][0]) / results.SUMMARY_FILE
    damaged.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        compare.main([str(sweep)])
    err = capsys.readouterr().err
    assert exit_.value.code == 1
    assert err.startswith(f"kvbench-compare: error: {damaged} {said}")
    assert err.count("\n") == 1 and "delete the run's folder" in err


def test_timed_figures_closer_than_the_noise_are_marked(tmp_path: Path) -> None:
    # thruput 10 and 12 (17 % apart) on a machine whose speed moved 25 % during the first:
    # not rankable; 20 is more than either run's noise from both.
    for name, thruput, noise in (("a", 10.0, 0.25), ("b", 12.0, 0.05), ("c", 20.0, 0.05)):
        write_run(tmp_path / name, [f"allocator={name}"],
                  dict(request_throughput=thruput, timing_noise=noise))  # fmt: skip
    frame = compare.table(tmp_path)
    assert frame["noise (%)"].tolist() == [25.0, 5.0, 5.0]
    lines = compare.format_text(frame, tmp_path).splitlines()
    assert [re.split(r"\s{2,}", line)[2] for line in lines[3:6]] == ["10.00~", "12.00~", "20.00"]
    assert "~: a timed figure this table cannot rank" in " ".join(lines[6:])


def test_runs_of_the_same_work_share_a_letter_and_their_timed_figures_are_marked(
    tmp_path: Path,
) -> None:
    # 25 % apart with a quiet machine (1 % noise), but the same steps, tokens and batches: the
    # policies decided the same, so the difference is the machine's or host work.
    work = pd.DataFrame({c: [3, 5] for c in results.WORK_COLUMNS})
    other = work.assign(prefill_tokens=[3, 6])
    for name, thruput, steps in (("free_list", 8.0, work), ("radix", 10.0, work),
                                 ("buddy", 20.0, other)):  # fmt: skip
        write_run(tmp_path / name, [f"allocator={name}"],
                  dict(request_throughput=thruput, timing_noise=0.01))  # fmt: skip
        steps.to_parquet(tmp_path / name / results.STEPS_FILE)
    frame = compare.table(tmp_path)
    assert dict(zip(frame["run"], frame["same work"], strict=True)) == {
        "allocator=buddy": "", "allocator=free_list": "a", "allocator=radix": "a"
    }  # fmt: skip
    # rows: buddy, free_list, radix; buddy's other work is 50 % from both, beyond 1 %
    assert compare.within_noise(frame) == {(1, "thruput (req/s)"), (2, "thruput (req/s)")}
    lines = compare.format_text(frame, tmp_path).splitlines()
    assert lines[1].split()[-2:] == ["same", "work"] and lines[3].split()[-1] == "-"


def test_priced_figures_are_never_marked(tmp_path: Path) -> None:
    for name in ("free_list", "radix"):
        write_run(tmp_path / name, [f"allocator={name}"], dict(request_throughput=10.0))
        summary = results.read_summary(tmp_path / name)
        results.write_summary(tmp_path / name, {**summary, "clock": "model"})
    assert compare.within_noise(compare.table(tmp_path)) == set()


def test_a_damaged_plan_of_jobs_is_one_line_naming_it(sweep: Path, capsys) -> None:
    (sweep / results.JOBS_FILE).write_text('{"jobs": 3}')
    with pytest.raises(SystemExit) as exit_:
        compare.main([str(sweep)])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvbench-compare: error: {sweep / results.JOBS_FILE} is not a sweep's")
    assert err.count("\n") == 1
