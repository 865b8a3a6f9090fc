"""python -m harness.bench host_time: one step's host time split by part, and the table's
ratios against REF, computed by hand."""

import pytest

from harness.bench.host_time import format_rows, main, split


def test_a_step_splits_into_its_parts_by_hand() -> None:
    # engine.step 0..10 ms; forward_time 6 ms (graph + launch + wait). Stamps in ms.
    stamps = {"engine": 0.0, "schedule": 0.1, "schedule/": 0.4, "move_blocks": 0.4,
              "move_blocks/": 0.5, "forward": 0.7, "forward/": 3.0, "launch": 3.0,
              "launch/": 6.0, "wait": 6.5, "wait/": 8.0, "draw": 8.0, "draw/": 8.3,
              "update": 8.4, "update/": 8.6, "record": 9.0, "record/": 9.2,
              "engine/": 10.0}  # fmt: skip
    row = {"forward_time": 6.0, "build_time": 0.2}
    got = split(stamps, row)
    assert got["host"] == pytest.approx(10.0 - 6.0)
    assert got["build"] == pytest.approx((0.7 - 0.5) + 0.2)  # rows, then index arrays
    assert got["scheduler"] == pytest.approx(0.3 + (8.6 - 8.3))  # schedule; results + update
    assert got["sampler"] == pytest.approx(0.3)
    assert got["outputs"] == pytest.approx(9.0 - 8.6)
    assert got["recorder"] == pytest.approx((6.5 - 6.0) + 0.2)  # snapshot; recorder.step
    assert got["other"] == pytest.approx(4.0 - 0.4 - 0.6 - 0.3 - 0.4 - 0.7)


def test_the_table_gives_this_code_over_ref() -> None:
    parts = {"build": 0.1, "scheduler": 0.1, "sampler": 0.1, "outputs": 0.1, "recorder": 0.1,
             "other": 0.0}  # fmt: skip
    got = parts | {"forward": 0.020, "host": 0.001}
    old = parts | {"forward": 0.025, "host": 0.004}
    header, _, line = format_rows([{"batch": 32, "got": got, "old": old}]).splitlines()
    assert header.endswith("REF forward ms  REF host ms  forward vs REF  host vs REF")
    assert line.split()[-4:] == ["25.000", "4.000", "0.80x", "0.25x"]


def test_against_an_unknown_commit_is_one_line() -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--against", "no-such-ref", "--batches", "1"])
    message = str(stop.value)
    assert message.startswith("python -m harness.bench host_time: --against no-such-ref")
    assert "\n" not in message
