"""The instructions benchmark: counts per sequence-step from two runs, callgrind's report,
the table against a commit, and its one-line errors."""

from __future__ import annotations

import resource
import shutil
import subprocess

import pytest

from harness.bench import instructions
from harness.bench.instructions import collected, format_rows, measure, per_seq_step

HAS_VALGRIND = shutil.which("valgrind") is not None


def test_a_sequence_step_costs_what_the_bigger_run_did_more_per_sequence_step_more() -> None:
    # Both runs start up for 9e9 instructions; the replay costs 37,000 a sequence-step.
    small = {"ir": 9_000_000_000 + 500 * 37_000, "seq_steps": 500}
    big = {"ir": 9_000_000_000 + 2_000 * 37_000, "seq_steps": 2_000}
    assert per_seq_step(small, big) == 37_000


def test_sizes_no_further_apart_than_their_steps_are_an_error_not_a_figure() -> None:
    run = {"ir": 10, "seq_steps": 5}
    with pytest.raises(ValueError, match="further apart"):
        per_seq_step(run, run)
    got = measure((1, 2), {("got", 1): run, ("got", 2): run})
    assert "further apart" in got["got"]["error"]


def test_a_cells_figures_per_code_and_the_first_failure() -> None:
    runs = {
        ("got", 10): {"ir": 1_000, "seq_steps": 10},
        ("got", 30): {"ir": 3_000, "seq_steps": 30},
        ("old", 10): {"ir": 1_000, "seq_steps": 10},
        ("old", 30): {"error": "timeout"},
    }
    got = measure((10, 30), runs)
    assert got == {"got": {"per": 100.0, "seq_steps": 30}, "old": {"error": "timeout"}}


@pytest.mark.skipif(not HAS_VALGRIND, reason="valgrind (Linux) counts the instructions")
def test_callgrinds_report_gives_the_count() -> None:
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", "true"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert collected(done.stderr) > 0
    with pytest.raises(ValueError, match="no instruction count"):
        collected("==1== Callgrind, a call-graph generating cache profiler\n")


def test_the_table_against_a_commit_gives_the_ratio_and_flags_other_steps() -> None:
    cell = {"trace": "azure_like", "scheduler": "fcfs", "rate": 40.0}
    rows = [
        cell
        | {
            "allocator": "free_list",
            "got": {"per": 27_000.0, "seq_steps": 97_000},
            "old": {"per": 30_000.0, "seq_steps": 97_000},
        },
        cell
        | {
            "allocator": "radix",
            "got": {"per": 36_000.0, "seq_steps": 97_000},
            "old": {"per": 30_000.0, "seq_steps": 96_000},
        },
        cell | {"allocator": "buddy", "got": {"error": "timeout"}, "old": {"error": "timeout"}},
    ]
    lines = format_rows(rows, (300, 900)).splitlines()
    assert lines[0].split() == [
        *("trace", "allocator", "scheduler", "seq-steps", "at", "900", "instr/seq-step"),
        *("REF", "instr/seq-step", "instr", "vs", "REF", "same", "steps"),
    ]
    assert lines[2].split()[3:] == ["97,000", "27,000", "30,000", "0.900x", "yes"]
    assert lines[3].split()[3:] == ["97,000", "36,000", "30,000", "1.200x", "NO"]
    assert lines[4].split()[3:] == ["timeout"]


def test_the_subprocess_sets_only_soft_limits(monkeypatch) -> None:
    monkeypatch.setattr(resource, "setrlimit", resource.setrlimit)  # restored after the test
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    instructions.keep_hard_limits()
    other = hard - 1 if hard != resource.RLIM_INFINITY else 1 << 20  # a hard limit asked for
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, other))
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft - 1, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--sizes", "300"], "--sizes: '300'; give two numbers of requests"),
        (["--sizes", "300,300"], "--sizes: '300,300'; give two different sizes"),
        (["--jobs", "0"], "--jobs: 0; give a number of runs at once >= 1"),
        (["--allocators", "nope"], "--allocators: unknown ['nope']"),
    ],
)
def test_a_bad_option_is_one_line(args, error, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        instructions.main(args)
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


def test_without_valgrind_it_says_how_to_get_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a folder with no valgrind in it
    with pytest.raises(SystemExit) as exited:
        instructions.main(["--sizes", "10,20"])
    assert exited.value.code == f"{instructions.PROG}: valgrind not found; install it " + (
        "(Debian/Ubuntu: apt install valgrind)"
    )
