"""Beam search (vLLM's ``LLM.beam_search``) over forked beams: the engine's results equal a
brute-force search that re-runs every beam through mlx_lm's full forward, for every
allocator, under memory pressure too; paged allocators share the beams' common blocks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from reference import beam_search_reference, mlx_lm_tokens
from support import ALLOCATORS, assert_all_free, build_with_policy

from harness.analysis.metrics import requests_frame, steps_frame, summarize
from harness.engine.beam_search import (
    BeamGroup,
    BeamSearchParams,
    Hypothesis,
    score,
    top_candidates,
)
from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams, SamplingParamsError

MAX_TOKENS = 6
PROMPT_LENS = (21, 40, 9)
PROMPT_SEED = 8


def engine(model, allocator, num_blocks=128, **kwargs):
    return build_with_policy(model, allocator, block_size=8, num_blocks=num_blocks, **kwargs)


def assert_matches(outputs, references):
    for out, ref in zip(outputs, references, strict=True):
        assert out.finished
        assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in ref]
        for c, (_, cum) in zip(out.outputs, ref, strict=True):
            assert c.cumulative_logprob == pytest.approx(cum, abs=1e-3)
        assert [c.index for c in out.outputs] == list(range(len(ref)))


# -- the search's arithmetic, by hand --------------------------------------------------------
def test_score_is_vllms_length_normalised_cumulative_logprob():
    # 10 prompt + 5 output tokens, the last EOS: length 14.
    assert score(15, -7.0, True, 1.0) == pytest.approx(-0.5)
    assert score(15, -7.5, False, 1.0) == pytest.approx(-0.5)
    assert score(16, -8.0, False, 0.5) == pytest.approx(-2.0)  # 16 ** 0.5 = 4
    assert score(16, -8.0, False, 0.0) == -8.0


def test_top_candidates_are_the_best_raw_logprobs_ties_by_token_id():
    logits = np.log(np.array([0.1, 0.4, 0.1, 0.4], dtype=np.float32))
    got = top_candidates(logits, 3)
    assert [t for t, _ in got] == [1, 3, 0]
    assert [lp for _, lp in got] == pytest.approx(np.log([0.4, 0.4, 0.1]), abs=1e-6)
    # A tie at the cut: the lowest ids of the tied tokens make it.
    tied = np.log(np.array([0.1, 0.4, 0.1, 0.3, 0.1], dtype=np.float32))
    assert [t for t, _ in top_candidates(tied, 3)] == [1, 3, 0]


def _seq(request_id, tokens, cum, num_prompt=2):
    seq = Seq(request_id, list(tokens), SamplingParams(), 0.0, num_prompt_tokens=num_prompt)
    seq.cumulative_logprob = cum
    return seq


def test_a_round_keeps_the_best_width_and_completes_eos_candidates():
    """Width 2, EOS = 9. Beam a (cum -1) offers 5 (-0.1), 9 (-0.2), 6 (-2), 7 (-3); beam b
    (cum -1.5) offers 9 (-0.05), 5 (-0.3), 6 (-0.4), 8 (-4). By hand: EOS candidates a+9
    (-1.2) and b+9 (-1.55) complete; the others rank a+5 -1.1, b+5 -1.8, b+6 -1.9, ...: the
    next beams are a+5 and b+5."""
    a, b = _seq("r", [1, 2, 3], -1.0), _seq("r/beam1", [1, 2, 4], -1.5)
    group = BeamGroup(BeamSearchParams(beam_width=2, length_penalty=1.0), (9,), a)
    group.go_on([a, b])
    offers = {a: {5: 0.1, 9: 0.2, 6: 2.0, 7: 3.0}, b: {9: 0.05, 5: 0.3, 6: 0.4, 8: 4.0}}
    for beam, cost in offers.items():
        logits = np.full(16, -1e9)
        for token, c in cost.items():
            logits[token] = -c
        # Each row's log-softmax is -cost + log Z: subtract it back out by hand below.
        assert group.offer(beam, logits) is (beam is b)
    z = {beam: math.log(sum(math.exp(-c) for c in cost.values())) for beam, cost in offers.items()}
    chosen = group.select(now=1.0)
    assert group.round_times == [1.0]
    assert [(p, t) for p, t, _ in chosen] == [(a, 5), (b, 5)]
    assert chosen[0][2] == pytest.approx(-1.0 - 0.1 - z[a])
    done = {tuple(h.output_token_ids): h for h in group.completed}
    assert set(done) == {(3, 9), (4, 9)}
    h = done[3, 9]
    assert h.finish_reason == "stop"
    # prompt 2 + output (3, 9) = 4 tokens, less the final EOS: length 3.
    assert h.score == pytest.approx((-1.0 - 0.2 - z[a]) / 3)


def test_finish_ranks_live_and_completed_beams_by_score():
    a = _seq("r", [1, 2, 3, 4], -2.0)  # output (3, 4): length 4, score -0.5
    group = BeamGroup(BeamSearchParams(beam_width=2), (9,), a)
    for output, cum in (([3, 9], -1.2), ([5, 9], -1.8)):  # length 3: scores -0.4, -0.6
        value = score(2 + len(output), cum, True, 1.0)
        group.completed.append(Hypothesis(output, cum, "stop", value))
    best = group.finish("length")
    assert [(h.output_token_ids, h.finish_reason) for h in best] == [
        ([3, 9], "stop"),
        ([3, 4], "length"),
    ]
    assert [h.score for h in best] == pytest.approx([-0.4, -0.5])


@pytest.mark.parametrize(
    "field, value",
    [("beam_width", 0), ("beam_width", 1.5), ("max_tokens", 0), ("length_penalty", math.inf)],
)
def test_bad_params_name_the_field(field, value):
    kwargs = {"beam_width": 2, field: value}
    with pytest.raises(SamplingParamsError, match=f"BeamSearchParams.{field}="):
        BeamSearchParams(**kwargs)


# -- the engine against brute force ----------------------------------------------------------
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_beam_search_equals_brute_force_for_every_allocator(model, prompts, allocator):
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    e = engine(model, allocator)
    outputs = e.generate(prompts, params)
    refs = [beam_search_reference(model, p, 3, MAX_TOKENS) for p in prompts]
    assert_matches(outputs, refs)
    assert_all_free(e)
    rows = e.recorder.requests
    assert sorted(r["request_id"] for r in rows) == ["gen-0", "gen-1", "gen-2"]
    assert all(r["output_tokens"] == len(r["token_times"]) == MAX_TOKENS for r in rows)
    shared = max(r["blocks_shared"] for r in e.recorder.steps)
    if allocator.__name__ in ("ContiguousAllocator", "BuddyAllocator"):
        assert shared == 0  # regions are copied at each fork, never shared
    else:
        assert shared > 0


def test_width_one_is_mlx_lms_greedy_generation(model, prompts):
    e = engine(model, ALLOCATORS[0])
    outputs = e.generate(prompts, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    for out, prompt in zip(outputs, prompts, strict=True):
        (only,) = out.outputs
        assert only.token_ids == mlx_lm_tokens(model, prompt, 8)


def test_eos_candidates_complete_and_the_length_penalty_ranks_them(model, prompts):
    """The EOS is a token the first round offers (the prompt's 2nd best), so hypotheses end
    early and compete with the live beams at the end, under two length penalties; with
    ignore_eos the EOS-ending beams go on, scored one token shorter (vLLM)."""
    prompt = prompts[0]
    from reference import mlx_lm_logprobs

    row = mlx_lm_logprobs(model, prompt)[-1]
    eos = int(np.argsort(-row)[1])
    for penalty, ignore_eos in [(0.0, False), (2.0, False), (1.0, True)]:
        e = engine(dataclasses.replace(model, eos_token_ids=(eos,)), ALLOCATORS[0])
        params = BeamSearchParams(2, MAX_TOKENS, ignore_eos=ignore_eos, length_penalty=penalty)
        (out,) = e.generate([prompt], params)
        ref = beam_search_reference(model, prompt, 2, MAX_TOKENS, (eos,), penalty, ignore_eos)
        assert_matches([out], [ref])
        assert_all_free(e)
        if penalty == 0.0:  # the raw cumulative logprob favours the 1-token hypothesis
            assert out.outputs[0].token_ids == [eos]
            assert out.outputs[0].finish_reason == "stop"
            assert out.outputs[0].text == ""


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_memory_pressure_preempts_parked_beams_and_the_result_holds(model, allocator, mode):
    """An arena too small for every beam of two searches at once: beams that offered wait
    parked while siblings are preempted and come back; nothing deadlocks, the results are
    still brute force's."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 1024, 30).tolist() for _ in range(2)]
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True)
    e = engine(model, allocator, num_blocks=10, preemption_mode=mode)
    outputs = e.generate(prompts, params)
    refs = [beam_search_reference(model, p, 4, MAX_TOKENS) for p in prompts]
    assert_matches(outputs, refs)
    assert_all_free(e)
    assert sum(r["preempted"] for r in e.recorder.steps) > 0


