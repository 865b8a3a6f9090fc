"""python -m harness.bench dynamo: Dynamo's engine read from a cell's kvbench config, the
table's figures by hand, one line for a bad interpreter or option, and a whole run against a
stand-in for Dynamo's runtime (the real one is not installed here: its wheels pin their own
pydantic, so it lives in a venv of its own)."""

import json
import sys

import pytest

from harness.bench.dynamo import call_driver, engine_args, format_rows, main, run_dynamo
from harness.bench.scale import cell_overrides
from harness.bench.support.components import compose_config

# A stand-in for ai-dynamo-runtime's ``dynamo._core``: it records how it was called and
# answers with the trace file's own totals and a simulation of 1,000 ms (FAKE_SHORT: that
# many output tokens fewer, as Dynamo's clipping to max_model_len would).
FAKE_CORE = """
import json, os

class _Result:
    def __init__(self, summary):
        self.summary = summary

def run_mocker_trace_replay(trace_files, extra_engine_args=None, trace_block_size=None):
    records = [json.loads(line) for path in trace_files for line in open(path)]
    with open(os.environ["FAKE_CALLS"], "a") as out:
        out.write(json.dumps([extra_engine_args, trace_block_size]) + "\\n")
    return _Result({
        "num_requests": len(records), "completed_requests": len(records),
        "total_input_tokens": sum(r["input_length"] for r in records),
        "total_output_tokens": sum(r["output_length"] for r in records)
        - int(os.environ.get("FAKE_SHORT", "0")),
        "wall_time_ms": 1000.0,
    })
"""


@pytest.fixture
def fake_dynamo(tmp_path, monkeypatch):
    """kvbench's own interpreter with the stand-in on its path; the file of its calls."""
    root = tmp_path / "fake"
    (root / "dynamo").mkdir(parents=True)
    (root / "dynamo" / "__init__.py").write_text("")
    (root / "dynamo" / "_core.py").write_text(FAKE_CORE)
    info = root / "ai_dynamo_runtime-0.0.1.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: ai-dynamo-runtime\nVersion: 0.0.1\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    return tmp_path / "calls.jsonl"


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


def _row(kvbench: dict, dynamo: dict) -> dict:
    return {"trace": "t", "allocator": "radix", "scheduler": "fcfs", "size": 4_000,
            "output_tokens": 1_000_000, "engine": {"max_num_seqs": 32, "num_gpu_blocks": 4096},
            "kvbench": kvbench, "dynamo": dynamo}  # fmt: skip


def test_each_side_is_timed_per_output_token_and_kvbench_over_dynamo() -> None:
    # 1,000,000 output tokens in 32,000 steps of 960,000 sequences (a mean batch of 30.0):
    # kvbench's replay 2.5 s is 2.50 µs a token, Dynamo's 0.5 s 0.50 µs; kvbench / Dynamo
    # = 5.0x. Three runs each, spreads 10 % and 40 %.
    ours = {"replay": 2.5, "steps": 32_000, "seq_steps": 960_000, "runs": 3, "wall_spread": 0.1}
    row = _row(ours, {"replay": 0.5, "runs": 3, "wall_spread": 0.4})
    header, _, line = format_rows([row]).splitlines()
    assert "mean batch  kvbench replay s  kvbench µs/token  Dynamo replay s" in header
    assert line.split() == ["t", "radix", "fcfs", "32", "4,000", "1,000,000", "4,096", "30.0",
                            "2.50", "2.50", "0.50", "0.50", "5.0x", "3", "10%,", "40%"]  # fmt: skip


def test_a_failed_side_has_no_ratio() -> None:
    # kvbench 1.0 s for 1,000,000 tokens is 1.00 µs a token; Dynamo timed out: no ratio
    row = _row({"replay": 1.0, "steps": 10, "seq_steps": 20}, {"error": "timeout"})
    line = format_rows([row]).splitlines()[-1].split()
    assert line[-5:] == ["2.0", "1.00", "1.00", "timeout", "n/a"]


def test_an_interpreter_without_dynamo_or_no_interpreter_is_one_line(tmp_path) -> None:
    got = call_driver(sys.executable, ["--check"], timeout=60)  # kvbench's own: no Dynamo
    assert got["error"].startswith(f"{sys.executable} has no ai-dynamo-runtime")
    assert got["error"].endswith("pip install ai-dynamo-runtime==1.6.1 there (Linux wheels only)")
    missing = str(tmp_path / "no-python")
    assert call_driver(missing, ["--check"], timeout=60) == {
        "error": f"--python {missing}: No such file or directory"
    }
    assert call_driver("/bin/echo", ["--check"], timeout=60) == {
        "error": "--python /bin/echo: printed no result; is it a Python interpreter?"
    }


def test_dynamo_gets_the_engine_and_the_block_size_and_its_tokens_are_checked(
    tmp_path, fake_dynamo, monkeypatch
) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [0, 1]},
             {"timestamp": 5, "input_length": 9, "output_length": 4, "hash_ids": [2]}]  # fmt: skip
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = engine_args(_config("free_list", "fcfs"))
    assert call_driver(sys.executable, ["--check"], timeout=60) == {"version": "0.0.1"}
    got = run_dynamo(sys.executable, trace, args, tokens=7, timeout=60)
    assert (got["replay"], got["completed_requests"], got["total_output_tokens"]) == (1.0, 2, 7)
    assert json.loads(fake_dynamo.read_text()) == [{"engine": args}, 16]
    monkeypatch.setenv("FAKE_SHORT", "2")  # an output shortened: not the same work
    assert run_dynamo(sys.executable, trace, args, tokens=7, timeout=60) == {
        "error": "Dynamo emitted 5 of 7 tokens"
    }


def test_a_whole_run_prints_both_sides(fake_dynamo, capsys) -> None:
    main(["--python", sys.executable, "--sizes", "6", "--allocators", "free_list",
          "--schedulers", "fcfs"])  # fmt: skip
    out = capsys.readouterr().out
    assert "Dynamo: ai-dynamo-runtime 0.0.1" in out
    line = out.splitlines()[-1].split()  # the table's row
    assert line[:5] == ["azure_like", "free_list", "fcfs", "32", "6"]
    tokens = int(line[5].replace(",", ""))
    ((engine, block_size),) = map(json.loads, fake_dynamo.read_text().splitlines())
    assert engine["engine"]["max_num_seqs"] == 32 and block_size == 16
    # Dynamo's side: 1.00 s for the trace's tokens, which kvbench emitted too
    assert line[10:12] == ["1.00", f"{1e6 / tokens:.2f}"]
    assert line[12].endswith("x")  # kvbench's replay over Dynamo's 1.00 s, to 0.1
    assert float(line[12][:-1]) == pytest.approx(float(line[8]), abs=0.06)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "0"], "--sizes: '0'; give request counts >= 1"),
        (["--repeats", "0"], "--repeats: 0; give a number of runs >= 1"),
        (["--allocators", "nope"], "--allocators: unknown ['nope']"),
        (["--allocators", "buddy"], "--allocators: ['buddy'] have no counterpart in Dynamo's"),
        (["--schedulers", "priority"], "--schedulers: ['priority'] have no counterpart"),
        (["--python", "/bin/echo"], "--python /bin/echo: printed no result"),
    ],
)
def test_a_bad_option_is_one_line_before_any_run(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--python", sys.executable, *argv])
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the usage, one line
    assert last.startswith("python -m harness.bench dynamo: error: ") and message in last
