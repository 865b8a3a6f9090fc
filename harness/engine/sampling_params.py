"""What a request asks of sampling (the low-level design seed's fields, vLLM's names and
defaults): ``SamplingParams``, the engine-wide ``logprobs_mode`` choices, the logprobs records a
request gets back, and its per-request random generator. The batched sampler that reads them
is harness/engine/sampling.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, get_args

import numpy as np

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)
MAX_LOGPROBS = 20  # vLLM's default ModelConfig.max_logprobs
OutputKind = Literal["cumulative", "final_only"]
OUTPUT_KINDS: tuple[str, ...] = get_args(OutputKind)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and the fix."""


def check_fields(params: object, checks: list[tuple[str, bool, str]]) -> None:
    """Raise for the first (field, ok, what it must be) that is not ok, naming the field."""
    for name, ok, want in checks:
        if not ok:
            raise SamplingParamsError(
                f"{type(params).__name__}.{name}={getattr(params, name)!r} is invalid: it "
                f"must be {want}"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens (vLLM's field names and defaults).

    ``n`` completions are generated for the prompt (vLLM's parallel sampling): the prompt's
    KV is computed once and forked; completion ``i`` samples with seed ``seed + i``.
    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    Penalties follow vLLM: presence/frequency subtract from logits of tokens already
    generated; repetition divides positive (multiplies negative) logits of tokens seen in
    the prompt or output.

    ``logprobs``: the top-n log-probabilities of each output token plus the sampled token's
    (see the module docstring). ``prompt_logprobs``: per prompt position, None for the first
    and then the prompt token's log-probability plus the top-n, always from the raw logits
    (vLLM's ``GPUModelRunner._get_prompt_logprobs_dict``); such a request skips reading the
    prefix cache (``skip_reading_prefix_cache``, vLLM's), so every prompt position is computed.

    ``output_kind`` (vLLM's ``RequestOutputKind``): ``cumulative``, a ``RequestOutput`` from
    every step the request progresses in, with all its tokens so far; ``final_only``, the
    finished request's alone (a replay reads nothing else: building the others was a fifth
    of a model-clock replay's time).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    output_kind: OutputKind = "cumulative"

    def __post_init__(self) -> None:
        # Accept lists from configs and JSON; store tuples so params stay hashable.
        object.__setattr__(
            self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop)
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "an int >= 1"),
            ("temperature", self.temperature >= 0 and math.isfinite(self.temperature), ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int), "an int (<= 0 disables it)"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, ">= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "in [0, max_tokens]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 10, "in (0, 10]"),
            ("logprobs", _count_or_none(self.logprobs), f"None or an int in [0, {MAX_LOGPROBS}]"),
            (
                "prompt_logprobs",
                _count_or_none(self.prompt_logprobs),
                f"None or an int in [0, {MAX_LOGPROBS}]",
            ),
            ("seed", self.seed is None or isinstance(self.seed, int), "None or an int"),
            ("output_kind", self.output_kind in OUTPUT_KINDS, f"one of {', '.join(OUTPUT_KINDS)}"),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "non-negative ints",
            ),
        ]
        check_fields(self, checks)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @cached_property
    def argmax(self) -> bool:
        """The token is the logits' argmax, whatever was generated: greedy, no penalties, no
        logprobs (bans below ``min_tokens`` aside). Computed once per params object: the
        sampler asks it of every sampling row every step."""
        return self.temperature == 0 and not self.penalised and self.logprobs is None

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so none may come from the
        prefix cache (vLLM's ``SamplingParams.skip_reading_prefix_cache``)."""
        return self.prompt_logprobs is not None


def _count_or_none(n) -> bool:
    return n is None or (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_LOGPROBS)


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (or logit, by ``logprobs_mode``), its rank, 1 = the
    highest, and its text when the model has a tokenizer (vLLM's ``Logprob``)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]  # token id -> Logprob, at one position


def make_rng(params: SamplingParams, fallback_seed: int) -> np.random.Generator | None:
    """Per-request randomness: its own seed, else one derived from the engine's seed."""
    if params.greedy:
        return None
    return np.random.default_rng(params.seed if params.seed is not None else fallback_seed)
