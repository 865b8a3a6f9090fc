"""kvbench-report on a real tiny 2x2 sweep (allocator x trace.rate): the files and the page
linking them, each figure's series checked against the runs' tables and summaries, the
Pareto front's rule, and the errors."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection

from harness.analysis import metrics, plots, report, results

LABELS = [
    "allocator=free_list,trace.rate=4",
    "allocator=free_list,trace.rate=16",
    "allocator=radix,trace.rate=4",
    "allocator=radix,trace.rate=16",
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A finished 2x2 sweep at tiny sizes, as `kvbench -m` leaves it."""
    from support import TINY, run_kvbench

    cwd = tmp_path_factory.mktemp("report")
    run_kvbench("-m", *TINY, "allocator=free_list,radix", "trace.rate=4,16", "sweep_id=s",
                "warmup=0", cwd=cwd)  # fmt: skip
    return cwd / "results" / "default" / "multiruns" / "s"


@pytest.fixture(scope="module")
def runs(sweep: Path) -> pd.DataFrame:
    return plots.runs(sweep)


@pytest.fixture(scope="module")
def page(sweep: Path) -> Path:
    return report.write(sweep)


def legend_texts(fig) -> list[str]:
    return [t.get_text().replace("\n", "") for t in fig.legends[0].get_texts()]


def test_runs_are_labelled_by_what_varies_in_compare_order(runs: pd.DataFrame) -> None:
    assert list(runs["label"]) == LABELS
    assert runs["colour"].nunique() == 4


def test_report_writes_every_figure_and_links_each(sweep: Path, page: Path) -> None:
    assert page == sweep / "report" / "report.md"
    pngs = {p.name for p in page.parent.glob("*.png")}
    assert pngs == {plot.file for plot in report.PLOTS}  # the sweep has a rate dimension
    text = page.read_text()
    assert set(re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)) == pngs  # relative links
    assert all(f"`{label}`" in text for label in LABELS)  # the comparison table
    assert "No run used speculative decoding" in text
    for png in pngs:
        assert (page.parent / png).read_bytes().startswith(b"\x89PNG")


def test_latency_cdfs_hold_each_runs_samples(runs: pd.DataFrame) -> None:
    fig = plots.latency_cdfs(runs)
    assert legend_texts(fig) == LABELS
    assert [ax.get_xlabel() for ax in fig.axes] == [x for _, x, _ in plots.LATENCY_AXES]
    for ax, name in zip(fig.axes, ("ttft", "tpot", "itl"), strict=True):
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == LABELS
        for line, run in zip(lines, runs.itertuples(), strict=True):
            x, y = line.get_xdata() / 1e3, line.get_ydata()
            assert np.all(np.diff(x) >= 0) and y[-1] == 1.0
            # the plotted samples are those the summary's percentiles are of
            assert np.percentile(x, 99) == pytest.approx(getattr(run, f"{name}_p99"))
            assert x.mean() == pytest.approx(getattr(run, f"{name}_mean"))


def test_load_curves_one_line_per_allocator_against_rate(runs: pd.DataFrame) -> None:
    fig = plots.load_curves(runs)
    assert legend_texts(fig) == ["allocator=free_list", "allocator=radix"]
    for ax, key, scale in zip(
        fig.axes, ("output_throughput", "ttft_p99", "goodput"), (1, 1e3, 1), strict=True
    ):
        assert ax.get_xlabel() == "request rate, trace.rate (req/s)"
        for line, allocator in zip(ax.get_lines(), ("free_list", "radix"), strict=True):
            mine = runs[runs["allocator"] == allocator].sort_values("trace.rate")
            assert list(line.get_xdata()) == [4.0, 16.0]
            assert list(line.get_ydata()) == pytest.approx(list(mine[key] * scale))


def test_load_curves_need_a_rate_dimension(runs: pd.DataFrame) -> None:
    one_rate = runs[runs["trace.rate"] == 4]
    assert not plots.has_rate_dimension(one_rate)
    with pytest.raises(ValueError, match="trace.rate"):
        plots.load_curves(one_rate)


