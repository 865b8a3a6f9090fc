"""The recorder's request rows, kept as typed columns: every value of two finished
sequences written by hand, the same through ``request_columns`` and ``requests``, and a
beam search's row replacing what one sequence cannot say."""

from __future__ import annotations

import math
from array import array

import numpy as np

from harness.analysis.metrics import REQUEST_COLUMNS
from harness.engine.recorder import Recorder
from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams


def _finished(name: str) -> Seq:
    seq = Seq(request_id=name, token_ids=[1, 2, 3], params=SamplingParams(), arrival_time=0.5)
    seq.num_prompt_tokens = 3
    seq.token_ids = [1, 2, 3, 4, 5]  # 2 output tokens
    seq.token_times = array("d", [1.0, 1.25])
    seq.first_scheduled_time, seq.first_token_time, seq.finish_time = 0.75, 1.0, 1.25
    seq.num_cached_tokens, seq.num_cached_tokens_host = 2, 1
    seq.finish_reason = "length"
    return seq


def test_request_rows_as_columns_and_as_dicts():
    recorder = Recorder(measured=False)
    a = _finished("a")
    recorder.request(a)
    recorder.request(_finished("b"), output_tokens=1, token_times=array("d", [2.0]))
    assert recorder.num_requests == 2
    columns = recorder.request_columns()
    assert list(columns) == list(REQUEST_COLUMNS)
    assert columns["request_id"] == ["a", "b"]
    assert columns["output_tokens"].dtype == np.int64
    assert columns["output_tokens"].tolist() == [2, 1]  # b's row replaced
    assert columns["cached_tokens"].tolist() == [2, 2]
    assert columns["cached_tokens_device"].tolist() == [1, 1]  # 2 cached - 1 from the host
    assert columns["first_scheduled_time"].tolist() == [0.75, 0.75]
    assert columns["token_times"][0] is a.token_times  # uncopied
    assert list(columns["token_times"][1]) == [2.0]
    assert columns["abort_reason"] == [None, None]
    assert all(math.isnan(v) for v in columns["ttft_slo"].tolist())
    rows = recorder.requests
    assert [r["request_id"] for r in rows] == ["a", "b"]
    assert rows[0]["finish_time"] == 1.25 and rows[0]["prompt_tokens"] == 3
    assert rows[1]["output_tokens"] == 1 and rows[1]["finish_reason"] == "length"
    assert list(rows[0]) == list(REQUEST_COLUMNS)


def test_a_request_column_handed_out_is_the_callers():
    recorder = Recorder(measured=False)
    recorder.request(_finished("a"))
    columns = recorder.request_columns()
    columns["output_tokens"][0] = 9
    recorder.request(_finished("b"))  # the recorder's columns still grow
    assert recorder.request_columns()["output_tokens"].tolist() == [2, 2]


def test_a_disabled_recorder_keeps_no_rows():
    recorder = Recorder(enabled=False)
    recorder.request(_finished("a"))
    assert recorder.num_requests == 0 and recorder.requests == []
