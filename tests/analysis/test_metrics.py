"""Result tables and the summary: hand-checked values and an independent loop recomputation."""

from __future__ import annotations

import math
import random

import pandas as pd
import pytest

from harness.analysis.metrics import (
    CLOCKS,
    REQUEST_COLUMNS,
    STEP_COLUMNS,
    SUMMARY_KEYS,
    MetricsError,
    abort_reasons,
    decode_stalls,
    decode_step_time,
    format_summary,
    requests_frame,
    steps_frame,
    summarize,
)
from harness.engine.clock import CLOCKS as ENGINE_CLOCKS
from harness.engine.modelled import ModelClock

NAN = math.nan


def _request(rid, arrival, times, *, reason="length", ttft_slo=NAN, tpot_slo=NAN, **kw):
    row = {
        "request_id": rid,
        "priority": 0,
        "arrival_time": arrival,
        "first_scheduled_time": arrival,
        "first_token_time": times[0] if times else NAN,
        "finish_time": times[-1] if times else arrival,
        "prompt_tokens": 10,
        "output_tokens": len(times),
        "cached_tokens": 0,
        "forked_tokens": 0,
        "preemptions": 0,
        "finish_reason": reason,
        "abort_reason": "client" if reason == "abort" else None,
        "ttft_slo": ttft_slo,
        "tpot_slo": tpot_slo,
        "token_times": list(times),
        "spec_proposed": 0,
        "spec_accepted": 0,
    }
    return {**row, **kw}


def _step(i, tokens, future, internal, external, total=100, **kw):
    row = dict.fromkeys(STEP_COLUMNS, 0)
    row.update(
        step=i, start_time=float(i), duration=1.0, forward_time=0.5, external_fragmentation=0.0
    )
    row.update(slots_tokens=tokens, slots_future=future, slots_internal=internal)
    row.update(slots_external=external, slots_total=total)
    return {**row, **kw}


@pytest.fixture
def hand_tables():
    requests = [
        # TTFT 1.0, TPOT 2/4 = 0.5: meets both SLOs
        _request("a", 0.0, [1.0, 1.5, 2.0, 2.5, 3.0], ttft_slo=1.5, tpot_slo=0.6),
        # one output token: no TPOT (its SLO counts as met, TPOT 0 as in vLLM)
        _request("b", 1.0, [1.5], tpot_slo=0.01, prompt_tokens=20, cached_tokens=16),
        # TTFT 2.0 misses its SLO; TPOT 1.0
        _request("c", 2.0, [4.0, 5.0, 6.0], ttft_slo=1.0, preemptions=2),
        # aborted: counted, but its TTFT 0.2 / ITL 0.1 must not enter the latencies
        _request("d", 0.5, [0.7, 0.8], reason="abort", finish_time=7.0),
    ]
    # Steps of 1, 3 and 2 s: means over time weigh them so (per-step means would not).
    steps = [
        _step(0, 10, 20, 5, 5, blocks_used=4, mlx_peak_bytes=100, spec_proposed=4,
              spec_rejected=1, spec_verifications=1, block_refs=8, blocks_shared=4,
              batch_size=4),
        _step(1, 30, 10, 10, 0, duration=3.0, blocks_used=6, mlx_peak_bytes=300, batch_size=2,
              external_fragmentation=0.5, spec_proposed=8, spec_accepted=6, spec_rejected=1,
              spec_verifications=2, block_refs=6),
        _step(2, 0, 0, 0, 0, duration=2.0, blocks_used=0, mlx_peak_bytes=200),
    ]  # fmt: skip
    return requests_frame(requests), steps_frame(steps)


def test_hand_built_latencies(hand_tables):
    s = summarize(*hand_tables, clock="virtual")
    assert s["ttft_mean"] == pytest.approx(3.5 / 3) and s["ttft_p50"] == 1.0
    assert s["tpot_mean"] == pytest.approx(0.75) and s["tpot_p50"] == pytest.approx(0.75)
    assert s["itl_mean"] == pytest.approx(4 / 6) and s["itl_p50"] == pytest.approx(0.5)
    assert s["e2e_mean"] == pytest.approx(7.5 / 3) and s["e2e_p99"] == pytest.approx(3.98)
    assert s["ttft_p90"] == pytest.approx(1.8)  # numpy linear interpolation over 0.5, 1, 2


