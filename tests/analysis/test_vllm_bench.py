"""vllm_bench.json: a run's figures under vllm bench serve's keys and units, checked against a
hand-built summary, and written by a real run just before summary.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.analysis import results
from harness.analysis.vllm_bench import vllm_summary
from harness.cli.run import run


def summary(**changes) -> dict:
    """A summary as harness.cli.run.run writes it: 3 of 4 requests completed in 2 s, 90 prompt
    and 30 output tokens, a Gamma trace at 4 req/s."""
    base = dict(
        ttft_mean=0.1, ttft_p50=0.08, ttft_p90=0.2, ttft_p99=0.25,
        tpot_mean=0.01, tpot_p50=0.009, tpot_p90=0.015, tpot_p99=0.0175,
        itl_mean=0.011, itl_p50=0.0085, itl_p90=0.02, itl_p99=0.05,
        e2e_mean=0.5, e2e_p50=0.45, e2e_p90=0.9, e2e_p99=1.25,
        duration=2.0, completed=3, aborted=1,
        output_throughput=30 / 2.0, total_token_throughput=(90 + 30) / 2.0,
        request_throughput=3 / 2.0, goodput=2 / 2.0,
        kv_utilisation=0.9, num_requests=4, model_name="llama-tiny-random-seed0",
        trace_metadata={
            "generator": "synthetic",
            "parameters": {"arrival": {"type": "Gamma", "rate": 4.0, "burstiness": 0.25}},
        },
    )  # fmt: skip
    return {**base, **changes}


def test_figures_under_vllm_names_in_ms() -> None:
    assert vllm_summary(summary()) == pytest.approx(
        {
            "model_id": "llama-tiny-random-seed0",
            "num_prompts": 4,
            "request_rate": 4.0,
            "burstiness": 0.25,
            "max_concurrency": None,
            "duration": 2.0,
            "completed": 3,
            "failed": 1,
            "total_input_tokens": 90,
            "total_output_tokens": 30,
            "request_throughput": 1.5,
            "request_goodput": 1.0,
            "output_throughput": 15.0,
            "total_token_throughput": 60.0,
            "mean_ttft_ms": 100.0,
            "median_ttft_ms": 80.0,
            "p90_ttft_ms": 200.0,
            "p99_ttft_ms": 250.0,
            "mean_tpot_ms": 10.0,
            "median_tpot_ms": 9.0,
            "p90_tpot_ms": 15.0,
            "p99_tpot_ms": 17.5,
            "mean_itl_ms": 11.0,
            "median_itl_ms": 8.5,
            "p90_itl_ms": 20.0,
            "p99_itl_ms": 50.0,
            "mean_e2el_ms": 500.0,
            "median_e2el_ms": 450.0,
            "p90_e2el_ms": 900.0,
            "p99_e2el_ms": 1250.0,
        }  # fmt: skip
    )


def test_token_totals_are_exact_integers_after_the_round_trip() -> None:
    duration = 7.123456789
    out = vllm_summary(
        summary(
            duration=duration,
            output_throughput=12345 * (1 / duration),
            total_token_throughput=(67890 + 12345) * (1 / duration),
        )
    )
    assert out["total_input_tokens"] == 67890 and out["total_output_tokens"] == 12345
    assert isinstance(out["total_input_tokens"], int)


@pytest.mark.parametrize(
    ("generator", "arrival", "rate", "burstiness"),
    [
        ("synthetic", {"type": "Poisson", "rate": 2.0}, 2.0, 1.0),
        ("shared_prefix", {"type": "Constant", "rate": 8.0}, 8.0, None),
        ("synthetic", {"type": "AllAtOnce"}, "inf", None),
        ("synthetic", {"type": "Poisson", "rate": math.inf}, "inf", 1.0),  # trace.rate=inf
        ("multi_turn", {"type": "Poisson", "rate": 1.0}, None, None),  # conversations/s
    ],
)
def test_request_rate_where_the_trace_knows_it(generator, arrival, rate, burstiness) -> None:
    meta = {"generator": generator, "parameters": {"arrival": arrival}}
    out = vllm_summary(summary(trace_metadata=meta))
    assert out["request_rate"] == rate and out["burstiness"] == burstiness


def test_a_trace_file_without_metadata_has_no_rate() -> None:
    out = vllm_summary(summary(trace_metadata={"source_file": "t.jsonl"}))
    assert out["request_rate"] is None and out["burstiness"] is None


def test_nan_is_written_as_null(tmp_path: Path) -> None:
    nan = math.nan
    results.write_vllm_bench(tmp_path, summary(tpot_mean=nan, duration=nan))
    written = json.loads((tmp_path / results.VLLM_BENCH_FILE).read_text())
    assert written["mean_tpot_ms"] is None and written["duration"] is None
    assert written["total_output_tokens"] is None  # nothing to recover it from
    assert written["median_tpot_ms"] == pytest.approx(9.0)


def test_a_run_writes_it_before_the_summary(compose_cfg, tmp_path: Path, monkeypatch) -> None:
    seen = []
    write_summary = results.write_summary

    def spy(run_dir, s):
        seen.append((Path(run_dir) / results.VLLM_BENCH_FILE).exists())
        write_summary(run_dir, s)

    monkeypatch.setattr(results, "write_summary", spy)
    out = run(compose_cfg(["warmup=0"]), tmp_path)
    assert seen == [True]
    written = json.loads((tmp_path / results.VLLM_BENCH_FILE).read_text())
    assert set(written) == set(vllm_summary(out))
    assert written["completed"] == 6 and written["request_rate"] == 8.0  # trace=smoke
    assert written["mean_ttft_ms"] == pytest.approx(out["ttft_mean"] * 1e3)
