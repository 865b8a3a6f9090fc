"""Logprobs as vLLM v1 defines them: the sampled token always included with its rank, raw
(before penalties and filters) by default or processed by ``engine.logprobs_mode``;
``prompt_logprobs`` against mlx_lm's own forward for every allocator, with chunked prefill,
a prefix-cache hit and preemption; outputs already returned never change."""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from reference import mlx_lm_logprobs
from support import ALLOCATORS, random_prompts

from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from harness.engine import build_engine
from harness.engine.sampling import SampleRow, sample
from harness.engine.sampling_params import Logprob, SamplingParams, SamplingParamsError, make_rng
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler

TOL = 1e-4  # float32 logits through two different attention paths


def one(logits, params, mode="raw_logprobs", tokens=(0,), seed=0):
    """Sample one row of hand-made ``logits``; prompt ``tokens``."""
    row = SampleRow(params, list(tokens), len(tokens), make_rng(params, seed))
    return sample(mx.array(np.array([logits], dtype=np.float32)), [row], mode)[0]


def test_raw_and_processed_by_hand():
    """Logits 2, 1, 0, -1, prompt [0]: raw is their log-softmax. Repetition 2 halves token
    0's logit to 1 and temperature .5 doubles all: 2, 2, 0, -2; top-k 2 then leaves tokens 0
    and 1 at log(1/2) each, the rest at -inf. The logits modes skip the normalisation."""
    logits = [2.0, 1.0, 0.0, -1.0]
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0, top_k=2, logprobs=4, seed=1)
    raw_norm = math.log(sum(math.exp(x) for x in logits))
    want = {
        "raw_logprobs": [x - raw_norm for x in logits],
        "raw_logits": logits,
        "processed_logprobs": [-math.log(2), -math.log(2), -math.inf, -math.inf],
        "processed_logits": [2.0, 2.0, -math.inf, -math.inf],
    }
    for mode, values in want.items():
        got = one(logits, params, mode)
        assert got.token in (0, 1)
        # All four requested: every token, its rank by value (ties share the stable order).
        assert set(got.logprobs) == {0, 1, 2, 3}
        np.testing.assert_allclose([got.logprobs[t].logprob for t in range(4)], values, rtol=1e-6)
        assert [got.logprobs[t].rank for t in range(4)] == [1, 2, 3, 4]


def test_processed_without_filters_is_after_penalties_and_temperature():
    """Prompt [0], repetition 2 and temperature .5 on logits 2, 1, 0, -1: 2, 2, 0, -2."""
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0, logprobs=1, seed=1)
    got = one([2.0, 1.0, 0.0, -1.0], params, "processed_logprobs")
    norm = math.log(2 * math.e**2 + 1 + math.e**-2)
    assert got.logprobs[got.token].logprob == pytest.approx([2, 2, 0, -2][got.token] - norm)


def test_logprobs_zero_gives_exactly_the_sampled_token():
    got = one([0.0, 3.0, 1.0], SamplingParams(temperature=0, logprobs=0))
    assert got.token == 1
    norm = math.log(1 + math.e**3 + math.e)
    assert got.logprobs == {1: Logprob(pytest.approx(3 - norm), 1)}


def test_a_sampled_token_outside_the_top_n_adds_an_entry_with_its_rank():
    """Logits 4, 3, 2, 1, 0, token 0 in the prompt: repetition 10 takes it to .4, so greedy
    picks token 1. Raw, token 0 is still the top-1: two entries, token 1 at rank 2.
    Processed, token 1 is the top-1 itself: one entry."""
    logits = [4.0, 3.0, 2.0, 1.0, 0.0]
    params = SamplingParams(temperature=0, repetition_penalty=10.0, logprobs=1)
    raw = one(logits, params)
    assert raw.token == 1
    norm = math.log(sum(math.exp(x) for x in logits))
    assert list(raw.logprobs) == [1, 0]  # the sampled token first, as vLLM builds it
    assert raw.logprobs[1] == Logprob(pytest.approx(3 - norm), 2)
    assert raw.logprobs[0] == Logprob(pytest.approx(4 - norm), 1)
    processed = one(logits, params, "processed_logits")
    assert processed.logprobs == {1: Logprob(3.0, 1)}