def test_an_aborted_search_frees_every_beam_and_records_one_row(model, prompts):
    e = engine(model, ALLOCATORS[0])
    e.add_request("b", prompts[1], BeamSearchParams(beam_width=4, max_tokens=50))
    for _ in range(4):
        e.step()
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("b/beam2", [1, 2])
    e.abort_request("b")
    (out,) = e.step()
    assert out.finished and out.abort_reason == "aborted by the user"
    assert len(out.outputs) == 4 and {c.finish_reason for c in out.outputs} == {"abort"}
    assert not e.has_unfinished_requests()
    assert_all_free(e)
    (row,) = e.recorder.requests
    assert row["request_id"] == "b" and row["finish_reason"] == "abort"


def test_the_summary_reports_the_kv_saved_by_sharing_beams(model, prompts):
    e = engine(model, ALLOCATORS[0])
    e.generate(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True))
    summary = summarize(
        requests_frame(e.recorder.requests), steps_frame(e.recorder.steps), clock="virtual"
    )
    assert 0 < summary["kv_sharing_saving"] < 1
    assert summary["completed"] == 3


def test_under_ignore_eos_a_beam_ending_in_eos_is_scored_one_token_shorter(model, prompts):
    """vLLM's get_beam_search_score drops a final EOS from the length even when EOS is
    ignored. One round, width 2, EOS the 2nd best of 4 candidates c1 > c2 > c3 > c4: the EOS
    beam scores c2 / (L - 1), the 3rd c3 / L (L = prompt + 1), and the larger goes on."""
    from reference import mlx_lm_logprobs

    prompt = prompts[0]
    row = mlx_lm_logprobs(model, prompt)[-1].astype(np.float64)
    top = [int(t) for t in np.argsort(-row)[:3]]
    eos, third, n = top[1], top[2], len(prompt) + 1
    second = eos if row[eos] / (n - 1) > row[third] / n else third
    e = engine(dataclasses.replace(model, eos_token_ids=(eos,)), ALLOCATORS[0])
    (out,) = e.generate([prompt], BeamSearchParams(2, max_tokens=1, ignore_eos=True))
    assert [c.token_ids for c in out.outputs] == [[top[0]], [second]]
    assert second == third  # here c2 / (L - 1) < c3 / L: raw order would have kept EOS