def test_load_curves_leave_out_an_infinite_rate(runs: pd.DataFrame) -> None:
    """Overrides come back as ints and the string "inf" (all at t=0): inf has no place on the
    axis, and one finite rate is no curve."""
    mixed = runs.assign(**{"trace.rate": [4, "inf", 4, "inf"]})
    assert not plots.has_rate_dimension(mixed)
    three = pd.concat([runs, mixed[mixed["trace.rate"] == "inf"]], ignore_index=True)
    fig = plots.load_curves(three)
    for line in fig.axes[0].get_lines():
        assert list(line.get_xdata()) == [4.0, 16.0]


def test_pareto_front_keeps_the_points_nothing_beats() -> None:
    x = np.array([1.0, 2.0, 3.0, 2.0, 0.5, 3.0])
    y = np.array([5.0, 4.0, 1.0, 3.0, 5.0, 0.5])
    # (2, 3) is beaten by (2, 4), (0.5, 5) by (1, 5), (3, 0.5) by (3, 1): ties do not count
    assert list(plots.pareto_front(x, y)) == [0, 1, 2]


def test_pareto_plots_every_run_and_circles_its_front(runs: pd.DataFrame) -> None:
    fig = plots.pareto(runs)
    (ax,) = fig.axes
    *points, front = ax.get_lines()
    assert legend_texts(fig) == [*LABELS, "Pareto front"]
    x = 1 / runs["tpot_mean"].to_numpy()
    y = runs["output_throughput"].to_numpy()
    assert [(p.get_xdata()[0], p.get_ydata()[0]) for p in points] == list(zip(x, y, strict=True))
    fx, fy = front.get_xdata(), front.get_ydata()
    assert list(fx) == sorted(fx)
    for xi, yi in zip(x, y, strict=True):
        on_front = any(xi == a and yi == b for a, b in zip(fx, fy, strict=True))
        beaten = any(a >= xi and b >= yi and (a, b) != (xi, yi) for a, b in zip(x, y, strict=True))
        assert on_front != beaten
    assert "tok/s per user" in ax.get_xlabel() and "(tok/s)" in ax.get_ylabel()


def test_kv_timeline_stacks_each_runs_blocks_up_to_the_arena(runs: pd.DataFrame) -> None:
    fig = plots.kv_timeline(runs)
    assert [ax.get_title() for ax in fig.axes] == LABELS
    assert legend_texts(fig) == ["used", "cached", "free"]
    for ax, run in zip(fig.axes, runs.itertuples(), strict=True):
        used, cached, free = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert [c.get_label() for c in (used, cached, free)] == ["used", "cached", "free"]
        _, steps = results.load_tables(run.run_dir)
        assert used.get_paths()[0].vertices[:, 1].max() == steps["blocks_used"].max()
        assert free.get_paths()[0].vertices[:, 1].max() == run.num_blocks == 64  # the whole arena
        assert ax.get_xlim()[1] == pytest.approx(
            steps["start_time"].iloc[-1] + steps["duration"].iloc[-1]
        )


def test_kv_breakdown_stacks_the_five_parts_per_run(runs: pd.DataFrame) -> None:
    fig = plots.kv_breakdown(runs)
    (ax,) = fig.axes
    assert legend_texts(fig) == [plots.KV_NAMES[p] for p in metrics.KV_PARTS]
    assert [t.get_text().replace("\n", "") for t in ax.get_yticklabels()] == LABELS
    total = np.zeros(len(runs))
    for bars, part in zip(ax.containers, metrics.KV_PARTS, strict=True):
        widths = np.array([b.get_width() for b in bars])
        assert widths == pytest.approx(runs[f"kv_{part}_frac_mean"].to_numpy() * 100)
        total += widths
    assert total == pytest.approx(100.0)  # the parts split the whole arena


