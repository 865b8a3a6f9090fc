"""Sampling parameters (the low-level design seed's fields) and the batched sampler.

Greedy rows are decided by one ``mx.argmax`` over the batch. Rows that sample go through
numpy with a per-request ``numpy.random.Generator`` seeded from ``SamplingParams.seed``, so
a request's tokens depend on its own seed only, never on what it was batched with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and the fix."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens (vLLM's field names and defaults).

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    Penalties follow vLLM: presence/frequency subtract from logits of tokens already
    generated; repetition divides positive (multiplies negative) logits of tokens seen in
    the prompt or output.
    """

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
    seed: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from configs and JSON; store tuples so params stay hashable.
        object.__setattr__(
            self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop)
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            ("temperature", self.temperature >= 0 and math.isfinite(self.temperature), ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int), "an int (<= 0 disables it)"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, ">= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "in [0, max_tokens]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 10, "in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "None or in [0, 20]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "None or an int"),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "non-negative ints",
            ),
        ]
        for name, ok, want in checks:
            if not ok:
                raise SamplingParamsError(
                    f"SamplingParams.{name}={getattr(self, name)!r} is invalid: it must be {want}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


@dataclass
class SampleRow:
    """What the sampler needs of one sequence."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far
    num_prompt_tokens: int
    rng: np.random.Generator | None
    banned: tuple[int, ...] = field(default=())  # EOS/stop ids while below min_tokens


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def sample(logits: mx.array, rows: Sequence[SampleRow]) -> list[Sampled]:
    """Pick one token per row of ``logits`` [len(rows), vocab]."""
    simple = all(r.params.greedy and not r.params.penalised and not r.banned for r in rows)
    if simple and not any(r.params.logprobs is not None for r in rows):
        return [Sampled(t) for t in mx.argmax(logits, axis=-1).tolist()]
    table = np.array(logits.astype(mx.float32))
    return [_sample_row(table[i], row) for i, row in enumerate(rows)]


def _sample_row(logits: np.ndarray, row: SampleRow) -> Sampled:
    p = row.params
    logits = adjust_logits(logits, row)
    if p.greedy:
        token = int(np.argmax(logits))
    else:
        probs = filtered_probs(logits, p)
        token = int(np.searchsorted(np.cumsum(probs), row.rng.random() * probs.sum(), "right"))
        token = min(token, len(probs) - 1)
    if p.logprobs is None:
        return Sampled(token)
    logprobs = logits - _logsumexp(logits)
    top = np.argsort(-logprobs)[: p.logprobs]
    return Sampled(token, float(logprobs[token]), {int(t): float(logprobs[t]) for t in top})


def adjust_logits(logits: np.ndarray, row: SampleRow) -> np.ndarray:
    """Apply penalties and min_tokens bans (a copy; the input is left alone)."""
    p = row.params
    logits = logits.copy()
    if p.penalised:
        output = np.asarray(row.token_ids[row.num_prompt_tokens :], dtype=np.int64)
        counts = np.bincount(output, minlength=logits.shape[0])[: logits.shape[0]]
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(row.token_ids, dtype=np.int64))
            vals = logits[seen]
            logits[seen] = np.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if row.banned:
        logits[list(row.banned)] = -np.inf
    return logits


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, then top-k, top-p and min-p filters; returns unnormalised probabilities."""
    scaled = logits / p.temperature
    probs = np.exp(scaled - scaled.max())
    if 0 < p.top_k < probs.shape[0]:
        kth = np.partition(probs, -p.top_k)[-p.top_k]
        probs[probs < kth] = 0.0
    if p.top_p < 1.0:
        order = np.argsort(-probs)
        cum = np.cumsum(probs[order])
        # keep the smallest head of the sorted distribution whose mass reaches top_p
        cut = int(np.searchsorted(cum, p.top_p * cum[-1])) + 1
        probs[order[cut:]] = 0.0
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0.0
    return probs


def _logsumexp(x: np.ndarray) -> float:
    m = x[np.isfinite(x)].max()
    return float(m + np.log(np.exp(x - m).sum()))


def make_rng(params: SamplingParams, fallback_seed: int) -> np.random.Generator | None:
    """Per-request randomness: its own seed, else one derived from the engine's seed."""
    if params.greedy:
        return None
    return np.random.default_rng(params.seed if params.seed is not None else fallback_seed)