def test_a_running_searchs_ids_stay_taken_and_a_beams_own_id_is_not_a_request(model, prompts):
    """Found on review: the search's id stays taken after its first beam is dropped, a
    search whose beams' ids are taken is refused, and aborting a beam's own id is a no-op."""
    e = engine(model, ALLOCATORS[0])
    e.add_request("Y/beam1", prompts[2], SamplingParams(temperature=0, max_tokens=2))
    with pytest.raises(ValueError, match=r"'Y' is already in use \('Y/beam1'\)"):
        e.add_request("Y", prompts[1], BeamSearchParams(beam_width=3, max_tokens=4))
    # This prompt's first beam is not chosen in an early round (found by search).
    prompt = np.random.default_rng(0).integers(1, 1024, 10).tolist()
    e.add_request("X", prompt, BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))
    root_dropped, final = False, []
    while e.has_unfinished_requests():
        final += [o for o in e.step() if o.request_id == "X"]
        if "X" in e.requests.beams:
            root_dropped |= "X" not in e.requests.live
            with pytest.raises(ValueError, match="'X' is already in use"):
                e.add_request("X", prompts[2])
            e.abort_request("X/beam2")
    assert root_dropped
    (out,) = final
    assert out.finished and len(out.outputs) == 3 and out.outputs[0].finish_reason == "length"
    assert_all_free(e)


def test_a_beam_that_cannot_fork_waits_first_in_line(model, prompts):
    """max_num_seqs=4 and 20 requests behind a width-3 search: a beam forked without a seat
    waits at the head of the line, so the search is not held up behind later arrivals."""
    rng = np.random.default_rng(1)
    e = engine(model, ALLOCATORS[0], num_blocks=200, max_num_seqs=4)
    e.add_request("B", prompts[0], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    for i in range(20):
        prompt = rng.integers(1, 1024, 16).tolist()
        e.add_request(
            f"n{i}", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        )
    order = [
        o.request_id for _ in iter(e.has_unfinished_requests, False) for o in e.step() if o.finished
    ]
    assert order.index("B") < 6
