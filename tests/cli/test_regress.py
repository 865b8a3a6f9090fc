"""kvbench-regress: the comparison with a baseline, wrong input, and, on real runs of the engine
and padding figures, that an unchanged run passes while an injected slowdown or padded batches
fail, named."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.cli import regress
from harness.engine import LLMEngine, model_runner

# Real runs of the noisiest figures at fewer rounds than CI's, so the tests take minutes.
REAL = ["--only", "engine,padding", "--rounds", "3"]


def test_compare_names_only_figures_worse_than_their_tolerance():
    baseline = {"engine.uniform": 1.0, "padding.prefill": 1.0}
    figures = {"engine.uniform": 0.7, "padding.prefill": 3.1, "sweep.prefix_hit_rate": 0.5}
    checks = {c["figure"]: c for c in regress.compare_figures(figures, baseline)}
    assert checks["engine.uniform"]["status"] == "ok"  # 30 % lower, tolerance 35 %
    assert checks["engine.uniform"]["limit"] == pytest.approx(0.65)
    assert checks["padding.prefill"]["status"] == "regressed"  # 210 % higher, tolerance 200 %
    assert checks["sweep.prefix_hit_rate"]["status"] == "new"


def test_better_than_the_baseline_never_regresses():
    for figure in regress.FIGURES.values():
        better = 10.0 if figure.better == "higher" else 0.1
        assert not figure.regressed(better, 1.0), figure.name


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
    """A baseline of the engine and padding figures, written by a real run just now."""
    tmp = tmp_path_factory.mktemp("regress")
    path = tmp / "baseline.json"
    regress.main(
        [*REAL, "--baseline", str(path), "--output", str(tmp / "first"), "--update-baseline"]
    )
    return path


@pytest.mark.slow
def test_an_unchanged_run_passes_against_the_baseline_it_just_wrote(baseline, tmp_path, capsys):
    regress.main([*REAL, "--baseline", str(baseline), "--output", str(tmp_path)])  # no exit
    report = json.loads((tmp_path / regress.FILE).read_text())
    assert {c["status"] for c in report["checks"]} == {"ok"}, report["checks"]
    assert set(report["figures"]) == set(json.loads(baseline.read_text())["figures"])
    assert "figures: 5 passed, 0 failed" in capsys.readouterr().out


@pytest.mark.slow
def test_a_2x_slower_engine_fails_naming_its_figures(baseline, tmp_path, capsys, monkeypatch):
    step = LLMEngine.step

    def slow_step(self, *args, **kwargs):
        start = time.perf_counter()
        out = step(self, *args, **kwargs)
        time.sleep(time.perf_counter() - start)  # every step takes twice as long
        return out

    monkeypatch.setattr(LLMEngine, "step", slow_step)
    only = ["--only", "engine", "--rounds", "2"]  # fewer rounds can only look slower
    with pytest.raises(SystemExit) as exit_:
        regress.main([*only, "--baseline", str(baseline), "--output", str(tmp_path)])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    for name in ("engine.uniform", "engine.mixed"):
        assert f"regressed: {name} = " in err, err


@pytest.mark.slow
def test_padded_batches_fail_naming_the_padding_figures(baseline, tmp_path, capsys, monkeypatch):
    # Padding comes back: all of a forward's rows in one padded batch.
    monkeypatch.setattr(model_runner, "group_rows", lambda rows, key_cost: [list(range(len(rows)))])
    only = ["--only", "padding", "--rounds", "1"]  # 8x is no noise
    with pytest.raises(SystemExit) as exit_:
        regress.main([*only, "--baseline", str(baseline), "--output", str(tmp_path)])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    for name in ("padding.prefill", "padding.decode"):
        assert f"regressed: {name} = " in err, err
