"""Trace generators, distributions, max_prefix_hit_rate and trace files."""

from __future__ import annotations

import json
import math
from array import array

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.cli.run import check
from harness.workload.distributions import (
    AllAtOnce,
    Constant,
    Fixed,
    Gamma,
    LogNormal,
    Poisson,
    ShareGPT,
    Uniform,
    Zipf,
)
from harness.workload.generators import multi_turn, shared_prefix, synthetic
from harness.workload.traces import (
    Trace,
    TraceError,
    TraceRequest,
    from_file,
    load,
    max_prefix_hit_rate,
    prefix_hit_bounds,
    save,
    token_array,
    token_arrays,
)


def _synthetic(seed: int = 0):
    return synthetic(
        num_requests=50,
        seed=seed,
        vocab_size=1000,
        arrival=Gamma(rate=4.0, burstiness=0.5),
        prompt_len=ShareGPT("prompt", max=256),
        output_len=Uniform(1, 16),
        priorities=[{"priority": 0, "weight": 0.7}, {"priority": 1, "weight": 0.3}],
        slos={1: {"ttft": 0.5, "tpot": 0.05}},
    )


@pytest.mark.parametrize(
    "make",
    [
        _synthetic,
        lambda seed=0: shared_prefix(3, 4, 16, Uniform(1, 8), Fixed(4), Poisson(2.0), seed, 500),
        lambda seed=0: multi_turn(3, 4, Fixed(3), Uniform(1, 5), Constant(1.0), 2.0, seed, 500),
    ],
)
def test_same_seed_gives_identical_trace(make):
    assert make(seed=7) == make(seed=7)
    assert make(seed=7).requests != make(seed=8).requests


def test_trace_is_sorted_with_valid_tokens_and_slos_per_class():
    trace = _synthetic()
    times = [r.arrival_time for r in trace]
    assert times == sorted(times) and times[0] == 0.0
    assert all(1 <= t < 1000 for r in trace for t in r.prompt_token_ids)
    assert {r.priority for r in trace} == {0, 1}
    for r in trace:
        expected = (0.5, 0.05) if r.priority == 1 else (None, None)
        assert (r.ttft_slo, r.tpot_slo) == expected
    json.dumps(trace.metadata)  # must be storable in the file header


