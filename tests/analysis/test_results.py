"""Result files: atomic writes, loading many runs into one table, per-run tables on demand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from harness.analysis import results
from harness.analysis.metrics import REQUEST_COLUMNS, STEP_COLUMNS, MetricsError, requests_frame
from harness.cli.run import run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two finished runs and one unfinished folder, laid out as a Hydra sweep."""
    from support import compose_config

    root = tmp_path_factory.mktemp("results")
    for allocator, rate in (("free_list", 4), ("buddy", 16)):
        overrides = [f"allocator={allocator}", f"trace.rate={rate}"]
        job = root / "sweep" / ",".join(overrides)
        run(compose_config(overrides), job, overrides=overrides, choices={"allocator": allocator})
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (root / "sweep" / "unfinished").mkdir()
    (root / "sweep" / "unfinished" / "requests.parquet").write_bytes(b"")
    return root


def test_load_gathers_finished_runs_with_their_overrides(runs: Path) -> None:
    table = results.load(runs)
    assert len(table) == 2  # the folder without summary.json is not a run
    assert list(table["allocator"]) == ["buddy", "free_list"]  # sorted by folder
    assert list(table["trace.rate"]) == [16, 4]  # typed, not strings
    assert (table["completed"] == 6).all() and (table["clock"] == "virtual").all()
    assert "machine" not in table.columns  # nested records stay in summary.json


def test_load_of_an_empty_folder_is_an_empty_table(tmp_path: Path) -> None:
    assert results.load(tmp_path).empty


def test_load_tables_gives_the_typed_tables(runs: Path) -> None:
    run_dir = Path(results.load(runs)["run_dir"].iloc[0])
    requests, steps = results.load_tables(run_dir)
    assert list(requests.columns[: len(REQUEST_COLUMNS)]) == list(REQUEST_COLUMNS)
    assert list(steps.columns[: len(STEP_COLUMNS)]) == list(STEP_COLUMNS)
    assert len(requests) == 6 and len(steps) == results.read_summary(run_dir)["num_steps"]


def test_load_tables_names_a_broken_column(runs: Path, tmp_path: Path) -> None:
    run_dir = Path(results.load(runs)["run_dir"].iloc[0])
    requests, steps = results.load_tables(run_dir)
    results.write_tables(tmp_path, requests.drop(columns=["finish_time"]), steps)
    with pytest.raises(MetricsError, match="finish_time"):
        results.load_tables(tmp_path)


def test_summary_round_trips_nan_as_json_null(tmp_path: Path) -> None:
    results.write_summary(tmp_path, {"ttft_mean": math.nan, "completed": 3, "m": {"x": None}})
    text = (tmp_path / results.SUMMARY_FILE).read_text()
    assert '"ttft_mean": null' in text
    back = results.read_summary(tmp_path)
    assert math.isnan(back["ttft_mean"]) and back["completed"] == 3
    assert [p.name for p in tmp_path.iterdir()] == [results.SUMMARY_FILE]  # no temp file


def test_infinity_is_written_as_the_string_inf(tmp_path: Path) -> None:
    results.write_summary(tmp_path, {"trace_metadata": {"rate": math.inf, "low": -math.inf}})

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    text = (tmp_path / results.SUMMARY_FILE).read_text()
    back = json.loads(text, parse_constant=refuse)
    assert back["trace_metadata"] == {"rate": "inf", "low": "-inf"}


def test_a_failed_write_leaves_the_previous_file(tmp_path: Path) -> None:
    good = pd.DataFrame({"x": [1, 2]})
    results.write_tables(tmp_path, good, good)
    unwritable = pd.DataFrame({"x": [1, object()]})  # pyarrow fails inside the temp file
    with pytest.raises(Exception, match="object"):
        results.write_tables(tmp_path, unwritable, good)
    assert pd.read_parquet(tmp_path / results.REQUESTS_FILE).equals(good)
    assert sorted(p.name for p in tmp_path.iterdir()) == [results.REQUESTS_FILE, results.STEPS_FILE]


def test_overrides_fall_back_to_the_summary_without_hydra(tmp_path: Path) -> None:
    results.write_summary(tmp_path, {"overrides": ["+engine.seed=3", "model=tiny"]})
    assert results.overrides(tmp_path) == {"engine.seed": 3, "model": "tiny"}
    assert isinstance(results.load(tmp_path), pd.DataFrame)


def test_tables_longer_than_a_row_group_keep_every_type_and_value(
    runs: Path, tmp_path: Path
) -> None:
    # 10,000 request rows (more than one row group of 8,192) whose abort_reason is missing
    # until the last row and whose token_times vary in length: the file's types are those of
    # the whole table (the last row's string among them), and every value reads back.
    from array import array

    import pyarrow as pa
    import pyarrow.parquet as pq

    run_dir = Path(results.load(runs)["run_dir"].iloc[0])
    requests, steps = results.load_tables(run_dir)
    many = pd.concat([requests.iloc[[0]]] * 10_000, ignore_index=True)
    many["request_id"] = [f"r{i}" for i in range(len(many))]
    many["output_tokens"] = [i % 3 for i in range(len(many))]
    many["token_times"] = [array("d", [0.5 * i] * (i % 3)) for i in range(len(many))]
    many["abort_reason"] = [None] * (len(many) - 1) + ["client"]
    many["finish_reason"] = ["stop"] * (len(many) - 1) + ["abort"]
    many = requests_frame(many)  # as a run hands it: token_times as float arrays
    results.write_tables(tmp_path, many, steps)
    written = pq.read_schema(tmp_path / results.REQUESTS_FILE)
    assert written.field("abort_reason").type == pa.string()
    assert written.field("token_times").type == pa.list_(pa.float64())
    assert pq.ParquetFile(tmp_path / results.REQUESTS_FILE).metadata.num_row_groups == 2
    back, steps_back = results.load_tables(tmp_path)
    assert back["request_id"].tolist() == many["request_id"].tolist()
    assert back["abort_reason"].iloc[-1] == "client" and back["abort_reason"].iloc[0] is None
    assert [list(t) for t in back["token_times"].iloc[:4]] == [[], [0.5], [1.0, 1.0], []]
    pd.testing.assert_frame_equal(steps_back, steps)
