"""python -m harness.bench scale: its size ratios, computed by hand."""

import json
import subprocess

import pyarrow.parquet as pq
import pytest

from harness.analysis.results import REQUESTS_FILE
from harness.bench.scale import (
    cell_overrides,
    fit_line,
    format_batches,
    format_cells,
    format_ratios,
    main,
    measure,
    median_run,
    run_cell,
)


def _cell(size: int, wall: float, cpu: float, seq_steps: int) -> dict:
    got = {"wall": wall, "cpu": cpu, "seq_steps": seq_steps}
    return {"trace": "t", "allocator": "free_list", "scheduler": "fcfs", "size": size, "got": got}


def test_ratios_split_the_wall_growth_into_work_and_cost_per_unit_of_work() -> None:
    # 10x the requests, 15x the work (a heavier mix), 13.5x the CPU: the wall ratio misses
    # "linear", while each sequence-step got cheaper: (135 / 1.5M) / (10 / 100k) = 0.9.
    rows = [_cell(10_000, 12.0, 10.0, 100_000), _cell(100_000, 150.0, 135.0, 1_500_000)]
    table = format_ratios(rows, [10_000, 100_000])
    header, _, line = table.splitlines()
    assert header.split()[3:] == ["wall", "100,000", "/", "10,000", "(linear:", "10)",
                                  "seq-steps", "CPU", "per", "seq-step"]  # fmt: skip
    assert line.split() == ["t", "free_list", "fcfs", "12.5x", "15.0x", "0.90x"]


def test_a_cell_that_timed_out_has_no_ratio() -> None:
    rows = [_cell(10_000, 12.0, 10.0, 100_000), _cell(100_000, 0, 0, 0)]
    rows[1]["got"] = {"error": "timeout"}
    line = format_ratios(rows, [10_000, 100_000]).splitlines()[-1]
    assert line.split()[3:] == ["n/a", "n/a", "n/a"]


def test_a_cell_run_against_a_commit_shows_both_and_the_cpu_ratio() -> None:
    # This code: 10 s CPU over 100k sequence-steps (replay 8 s: 80 µs each); the commit's:
    # 25 s over the same 100k (replay 20 s: 200 µs). CPU per sequence-step: 10 / 25 = 0.40x.
    new = {"wall": 12.0, "cpu": 10.0, "replay": 8.0, "rss_mib": 300.0, "steps": 5_000,
           "seq_steps": 100_000, "throughput": 1.5}  # fmt: skip
    old = new | {"cpu": 25.0, "replay": 20.0, "rss_mib": 700.0}
    row = _cell(10_000, 0, 0, 0) | {"got": new, "old": old}
    header, _, line = format_cells([row]).splitlines()
    assert header.endswith(
        "µs/seq-step  REF wall s  REF µs/seq-step  REF peak RSS MiB  CPU/seq-step vs REF"
    )
    assert line.split()[-6:] == ["12,500", "80.00", "12.0", "200.00", "700", "0.40x"]


def test_against_an_unknown_commit_is_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--against", "no-such-ref", "--sizes", "10"])
    assert "--against no-such-ref" in str(stop.value) and "\n" not in str(stop.value)


def test_the_real_shaped_trace_runs_at_its_own_rate_with_long_contexts(tmp_path) -> None:
    # mooncake_conversation keeps its arrivals (no trace.rate) and gets a 32k context in an
    # arena that never evicts; 40 of its requests replay whole on the model clock.
    cell = {"trace": "mooncake_conversation", "allocator": "radix", "scheduler": "fcfs",
            "size": 40, "rate": 40.0}  # fmt: skip
    overrides = cell_overrides(cell, 4096)
    assert not any(o.startswith("trace.rate=") for o in overrides)
    assert overrides[-2:] == ["engine.max_model_len=32768", "engine.num_blocks=8000000"]
    got = run_cell(overrides, tmp_path / "run")
    assert got["completed"] == 40
    prompts = pq.read_table(tmp_path / "run" / REQUESTS_FILE, columns=["prompt_tokens"])
    assert max(prompts.column(0).to_pylist()) > 2048  # longer than the bench's other traces


def _batched(batch: int, steps: int, seq_steps: int, replay: float) -> dict:
    got = {"wall": 1.0, "cpu": 1.0, "replay": replay, "rss_mib": 300.0, "steps": steps,
           "seq_steps": seq_steps, "throughput": 1.0}  # fmt: skip
    return _cell(1_000, 0, 0, 0) | {"batch": batch, "got": got}


def test_the_line_is_the_least_squares_one_and_none_without_two_batches() -> None:
    # Through (0, 0), (1, 1), (2, 1), which no line crosses: mean x 1, mean y 2/3; deviations
    # (-1, -2/3), (0, 1/3), (1, 1/3), so sum dx dy = 2/3 + 0 + 1/3 = 1 and sum dx^2 = 2: slope
    # 1/2, intercept 2/3 - 1/2 = 1/6.
    fixed, per = fit_line([(0.0, 0.0), (1.0, 1.0), (2.0, 1.0)])
    assert per == pytest.approx(0.5)
    assert fixed == pytest.approx(1 / 6)
    assert fit_line([(1.0, 1.0), (1.0, 2.0)]) is None