def test_hand_built_throughput_goodput_and_counts(hand_tables):
    s = summarize(*hand_tables, clock="wall")
    assert (s["completed"], s["aborted"], s["clock"]) == (3, 1, "wall")
    assert s["duration"] == 7.0
    assert s["output_throughput"] == pytest.approx(9 / 7)
    assert s["total_token_throughput"] == pytest.approx((9 + 40) / 7)
    assert s["request_throughput"] == pytest.approx(3 / 7)
    assert s["goodput"] == pytest.approx(2 / 7)
    assert s["prefix_hit_rate"] == pytest.approx(16 / 50)
    assert s["preemptions"] == 2


def test_hand_built_memory_and_spec(hand_tables):
    s = summarize(*hand_tables, clock="virtual")
    # Time-weighted over 6 s: tokens 10 % for 1 s, 30 % for 3 s, 0 % for 2 s.
    assert s["kv_tokens_frac_mean"] == pytest.approx((0.1 + 0.9) / 6)
    assert s["kv_free_frac_mean"] == pytest.approx((0.6 + 3 * 0.5 + 2 * 1.0) / 6)
    peak = [s[f"kv_{p}_frac_peak"] for p in ("tokens", "future", "internal", "external", "free")]
    assert peak == pytest.approx([0.3, 0.1, 0.1, 0.0, 0.5])
    assert s["kv_utilisation"] == pytest.approx((10 + 3 * 30) / (35 + 3 * 50))
    assert (s["blocks_used_peak"], s["blocks_used_mean"]) == (6, pytest.approx((4 + 18) / 6))
    assert s["batch_size_mean"] == pytest.approx((4 + 3 * 2) / 6)  # requests batched, over time
    assert s["external_fragmentation_mean"] == pytest.approx(1.5 / 6)
    # Sharing: 4 of 8 table entries shared for 1 s, none of 6 for 3 s (vLLM paper, 6.3).
    assert s["kv_sharing_saving"] == pytest.approx(4 / (8 + 3 * 6))
    # Leviathan et al.: 6 accepted, 2 verifications stopped at a rejection -> alpha 6/8;
    # 3 verifications gave 6 + 3 tokens; vLLM's draft acceptance: 6 of 12 proposed.
    assert s["spec_acceptance_rate"] == pytest.approx(0.75)
    assert s["spec_tokens_per_verification"] == pytest.approx(3.0)
    assert s["spec_draft_acceptance_rate"] == pytest.approx(0.5)
    assert (s["mlx_peak_bytes"], s["num_steps"]) == (300, 3)


def test_decode_stalls_count_the_token_gaps_a_prompt_made_long():
    """Hand-computed: decode-only steps of 0.1 s and 0.3 s (median 0.1), one 1.2 s step that
    also ran a 512-token prompt. Request a decodes through it; b's gaps are all decode-only;
    c was aborted (not counted, as ITL). At 5 x 0.1 s only a's 1.2 s gap is a stall."""
    steps = steps_frame(
        [
            _step(0, 0, 0, 0, 0, duration=0.1, decode_tokens=2),
            _step(1, 0, 0, 0, 0, duration=0.1, decode_tokens=2),
            _step(2, 0, 0, 0, 0, duration=1.2, decode_tokens=2, prefill_tokens=512),
            _step(3, 0, 0, 0, 0, duration=0.3, decode_tokens=2),
            _step(4, 0, 0, 0, 0, duration=0.5, prefill_tokens=64),
        ]
    )
    assert decode_step_time(steps) == pytest.approx(0.1)  # median of 0.1, 0.1, 0.3
    requests = requests_frame(
        [
            _request("a", 0.0, [0.1, 0.2, 1.4, 1.7]),  # gaps 0.1, 1.2, 0.3
            _request("b", 0.0, [0.1, 0.2, 0.2, 0.5]),  # gaps 0.1, 0.3 (one chunk at 0.2)
            _request("c", 0.0, [0.1, 1.4], reason="abort"),
        ]
    )
    assert decode_stalls(requests, 5 * decode_step_time(steps)) == 1
    assert decode_stalls(requests, 0.2) == 3  # 1.2 and both 0.3 gaps
    assert math.isnan(decode_step_time(steps.iloc[[4]]))  # no decode-only step


def test_itl_is_per_chunk_as_vllm_bench_serve():
    """Tokens one step produced together (accepted drafts) arrive as one chunk: one ITL."""
    req = requests_frame([_request("a", 0.0, [1.0, 2.0, 2.0, 2.0, 4.0])])
    s = summarize(req, steps_frame([]), clock="virtual")
    assert s["itl_mean"] == pytest.approx(1.5) and s["itl_p50"] == pytest.approx(1.5)
    assert s["tpot_mean"] == pytest.approx(3.0 / 4)  # TPOT still counts every token


