"""kvbench-regress: the comparison with a baseline (hand-written figures), wrong input, and, on
real runs of the work counts (the same under any load), that an unchanged run passes while more
host work per step or padded batches fail, named. No test here reads a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import regress, regress_baseline, regress_suite
from harness.engine import LLMEngine, model_runner

WORK = ["--only", "work"]  # the deterministic figures: seconds to run, exact on any machine


def test_compare_names_only_figures_worse_than_their_tolerance():
    baseline = {"work.mixed.query_padding": 1.0, "work.mixed.calls_per_step": 500.0}
    figures = {
        "work.mixed.query_padding": 1.0001,  # a count: any rise regresses
        "work.mixed.calls_per_step": 504.0,  # 0.8 % more calls, tolerance 1 %
        "work.padding.decode": 1.0,
    }
    checks = {c["figure"]: c for c in regress_baseline.compare_figures(figures, baseline)}
    assert checks["work.mixed.query_padding"]["status"] == "regressed"
    assert checks["work.mixed.calls_per_step"]["status"] == "ok"
    assert checks["work.mixed.calls_per_step"]["limit"] == pytest.approx(505.0)
    assert checks["work.padding.decode"]["status"] == "new"


def test_a_timed_figure_is_reported_and_never_gates_however_far_it_moves():
    baseline = {"engine.uniform": 1.0, "padding.prefill": 1.0}
    figures = {"engine.uniform": 0.01, "padding.prefill": 100.0}
    for check in regress_baseline.compare_figures(figures, baseline):
        assert check["status"] == "timed" and check["limit"] is None, check


def test_better_than_the_baseline_never_regresses():
    for figure in regress_suite.FIGURES.values():
        if figure.gates:
            better = 10.0 if figure.better == "higher" else 0.1
            assert not figure.regressed(better, 1.0), figure.name
            assert figure.improved(better, 1.0), figure.name


def test_every_gating_figure_is_a_count_a_call_count_or_priced():
    """Timed figures move with load (two suites at once halve a ratio), so none gates; the
    policy figures are priced by a profile, not timed."""
    gating = {f.name for f in regress_suite.FIGURES.values() if f.gates}
    assert gating == {n for n in regress_suite.FIGURES if n.startswith(("work.", "policy."))} | {
        "sweep.prefix_hit_rate"
    }


@pytest.fixture
def measured(monkeypatch):
    """``regress.main`` measures the figures this sets instead of running the suite."""
    figures: dict[str, float] = {}
    monkeypatch.setattr(regress, "measure", lambda groups, out, rounds: dict(figures))
    return figures


def test_figures_missing_from_the_baseline_are_noted_not_compared_and_pass(
    tmp_path, capsys, measured
):
    """A baseline from before the counters (or another platform's, not regenerated yet)."""
    baseline = tmp_path / "base.json"
    baseline.write_text(json.dumps({"figures": {"engine.uniform": 1.0}}))
    measured |= {"engine.uniform": 0.2, "work.padding.prefill": 7.0}
    regress.main(["--baseline", str(baseline), "--output", str(tmp_path / "out")])  # no exit
    out = capsys.readouterr().out
    assert "not in the baseline, not compared yet: work.padding.prefill" in out
    assert out.rstrip().endswith(
        "figures: 0 passed, 0 failed, 1 not compared yet, 1 timed (not gated)"
    )


def test_an_improved_count_passes_with_a_note_to_rewrite_the_baseline(tmp_path, capsys, measured):
    baseline = tmp_path / "base.json"
    baseline.write_text(json.dumps({"figures": {"work.mixed.row_groups": 109}}))
    measured["work.mixed.row_groups"] = 100
    regress.main(["--baseline", str(baseline), "--output", str(tmp_path / "out")])  # no exit
    out = capsys.readouterr().out
    assert "improved: work.mixed.row_groups = 100, baseline 109" in out
    assert "figures: 1 passed, 0 failed" in out


@pytest.fixture
def darwin(tmp_path, monkeypatch) -> Path:
    """The committed baselines' folder as a new platform sees it: common.json (the row groups
    of the mixed workload) and no file of darwin-arm64's own."""
    folder = tmp_path / "baselines"
    folder.mkdir()
    monkeypatch.setattr(regress, "BASELINES", folder)
    monkeypatch.setattr(regress, "COMMON_BASELINE", folder / "common.json")
    monkeypatch.setattr(regress, "platform_name", lambda: "darwin-arm64")
    (folder / "common.json").write_text(json.dumps({"figures": {"work.mixed.row_groups": 109}}))
    return folder


def test_a_platform_without_its_own_baseline_says_so_and_fails_on_a_count(
    darwin, tmp_path, capsys, measured
):
    measured |= {
        "work.mixed.row_groups": 200,  # padded batches: the same count on any machine
        "work.mixed.calls_per_step": 9999.0,  # Python calls: this platform's own
        "engine.uniform": 0.1,
    }
    with pytest.raises(SystemExit) as exit_:
        regress.main(["--output", str(tmp_path / "out")])
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    said = [line for line in out.splitlines() if "darwin-arm64's own" in line]
    assert said == [
        f"kvbench-regress: no baseline of darwin-arm64's own ({darwin / 'darwin-arm64.json'}): "
        "its timed figures and Python calls per step are not compared, the figures no machine "
        f"changes are ({darwin / 'common.json'}); --update-baseline on this platform starts one"
    ]
    assert "regressed: work.mixed.row_groups = 200, baseline 109" in err
    assert "calls_per_step" not in err


def test_update_writes_each_figure_into_the_file_of_its_kind(darwin, tmp_path, measured):
    measured |= {"work.mixed.row_groups": 100, "work.mixed.calls_per_step": 450.0,
                 "engine.uniform": 0.9, "policy.radix.hit_rate": 0.75}  # fmt: skip
    regress.main(["--output", str(tmp_path / "out"), "--update-baseline"])
    common = json.loads((darwin / "common.json").read_text())["figures"]
    own = json.loads((darwin / "darwin-arm64.json").read_text())["figures"]
    assert common == {"work.mixed.row_groups": 100, "policy.radix.hit_rate": 0.75}
    assert own == {"work.mixed.calls_per_step": 450.0, "engine.uniform": 0.9}


def test_each_committed_figure_is_in_the_baseline_of_its_kind_once():
    common = json.loads(regress_suite.COMMON_BASELINE.read_text())["figures"]
    linux = json.loads((regress_suite.BASELINES / "linux-x86_64.json").read_text())["figures"]
    shared = {n for n, f in regress_suite.FIGURES.items() if not f.per_platform}
    assert set(common) == shared
    assert not set(linux) & shared
    assert {n for n in linux if n.endswith("calls_per_step")} == {
        "work.uniform.calls_per_step", "work.mixed.calls_per_step",
        "work.general.calls_per_step",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("{not json", "not JSON"),
        ('{"figures": [1]}', "'figures'"),
        ('{"figures": {"a": "x"}}', "'figures.a'"),
    ],
)
def test_a_malformed_baseline_is_one_line_naming_the_field_and_exit_2(
    tmp_path, capsys, content, field
):
    baseline = tmp_path / "base.json"
    baseline.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        regress.main(["--baseline", str(baseline), "--output", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "--update-baseline" in err
    assert not (tmp_path / "out").exists()  # nothing measured


def test_an_unknown_group_is_named_with_those_that_exist(capsys):
    with pytest.raises(SystemExit) as exit_:
        regress.main(["--only", "engine,nope"])
    assert exit_.value.code == 2
    assert "'nope'" in capsys.readouterr().err


def test_rounds_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        regress.main(["--rounds", "0"])
    assert exit_.value.code == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """A baseline of the work figures, written by a real run just now."""
    tmp = tmp_path_factory.mktemp("regress")
    path = tmp / "baseline.json"
    regress.main(
        [*WORK, "--baseline", str(path), "--output", str(tmp / "first"), "--update-baseline"]
    )
    return path


def test_an_unchanged_run_passes_against_the_baseline_it_just_wrote(baseline, tmp_path, capsys):
    regress.main([*WORK, "--baseline", str(baseline), "--output", str(tmp_path)])  # no exit
    report = json.loads((tmp_path / regress.FILE).read_text())
    assert {c["status"] for c in report["checks"]} == {"ok"}, report["checks"]
    before = json.loads(baseline.read_text())["figures"]
    # Counts repeat exactly; Python calls within a call or two a run (a lazy cache warmed by
    # the first run in a process), well inside their 1 % tolerance.
    calls = {k for k in before if k.endswith("calls_per_step")}
    assert {k: v for k, v in report["figures"].items() if k not in calls} == {
        k: v for k, v in before.items() if k not in calls
    }
    assert all(abs(report["figures"][k] / before[k] - 1) < 0.001 for k in calls)
    assert capsys.readouterr().out.rstrip().endswith("figures: 12 passed, 0 failed")


def test_more_host_work_per_step_fails_naming_the_calls_per_step(
    baseline, tmp_path, capsys, monkeypatch
):
    """Every step calls a Python function 100 times more: 13 % and 19 % more calls per step
    on the uniform and mixed workloads (752 and 534 a step), tolerance 1 %."""
    step = LLMEngine.step

    def overhead() -> None:
        pass

    def busier_step(self, *args, **kwargs):
        for _ in range(100):
            overhead()
        return step(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "step", busier_step)
    with pytest.raises(SystemExit) as exit_:
        regress.main([*WORK, "--baseline", str(baseline), "--output", str(tmp_path)])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    for name in ("uniform", "mixed", "general"):
        assert f"regressed: work.{name}.calls_per_step = " in err, err


def test_padded_batches_fail_naming_the_padding_counts(baseline, tmp_path, capsys, monkeypatch):
    # Padding comes back: all of a forward's rows in one padded batch.
    monkeypatch.setattr(model_runner, "group_rows", lambda queries, *_: [list(range(len(queries)))])
    with pytest.raises(SystemExit) as exit_:
        regress.main([*WORK, "--baseline", str(baseline), "--output", str(tmp_path)])
    assert exit_.value.code == 1
    report = json.loads((tmp_path / regress.FILE).read_text())
    figures = report["figures"]
    # bench padding's cases: 8 x 1024 query positions for 1024 + 7 x 16; 32 rows x 188
    # blocks x 16 slots read for 31 x 4 + 188 blocks' worth
    assert figures["work.padding.prefill"] == pytest.approx(8 * 1024 / (1024 + 7 * 16))
    assert figures["work.padding.decode"] == pytest.approx(32 * 188 / (31 * 4 + 188))
    err = capsys.readouterr().err
    for name in ("work.padding.prefill", "work.padding.decode", "work.mixed.query_padding"):
        assert f"regressed: {name} = " in err, err


@pytest.mark.slow
def test_the_policy_figures_repeat_exactly_with_two_busy_processes_beside_them(tmp_path):
    """Priced by the committed profile, the policies' latencies, throughput, preemptions and
    hit rates are the same quiet and under load, and the committed baseline's (this
    machine's; they are the same on any platform: common.json serves every one)."""
    quiet = regress_suite.policy_figures(tmp_path / "quiet")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = regress_suite.policy_figures(tmp_path / "loaded")
    finally:
        for p in busy:
            p.kill()
    assert loaded == quiet
    committed = json.loads(regress_suite.COMMON_BASELINE.read_text())
    for name, value in quiet.items():
        assert value == pytest.approx(committed["figures"][name], rel=regress_suite.PRICED), name
