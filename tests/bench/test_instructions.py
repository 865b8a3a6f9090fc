"""The instructions benchmark: counts per sequence-step from two runs, callgrind's report,
the table against a commit, and its one-line errors."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess

import pytest

from harness.bench import instructions
from harness.bench.instructions import (
    collected,
    count,
    format_fits,
    format_rows,
    measure,
    per_seq_step,
)

HAS_VALGRIND = shutil.which("valgrind") is not None


def test_a_sequence_step_costs_what_the_bigger_run_did_more_per_sequence_step_more() -> None:
    # Both runs start up for 9e9 instructions; the replay costs 37,000 a sequence-step.
    small = {"ir": 9_000_000_000 + 500 * 37_000, "seq_steps": 500}
    big = {"ir": 9_000_000_000 + 2_000 * 37_000, "seq_steps": 2_000}
    assert per_seq_step(small, big) == 37_000


def test_sizes_no_further_apart_than_their_steps_are_an_error_not_a_figure() -> None:
    run = {"ir": 10, "steps": 1, "seq_steps": 5}
    with pytest.raises(ValueError, match="further apart"):
        per_seq_step(run, run)
    got = measure((1, 2), {("got", 1): run, ("got", 2): run})
    assert "further apart" in got["got"]["error"]
    # More sequence-steps in no more steps: no step's figure either (not a division by 0)
    wider = {"ir": 20, "steps": 1, "seq_steps": 10}
    got = measure((1, 2), {("got", 1): run, ("got", 2): wider})
    assert got["got"] == {"error": "the bigger run took no more steps: give sizes further apart"}


def test_a_cells_figures_per_code_and_the_first_failure() -> None:
    # The bigger run took 5 more steps of 20 sequence-steps more, for 2,000 instructions more:
    # 100 a sequence-step, 400 a step, 4 sequences a step.
    runs = {
        ("got", 10): {"ir": 1_000, "steps": 3, "seq_steps": 10},
        ("got", 30): {"ir": 3_000, "steps": 8, "seq_steps": 30},
        ("old", 10): {"ir": 1_000, "steps": 3, "seq_steps": 10},
        ("old", 30): {"error": "timeout"},
    }
    got = measure((10, 30), runs)
    assert got == {
        "got": {"per": 100.0, "seq_steps": 30, "per_step": 400.0, "batch": 4.0},
        "old": {"error": "timeout"},
    }


def test_batches_split_a_steps_instructions_into_fixed_and_per_sequence() -> None:
    # A step executes 290,000 instructions whatever its batch and 10,000 a sequence: at a
    # mean batch of 1 that is 300,000 a step, at 31, 600,000. REF: 200,000 and 20,000, so
    # 220,000 at 1 and 820,000 at 31. A configuration counted at one batch has no line.
    cell = {"trace": "azure_like", "allocator": "free_list", "scheduler": "fcfs"}
    rows = [
        cell | {"batch": 1, "got": {"per_step": 300_000.0, "batch": 1.0},
                "old": {"per_step": 220_000.0, "batch": 1.0}},
        cell | {"batch": 32, "got": {"per_step": 600_000.0, "batch": 31.0},
                "old": {"per_step": 820_000.0, "batch": 31.0}},
        cell | {"allocator": "radix", "batch": 32, "got": {"per_step": 1.0, "batch": 31.0}},
        cell | {"allocator": "buddy", "got": {"per_step": 1.0, "batch": 31.0}},
    ]  # fmt: skip
    header, _, this, ref = format_fits(rows).splitlines()
    assert header.split()[-6:] == ["(mean)", "fixed", "instr/step", "instr/seq", "a", "step"]
    assert this.split() == ["azure_like", "free_list", "fcfs", "this", "1.0,", "31.0",
                            "290,000", "10,000"]  # fmt: skip
    assert ref.split()[3:] == ["REF", "1.0,", "31.0", "200,000", "20,000"]
    assert format_fits(rows[2:]) == ""


def test_a_run_of_another_batch_than_its_cell_is_an_error(monkeypatch) -> None:
    # A REF whose bench predates --batches runs its default max_num_seqs whatever the cell
    # asks: its count would be of another configuration.
    report = "==1== Collected : 5000\n"
    out = json.dumps({"steps": 5, "seq_steps": 160, "max_num_seqs": 32})
    done = subprocess.CompletedProcess([], 0, stdout=out, stderr=report)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kwargs: done)
    cell = {"trace": "azure_like", "allocator": "free_list", "scheduler": "fcfs", "size": 10}
    assert count(cell | {"batch": 8}, 64, 60.0) == {"error": "ran max_num_seqs=32, not 8"}
    assert count(cell | {"batch": 32}, 64, 60.0) == {"ir": 5000, "steps": 5, "seq_steps": 160}
    assert count(cell | {"batch": None}, 64, 60.0) == {"ir": 5000, "steps": 5, "seq_steps": 160}


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
        (["--batches", "0,32"], "--batches: '0,32'; give distinct max_num_seqs values >= 1"),
        (["--batches", "x"], "--batches: 'x'; give distinct max_num_seqs values >= 1"),
        (["--batches", "32,32"], "--batches: '32,32'; give distinct max_num_seqs values >= 1"),
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