def test_reuse_and_preemption_bars_and_trace_bounds(runs: pd.DataFrame) -> None:
    fig = plots.reuse_and_preemption(runs)
    hits, preempt = fig.axes  # no speculation in this sweep: no acceptance panels
    (hit_bars,) = hits.containers
    assert [b.get_width() for b in hit_bars] == pytest.approx(list(runs["prefix_hit_rate"] * 100))
    bounds = {line.get_label(): list(line.get_xdata()) for line in hits.get_lines()}
    assert bounds == {
        "trace bound (tokens)": pytest.approx(list(runs["max_prefix_hit_rate"] * 100)),
        "trace bound (whole blocks)": pytest.approx(list(runs["max_prefix_hit_rate_blocks"] * 100)),
    }
    (preempt_bars,) = preempt.containers
    assert [b.get_width() for b in preempt_bars] == list(runs["preemptions"])
    assert "(count)" in preempt.get_xlabel() and "(%" in hits.get_xlabel()


def test_speculation_panels_show_only_runs_that_verified_drafts(runs: pd.DataFrame) -> None:
    spec = runs.assign(
        spec_acceptance_rate=[math.nan, 0.8, math.nan, 0.5],
        spec_tokens_per_verification=[math.nan, 3.2, math.nan, 2.0],
    )
    fig = plots.reuse_and_preemption(spec)
    alpha, tokens = fig.axes[2:]
    (alpha_bars,) = alpha.containers
    assert [(b.get_y() + b.get_height() / 2, b.get_width()) for b in alpha_bars] == [
        (1, pytest.approx(80.0)),
        (3, pytest.approx(50.0)),
    ]
    assert [b.get_width() for b in tokens.containers[0]] == [3.2, 2.0]
    assert "(tokens)" in tokens.get_xlabel()


def test_one_rate_leaves_the_load_curves_out_with_a_note(sweep: Path, tmp_path, capsys) -> None:
    one_run = sweep / "allocator=radix,engine.num_blocks=64,trace.rate=4,trace=smoke,warmup=0"
    report.main([str(one_run), "--out", str(tmp_path / "r")])
    page = tmp_path / "r" / report.REPORT_FILE
    assert capsys.readouterr().out == f"report: {page} ({len(report.PLOTS) - 1} figures)\n"
    assert "Left out: the runs do not vary `trace.rate`" in page.read_text()
    assert not (tmp_path / "r" / "load_curves.png").exists()


def test_a_folder_without_a_finished_run_is_one_line_and_exit_1(tmp_path, capsys) -> None:
    results.write_failure(tmp_path / "job", RuntimeError("boom"))
    with pytest.raises(SystemExit) as exit_:
        report.main([str(tmp_path)])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no finished run in" in err and "summary.json" in err
    assert not (tmp_path / "report").exists()


def test_a_missing_folder_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        report.main([str(tmp_path / "nope")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"kvbench-report: error: {tmp_path / 'nope'} does not exist\n"


def _zero_a_data_page(path: Path) -> None:
    """A kilobyte of zeros over the first column's data, past the magic number and the page
    header (pyarrow: "Corrupt snappy compressed data.", naming no file)."""
    data = bytearray(path.read_bytes())
    data[16:1040] = bytes(1024)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "file", "said"),
    [
        (lambda p: p.write_text("{"), results.SUMMARY_FILE, "is not JSON"),
        (lambda p: p.write_text("[]"), results.SUMMARY_FILE, "holds a JSON list"),
        (_zero_a_data_page, results.REQUESTS_FILE, "is damaged"),
        (Path.unlink, results.REQUESTS_FILE, "is missing"),
    ],
    ids=["summary_not_json", "summary_a_list", "requests_zeroed", "requests_missing"],
)
def test_a_damaged_run_is_one_line_naming_its_file_and_leaves_no_report(
    sweep: Path, tmp_path: Path, capsys, damage, file: str, said: str
) -> None:
    copy = tmp_path / "s"
    shutil.copytree(sweep, copy, ignore=shutil.ignore_patterns("report"))
    damaged = copy / ",".join(["allocator=radix", "engine.num_blocks=64", "trace.rate=4",
                               "trace=smoke", "warmup=0"]) / file  # fmt: skip
    damage(damaged)
    with pytest.raises(SystemExit) as exit_:
        report.main([str(copy)])
    err = capsys.readouterr().err
    assert exit_.value.code == 1
    assert err.startswith(f"kvbench-report: {damaged} {said}") and err.count("\n") == 1
    assert [p.name for p in copy.iterdir() if "report" in p.name] == []  # nor a temporary one
