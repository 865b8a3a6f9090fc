"""Sampling parameters (the low-level design seed's fields) and the batched sampler.

A step samples all its rows at once: penalties and bans, temperature, top-k, top-p and
min-p are whole-batch array operations (per-row values as vectors), then one inverse-CDF
draw per row. Randomness stays per request: each sampling row draws its one uniform from
its own ``numpy.random.Generator`` (seeded from ``SamplingParams.seed``), so a request's
tokens depend on its seed, never on what it was batched with. Greedy rows without
penalties, bans or logprobs are one ``mx.argmax``.

Logprobs follow vLLM v1. Each sampled token gets a dict token id -> ``Logprob(logprob,
rank)``: the sampled token (rank: how many tokens score at least as high, 1 = the best;
vLLM's ``batched_count_greater_than``, ``vllm/v1/sample/ops/logprobs.py``) and the top
``logprobs`` (ranks 1..n), so n + 1 entries when the sampled token is not among them
(``LogprobsProcessor._make_logprob_dict``, ``vllm/v1/engine/logprobs.py``). What they are
taken from is the engine's ``logprobs_mode`` (vLLM's ``ModelConfig.logprobs_mode``):
``raw_logprobs`` (the default) and ``raw_logits`` are the model's output before any
processing; ``processed_logprobs`` and ``processed_logits`` are what the token was drawn
from: after penalties and bans, then temperature and min-p/top-k/top-p with filtered tokens
at -inf (``Sampler.sample`` and ``TopKTopPSampler.forward_native``,
``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py``); a greedy row's processed
values are its penalised logits, as vLLM returns them before temperature for greedy rows.

The batched math is written once against an array module ``xp``: MLX where it runs on a GPU
(the logits never leave the device), numpy on MLX's CPU build, where numpy's vectorised
``exp`` measured 5x faster than MLX's (``python -m harness.bench sampling``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, get_args

import mlx.core as mx
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

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so none may come from the
        prefix cache (vLLM's ``SamplingParams.skip_reading_prefix_cache``)."""
        return self.prompt_logprobs is not None


def _count_or_none(n) -> bool:
    return n is None or (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_LOGPROBS)