def test_empty_run_is_nan_safe():
    s = summarize(requests_frame([]), steps_frame([]), clock="virtual")
    assert list(s) == list(SUMMARY_KEYS)
    assert math.isnan(s["ttft_p99"]) and math.isnan(s["goodput"]) and s["completed"] == 0
    assert "n/a" in format_summary(s)


def test_missing_column_and_bad_values_are_named():
    row = _request("a", 0.0, [1.0])
    with pytest.raises(MetricsError, match=r"missing column\(s\) \['cached_tokens'\]"):
        requests_frame([{k: v for k, v in row.items() if k != "cached_tokens"}])
    with pytest.raises(MetricsError, match="row 1: column 'output_tokens' must be int"):
        requests_frame([row, {**row, "output_tokens": 1.5}])
    with pytest.raises(MetricsError, match="row 0: finish_reason must be one of"):
        requests_frame([{**row, "finish_reason": "eos"}])
    with pytest.raises(MetricsError, match="row 0: token_times needs one time per output token"):
        requests_frame([{**row, "token_times": [1.0, 2.0]}])
    with pytest.raises(MetricsError, match="steps table row 0: column 'slots_total' must be int"):
        steps_frame([_step(0, 1, 1, 1, 1, total="lots")])
    with pytest.raises(ValueError, match="clock must be one of"):
        summarize(requests_frame([row]), steps_frame([]), clock="cpu")


def test_parquet_round_trip_and_extra_columns_kept(tmp_path, hand_tables):
    requests, _ = hand_tables
    requests.to_parquet(tmp_path / "r.parquet")
    back = requests_frame(pd.read_parquet(tmp_path / "r.parquet"))
    assert [list(t) for t in back["token_times"]] == requests["token_times"].tolist()
    assert back["abort_reason"].tolist() == [None, None, None, "client"]
    steps = steps_frame([_step(0, 1, 1, 1, 1, kernel_time=0.1)])
    assert list(steps.columns) == [*STEP_COLUMNS, "kernel_time"]
    assert tuple(back.columns) == REQUEST_COLUMNS


# ----------------------------------------------------- independent recomputation with loops


