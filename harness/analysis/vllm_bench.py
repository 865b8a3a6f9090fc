"""A run's figures under ``vllm bench serve``'s result names and units (``vllm_bench.json``).

vLLM's ``vllm/benchmarks/serve.py`` saves a JSON (``--save-result``) of the run's set-up
(``num_prompts``, ``request_rate``, ``burstiness``, ``max_concurrency``, ``model_id``) merged
with ``benchmark()``'s ``result`` dict: counts, throughputs per second, and for each latency
metric ``mean_<m>_ms``, ``median_<m>_ms`` and ``p<p>_<m>_ms`` (one per ``--metric-percentiles``,
default ``99``), in milliseconds. kvbench computes the same figures the same way
(docs/results.md), so ``vllm_summary`` renames and rescales them; a vLLM key kvbench has no
figure for is left out, never invented. docs/results.md lists every key written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# kvbench latency -> vLLM metric name; kvbench's p50 is vLLM's median (numpy.percentile, linear).
LATENCIES = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"}
STATS = {"mean": "mean", "p50": "median", "p90": "p90", "p99": "p99"}
# Arrival processes whose ``rate`` is requests per second (harness.workload.distributions);
# an offline batch is vLLM's ``--request-rate inf``, which its JSON writes as the string "inf".
RATED_ARRIVALS = ("Poisson", "Gamma", "Constant")
OFFLINE_ARRIVAL = "AllAtOnce"
# Generators whose arrival process draws requests (multi_turn's draws conversations).
PER_REQUEST_GENERATORS = ("synthetic", "shared_prefix")


def vllm_summary(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of a run's ``summary`` (as ``harness.cli.run.run`` writes it) under ``vllm bench
    serve``'s result keys: latencies in ms, token totals recovered from the throughputs.
    NaN stays NaN (written as null, as in summary.json)."""
    s = summary
    arrival = _arrival(s.get("trace_metadata", {}))
    out: dict[str, Any] = {
        "model_id": s["model_name"],
        "num_prompts": s["num_requests"],
        "request_rate": _request_rate(arrival),
        "burstiness": _burstiness(arrival),
        "max_concurrency": None,  # kvbench's replay never caps requests in flight
        "duration": s["duration"],
        "completed": s["completed"],
        "failed": s["aborted"],
        "total_input_tokens": _total(s["total_token_throughput"] - s["output_throughput"], s),
        "total_output_tokens": _total(s["output_throughput"], s),
        "request_throughput": s["request_throughput"],
        "request_goodput": s["goodput"],
        "output_throughput": s["output_throughput"],
        "total_token_throughput": s["total_token_throughput"],
    }
    for ours, theirs in LATENCIES.items():
        for stat, name in STATS.items():
            out[f"{name}_{theirs}_ms"] = s[f"{ours}_{stat}"] * 1e3
    return out


def _total(rate: float, summary: Mapping[str, Any]) -> int | None:
    """Σ tokens of completed requests: the rate times the duration it was divided by."""
    total = rate * summary["duration"]
    return round(total) if math.isfinite(total) else None


def _arrival(metadata: Mapping[str, Any]) -> Mapping[str, Any]:
    if metadata.get("generator") not in PER_REQUEST_GENERATORS:
        return {}
    return metadata.get("parameters", {}).get("arrival", {})


def _request_rate(arrival: Mapping[str, Any]) -> float | str | None:
    rate = arrival.get("rate") if arrival.get("type") in RATED_ARRIVALS else None
    if arrival.get("type") == OFFLINE_ARRIVAL or rate == math.inf:
        return "inf"
    return rate


def _burstiness(arrival: Mapping[str, Any]) -> float | None:
    return {"Poisson": 1.0, "Gamma": arrival.get("burstiness")}.get(arrival.get("type"))
