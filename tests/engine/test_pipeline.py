"""Pipelined steps (LLMEngine(pipeline=True)): the next step is scheduled, built and launched
before the host reads this step's tokens. Tokens, stops, aborts and preemption must be exactly
as in synchronous steps, and a token computed past a stop is never emitted."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from reference import mlx_lm_tokens
from support import ALLOCATORS, assert_all_free, build_with_policy

from harness.engine import build_engine
from harness.engine.sampling_params import SamplingParams
from schedulers.fcfs import FCFSScheduler
from schedulers.output import INFLIGHT

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_LENS = [3, 17, 40, 64, 90, 130]
PROMPT_SEED = 7


def engine(model, allocator, *, pipeline, num_blocks=64, block_size=16, **scheduler_kwargs):
    return build_with_policy(
        model,
        allocator,
        block_size=block_size,
        num_blocks=num_blocks,
        engine_options={"pipeline": pipeline},
        **scheduler_kwargs,
    )


def test_steps_are_synchronous_by_default(model):
    built = build_engine(model, ALLOCATORS[0], FCFSScheduler, num_blocks=8)
    assert built.pipeline is None


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_pipelined_tokens_are_mlx_lms_and_blocks_come_back(model, prompts, reference, allocator):
    e = engine(model, allocator, pipeline=True, num_blocks=96)
    for out, ref in zip(e.generate(prompts, GREEDY), reference, strict=True):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
        assert INFLIGHT not in out.outputs[0].token_ids
    assert_all_free(e)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_preemption_under_pipelining_keeps_every_token(model, allocator, mode):
    """Eight 60-token prompts fill 32 of 34 blocks; their decodes cross into a fifth block
    each: sequences are preempted while a token of theirs is still on the device, and their
    tokens are still mlx_lm's."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 1024, 60).tolist() for _ in range(8)]
    reference = [mlx_lm_tokens(model, p, MAX_TOKENS) for p in prompts]
    e = engine(model, allocator, pipeline=True, num_blocks=34, preemption_mode=mode)
    outputs = e.generate(prompts, GREEDY)
    assert sum(r["preemptions"] for r in e.recorder.requests) > 0
    for out, ref in zip(outputs, reference, strict=True):
        assert out.outputs[0].token_ids == ref
    assert_all_free(e)


def test_a_stop_token_ends_the_output_and_the_step_computed_past_it_is_dropped(
    model, prompts, reference
):
    """Stop on the 5th token: pipelined, the 6th was already computed when the 5th was read;
    it is not emitted, and the sequence's blocks are free."""
    stop = reference[2][4]
    first = reference[2].index(stop)
    params = dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=(stop,))
    e = engine(model, ALLOCATORS[0], pipeline=True)
    e.add_request("s", prompts[2], params)
    e.add_request("long", prompts[3], GREEDY)
    finished = {}
    released = None
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        if "s" in finished and released is None:
            released = e.allocator.reclaimable_blocks("s") == 0
    assert finished["s"].token_ids == reference[2][: first + 1]
    assert (finished["s"].finish_reason, finished["s"].stop_reason) == ("stop", stop)
    assert finished["long"].token_ids == reference[3]
    assert released  # when the stop was read
    assert_all_free(e)


def test_a_sequence_sure_to_stop_gives_its_blocks_back_before_its_last_token_is_read(
    model, prompts, reference
):
    e = engine(model, ALLOCATORS[0], pipeline=True)
    e.add_request("a", prompts[1], dataclasses.replace(GREEDY, max_tokens=1))
    assert e.step() == []  # the prefill launched; its token is still on the device
    assert e.allocator.stats().used_blocks == 0
    assert e.has_unfinished_requests() and e.get_num_unfinished_requests() == 1
    (out,) = e.step()  # reads it
    assert out.finished and out.outputs[0].token_ids == reference[1][:1]
    assert not e.has_unfinished_requests()


def test_an_abort_while_a_token_is_on_the_device_emits_none_of_it(model, prompts, reference):
    e = engine(model, ALLOCATORS[0], pipeline=True)
    e.add_request("a", prompts[1], GREEDY)
    for _ in range(4):
        e.step()
    assert e.pipeline.busy  # a token of "a" is still on the device
    e.abort_request("a")
    outputs = []
    while e.has_unfinished_requests():
        outputs += e.step()
    (out,) = outputs
    assert out.finished and out.outputs[0].finish_reason == "abort"
    tokens = out.outputs[0].token_ids
    assert INFLIGHT not in tokens and tokens == reference[1][: len(tokens)]
    (row,) = e.recorder.requests
    assert row["output_tokens"] == len(tokens)
    assert_all_free(e)


def test_steps_that_need_the_host_run_synchronously_beside_pipelined_ones(model, prompts):
    """A penalised and a sampled request beside greedy ones: their steps wait for every
    token; all tokens match a synchronous engine's."""
    params = [
        GREEDY,
        dataclasses.replace(GREEDY, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=3, max_tokens=MAX_TOKENS),
        dataclasses.replace(GREEDY, min_tokens=4),
    ] + [GREEDY] * 2
    runs = [
        engine(model, ALLOCATORS[0], pipeline=p, num_blocks=96).generate(prompts, params)
        for p in (True, False)
    ]
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_synchronous_step_drops_a_sequence_that_stopped_on_the_token_it_read(
    model, prompts, reference
):
    """A greedy request's stop token is still on the device when a sampled request joins:
    the next step is synchronous, reads the stop first, and runs without the stopped row."""
    stop = reference[2][4]
    first = reference[2].index(stop)
    params = dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=(stop,))
    e = engine(model, ALLOCATORS[0], pipeline=True)
    e.add_request("s", prompts[2], params)
    finished = {}
    while "s" not in finished:
        on_device = next(iter(e.pipeline.rows()), None)
        if on_device is not None and on_device.num_output_tokens == first + 1:
            e.add_request("sampled", prompts[1], SamplingParams(temperature=0.9, seed=2))
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished["s"].token_ids == reference[2][: first + 1]
    while e.has_unfinished_requests():
        e.step()
    assert_all_free(e)


def test_an_abort_after_the_blocks_went_back_still_aborts(model, prompts, reference):
    """max_tokens=3: the step that launches the last token releases the blocks at once; an
    abort then still ends the request as aborted, without that token."""
    e = engine(model, ALLOCATORS[0], pipeline=True)
    e.add_request("a", prompts[1], dataclasses.replace(GREEDY, max_tokens=3))
    while not e.scheduler.draining:
        e.step()
    e.abort_request("a")
    outputs = []
    while e.has_unfinished_requests():
        outputs += e.step()
    (out,) = outputs
    assert out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == reference[1][:2]
    assert_all_free(e)