def _percentile(values, q):
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _reference(reqs, steps, clock):
    out = {}
    done = [r for r in reqs if r["finish_reason"] != "abort"]
    series = {"ttft": [], "tpot": [], "itl": [], "e2e": []}
    good = 0
    for r in done:
        ttft = r["first_token_time"] - r["arrival_time"]
        e2e = r["finish_time"] - r["arrival_time"]
        tpot = (e2e - ttft) / (r["output_tokens"] - 1) if r["output_tokens"] > 1 else 0.0
        series["ttft"].append(ttft)
        series["e2e"].append(e2e)
        if r["output_tokens"] > 1:
            series["tpot"].append(tpot)
        for prev, nxt in zip(r["token_times"], r["token_times"][1:], strict=False):
            if nxt > prev:  # tokens of one step are one chunk
                series["itl"].append(nxt - prev)
        ok_ttft = math.isnan(r["ttft_slo"]) or ttft <= r["ttft_slo"]
        ok_tpot = math.isnan(r["tpot_slo"]) or tpot <= r["tpot_slo"]
        good += ok_ttft and ok_tpot
    for name, xs in series.items():
        out[f"{name}_mean"] = sum(xs) / len(xs) if xs else NAN
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = _percentile(xs, q) if xs else NAN
    duration = max(r["finish_time"] for r in reqs) - min(r["arrival_time"] for r in reqs)
    out.update(duration=duration, completed=len(done), aborted=len(reqs) - len(done))
    out["output_throughput"] = sum(r["output_tokens"] for r in done) / duration
    out["total_token_throughput"] = (
        sum(r["output_tokens"] + r["prompt_tokens"] for r in done) / duration
    )
    out["request_throughput"] = len(done) / duration
    out["goodput"] = good / duration
    names = ("tokens", "future", "internal", "external")
    fracs = {p: [] for p in (*names, "free")}
    best, peak = -1, None
    for s in steps:
        parts = {p: s[f"slots_{p}"] for p in names}
        parts["free"] = s["slots_total"] - sum(parts.values())
        for p, v in parts.items():
            fracs[p].append(v / s["slots_total"])
        allocated = parts["tokens"] + parts["future"] + parts["internal"]
        if allocated > best:
            best, peak = allocated, {p: v / s["slots_total"] for p, v in parts.items()}
    weights = [s["duration"] for s in steps]
    time = sum(weights)

    def over_time(xs):
        return sum(w * x for w, x in zip(weights, xs, strict=True)) / time if time else NAN

    for p, xs in fracs.items():
        out[f"kv_{p}_frac_mean"] = over_time(xs)
        out[f"kv_{p}_frac_peak"] = peak[p]
    allocated = over_time(
        [s["slots_tokens"] + s["slots_future"] + s["slots_internal"] for s in steps]
    )
    tokens = over_time([s["slots_tokens"] for s in steps])
    out["kv_utilisation"] = tokens / allocated if allocated > 0 else NAN
    out["blocks_used_peak"] = max(s["blocks_used"] for s in steps)
    out["blocks_used_mean"] = over_time([s["blocks_used"] for s in steps])
    out["window_blocks_used_peak"] = max(s["window_blocks_used"] for s in steps)
    out["batch_size_mean"] = over_time([s["batch_size"] for s in steps])
    out["external_fragmentation_mean"] = over_time([s["external_fragmentation"] for s in steps])
    shared, refs = (over_time([s[k] for s in steps]) for k in ("blocks_shared", "block_refs"))
    out["kv_sharing_saving"] = shared / refs if refs > 0 else math.nan
    ids = {r["request_id"] for r in reqs}

    def root(rid):  # completion k > 0 of a request with n > 1 is "ID/k"
        parent, _, k = rid.rpartition("/")
        return parent if k.isdigit() and parent in ids else rid

    groups = {}
    for r in reqs:
        groups.setdefault(root(r["request_id"]), []).append(r["finish_reason"] != "abort")
    out["completed_requests"] = sum(all(g) for g in groups.values())
    lookups = [r for r in reqs if r["forked_tokens"] == 0]
    out["prefix_hit_rate"] = sum(r["cached_tokens"] for r in lookups) / sum(
        r["prompt_tokens"] for r in lookups
    )
    for tier in ("device", "host", "disk"):
        hits = sum(r.get(f"cached_tokens_{tier}", r["cached_tokens"] * (tier == "device"))
                   for r in lookups)  # fmt: skip
        out[f"prefix_hit_rate_{tier}"] = hits / sum(r["prompt_tokens"] for r in lookups)
    for verb in ("loaded", "written"):
        moved = sum(s[f"{t}_bytes_{verb}"] for s in steps for t in ("host", "disk"))
        out[f"tier_bytes_{verb}"] = moved
    out["preemptions"] = sum(r["preemptions"] for r in reqs)
    proposed = sum(s["spec_proposed"] for s in steps)
    accepted = sum(s["spec_accepted"] for s in steps)
    rejected = sum(s["spec_rejected"] for s in steps)
    verifications = sum(s["spec_verifications"] for s in steps)
    out["spec_acceptance_rate"] = accepted / (accepted + rejected) if accepted + rejected else NAN
    out["spec_draft_acceptance_rate"] = accepted / proposed if proposed else NAN
    out["spec_tokens_per_verification"] = (
        (accepted + verifications) / verifications if verifications else NAN
    )
    out["mlx_peak_bytes"] = max(s["mlx_peak_bytes"] for s in steps)
    out.update(num_steps=len(steps), clock=clock)
    return out


