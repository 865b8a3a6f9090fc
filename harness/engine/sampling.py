"""The batched sampler over a step's logits (its parameters: harness/engine/sampling_params.py).

A step samples all its rows at once: penalties and bans, then temperature, min-p, top-k and
top-p, then one inverse-CDF draw per row. Randomness stays per request: each sampling row
draws its one uniform from its own ``numpy.random.Generator`` (seeded from
``SamplingParams.seed``), so a request's tokens depend on its seed, never on what it was
batched with. Greedy rows without penalties, bans or logprobs are one ``mx.argmax``.

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

Penalties are written once against an array module ``xp``: MLX where it runs on a GPU (the
logits never leave the device), numpy on MLX's CPU build, where numpy's ``exp`` measured 5x
faster than MLX's (``python -m harness.bench sampling``). The filters are batched whole-row
MLX arrays on a GPU; on numpy they look at each row's candidates first (``kept_tokens``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, partial

import mlx.core as mx
import numpy as np

from harness.engine.sampling_params import (
    Logprob,
    LogprobsMode,
    SamplingParams,
    TokenLogprobs,
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
    logprobs: TokenLogprobs | None = None  # when the row's params ask for logprobs


def sample(
    logits: mx.array, rows: Sequence[SampleRow], logprobs_mode: LogprobsMode = "raw_logprobs"
) -> list[Sampled]:
    """Pick one token per row of ``logits`` [len(rows), vocab]; logprobs per ``logprobs_mode``
    for the rows that ask for them."""
    if all(r.params.argmax and not r.banned for r in rows):  # SamplingParams.argmax's case
        return [Sampled(t) for t in argmax_tokens(logits)]
    xp = mx if mx.default_device().type == mx.DeviceType.gpu else np
    table = logits.astype(mx.float32)
    adjusted = adjust(table if xp is mx else np.asarray(table), rows)
    tokens = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    draw = [i for i, r in enumerate(rows) if not r.params.greedy]
    if greedy:
        for i, token in zip(greedy, _to_list(_take(adjusted, greedy).argmax(axis=-1)), strict=True):
            tokens[i] = token
    kept: dict[int, np.ndarray] = {}  # a drawing row's kept token ids
    if draw:
        params = [rows[i].params for i in draw]
        uniforms = np.array([rows[i].rng.random() for i in draw])
        if xp is np:
            for i, (ids, probs), u in zip(
                draw, kept_tokens(_take(adjusted, draw), params), uniforms, strict=True
            ):
                tokens[i], kept[i] = _draw(ids, probs, u), ids
        else:
            probs = filtered(_take(adjusted, draw), params)
            drawn = _to_list(draw_tokens(probs, uniforms))
            for j, (i, token) in enumerate(zip(draw, drawn, strict=True)):
                tokens[i] = token
                if rows[i].params.logprobs is not None:
                    kept[i] = np.flatnonzero(np.asarray(_take(probs, [j]))[0])
    out = []
    for i, row in enumerate(rows):
        n = row.params.logprobs
        if n is None:
            out.append(Sampled(tokens[i]))
            continue
        values = logprob_values(
            np.asarray(_take(table, [i]))[0],
            np.asarray(_take(adjusted, [i]))[0],
            kept.get(i),
            row.params,
            logprobs_mode,
        )
        out.append(Sampled(tokens[i], logprob_dict(values, tokens[i], n)))
    return out


def argmax_tokens(logits: mx.array) -> list[int]:
    """Each row's highest-scoring token of ``logits`` [rows, vocab] (the first of equals, as
    both ``mx.argmax`` and ``np.argmax`` break ties): numpy's or MLX's, as
    ``argmax_on_host`` says."""
    if argmax_on_host(logits.dtype):
        return np.asarray(logits).argmax(axis=-1).tolist()
    return mx.argmax(logits, axis=-1).tolist()


@cache
def argmax_on_host(dtype: mx.Dtype) -> bool:
    """Logits of ``dtype`` take their argmax in numpy, on the host, not in MLX: on MLX's CPU
    build over float32 or float16. There MLX's argmax is a plain reduction, ~12x numpy's
    (3.4 against 0.27 ms over 32 x 49,152 float32 logits, SmolLM2's batch 32), and a round
    trip to its CPU stream when run apart from the forward (65 against 5 µs at batch 32 on
    the tiny model's 1,024 tokens). On a GPU, and for bfloat16 (which numpy lacks), MLX's,
    on the device: in the forward's own graph when that is all a step samples (the engine's
    ``_launch``). Decided once per dtype, on the default device then (a cached call is no
    Python frame: it runs every step)."""
    return dtype in _NUMPY_FLOATS and mx.default_device().type == mx.DeviceType.cpu


_NUMPY_FLOATS = (mx.float32, mx.float16)


def logprob_values(
    raw: np.ndarray,
    adjusted: np.ndarray,
    kept: np.ndarray | None,
    params: SamplingParams,
    mode: LogprobsMode,
) -> np.ndarray:
    """One row's values that ``mode`` reports, from its ``raw`` logits, its ``adjusted``
    (penalised, banned) logits and, for a sampling row, the tokens its filters ``kept`` (a
    mask or their ids; a token whose probability underflows float32 counts as filtered: it
    cannot be drawn)."""
    if mode.startswith("raw"):
        values = raw.astype(np.float64)
    elif params.greedy:
        values = adjusted.astype(np.float64)
    else:
        values = np.full(adjusted.shape, -np.inf)
        values[kept] = adjusted[kept].astype(np.float64) / params.temperature
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
    """Temperature, then min-p, then top-k and top-p (vLLM v1's order), per row of a batch
    [len(params), vocab] of adjusted logits (numpy or MLX): the unnormalised probabilities
    exp((logit - max) / temperature), float32, with the filtered tokens at 0. Min-p keeps the
    tokens at least ``min_p`` times as probable as the most probable one; top-k the ``top_k``
    most probable; top-p the smallest head of the sorted distribution whose mass reaches
    ``top_p`` of the row's (after min-p and top-k); ties at an edge are kept. On numpy the
    masses are summed in float64; MLX on a GPU (no float64) sums in float32, so a nucleus
    whose edge lies within float32 rounding of ``top_p`` can end one token apart."""
    if _xp(logits) is mx:
        return _filtered_mlx(logits, params)
    probs = np.zeros(logits.shape, dtype=np.float32)
    for r, (ids, values) in enumerate(kept_tokens(logits, params)):
        probs[r, ids] = values
    return probs


# Top-k's and top-p's edges are looked for among each row's candidates: the tokens within
# TAIL nats (at the row's temperature) of its most probable one, a few hundred on a served
# model's peaked rows. A token left out weighs at most TAIL_MASS (e^-16, with room for
# float32 rounding) of the most probable, at most e^-20 beyond 20 nats and e^-24 beyond 24
# (BANDS): counting the tokens within each bounds their mass. Where that bound straddles
# top-p's edge, the row's exact total is taken; where an edge could lie among the tokens
# left out, the whole row. Either way the result is the whole row's computation, bit for
# bit. A flat row (more than 1/FLAT of its tokens candidates) is done whole at once: its
# exps cost less than picking them out. Rows are done one at a time: a row's comparisons
# stay in cache, a whole batch's do not (measured 25-33 % slower).
TAIL = 16.0
BANDS = (20.0, 24.0)
BAND_MASS = tuple(math.exp(-nats + 1e-3) for nats in (TAIL, *BANDS))
TAIL_MASS = BAND_MASS[0]
FLAT = 8
HEAD = 64  # candidates sorted first, four times more while an edge lies beyond them
SUM_ERROR = 1e-9  # bounds two float64 sums of the same values in different orders, relative


def kept_tokens(logits: np.ndarray, params: Sequence[SamplingParams]) -> list[tuple]:
    """``filtered`` for numpy logits [rows, vocab], as (token ids ascending, probabilities)
    per row: the tokens with nonzero probability alone."""
    vocab = logits.shape[-1]
    top = logits.max(axis=-1)
    temperature = np.array([p.temperature for p in params], dtype=np.float32)
    candidates: list[tuple | None] = [None] * len(params)
    for r, p in enumerate(params):
        if not (0 < p.top_k < vocab or p.top_p < 1):
            continue
        row, edge = logits[r], top[r] - np.float32(TAIL) * temperature[r]
        near = row >= edge
        n = np.count_nonzero(near)
        if n * FLAT <= vocab:
            left_out, within = 0.0, n
            for nats, mass in zip(BANDS, BAND_MASS[:-1], strict=True):  # tokens within ``nats``
                reach = np.count_nonzero(row >= top[r] - np.float32(nats) * temperature[r])
                left_out += (reach - within) * mass
                within = reach
            left_out += (vocab - within) * BAND_MASS[-1]
            candidates[r] = (np.flatnonzero(near), left_out)
    return [
        _kept_row(logits[r], top[r], temperature[r], p, candidates[r]) for r, p in enumerate(params)
    ]


def _kept_row(logits: np.ndarray, top, temperature, params: SamplingParams, candidates):
    """One row of ``kept_tokens`` from its candidates (token ids, a bound on the mass of the
    tokens left out), or from all its tokens (None)."""
    vocab = logits.size
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if candidates is None:
        ids = np.arange(vocab)
        probs = _probs(logits, top, temperature, params.min_p)
        total = probs.sum(dtype=np.float64) if params.top_p < 1 else 0.0
        floor = kept_floor(probs, top_k, params.top_p, (total, total), partial=False)
    else:
        ids, left_out = candidates
        probs = _probs(logits[ids], top, temperature, params.min_p)
        left_out = 0.0 if params.min_p > TAIL_MASS else left_out
        # Top-p's total, where top-k does not set it (from the head, in kept_floor).
        mass = probs.sum(dtype=np.float64) if params.top_p < 1 and not top_k else 0.0
        bounds = (mass * (1 - SUM_ERROR), (mass + left_out) * (1 + SUM_ERROR))
        floor = kept_floor(probs, top_k, params.top_p, bounds, partial=left_out > 0)
        if floor is None and left_out:
            total = _probs(logits, top, temperature, params.min_p).sum(dtype=np.float64)
            floor = kept_floor(probs, top_k, params.top_p, (total, total), partial=True)
        if floor is None:
            return _kept_row(logits, top, temperature, params, None)
    kept = probs >= floor if floor > 0 else probs > 0
    if np.count_nonzero(kept) == kept.size:  # cheaper than listing them all
        return ids, probs
    keep = np.flatnonzero(kept)
    return ids[keep], probs[keep]


def _probs(logits: np.ndarray, top, temperature, min_p: float) -> np.ndarray:
    """exp((logit - max) / temperature), float32, min-p applied: the same values whichever
    tokens ``logits`` holds."""
    probs = np.exp((logits - top) / temperature)
    if min_p > 0:
        probs[probs < min_p] = 0.0
    return probs


def kept_floor(
    probs: np.ndarray, top_k: int, top_p: float, mass: tuple, partial: bool
) -> float | None:
    """The least probability top-k (``top_k`` 0: none) and top-p keep among ``probs``, 0 when
    they keep everything. ``mass`` bounds the row's total (low, high: equal when exact);
    ``partial``: tokens with mass, each at most TAIL_MASS, are left out of ``probs``. None
    when the bounds, or the tokens left out, could move an edge."""
    if not top_k and top_p == 1.0:
        return 0.0
    n = probs.size
    if top_k > n:  # the kth is among the tokens left out, or is a 0
        if partial:
            return None
        top_k = 0
    size = max(HEAD, top_k, 0 if partial else n // 64)
    while True:
        size = min(size, n)
        head = np.sort(np.partition(probs, n - size)[n - size :] if size < n else probs)[::-1]
        kth = head[top_k - 1] if top_k else 0.0
        if size < n and kth and head[-1] == kth:  # ties with the kth beyond the head
            size *= 4
            continue
        if partial and kth and kth <= TAIL_MASS:
            return None
        if top_p == 1.0:
            return kth
        nucleus = head[head >= kth] if top_k else head
        cum = np.cumsum(nucleus, dtype=np.float64)
        # Top-k keeps nothing beyond the head, so the head's sum is the total.
        low, high = (cum[-1], cum[-1]) if top_k else mass
        below = int(np.searchsorted(cum, top_p * low))
        if below != int(np.searchsorted(cum, top_p * high)):
            return None
        if below >= cum.size and size < n:  # the nucleus ends beyond the head
            size *= 4
            continue
        if below >= cum.size and partial:
            return None
        cutoff = nucleus[min(below, cum.size - 1)]
        return None if partial and cutoff <= TAIL_MASS else cutoff


def _filtered_mlx(logits: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """``filtered`` on MLX: each row sorted in full, its mass summed in float32."""
    vocab = logits.shape[-1]
    column = partial(_column, dtype=logits.dtype)
    temperature = column([p.temperature for p in params])
    probs = mx.exp((logits - logits.max(axis=-1, keepdims=True)) / temperature)
    probs = mx.where(probs < column([p.min_p for p in params]), 0.0, probs)
    top_k = np.array([p.top_k if 0 < p.top_k < vocab else 0 for p in params])
    top_p = np.array([p.top_p for p in params])
    if top_k.max() == 0 and top_p.min() == 1.0:
        return probs
    desc = -mx.sort(-probs, axis=-1)
    kth = mx.where(
        _column(top_k, mx.int32) > 0,
        mx.take_along_axis(desc, _column(np.maximum(top_k, 1) - 1, mx.int32), axis=-1),
        0.0,
    )
    desc = mx.where(desc < kth, 0.0, desc)
    cum = mx.cumsum(desc, axis=-1)
    p = column(top_p)
    below = (cum < p * cum[:, -1:]).sum(axis=-1, keepdims=True)
    cutoff = mx.take_along_axis(desc, mx.minimum(below, vocab - 1).astype(mx.int32), axis=-1)
    cutoff = mx.where(p < 1.0, cutoff, 0.0)
    return mx.where(probs < mx.maximum(kth, cutoff), 0.0, probs)


def draw_tokens(probs, uniforms: np.ndarray):
    """Inverse-CDF draw per row of ``probs`` [rows, vocab] (numpy or MLX): the first token
    whose running mass, in token-id order, exceeds ``u x total`` (the last token with mass
    when rounding leaves none)."""
    if _xp(probs) is np:
        rows = [np.flatnonzero(row) for row in probs]
        return np.array(
            [_draw(ids, row[ids], u) for ids, row, u in zip(rows, probs, uniforms, strict=True)]
        )
    cum = mx.cumsum(probs, axis=-1)
    target = mx.array(np.asarray(uniforms, dtype=np.float32))[:, None] * cum[:, -1:]
    last = probs.shape[-1] - 1 - mx.argmax(probs[:, ::-1] > 0, axis=-1)
    return mx.minimum((cum <= target).sum(axis=-1), last)


def _draw(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """``draw_tokens`` of one row whose tokens with mass are ``ids`` (ascending), in float64."""
    cum = np.cumsum(probs, dtype=np.float64)
    return int(ids[min(int(np.searchsorted(cum, u * cum[-1], side="right")), ids.size - 1)])


def adjust_logits(logits: np.ndarray, row: SampleRow) -> np.ndarray:
    """``adjust`` for one row of numpy logits [vocab]."""
    return adjust(logits[None], [row])[0]


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """``filtered`` for one row of numpy logits [vocab]."""
    return filtered(logits[None], [p])[0]


def _xp(array):
    return mx if isinstance(array, mx.array) else np


def _column(values, dtype=mx.float32) -> mx.array:
    """Per-row values as an MLX column [rows, 1]."""
    return mx.array(np.asarray(values)[:, None]).astype(dtype)


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
