"""python -m harness.bench dynamo: Dynamo's engine read from a cell's kvbench config, the
table's figures by hand, and one line for an interpreter without Dynamo (Dynamo itself is
not installed here: its wheels pin their own pydantic, so it lives in a venv of its own)."""

import sys

import pytest

from harness.bench.dynamo import engine_args, format_rows, main, median_wall, run_dynamo
from harness.bench.scale import cell_overrides
from harness.bench.support.components import compose_config


def _config(allocator: str, scheduler: str, batch: int | None = None):
    cell = {"trace": "azure_like", "allocator": allocator, "scheduler": scheduler,
            "size": 10, "rate": 40.0} | ({"batch": batch} if batch else {})  # fmt: skip
    return compose_config(cell_overrides(cell, 4096))


def test_dynamo_runs_the_engine_the_kvbench_cell_builds() -> None:
    # fcfs's token budget is max(engine.max_model_len, 2048) = 2048; chunked_prefill's 512.
    assert engine_args(_config("free_list", "fcfs")) == {
        "block_size": 16, "num_gpu_blocks": 4096, "max_num_seqs": 32,
        "max_num_batched_tokens": 2048, "max_model_len": 2048,
        "enable_prefix_caching": False, "enable_chunked_prefill": False,
        "preemption_mode": "lifo",
    }  # fmt: skip
    radix = engine_args(_config("radix", "chunked_prefill", batch=8))
    assert radix["enable_prefix_caching"] and radix["enable_chunked_prefill"]
    assert (radix["max_num_batched_tokens"], radix["max_num_seqs"]) == (512, 8)


def test_each_side_is_timed_per_output_token_and_kvbench_over_dynamo() -> None:
    # 1,000,000 output tokens: kvbench's replay 2.5 s is 2.50 µs a token, Dynamo's 0.5 s
    # 0.50 µs; kvbench / Dynamo = 5.0x.
    row = {"trace": "t", "allocator": "radix", "scheduler": "fcfs", "size": 4_000,
           "output_tokens": 1_000_000, "engine": {"max_num_seqs": 32},
           "kvbench": {"replay": 2.5, "completed": 4_000},
           "dynamo": {"wall": 0.5, "completed_requests": 4_000}}  # fmt: skip
    header, _, line = format_rows([row]).splitlines()
    assert "kvbench µs/token" in header and header.rstrip().endswith("(kvbench, Dynamo)")
    assert line.split() == ["t", "radix", "fcfs", "32", "4,000", "1,000,000", "2.50", "2.50",
                            "0.50", "0.50", "5.0x", "4,000,", "4,000"]  # fmt: skip


def test_a_failed_side_has_no_ratio() -> None:
    row = {"trace": "t", "allocator": "radix", "scheduler": "fcfs", "size": 10,
           "output_tokens": 100, "engine": {"max_num_seqs": 32},
           "kvbench": {"replay": 1.0, "completed": 10}, "dynamo": {"error": "timeout"}}  # fmt: skip
    # 100 tokens: kvbench 1.0 s is 10,000 µs a token; Dynamo timed out, so no ratio
    assert format_rows([row]).splitlines()[-1].split()[-4:] == [
        "1.00",
        "10000.00",
        "timeout",
        "n/a",
    ]


def test_the_median_run_is_the_lower_middle_and_an_error_wins() -> None:
    runs = [{"wall": 3.0}, {"wall": 1.0}, {"wall": 2.0}, {"wall": 4.0}]
    assert median_wall(runs, "wall") == {"wall": 2.0, "runs": 4}
    assert median_wall([*runs, {"error": "timeout"}], "wall") == {"error": "timeout"}


def test_an_interpreter_without_dynamo_or_no_interpreter_is_one_line(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 2, "output_length": 1, "hash_ids": [0]}\n')
    args = engine_args(_config("free_list", "fcfs"))
    got = run_dynamo(sys.executable, trace, args, timeout=60)  # kvbench's own: no Dynamo
    assert got["error"].startswith(f"{sys.executable} has no ai-dynamo-runtime")
    assert got["error"].endswith("pip install ai-dynamo-runtime==1.6.1 there (Linux wheels only)")
    missing = str(tmp_path / "no-python")
    assert run_dynamo(missing, trace, args, timeout=60) == {
        "error": f"--python {missing}: No such file or directory"
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "0"], "--sizes: '0'; give request counts >= 1"),
        (["--repeats", "0"], "--repeats: 0; give a number of runs >= 1"),
        (["--allocators", "nope"], "--allocators: unknown ['nope']"),
    ],
)
def test_a_bad_option_is_one_line(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--python", sys.executable, *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_failed_dynamo_run_is_shown_and_exits_non_zero(tmp_path, capsys) -> None:
    missing = str(tmp_path / "no-python")
    argv = ["--python", missing, "--sizes", "6", "--allocators", "free_list",
            "--schedulers", "fcfs"]  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == (
        f"python -m harness.bench dynamo: 1 run(s) failed; the first: --python {missing}: "
        "No such file or directory"
    )
    line = capsys.readouterr().out.splitlines()[-1].split()  # the table's row
    assert line[:5] == ["azure_like", "free_list", "fcfs", "32", "6"]
    assert int(line[5].replace(",", "")) >= 6 and float(line[7]) > 0  # kvbench's side ran
    assert line[8:] == ["--python", f"{missing}:", "No", "such", "file", "or", "directory", "n/a"]