def test_a_tied_sampled_token_ranks_behind_everything_it_ties():
    """vLLM's rank counts the tokens scoring at least as high: three tied tokens, the last
    of them sampled (top_k 3 keeps only them), ranks 3."""
    params = SamplingParams(top_k=3, logprobs=0, seed=0)
    ranks = set()
    for seed in range(20):
        got = one([1.0, 1.0, 1.0, 0.0], dataclasses.replace(params, seed=seed))
        (entry,) = got.logprobs.values()
        ranks.add(entry.rank)
    assert ranks == {3}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 2.5),
        ("prompt_logprobs", 21),
    ],
)
def test_bad_counts_are_named(field, value):
    with pytest.raises(SamplingParamsError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_a_bad_logprobs_mode_is_named(model):
    with pytest.raises(ValueError, match="engine.logprobs_mode='logits' is invalid"):
        build(model, FreeListAllocator, logprobs_mode="logits")


def build(model, allocator, scheduler=FCFSScheduler, num_blocks=64, **kwargs):
    return build_engine(model, allocator, scheduler, block_size=16, num_blocks=num_blocks, **kwargs)


def prompts_of(*lengths, seed=3):
    return random_prompts(lengths, seed)


def assert_prompt_logprobs(model, prompt, got, n):
    """``got`` holds, per position after the first, the prompt token's and the top-``n``
    log-probabilities of mlx_lm's forward, with ranks."""
    ref = mlx_lm_logprobs(model, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p, entry in enumerate(got[1:]):
        row, token = ref[p], prompt[p + 1]
        assert token in entry and len(entry) in (n, n + 1)
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t], abs=TOL)
        top = sorted((lp.rank, t) for t, lp in entry.items() if t != token or lp.rank <= n)
        assert [r for r, _ in top][:n] == list(range(1, n + 1))
        np.testing.assert_allclose(
            [entry[t].logprob for _, t in top[:n]], np.sort(row)[::-1][:n], atol=TOL
        )
        assert abs(entry[token].rank - 1 - (row > row[token]).sum()) <= 1  # ties within TOL


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_prompt_logprobs_are_mlx_lms(model, allocator, chunked):
    """Prompts of 1 to 45 tokens, batched; chunks of 16 split the longer ones over steps."""
    scheduler = partial(ChunkedPrefillScheduler, max_chunk=16) if chunked else FCFSScheduler
    engine = build(model, allocator, scheduler, num_blocks=96)
    prompts = prompts_of(1, 2, 17, 45)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        assert_prompt_logprobs(model, prompt, out.prompt_logprobs, 2)
        assert out.outputs[0].logprobs is None


def test_prompt_logprobs_skip_reading_the_prefix_cache(model):
    """A prompt whose blocks the radix cache holds is computed again in full for prompt
    logprobs (vLLM's skip_reading_prefix_cache); without them it hits the cache."""
    engine = build(model, RadixAllocator)
    (prompt,) = prompts_of(40)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.generate([prompt], greedy)
    hits = engine.allocator.stats().prefix_hit_tokens
    (out,) = engine.generate([prompt], dataclasses.replace(greedy, prompt_logprobs=1))
    assert engine.allocator.stats().prefix_hit_tokens == hits
    assert_prompt_logprobs(model, prompt, out.prompt_logprobs, 1)
    engine.generate([prompt], greedy)
    assert engine.allocator.stats().prefix_hit_tokens == hits + 32


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_preemption_by_recompute_takes_prompt_logprobs_once(model, allocator):
    """Eight 60-token prompts in 34 blocks (test_engine's overload): some are preempted and
    recompute their prompt, whose logprobs are still one per position, mlx_lm's."""
    prompts = prompts_of(*[60] * 8, seed=2)
    engine = build(model, allocator, partial(FCFSScheduler, max_num_seqs=8), num_blocks=34)
    params = SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert sum(r["preemptions"] for r in engine.recorder.requests) > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_prompt_logprobs(model, prompt, out.prompt_logprobs, 0)


@pytest.mark.parametrize("pipeline", [False, True], ids=["sync", "pipelined"])
def test_output_logprobs_are_the_raw_forward_and_never_alias(model, pipeline):
    """Streamed through step(): each output, as received, keeps its lengths to the end; each
    generated token's raw logprob is mlx_lm's over prompt + output, whatever the penalties.
    A pipelining engine runs these rows synchronously."""
    engine = build(model, FreeListAllocator, pipeline=pipeline)
    (prompt,) = prompts_of(20)
    params = SamplingParams(
        temperature=0,
        max_tokens=6,
        repetition_penalty=1.5,
        logprobs=2,
        prompt_logprobs=1,
        ignore_eos=True,
    )
    engine.add_request("r", prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            seen.append((out, len(c.token_ids), len(c.logprobs), len(out.prompt_logprobs)))
    assert [n for _, n, _, _ in seen] == list(range(1, 7))
    for out, n_tokens, n_logprobs, n_prompt in seen:
        assert len(out.outputs[0].token_ids) == n_tokens == n_logprobs
        assert len(out.outputs[0].logprobs) == n_logprobs
        assert len(out.prompt_logprobs) == n_prompt == len(prompt)
    final = seen[-1][0]
    output = final.outputs[0].token_ids
    ref = mlx_lm_logprobs(model, prompt + output[:-1])
    for k, (token, entry) in enumerate(zip(output, final.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + k]
        assert entry[token].logprob == pytest.approx(row[token], abs=TOL)
        assert len(entry) in (2, 3)
        assert entry[token].decoded_token is None  # no tokenizer
    # vLLM's cumulative_logprob: the sum of the generated tokens' (raw) logprobs.
    expected = sum(ref[len(prompt) - 1 + k][t] for k, t in enumerate(output))
    assert final.outputs[0].cumulative_logprob == pytest.approx(expected, abs=6 * TOL)
    assert_prompt_logprobs(model, prompt, final.prompt_logprobs, 1)


def test_a_pipelining_engine_takes_prompt_logprobs_synchronously(model):
    """Greedy rows without logprobs pipeline, but not the chunks that score the prompt."""
    scheduler = partial(ChunkedPrefillScheduler, max_chunk=16)
    engine = build(model, FreeListAllocator, scheduler, pipeline=True)
    prompts = prompts_of(9, 40)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        assert_prompt_logprobs(model, prompt, out.prompt_logprobs, 1)