def _random_tables(seed):
    rng = random.Random(seed)
    reqs = []
    for i in range(rng.randint(1, 40)):
        arrival = rng.uniform(0, 10)
        t = arrival + rng.uniform(0, 2)
        times = []
        for _ in range(rng.choice([1, 1, 2, rng.randint(3, 30)])):
            times.append(t)
            t += rng.choice([0.0, rng.expovariate(20)])  # 0: several tokens in one step
        abort = rng.random() < 0.15
        fork = i and rng.random() < 0.2
        prompt = rng.randint(1, 500)
        host, disk = rng.choice([(0, 0), (rng.randint(0, 16), rng.randint(0, 16))])
        reqs.append(
            _request(
                f"r{rng.randrange(i)}/{i}" if fork else f"r{i}",  # a completion 1..
                arrival,
                times,
                reason="abort" if abort else "stop",
                ttft_slo=rng.choice([NAN, rng.uniform(0, 2)]),
                tpot_slo=rng.choice([NAN, rng.uniform(0, 0.1)]),
                prompt_tokens=prompt,
                cached_tokens=(cached := rng.randint(0, 1) + host + disk),
                cached_tokens_device=cached - host - disk,
                cached_tokens_host=host,
                cached_tokens_disk=disk,
                forked_tokens=prompt if fork and rng.random() < 0.8 else 0,  # else: no room
                preemptions=rng.randint(0, 2),
            )
        )
    steps = []
    for i in range(rng.randint(1, 30)):
        total = rng.randint(64, 512)
        a, b, c, d = sorted(rng.randint(0, total) for _ in range(4))
        proposed = rng.choice([0, rng.randint(1, 8)])
        verifications = rng.randint(1, proposed) if proposed else 0
        accepted = rng.randint(0, proposed)
        steps.append(
            _step(
                i,
                a,
                b - a,
                c - b,
                d - c,
                total=total,
                blocks_used=rng.randint(0, 32),
                block_refs=(refs := rng.randint(0, 32)),
                blocks_shared=rng.randint(0, refs),
                external_fragmentation=rng.random(),
                mlx_peak_bytes=rng.randint(0, 10**9),
                duration=rng.choice([rng.uniform(0.001, 2.0), 0.0]),
                spec_proposed=proposed,
                spec_accepted=accepted,
                spec_rejected=min(verifications, proposed - accepted),
                spec_verifications=verifications,
                **{c: rng.choice([0, rng.randint(0, 8)]) for c in TIER_BLOCKS},
            )
        )
        for c in TIER_BLOCKS:
            steps[-1][c.replace("blocks", "bytes")] = steps[-1][c] * 4096
    return reqs, steps


TIER_BLOCKS = ("host_blocks_loaded", "disk_blocks_loaded", "host_blocks_written",
               "disk_blocks_written")  # fmt: skip


@pytest.mark.parametrize("seed", range(25))
def test_every_summary_key_matches_an_independent_loop(seed):
    reqs, steps = _random_tables(seed)
    got = summarize(requests_frame(reqs), steps_frame(steps), clock="virtual")
    want = _reference(reqs, steps, "virtual")
    assert list(got) == list(SUMMARY_KEYS) and set(want) == set(SUMMARY_KEYS)
    for key in SUMMARY_KEYS:
        if isinstance(want[key], str):
            assert got[key] == want[key]
        elif isinstance(want[key], float) and math.isnan(want[key]):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
    assert "KV slots (peak)" in format_summary(got)


def test_abort_reasons_group_reasons_that_differ_only_in_numbers() -> None:
    long = "prompt of {} tokens exceeds max_model_len=8"
    rows = [
        _request("a", 0.0, [], reason="abort", abort_reason=long.format(9)),
        _request("b", 0.0, [], reason="abort", abort_reason=long.format(40)),
        _request("c", 0.0, [], reason="abort", abort_reason=long.format(12)),
        _request("d", 0.0, [], reason="abort", abort_reason="prompt logprobs need 3 slots"),
        _request("e", 0.0, [1.0]),
    ]
    assert abort_reasons(requests_frame(rows)) == [
        (3, "prompt of 9-40 tokens exceeds max_model_len=8"),
        (1, "prompt logprobs need 3 slots"),
    ]


def test_prefix_hit_rate_counts_only_prefix_cache_hits():
    """Completion 1 of a request with n = 2 holds its prompt's KV by a fork: no lookup.
    Completion 2 found no room to fork, waited and looked its prompt up (4 of 10 hit)."""
    rows = [
        _request("a", 0.0, [1.0], cached_tokens=4),
        _request("a/1", 0.0, [1.0], forked_tokens=10),
        _request("a/2", 0.0, [1.0], cached_tokens=4),
        _request("b", 0.0, [1.0], cached_tokens=0),
    ]
    s = summarize(requests_frame(rows), steps_frame([]), clock="virtual")
    assert s["prefix_hit_rate"] == pytest.approx((4 + 4) / 30)


def test_completed_requests_counts_requests_not_their_completions():
    rows = [
        _request("a", 0.0, [1.0]),
        _request("a/1", 0.0, [1.0]),
        _request("b", 0.0, [1.0]),
        _request("b/1", 0.0, [], reason="abort"),
        _request("c/1", 0.0, [1.0]),  # a trace id with a slash: no request "c"
    ]
    s = summarize(requests_frame(rows), steps_frame([]), clock="virtual")
    assert (s["completed"], s["completed_requests"]) == (4, 2)


def test_the_clock_names_are_the_engines() -> None:
    assert set(CLOCKS) == {*ENGINE_CLOCKS, ModelClock.name}