@dataclass
class SampleRow:
    """What the sampler needs of one sequence."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far
    num_prompt_tokens: int
    rng: np.random.Generator | None
    banned: tuple[int, ...] = field(default=())  # EOS/stop ids while below min_tokens


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (or logit, by ``logprobs_mode``), its rank, 1 = the
    highest, and its text when the model has a tokenizer (vLLM's ``Logprob``)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]  # token id -> Logprob, at one position


@dataclass(frozen=True)
class Sampled:
    token: int
    logprobs: TokenLogprobs | None = None  # when the row's params ask for logprobs


def sample(
    logits: mx.array, rows: Sequence[SampleRow], logprobs_mode: LogprobsMode = "raw_logprobs"
) -> list[Sampled]:
    """Pick one token per row of ``logits`` [len(rows), vocab]; logprobs per ``logprobs_mode``
    for the rows that ask for them."""
    simple = all(r.params.greedy and not r.params.penalised and not r.banned for r in rows)
    if simple and not any(r.params.logprobs is not None for r in rows):
        return [Sampled(t) for t in mx.argmax(logits, axis=-1).tolist()]
    xp = mx if mx.default_device().type == mx.DeviceType.gpu else np
    table = logits.astype(mx.float32)
    adjusted = adjust(table if xp is mx else np.array(table), rows)
    tokens = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    draw = [i for i, r in enumerate(rows) if not r.params.greedy]
    if greedy:
        for i, token in zip(greedy, _to_list(_take(adjusted, greedy).argmax(axis=-1)), strict=True):
            tokens[i] = token
    probs = None
    if draw:
        probs = filtered(_take(adjusted, draw), [rows[i].params for i in draw])
        uniforms = np.array([rows[i].rng.random() for i in draw], dtype=np.float32)
        for i, token in zip(draw, _to_list(draw_tokens(probs, uniforms)), strict=True):
            tokens[i] = token
    out = []
    for i, row in enumerate(rows):
        n = row.params.logprobs
        if n is None:
            out.append(Sampled(tokens[i]))
            continue
        kept = None if row.params.greedy else np.asarray(_take(probs, [draw.index(i)]))[0] > 0
        values = logprob_values(
            np.asarray(_take(table, [i]))[0],
            np.asarray(_take(adjusted, [i]))[0],
            kept,
            row.params,
            logprobs_mode,
        )
        out.append(Sampled(tokens[i], logprob_dict(values, tokens[i], n)))
    return out


def logprob_values(
    raw: np.ndarray,
    adjusted: np.ndarray,
    kept: np.ndarray | None,
    params: SamplingParams,
    mode: LogprobsMode,
) -> np.ndarray:
    """One row's values that ``mode`` reports, from its ``raw`` logits, its ``adjusted``
    (penalised, banned) logits and, for a sampling row, the tokens its filters ``kept``
    (a token whose probability underflows float32 counts as filtered: it cannot be drawn)."""
    if mode.startswith("raw"):
        values = raw.astype(np.float64)
    elif params.greedy:
        values = adjusted.astype(np.float64)
    else:
        values = np.where(kept, adjusted.astype(np.float64) / params.temperature, -np.inf)
    return values if mode.endswith("logits") else values - _logsumexp(values)


def logprob_dict(values: np.ndarray, token: int, n: int) -> TokenLogprobs:
    """``token``'s entry, then the top ``n`` of ``values`` [vocab] with ranks 1..n (the token
    keeps its place but takes its top-n rank when among them), as vLLM builds it."""
    entries = {token: Logprob(float(values[token]), int((values >= values[token]).sum()))}
    for rank, t in enumerate(np.argsort(-values, kind="stable")[:n], start=1):
        entries[int(t)] = Logprob(float(values[t]), rank)
    return entries


def adjust(logits, rows: Sequence[SampleRow]):
    """Penalties in vLLM's order (repetition on prompt and output tokens, then frequency
    and presence on output tokens) and min_tokens bans for a batch [len(rows), vocab] of
    numpy or MLX logits; the input is left alone (a copy is changed, only when there is
    something to change)."""
    xp = _xp(logits)
    if not any(r.params.penalised or r.banned for r in rows):
        return logits
    logits = xp.array(logits)  # a copy
    vocab = logits.shape[-1]
    penalty, seen, banned = ([], [], []), ([], [], []), ([], [])
    for b, row in enumerate(rows):
        p = row.params
        if p.frequency_penalty or p.presence_penalty:
            out = np.asarray(row.token_ids[row.num_prompt_tokens :], dtype=np.int64)
            ids, counts = np.unique(out[out < vocab], return_counts=True)
            _extend(penalty, b, ids, p.frequency_penalty * counts + p.presence_penalty)
        if p.repetition_penalty != 1.0:
            ids = np.unique(np.asarray(row.token_ids, dtype=np.int64))
            ids = ids[ids < vocab]
            _extend(seen, b, ids, np.full(ids.size, p.repetition_penalty))
        if row.banned:
            banned[0].extend([b] * len(row.banned))
            banned[1].extend(row.banned)
    if seen[0]:
        r, t = _index(xp, seen)
        vals = logits[r, t]
        rp = xp.array(np.concatenate(seen[2]), dtype=logits.dtype)
        logits[r, t] = xp.where(vals > 0, vals / rp, vals * rp)
    if penalty[0]:
        r, t = _index(xp, penalty)
        logits[r, t] = logits[r, t] - xp.array(np.concatenate(penalty[2]), dtype=logits.dtype)
    if banned[0]:
        logits[xp.array(banned[0]), xp.array(banned[1])] = -np.inf
    return logits


def filtered(logits, params: Sequence[SamplingParams]):
    """Temperature, then min-p, then top-k and top-p (vLLM v1's order), per row: unnormalised
    probabilities of a batch [len(params), vocab] of adjusted logits (numpy or MLX). Top-p
    keeps the smallest head of the sorted distribution whose mass reaches ``top_p`` (ties at
    its edge kept)."""
    xp = _xp(logits)
    vocab = logits.shape[-1]
    column = partial(_column, xp, logits.dtype)
    scaled = logits / column([p.temperature for p in params])  # a new array, ours to change
    if xp is np:
        # In place: a fresh temporary as big as the batch costs its page faults each step
        # (glibc hands freed big blocks back to the OS), several times the arithmetic.
        scaled -= scaled.max(axis=-1, keepdims=True)
        probs = np.exp(scaled, out=scaled)
    else:
        probs = mx.exp(scaled - scaled.max(axis=-1, keepdims=True))
    min_p = [p.min_p for p in params]
    if max(min_p) > 0:
        probs = _zero_below(xp, probs, column(min_p) * probs.max(axis=-1, keepdims=True))
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # 0: no top-k
    top_p = [p.top_p for p in params]
    if max(top_k) > 0 or min(top_p) < 1.0:
        probs = _top_k_top_p(probs, np.array(top_k), np.array(top_p))
    return probs


# Top-k's edge and top-p's nucleus are looked for among each row's most probable tokens
# first (at least this many); only a row they do not settle sorts its whole vocabulary.
CANDIDATES = 4096


def _top_k_top_p(probs, top_k: np.ndarray, top_p: np.ndarray):
    """``probs`` [rows, vocab] with top-k and top-p applied (``top_k`` 0: none), as the full
    sort of each row decides them, the mass running in float32 down the sorted row.

    On numpy, from each row's ``size`` largest values (``np.partition``), sorted: they are
    the head of the full sort, so their running sums are its, and so is the kth value. The
    running total is the full sort's too when every value left out is below the kth (top-k
    zeroes it) or below half a unit in the last place of the row's largest (a float sum that
    starts there cannot move by it): then a nucleus that ends within the head ends where the
    full sort's does. The other rows (a flat distribution) take the full sort, as MLX always
    does."""
    xp = _xp(probs)
    vocab = probs.shape[-1]
    size = max(CANDIDATES, int(top_k.max()))
    if xp is mx or 2 * size > vocab:
        return _apply_edges(xp, probs, *_sorted_edges(xp, probs, top_k, top_p))
    head = np.sort(np.partition(probs, vocab - size, axis=-1)[:, vocab - size :], axis=-1)
    kth, cutoff, below = _edges(np, head[:, ::-1], top_k, top_p)
    reached = below[:, 0] < size  # the nucleus ends within the head
    unseen = head[:, :1]  # the largest value left out is at most the head's smallest
    negligible = probs.max(axis=-1, keepdims=True) * (np.finfo(probs.dtype).eps / 4)
    settled = (top_p == 1.0) | (reached & (unseen < np.maximum(kth, negligible))[:, 0])
    short = np.flatnonzero(~settled)
    if short.size:
        kth[short], cutoff[short] = _sorted_edges(np, probs[short], top_k[short], top_p[short])
    return _apply_edges(np, probs, kth, cutoff)


def _sorted_edges(xp, probs, top_k: np.ndarray, top_p: np.ndarray):
    """(kth, cutoff) of ``_edges`` from the full sort of each row."""
    kth, cutoff, _ = _edges(xp, -xp.sort(-probs, axis=-1), top_k, top_p)
    return kth, cutoff


def _edges(xp, desc, top_k: np.ndarray, top_p: np.ndarray):
    """Per row [rows, 1], from ``desc``, the row's values sorted in descending order or the
    head of them (at least ``top_k`` long): the kth value (0 without top-k), top-p's cutoff
    (0 without top-p) and how many values of ``desc`` run below top-p's mass (the
    nucleus ends at the next one)."""
    k = _indices(xp, np.maximum(top_k, 1) - 1)
    kth = xp.where(_indices(xp, top_k) > 0, xp.take_along_axis(desc, k, axis=-1), 0.0)
    desc = xp.where(desc < kth, 0.0, desc)
    cum = xp.cumsum(desc, axis=-1)
    p = _column(xp, desc.dtype, top_p)
    below = (cum < p * cum[:, -1:]).sum(axis=-1, keepdims=True)
    last = xp.minimum(below, desc.shape[-1] - 1).astype(xp.int32)
    cutoff = xp.take_along_axis(desc, last, axis=-1)
    # Only rows that filter: with top_p = 1 a tail too small to move the float total
    # would be cut, and a row's tokens would depend on what it is batched with.
    cutoff = xp.where(p < 1.0, cutoff, 0.0)
    return kth, cutoff, below


def _apply_edges(xp, probs, kth, cutoff):
    return _zero_below(xp, probs, xp.maximum(kth, cutoff))


def _zero_below(xp, probs, floor):
    """``probs`` with the values below ``floor`` (per row) set to 0, in place on numpy."""
    if xp is mx:
        return mx.where(probs < floor, 0.0, probs)
    probs[probs < floor] = 0.0
    return probs


def draw_tokens(probs, uniforms: np.ndarray):
    """Inverse-CDF draw per row: the first token whose cumulative mass exceeds ``u x total``.
    ``u`` is capped one float32 step below 1 (1 - 2^-23), so ``u x total`` stays below the
    total and no zero-mass tail token can be drawn. On numpy, rows that filters left mostly
    zero sum only their kept tokens: adding a zero changes no float sum, so the running
    sums, and the token, are those of the whole row."""
    xp = _xp(probs)
    u = np.minimum(np.asarray(uniforms, dtype=np.float32), np.float32(1 - 2**-23))
    vocab = probs.shape[-1]
    if xp is np:
        kept = np.flatnonzero(probs > 0)  # a mask: 30x faster than nonzero of floats
        if 2 * kept.size <= probs.size:
            rows = np.split(kept % vocab, np.searchsorted(kept, vocab * np.arange(1, len(u))))
            return np.array([_draw_kept(*row) for row in zip(probs, rows, u, strict=True)])
    cum = xp.cumsum(probs, axis=-1)
    target = xp.array(u)[:, None] * cum[:, -1:]
    return xp.minimum((cum <= target).sum(axis=-1), vocab - 1)


def _draw_kept(probs: np.ndarray, kept: np.ndarray, u: np.float32) -> int:
    """``draw_tokens`` of one row whose nonzero tokens are ``kept`` (ascending)."""
    cum = np.cumsum(probs[kept])
    below = int((cum <= u * (cum[-1] if kept.size else 0)).sum())
    return int(kept[below]) if below < kept.size else probs.size - 1


def adjust_logits(logits: np.ndarray, row: SampleRow) -> np.ndarray:
    """``adjust`` for one row of numpy logits [vocab]."""
    return adjust(logits[None], [row])[0]


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """``filtered`` for one row of numpy logits [vocab]."""
    return filtered(logits[None], [p])[0]


def _xp(array):
    return mx if isinstance(array, mx.array) else np


def _column(xp, dtype, values):
    """Per-row values as a [rows, 1] column of ``dtype``."""
    return xp.array(np.asarray(values)[:, None]).astype(dtype)


def _indices(xp, values):
    return xp.array(np.asarray(values, dtype=np.int32)[:, None])


def _extend(parts: tuple[list, list, list], row: int, ids: np.ndarray, values: np.ndarray) -> None:
    parts[0].append(np.full(ids.size, row))
    parts[1].append(ids)
    parts[2].append(values)


def _index(xp, parts: tuple[list, list, list]):
    return xp.array(np.concatenate(parts[0])), xp.array(np.concatenate(parts[1]))


def _take(array, rows: list[int]):
    """The batch's ``rows`` (the array itself when that is all of them)."""
    if len(rows) == array.shape[0]:
        return array
    return array[mx.array(rows)] if isinstance(array, mx.array) else array[rows]


def _to_list(array) -> list[int]:
    return [int(t) for t in array.tolist()]


def _logsumexp(x: np.ndarray) -> float:
    m = x[np.isfinite(x)].max()
    return float(m + np.log(np.exp(x - m).sum()))


def make_rng(params: SamplingParams, fallback_seed: int) -> np.random.Generator | None:
    """Per-request randomness: its own seed, else one derived from the engine's seed."""
    if params.greedy:
        return None
    return np.random.default_rng(params.seed if params.seed is not None else fallback_seed)