@pytest.mark.parametrize("process", [Poisson(5.0), Gamma(5.0, 0.3), Gamma(5.0, 3.0), Constant(5.0)])
def test_arrival_rate(process):
    times = process.sample(20_000, np.random.default_rng(0))
    assert np.all(np.diff(times) >= 0)
    assert (len(times) - 1) / times[-1] == pytest.approx(5.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness_sets_cv2(burstiness):
    gaps = np.diff(Gamma(2.0, burstiness).sample(50_000, np.random.default_rng(1)))
    assert np.var(gaps) / np.mean(gaps) ** 2 == pytest.approx(1 / burstiness, rel=0.1)


def test_all_at_once_and_empty_samples():
    rng = np.random.default_rng(0)
    assert AllAtOnce().sample(5, rng).tolist() == [0.0] * 5
    assert Poisson(1.0).sample(0, rng).size == 0


@pytest.mark.parametrize(
    ("dist", "low", "high"),
    [
        (Fixed(7), 7, 7),
        (Uniform(3, 9), 3, 9),
        (LogNormal(mean=100, sigma=1.5, min=2, max=300), 2, 300),
        (LogNormal(median=5, sigma=2.0), 1, None),
        (Zipf(a=1.1, min=4, max=64), 4, 64),
        (ShareGPT("prompt"), 1, 2048),
        (ShareGPT("output", max=512), 1, 512),
    ],
)
def test_lengths_within_bounds(dist, low, high):
    x = dist.sample(10_000, np.random.default_rng(0))
    assert x.dtype.kind == "i" and x.min() >= low and x.min() >= 1
    if high is not None:
        assert x.max() <= high


def test_lognormal_and_sharegpt_hit_their_centre():
    rng = np.random.default_rng(0)
    assert np.median(LogNormal(median=50, sigma=0.5).sample(20_000, rng)) == pytest.approx(50, 0.05)
    assert LogNormal(mean=50, sigma=0.5).sample(20_000, rng).mean() == pytest.approx(50, 0.05)
    # Clipping at 2048 trims the tail only slightly below the published mean of 161.31.
    assert ShareGPT("prompt").sample(50_000, rng).mean() == pytest.approx(161.31, rel=0.05)


@pytest.mark.parametrize(
    "bad",
    [lambda: Uniform(0, 3), lambda: Poisson(0.0), lambda: Poisson(math.nan), lambda: Zipf(0.0)],
)
def test_invalid_parameters_fail_at_construction(bad):
    with pytest.raises(ValueError):
        bad()


@pytest.mark.parametrize(
    ("trace", "key"),
    [
        ("poisson", "trace.num_requests"),
        ("mooncake_like", "trace.num_requests"),
        ("chat", "trace.num_requests"),
        ("multi_turn", "trace.num_conversations"),
        ("shared_prefix", "trace.users_per_prompt"),
    ],
)
def test_a_negative_count_names_its_key(compose_cfg, trace, key):
    with pytest.raises(ValueError, match=rf"^{key}=-3 is invalid: a count >= 0$"):
        check(compose_cfg([f"trace={trace}", f"{key}=-3"]))


@pytest.mark.parametrize("process", [Poisson, Constant, lambda rate: Gamma(rate, 0.25)])
def test_an_infinite_rate_puts_the_same_requests_at_t0(process):
    def trace(rate: float):
        return synthetic(20, 3, 1000, process(rate), Uniform(1, 64), Uniform(1, 16))

    offline, online = trace(math.inf), trace(4.0)
    assert [r.arrival_time for r in offline] == [0.0] * 20
    assert len({r.arrival_time for r in online}) == 20
    same = [(r.request_id, r.prompt_token_ids, r.max_tokens) for r in offline]
    assert same == [(r.request_id, r.prompt_token_ids, r.max_tokens) for r in online]


def _req(i: int, ids: tuple[int, ...], t: float = 0.0) -> TraceRequest:
    return TraceRequest(f"r{i}", t, ids, 1)


def test_max_prefix_hit_rate_by_hand():
    reqs = [_req(0, (1, 2, 3, 4)), _req(1, (1, 2, 3, 5)), _req(2, (1, 2, 3, 4)), _req(3, (9,))]
    # hits: 0, lcp 3, identical -> capped at len-1 = 3, 0; over 4+4+4+1 tokens
    assert max_prefix_hit_rate(reqs) == 6 / 13
    assert max_prefix_hit_rate(reqs, block_size=2) == 4 / 13
    assert max_prefix_hit_rate([]) == 0.0


def test_prefix_hit_bounds_by_hand_past_a_later_prompt_between():
    """A later prompt sorts between a prompt and the earlier one it shares most with: the
    shared prefix is the least of the neighbours' between them."""
    reqs = [_req(0, (1, 1, 1, 1)), _req(1, (1, 1, 5)), _req(2, (1, 1, 1, 2))]
    # sorted: r0, r2, r1. r1 shares (1, 1) with r0 (r2 between, later); r2 shares (1, 1, 1)
    # with r0. Hits 0, 2 (capped at len-1 = 2), 3; in blocks of 2: 0, 2, 2; of 11 tokens.
    assert prefix_hit_bounds(reqs, 2) == (5 / 11, 4 / 11)
    assert prefix_hit_bounds([], 2) == (0.0, 0.0)


def test_shared_prefix_hit_rate_matches_hand_computation():
    # 2 system prompts x 3 users, 8 system + 2 user tokens each: every request but the first
    # of each system prompt hits its 8 system tokens (a vast vocab makes user collisions
    # impossible in practice): 4 * 8 / (6 * 10).
    trace = shared_prefix(2, 3, 8, Fixed(2), Fixed(1), AllAtOnce(), 0, 10**9)
    assert trace.metadata["max_prefix_hit_rate"] == pytest.approx(32 / 60)
    assert max_prefix_hit_rate(trace.requests, block_size=4) == pytest.approx(32 / 60)
    assert max_prefix_hit_rate(trace.requests, block_size=3) == pytest.approx(24 / 60)
    by_sys: dict[str, set] = {}
    for r in trace:
        by_sys.setdefault(r.request_id.split("-")[0], set()).add(tuple(r.prompt_token_ids[:8]))
    assert len(by_sys) == 2 and all(len(v) == 1 for v in by_sys.values())


def test_multi_turn_prompts_extend_the_previous_turn():
    trace = multi_turn(4, 3, Uniform(1, 6), Uniform(1, 4), Poisson(1.0), 3.0, 0, 100)
    by_id = {r.request_id: r for r in trace}
    for c in range(4):
        for k in range(1, 3):
            prev, cur = by_id[f"conv{c}-turn{k - 1}"], by_id[f"conv{c}-turn{k}"]
            assert cur.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
            assert len(cur.prompt_token_ids) > len(prev.prompt_token_ids) + prev.max_tokens
            assert cur.arrival_time >= prev.arrival_time
    assert trace.metadata["max_prefix_hit_rate"] > 0


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    trace = _synthetic()
    save(trace, tmp_path / f"t{suffix}")
    assert load(tmp_path / f"t{suffix}") == trace
    assert from_file(str(tmp_path / f"t{suffix}")).requests == trace.requests
    assert [p.name for p in tmp_path.iterdir()] == [f"t{suffix}"]  # no temp file left behind


GOOD = {"request_id": "a", "arrival_time": 0.0, "prompt_token_ids": [1, 2], "max_tokens": 2}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"max_tokens": None}, "field 'max_tokens' is missing"),
        ({"arrival_time": "soon"}, "field 'arrival_time' must be a finite number"),
        ({"arrival_time": -1.0}, "field 'arrival_time' is negative"),
        ({"prompt_token_ids": []}, "field 'prompt_token_ids' is empty"),
        ({"max_tokens": 0}, "field 'max_tokens' is 0; it must be an integer >= 1"),
        ({"prompt_token_ids": [1, -3]}, r"field 'prompt_token_ids\[1\]' is -3"),
        ({"prompt_token_ids": [1, 2.5]}, r"field 'prompt_token_ids\[1\]' is 2.5"),
        ({"max_token": 3}, "field 'max_token' is unknown"),
        ({"ttft_slo": -1}, "field 'ttft_slo' must be a number of seconds > 0"),
        ({"ignore_eos": "no"}, "field 'ignore_eos' must be true, false or null"),
        ({"after": 3}, "field 'after' must be an earlier request's id or null"),
        ({"after": "b"}, "field 'after' 'b' names no earlier request"),
    ],
)
def test_jsonl_errors_name_line_and_field(tmp_path, change, match):
    bad = {k: v for k, v in {**GOOD, "request_id": "b", **change}.items() if v is not None}
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [{"metadata": {}}, GOOD, bad]) + "\n")
    with pytest.raises(TraceError, match=f"t.jsonl line 3: {match}"):
        load(path)


