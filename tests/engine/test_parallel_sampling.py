"""Parallel sampling (SamplingParams.n, vLLM's semantics): the prompt is computed once and
forked; completion i samples with seed + i; paged allocators share the prompt's blocks,
region allocators copy them, and the steps record what sharing saved."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from reference import mlx_lm_tokens
from support import ALLOCATORS, assert_all_free, build_with_policy, timed_forwards

from harness.analysis.metrics import requests_frame, steps_frame, summarize
from harness.engine.sampling_params import SamplingParams, SamplingParamsError

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(5).integers(1, 1024, 40).tolist()


def engine(model, allocator, num_blocks=64, **kwargs):
    return build_with_policy(model, allocator, block_size=16, num_blocks=num_blocks, **kwargs)


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_greedy_completions_are_mlx_lms_and_paged_allocators_share_the_prompt(
    model, prompt, allocator, monkeypatch
):
    timed_forwards(monkeypatch, lambda rows: 1.0)
    e = engine(model, allocator)
    (out,) = e.generate([prompt], dataclasses.replace(GREEDY, n=4))
    ref = mlx_lm_tokens(model, prompt, MAX_TOKENS)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == ref and c.finish_reason == "length" for c in out.outputs)
    assert_all_free(e)
    steps = e.recorder.steps
    # 40 prompt tokens: 3 blocks each (the third partial), 4 completions.
    decoding = [r for r in steps if r["num_running"] == 4]
    assert decoding and all(r["block_refs"] == 12 for r in decoding)
    shared = {r["blocks_shared"] for r in decoding}
    if allocator.__name__ in ("ContiguousAllocator", "BuddyAllocator"):
        assert shared == {0}  # a region is never shared: the fork copied it
        assert e.allocator.stats().fork_copies == 3 * 3
    else:
        # The two full prompt blocks are shared by four tables (6 entries saved); the
        # partial third block is copied by three completions at their first write.
        assert shared == {6}
        assert e.allocator.stats().cow_copies == 3
    rows = e.recorder.requests
    assert sorted(r["request_id"] for r in rows) == ["gen-0", "gen-0/1", "gen-0/2", "gen-0/3"]
    # Completions 1..3 got the 40 prompt tokens' KV by the fork: no prefix-cache lookup.
    children = [r for r in rows if "/" in r["request_id"]]
    assert all(r["forked_tokens"] == 40 and r["cached_tokens"] == 0 for r in children)
    # Each step 1 s (injected): the prefill step's 3 entries, none shared, then 7 decode
    # steps of 12 entries, 6 shared by a paged allocator: 7 x 6 / (3 + 7 x 12).
    assert len(steps) == 8
    summary = summarize(requests_frame(rows), steps_frame(steps), clock="virtual")
    saved = 0 if allocator.__name__ in ("ContiguousAllocator", "BuddyAllocator") else 7 * 6
    assert summary["kv_sharing_saving"] == pytest.approx(saved / (3 + 7 * 12))


def test_completion_i_samples_as_a_request_seeded_seed_plus_i(model, prompt):
    """vLLM: child i of a seeded request uses seed + i; each completion's tokens are those
    of a lone request with that seed."""
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = engine(model, ALLOCATORS[0]).generate([prompt], dataclasses.replace(sampled, n=3))
    alone = engine(model, ALLOCATORS[0]).generate(
        [prompt] * 3, [dataclasses.replace(sampled, seed=11 + i) for i in range(3)]
    )
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_a_fork_without_room_recomputes_the_prompt(model, prompt):
    """max_num_seqs=2: two completions run on the fork, the other two wait and recompute;
    all four are still mlx_lm's tokens."""
    e = engine(model, ALLOCATORS[0], max_num_seqs=2)
    (out,) = e.generate([prompt], dataclasses.replace(GREEDY, n=4))
    ref = mlx_lm_tokens(model, prompt, MAX_TOKENS)
    assert all(c.token_ids == ref for c in out.outputs)
    assert max(r["num_running"] for r in e.recorder.steps) == 2
    forked = {r["request_id"]: r["forked_tokens"] for r in e.recorder.requests}
    assert forked == {"gen-0": 0, "gen-0/1": 40, "gen-0/2": 0, "gen-0/3": 0}
    assert_all_free(e)