def test_batches_split_a_steps_cost_into_fixed_and_per_sequence() -> None:
    # A step costs 100 µs plus 5 µs a sequence: at a mean batch of 4, 120 µs (1,000 steps in
    # 0.12 s); at 12, 160 µs; at 20, 200 µs. A timed-out cell and a configuration run at one
    # batch alone give no point and no line.
    rows = [_batched(4, 1_000, 4_000, 0.12), _batched(16, 1_000, 12_000, 0.16),
            _batched(32, 500, 10_000, 0.1), _batched(64, 0, 0, 0.0)]  # fmt: skip
    rows[-1]["got"] = {"error": "timeout"}
    rows.append(_batched(8, 100, 800, 0.02) | {"allocator": "radix"})
    header, _, line = format_batches(rows).splitlines()
    assert header.split()[-5:] == ["fixed", "µs/step", "µs/seq", "a", "step"]
    assert line.split()[-2:] == ["100.0", "5.00"]
    assert "4.0, 12.0, 20.0" in line
    table = format_cells(rows[:1])
    assert "max_num_seqs" in table and table.splitlines()[-1].split()[3] == "4"


def test_a_batch_is_the_schedulers_max_num_seqs_and_a_bad_one_is_one_line() -> None:
    cell = {"trace": "azure_like", "allocator": "radix", "scheduler": "fcfs", "size": 10,
            "rate": 40.0, "batch": 8}  # fmt: skip
    assert "scheduler.max_num_seqs=8" in cell_overrides(cell, 64)
    assert not any("max_num_seqs" in o for o in cell_overrides(cell | {"batch": None}, 64))
    with pytest.raises(SystemExit):
        main(["--batches", "0,8", "--sizes", "10"])


def test_a_commit_whose_bench_ignores_the_batch_is_an_error_not_a_figure(monkeypatch) -> None:
    # A REF checkout from before --batches runs its default max_num_seqs whatever the cell
    # asks: its figures would compare another configuration, so the cell says so instead.
    def ran(result: dict):
        def fake(cmd, **kwargs):
            return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(result), stderr="")

        return fake

    cell = {"trace": "azure_like", "allocator": "radix", "scheduler": "fcfs", "size": 10,
            "rate": 40.0, "batch": 8}  # fmt: skip
    monkeypatch.setattr(subprocess, "run", ran({"steps": 5}))
    old = "its bench predates --batches: ran its default batch, not 8"
    assert measure(cell, 64, 60.0, None) == {"error": old}
    monkeypatch.setattr(subprocess, "run", ran({"steps": 5, "max_num_seqs": 32}))
    assert measure(cell, 64, 60.0, None) == {"error": "ran max_num_seqs=32, not 8"}
    monkeypatch.setattr(subprocess, "run", ran({"steps": 5, "max_num_seqs": 8}))
    assert measure(cell, 64, 60.0, None)["steps"] == 5
    assert measure(cell | {"batch": None}, 64, 60.0, None) == {"steps": 5, "max_num_seqs": 8}


def _run(cpu: float, seq_steps: int = 1_000_000) -> dict:
    return {"wall": cpu + 1, "cpu": cpu, "replay": cpu, "rss_mib": 300.0, "steps": 1_000,
            "seq_steps": seq_steps, "throughput": 1.0}  # fmt: skip


def test_repeated_runs_give_the_median_runs_figures_and_their_spread() -> None:
    # CPU per sequence-step 2, 1 and 3 µs: the median run is the first; spread (3 - 1) / 2.
    # Four runs (1, 2, 3, 4 µs): the lower middle, 2; spread (4 - 1) / 2.5 (the median).
    got = median_run([_run(2.0), _run(1.0), _run(3.0)])
    assert got == _run(2.0) | {"runs": 3, "cpu_spread": pytest.approx(1.0)}
    got = median_run([_run(4.0), _run(1.0), _run(3.0), _run(2.0)])
    assert got["cpu"] == 2.0 and got["cpu_spread"] == pytest.approx(1.2)
    assert median_run([_run(1.0), {"error": "timeout"}]) == {"error": "timeout"}
    assert median_run([_run(5.0)])["cpu_spread"] == 0.0


def test_repeated_cells_show_their_runs_and_spreads() -> None:
    # This code: 3 runs, median 10 s over 1 M sequence-steps, spread 30 %; REF: 25 s, 5 %.
    new = _run(10.0) | {"runs": 3, "cpu_spread": 0.3}
    old = _run(25.0) | {"runs": 3, "cpu_spread": 0.05}
    row = _cell(10_000, 0, 0, 0) | {"got": new, "old": old}
    header, _, line = format_cells([row]).splitlines()
    assert header.endswith("runs  CPU spread  REF wall s  REF µs/seq-step  REF peak RSS MiB  "
                           "CPU/seq-step vs REF  REF CPU spread")  # fmt: skip
    assert line.split()[-7:] == ["3", "30%", "26.0", "25.00", "300", "0.40x", "5%"]
    with pytest.raises(SystemExit):
        main(["--repeats", "0", "--sizes", "10"])


def test_each_repeat_writes_a_folder_of_its_own(tmp_path, capsys) -> None:
    # Two runs of one 10-request cell: two run folders (two runs never write one), one row.
    main(["--sizes", "10", "--allocators", "free_list", "--schedulers", "fcfs",
          "--traces", "azure_like", "--repeats", "2", "--out", str(tmp_path)])  # fmt: skip
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == [f"azure_like-free_list-fcfs-10-40.0-run{k}" for k in (0, 1)]
    assert all((tmp_path / f / REQUESTS_FILE).exists() for f in folders)
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, text in enumerate(lines) if text.startswith("trace"))
    assert "runs  CPU spread" in lines[header] and lines[header + 2].split()[-2] == "2"