def test_jsonl_duplicate_unsorted_and_invalid_json(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(TraceError, match=r"line 2: field 'request_id' 'a' duplicates .*line 1"):
        load(path)
    later = {**GOOD, "arrival_time": 5.0}
    path.write_text(json.dumps(later) + "\n" + json.dumps({**GOOD, "request_id": "b"}) + "\n")
    with pytest.raises(TraceError, match="line 2: field 'arrival_time' 0.0 is earlier.*sort"):
        load(path)
    path.write_text(json.dumps(GOOD) + "\n{oops\n")
    with pytest.raises(TraceError, match="line 2: invalid JSON"):
        load(path)


def test_parquet_errors_name_row_and_field(tmp_path):
    path = tmp_path / "t.parquet"
    rows = [GOOD, {**GOOD, "request_id": "b", "max_tokens": 0}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(TraceError, match="t.parquet row 1: field 'max_tokens' is 0"):
        load(path)
    pd.DataFrame([GOOD]).drop(columns="prompt_token_ids").to_parquet(path)
    with pytest.raises(TraceError, match="row 0: field 'prompt_token_ids' is missing"):
        load(path)
    pd.DataFrame([{**GOOD, "arrival_time": "0"}]).to_parquet(path)
    with pytest.raises(TraceError, match="row 0: field 'arrival_time' must be a finite number"):
        load(path)


def test_unknown_suffix_is_an_error(tmp_path):
    with pytest.raises(TraceError, match=r"use .jsonl or .parquet"):
        load(tmp_path / "t.csv")
    with pytest.raises(TraceError, match=r"use .jsonl or .parquet"):
        save(_synthetic(), tmp_path / "t.csv")


def test_hand_written_file_without_header_gets_its_hit_rate(tmp_path):
    path = tmp_path / "t.jsonl"
    second = {**GOOD, "request_id": "b", "prompt_token_ids": [1, 2, 3]}
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(second) + "\n")
    trace = load(path)
    assert [r.request_id for r in trace] == ["a", "b"]
    assert trace.metadata["max_prefix_hit_rate"] == pytest.approx(2 / 5)


def test_follow_up_turns_round_trip_and_keep_their_place_after_the_turn_before(tmp_path):
    first = TraceRequest("a", 5.0, (1, 2), 4, ignore_eos=False)
    turn = TraceRequest("a-1", 0.5, (3,), 4, ignore_eos=False, after="a")  # a think time
    other = TraceRequest("b", 6.0, (7, 8), 4)
    trace = Trace((first, turn, other), {})
    for suffix in (".jsonl", ".parquet"):
        save(trace, tmp_path / f"t{suffix}")
        assert load(tmp_path / f"t{suffix}").requests == trace.requests


def test_the_bound_counts_an_earlier_turns_answer_by_hand():
    a = TraceRequest("a", 0.0, (1, 2, 3, 4), 2)
    b = TraceRequest("b", 1.0, (1, 2, 3, 4, 5, 6, 7, 8), 2)  # a's prompt, a's answer, 7 8
    # Without the answer B shares A's 4 prompt tokens; with it, 6: of 4 + 8 prompt tokens.
    assert max_prefix_hit_rate([a, b]) == pytest.approx(4 / 12)
    assert max_prefix_hit_rate([a, b], answers={"a": (5, 6)}) == pytest.approx(6 / 12)
    assert max_prefix_hit_rate([a, b], 4, {"a": (5, 6)}) == pytest.approx(4 / 12)  # whole blocks
    # an answer is no help to its own prompt, nor to a prompt sent before it
    assert max_prefix_hit_rate([b, a], answers={"a": (5, 6)}) == pytest.approx(3 / 12)


def test_prompts_are_compact_arrays_of_the_vocabularys_width():
    flat = np.array([700, 900, 700, 5, 900, 700] * 200)
    a, b = token_arrays(flat, [2, 1198], vocab_size=1000)
    assert list(a) == [700, 900] and list(b) == [700, 5, 900, 700, *flat[6:].tolist()]
    assert a.itemsize == 2 and len(b) * 2 == len(b.tobytes())  # 2 bytes a token id
    assert a + b[:2] == array("H", [700, 900, 700, 5])  # one vocabulary: they concatenate
    (wide,) = token_arrays(np.array([70_000, 5]), [2], vocab_size=100_000)
    assert wide.itemsize == 4 and list(wide) == [70_000, 5]
    assert token_array([1, 2]).itemsize == 2 and token_array([1, 1 << 20]).itemsize == 4
    assert token_array(a) is a  # already compact: not copied
