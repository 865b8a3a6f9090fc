"""Replay a trace through an LLMEngine on the engine's own clock.

Each request is added when the clock reaches its arrival time. With the virtual clock an
idle engine jumps straight to the next arrival (``clock.wait_until``), so a replay never
sleeps; with the wall clock it sleeps until then, which is a real-time replay.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
from tqdm import tqdm

from harness.engine import LLMEngine
from harness.engine.sampling_params import SamplingParams
from harness.workload.traces import Trace, TraceError, TraceRequest


def check_trace(trace: Trace, vocab_size: int) -> None:
    """Fail before any work on what a generated trace's own checks cannot know: a prompt
    token id outside the model's vocabulary, or an SLO that is not a positive number (a
    config knob such as ``trace.ttft_slo`` passed through untyped)."""
    tokenizer = trace.metadata.get("parameters", {}).get("tokenizer")
    for req in trace:
        ids = req.prompt_token_ids  # a token_array: numpy reads its buffer (15x max's speed)
        bad = int(np.frombuffer(ids, dtype=ids.typecode).max())
        if bad >= vocab_size and tokenizer is not None:  # a chat trace: a model's own tokens
            raise TraceError(
                f"request {req.request_id!r}: the trace was tokenized by {tokenizer!r} "
                f"(trace.tokenizer) into ids up to {bad}, outside the model's vocabulary "
                f"[0, {vocab_size}): run it with model=smollm2 (or model=pretrained and "
                "trace.tokenizer set to that model's folder)"
            )
        if bad >= vocab_size:
            raise TraceError(
                f"request {req.request_id!r}: field 'prompt_token_ids' holds id {bad}, outside "
                f"the model's vocabulary [0, {vocab_size}); generate the trace with "
                f"vocab_size <= {vocab_size} (trace.vocab_size) or pick a larger model"
            )
        for name in ("ttft_slo", "tpot_slo"):
            slo = getattr(req, name)
            number = isinstance(slo, (int, float)) and not isinstance(slo, bool)
            if slo is not None and not (number and slo > 0):
                raise TraceError(
                    f"request {req.request_id!r}: field {name!r} is {slo!r}; an SLO is a "
                    f"number of seconds > 0 (check trace.{name} or the trace's slos)"
                )


GREEDY = partial(SamplingParams, temperature=0.0)


def sampling_params(req: TraceRequest, sampling: Callable[..., SamplingParams] = GREEDY):
    """``sampling`` (the config's ``sampling``: greedy by default) with the trace's
    ``max_tokens`` and ``ignore_eos``: by default every request produces exactly
    ``max_tokens`` tokens, so the workload is the trace's and not the (random) weights'
    choice of when to stop; a trace of a real model's own answers (``trace=chat``) lets EOS
    end them."""
    return sampling(max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)


def params_for(
    sampling: Callable[..., SamplingParams] = GREEDY,
) -> Callable[[TraceRequest], SamplingParams]:
    """``sampling_params`` for each request of one replay: ``sampling`` called once, then its
    result copied with each request's ``max_tokens`` and ``ignore_eos`` (``replace`` runs the
    same checks). Calling a Hydra partial costs about 0.2 ms, 20 s of a 100,000-request
    replay. The copies are shared by the requests that ask the same (they are frozen): a
    trace has a few hundred distinct ``max_tokens``, and ``replace`` costs ~17 us a call.
    The replay reads only finished requests' outputs, so it asks for no other
    (``final_only``)."""
    first = None
    made: dict[tuple[int, bool], SamplingParams] = {}

    def params(req: TraceRequest) -> SamplingParams:
        nonlocal first
        if first is None:
            first = sampling_params(req, sampling)
            if isinstance(first, SamplingParams):  # beam search returns its own outputs
                first = replace(first, output_kind="final_only")
            return first
        key = (req.max_tokens, req.ignore_eos)
        got = made.get(key)
        if got is None:
            got = made[key] = replace(first, max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)
        return got

    return params


def replay(
    engine: LLMEngine,
    trace: Trace,
    *,
    sampling: Callable[..., SamplingParams] = GREEDY,
    progress: bool = True,
) -> Sent:
    """Run every request of ``trace`` to completion; results land in ``engine.recorder``.

    Arrival times are offsets from the moment the replay starts on ``engine.clock``. A
    follow-up turn (``TraceRequest.after``) is sent its think time after the request it
    continues finishes, its prompt grown by that request's prompt and answer; a follow-up
    of a request that finished without an answer (aborted) is not sent, nor are its own.
    Returns what was sent (``Sent``).
    """
    clock = engine.clock
    origin = clock.now()
    pending = deque(req for req in trace.requests if req.after is None)
    follow_ups: dict[str, list[TraceRequest]] = {}
    for req in trace.requests:
        if req.after is not None:
            follow_ups.setdefault(req.after, []).append(req)
    due: list[tuple[float, int, TraceRequest]] = []  # follow-ups by time since origin
    order = itertools.count()  # ties in ``due`` go first-come first-served
    sent = Sent([], {})
    sent_prompts: dict[str, tuple[int, ...]] = {}
    params = params_for(sampling)

    def next_arrival() -> float | None:
        times = [pending[0].arrival_time] if pending else []
        if due:
            times.append(due[0][0])
        return origin + min(times) if times else None

    with tqdm(total=len(trace), unit="req", disable=not progress, dynamic_ncols=True) as bar:
        while pending or due or engine.has_unfinished_requests():
            now = clock.now()
            while (arrival := next_arrival()) is not None and arrival <= now:
                if due and (not pending or due[0][0] <= pending[0].arrival_time):
                    req = heapq.heappop(due)[2]
                else:
                    req = pending.popleft()
                engine.add_request(
                    req.request_id,
                    req.prompt_token_ids,
                    params(req),
                    arrival_time=origin + req.arrival_time,
                    priority=req.priority,
                    ttft_slo=req.ttft_slo,
                    tpot_slo=req.tpot_slo,
                )
                sent.requests.append(req)
                if req.request_id in follow_ups:
                    sent_prompts[req.request_id] = req.prompt_token_ids
            if not engine.has_unfinished_requests():
                clock.wait_until(next_arrival())
                continue
            done = 0
            for out in engine.steps(next_arrival()):
                if not out.finished:
                    continue
                done += 1
                turns = follow_ups.pop(out.request_id, [])
                if not turns:
                    continue
                prompt = sent_prompts.pop(out.request_id)
                answer = tuple(out.outputs[0].token_ids) if out.outputs else ()
                if out.abort_reason is not None or not answer:
                    done += sum(1 + _dropped(turn.request_id, follow_ups) for turn in turns)
                    continue
                sent.answers[out.request_id] = answer
                for turn in turns:
                    t = out.finished_time - origin + turn.arrival_time
                    grown = (*prompt, *answer, *turn.prompt_token_ids)  # compacted by replace
                    sent_turn = replace(turn, arrival_time=t, prompt_token_ids=grown)
                    heapq.heappush(due, (t, next(order), sent_turn))
            if done:
                bar.update(done)
                bar.set_postfix_str(f"{clock.name} t={clock.now() - origin:.1f}s", refresh=False)
    return sent


@dataclass
class Sent:
    """What a replay sent: the requests in the order sent (a follow-up turn's prompt grown by
    the turns before it and their answers), and those answers by request id."""

    requests: list[TraceRequest]
    answers: dict[str, tuple[int, ...]]


def _dropped(request_id: str, follow_ups: dict[str, list[TraceRequest]]) -> int:
    """Drop the follow-ups of ``request_id`` and theirs; how many were dropped."""
    turns = follow_ups.pop(request_id, [])
    return sum(1 + _dropped(turn.request_id, follow_ups) for turn in turns)