def test_streaming_returns_one_output_per_request_with_every_completion(model, prompt):
    e = engine(model, ALLOCATORS[0])
    e.add_request("r", prompt, dataclasses.replace(GREEDY, n=3))
    while e.has_unfinished_requests():
        outputs = e.step()
        assert len(outputs) <= 1
        if outputs:
            (out,) = outputs
            assert out.request_id == "r" and len(out.outputs) in (1, 3)
    assert out.finished and all(c.finish_reason == "length" for c in out.outputs)


def test_aborting_a_request_aborts_every_completion(model, prompt):
    e = engine(model, ALLOCATORS[0])
    e.add_request("r", prompt, dataclasses.replace(GREEDY, n=3))
    e.step()
    e.step()
    e.abort_request("r")
    (out,) = e.step()
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not e.has_unfinished_requests()
    assert_all_free(e)


def test_n_must_be_a_positive_int():
    with pytest.raises(SamplingParamsError, match=r"SamplingParams\.n=0 is invalid"):
        SamplingParams(n=0)


def test_unseeded_completions_of_two_requests_do_not_share_a_seed(model, prompt):
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    a, b = engine(model, ALLOCATORS[0]).generate([prompt, prompt], sampled)
    tokens = [tuple(c.token_ids) for out in (a, b) for c in out.outputs]
    assert len(set(tokens)) == 4


def test_completion_ids_of_a_running_request_are_taken(model, prompt):
    from harness.engine import RequestError

    e = engine(model, ALLOCATORS[0])
    e.add_request("a", prompt, dataclasses.replace(GREEDY, n=3))
    for taken in ("a/1", "a/2"):
        with pytest.raises(RequestError, match="already in use"):
            e.add_request(taken, prompt, GREEDY)
    e.add_request("a/3", prompt, GREEDY)  # not one of its completions
    e.add_request("b/1", prompt, GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        e.add_request("b", prompt, dataclasses.replace(GREEDY, n=2))  # b/1 exists
    while e.has_unfinished_requests():
        e.step()
    assert_all_free(e)


def test_unfinished_requests_count_requests_not_completions(model, prompt):
    e = engine(model, ALLOCATORS[0])
    e.add_request("a", prompt, dataclasses.replace(GREEDY, n=3))
    e.add_request("b", prompt, GREEDY)
    e.step()
    assert e.get_num_unfinished_requests() == 2


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_blocks_shared_read_off_the_allocator_equals_a_union_of_the_running_tables(
    model, prompt, allocator
):
    # The recorder reads the running tables' sharing off the allocator's counts; forks,
    # copy-on-write, preemption in a small arena and re-admission change tables in every
    # way, and each step must still agree with the definition: refs minus the distinct
    # blocks of all running tables.
    e = engine(model, allocator, num_blocks=14)
    expected = []
    snapshot = e.recorder.snapshot

    def checked(stats, plan, proposed):
        tables = e.allocator.block_tables([s.request_id for s in stats.running])
        refs = sum(len(t) for t in tables)
        expected.append((refs, refs - len(set().union(*tables))))
        return snapshot(stats, plan, proposed)

    e.recorder.snapshot = checked
    prompts = [prompt, prompt[:20], prompt[5:], prompt[:33]]
    e.generate(prompts, dataclasses.replace(GREEDY, n=3, max_tokens=24))
    got = [(r["block_refs"], r["blocks_shared"]) for r in e.recorder.steps]
    assert got == expected
    assert sum(r["preempted"] for r in e.recorder.steps) > 0
    assert any(shared for _, shared in got) or allocator.__name__ in (
        "ContiguousAllocator",
        "BuddyAllocator",
    )
