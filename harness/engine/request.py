"""A request's state as it moves through the engine, and the outputs the engine returns."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from harness.engine.sampling_params import SamplingParams, TokenLogprobs
from schedulers.request import Status


@dataclass(eq=False, slots=True)
class Seq:
    """One sequence of a request (its only one, or one of its n completions or beams): its
    tokens, how many have KV in the arena, and its timeline (the
    ``schedulers.request.Request`` the scheduler side moves, plus what the engine keeps).

    Each field has one writer: the scheduler side moves its progress, tokens, timeline and
    status (``Scheduler.update``, ``finish``); the output processor its logprobs; the
    verifier its speculative counts; the rest is set when it is made.

    ``token_ids`` is prompt + output: a tuple, the prompt shared with its sender, until the
    scheduler first admits it (``Progress.admit``), then an int32 array of its own that
    grows (a sequence of ints; ``output_token_ids`` is a list). The
    last sampled token has no KV yet, so a running sequence in decode has
    ``num_computed_tokens == len(token_ids) - 1`` and computes one token per step; a prefill
    (or a recompute after preemption) computes the rest.
    """

    request_id: str
    token_ids: Sequence[int]  # the prompt as given until admitted, then an int32 array
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    rng: np.random.Generator | None = None
    seed: int = 0  # the effective seed of ``rng`` (SamplingParams.seed, else the engine's)
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    num_prompt_tokens: int = 0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at the first admission
    # Of those, loaded from the lower tiers (kv_tier); the rest were in the arena
    num_cached_tokens_host: int = 0
    num_cached_tokens_disk: int = 0
    num_forked_tokens: int = 0  # KV forked from completion 0 (n > 1), never looked up
    preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # When each output token existed on the host: 8 bytes a token (a list of floats: 32).
    token_times: array = field(default_factory=lambda: array("d"))
    finish_reason: str | None = None
    abort_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    spec_proposed: int = 0
    spec_accepted: int = 0
    cumulative_logprob: float = 0.0  # output logprobs summed (params.logprobs); a beam's
    index: int = 0  # which of the request's SamplingParams.n completions this is
    group_id: str = ""  # the caller's request id (``request_id`` is unique per completion)
    prompt_token_ids: Sequence[int] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        self.group_id = self.group_id or self.request_id
        # Every step's RequestOutput shares this instead of slicing the prompt again; a
        # waiting request's tokens are its prompt (a tuple, or a trace's compact array):
        # then the same object.
        tokens = self.token_ids
        self.prompt_token_ids = (
            tokens
            if type(tokens) is not list and len(tokens) == self.num_prompt_tokens
            else tuple(tokens[: self.num_prompt_tokens])
        )
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.token_ids[self.num_prompt_tokens :])

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class CompletionOutput:
    """One completion of a request (``index`` of SamplingParams.n). Its lists are the
    engine's copies at the time: an output already returned never changes."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # per output token, when params.logprobs
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None
    # vLLM's: the sum of the output tokens' logprobs (with params.logprobs, as
    # ``logprobs_mode`` reports them), or a beam's raw cumulative logprob; else None.
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What ``LLMEngine.step`` returns for each request that made progress or finished.
    ``prompt_logprobs`` (when params.prompt_logprobs): per prompt position, None for the first;
    complete in every output that carries a token (prefill ends before the first is sampled)."""

    request_id: str
    prompt_token_ids: Sequence[int]  # a tuple, or the trace's compact array of ids
    outputs: list[CompletionOutput]
    finished: bool
    abort_reason: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # When the last completion finished, on the engine's clock (vLLM's
    # RequestMetrics.finished_time); None while running.
    finished_time: float | None = None
