"""The batched sampler: filters, penalties and the draw against hand-computed values; a
request's tokens do not depend on its batch; numpy and MLX compute the same; the draws
follow the filtered distribution (chi-square, NIST/SEMATECH e-Handbook 1.3.6.7.4)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import harness  # noqa: F401  (BLAS switch before mlx)
from harness.engine import sampling
from harness.engine.sampling import SampleRow, adjust, draw_tokens, filtered, sample
from harness.engine.sampling_params import SamplingParams, make_rng

CHI2_999_DOF3 = 16.266  # upper 0.1 % point: a correct sampler fails 1 run in 1000


def row(params=None, tokens=(0,), prompt=1, seed=0, banned=()):
    params = params or SamplingParams()
    return SampleRow(params, list(tokens), prompt, make_rng(params, seed), tuple(banned))


def test_filters_by_hand():
    """Probabilities 1 : 2 : 3 : 4, unnormalised as exp(x - max): .25, .5, .75, 1."""
    logits = np.log(np.array([[1.0, 2.0, 3.0, 4.0]] * 5, dtype=np.float32))
    params = [
        SamplingParams(top_k=2),  # the two largest
        SamplingParams(top_p=0.5),  # 1 (.4 of 2.5) < .5 <= 1 + .75: two kept
        SamplingParams(top_p=0.3),  # the largest alone reaches .3
        SamplingParams(min_p=0.6),  # >= .6 x max
        SamplingParams(temperature=0.5),  # squares the ratios: 1 : 4 : 9 : 16
    ]
    got = np.asarray(filtered(logits, params))
    want = [
        [0, 0, 0.75, 1],
        [0, 0, 0.75, 1],
        [0, 0, 0, 1],
        [0, 0, 0.75, 1],
        [1 / 16, 4 / 16, 9 / 16, 1],
    ]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_filters_combine_in_vllm_v1_order():
    """Probabilities .5 .3 .1 .1 (unnormalised 1, .6, .2, .2). min-p .25 first (vLLM v1)
    keeps .5 and .3; top-p .6 of what is left (.8) is reached by .5 alone. Top-k 3 then top-p
    .5 on 1 : 2 : 3 : 4 keeps 3 and 4. A row without filters beside them keeps everything."""
    probs = np.array([0.5, 0.3, 0.1, 0.1], dtype=np.float32)
    logits = np.log(np.stack([probs, np.array([1, 2, 3, 4.0]), probs])).astype(np.float32)
    params = [SamplingParams(min_p=0.25, top_p=0.6), SamplingParams(top_k=3, top_p=0.5)]
    got = np.asarray(filtered(logits, [*params, SamplingParams()]))
    want = [[1, 0, 0, 0], [0, 0, 0.75, 1], [1, 0.6, 0.2, 0.2]]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_penalties_and_bans_by_hand():
    """vLLM's order. Prompt [0], output [2, 2, 4]: repetition 2 first halves the positive
    logits of 0, 2 and 4 (a negative one would double): 0.5, 1, 1.5; then frequency .5 and
    presence .1 take 1.1 from token 2 and .6 from token 4; token 3 is banned."""
    logits = np.array([[1.0, -1.0, 2.0, 0.5, 3.0]], dtype=np.float32)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.1, repetition_penalty=2.0)
    got = adjust(logits, [row(params, tokens=[0, 2, 2, 4], prompt=1, banned=[3])])
    np.testing.assert_allclose(got, [[0.5, -1.0, -0.1, -np.inf, 0.9]], rtol=1e-6)
    assert logits[0, 0] == 1.0  # the input is left alone


def test_draw_by_hand():
    """Mass 1, 1, 2 (total 4): u x 4 falls in [0, 1) -> 0, [1, 2) -> 1, [2, 4) -> 2."""
    probs = np.array([[1.0, 1.0, 2.0]] * 3, dtype=np.float32)
    assert draw_tokens(probs, np.array([0.2, 0.3, 0.99], dtype=np.float32)).tolist() == [0, 1, 2]
    # A uniform that rounds to 1.0 in float32 never lands on a zero-mass tail token.
    tail = np.array([[1.0, 1.0, 0.0]], dtype=np.float32)
    assert draw_tokens(tail, np.array([1 - 1e-9])).tolist() == [1]


def test_numpy_and_mlx_compute_the_same():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    params = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(top_k=5, min_p=0.05),
        SamplingParams(temperature=1.3, repetition_penalty=1.2, frequency_penalty=0.4),
        SamplingParams(temperature=0.5, top_k=10, top_p=0.7, presence_penalty=0.5),
        SamplingParams(),
        SamplingParams(temperature=2.0, min_p=0.2),
    ]
    rows = [row(p, tokens=[1, 2, 3, 3, 40], prompt=2, banned=(7,)) for p in params]
    uniforms = rng.random(6).astype(np.float32)
    want = draw_tokens(filtered(adjust(logits, rows), params), uniforms).tolist()
    probs = filtered(adjust(mx.array(logits), rows), params)
    np.testing.assert_allclose(
        np.asarray(probs), filtered(adjust(logits, rows), params), rtol=1e-5, atol=1e-7
    )
    assert draw_tokens(probs, uniforms).tolist() == want


def test_a_requests_tokens_do_not_depend_on_its_batch():
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(size=(5, 64)).astype(np.float32))
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=8, seed=12, logprobs=3),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=13),
        SamplingParams(temperature=0, presence_penalty=1.0),
    ]

    def rows():
        return [row(p, tokens=[4, 5, 6], prompt=2, seed=i) for i, p in enumerate(params)]

    for _ in range(3):  # a few draws from the same generators
        batched = sample(logits, rows())
        alone = [sample(logits[i : i + 1], [r])[0] for i, r in enumerate(rows())]
        assert batched == alone


def test_draws_follow_the_filtered_distribution():
    """4 tokens kept by top_p 0.9 at temperature 0.8 out of 8; 4,000 draws."""
    logits = np.log(np.array([8, 7, 6, 5, 1, 1, 0.5, 0.5], dtype=np.float32))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    p = filtered(logits[None], [params])[0]
    p = p / p.sum()
    assert (p > 0).sum() == 4
    r = row(params, seed=5)
    n = 4000
    picks = [sample(mx.array(logits[None]), [r])[0].token for _ in range(n)]
    counts = np.bincount(picks, minlength=8)
    assert counts[p == 0].sum() == 0
    expected = n * p[p > 0]
    assert ((counts[p > 0] - expected) ** 2 / expected).sum() < CHI2_999_DOF3


def reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """``filtered``'s definition over one whole sorted row: float32 probabilities, min-p,
    then top-k and top-p with masses summed in float64 (top-p's total: top-k's head when
    top-k filters, else the row's sum), ties at the edges kept."""
    probs = np.exp((logits - logits.max()) / np.float32(p.temperature))
    probs[probs < p.min_p] = 0
    desc = np.sort(probs)[::-1]
    k = p.top_k if 0 < p.top_k < logits.size else 0
    kth = desc[k - 1] if k else 0.0
    cutoff = 0.0
    if p.top_p < 1:
        kept = desc[desc >= kth] if k else desc
        cum = np.cumsum(kept, dtype=np.float64)
        total = cum[-1] if k else probs.sum(dtype=np.float64)
        cutoff = kept[min(np.searchsorted(cum, p.top_p * total), cum.size - 1)]
    floor = max(kth, cutoff)
    return np.where(probs >= floor if floor > 0 else probs > 0, probs, 0).astype(np.float32)


VOCAB = 2048


def _rows() -> np.ndarray:
    """Logits, one row per way the candidates (tokens within sampling.TAIL nats of the top
    at the row's temperature) can settle the edges; at temperature 1:
    peaked     a few tokens on top, the rest 40 below: the candidates settle everything;
    straddle   two tokens equally on top, 2,046 just beyond the candidates: their bound
               straddles top-p 0.5's edge, their exact total settles it;
    heavy      one token on top, the rest just beyond the candidates, together more than
               1 - top_p of the mass: the nucleus ends among them (the whole row);
    flat       normal, scale 3: every token a candidate;
    ties       100 tokens tied on top."""
    rng = np.random.default_rng(2)
    peaked = rng.normal(size=VOCAB) - 40
    peaked[:5] = [9, 8, 8, 7, 3]
    straddle = np.full(VOCAB, -16.5)
    straddle[:2] = 0
    heavy = np.full(VOCAB, -16.5)
    heavy[0] = 0
    flat = rng.normal(size=VOCAB) * 3
    ties = np.zeros(VOCAB)
    ties[:100] = 1.0
    return np.stack([peaked, straddle, heavy, flat, ties]).astype(np.float32)


CANDIDATE_CASES = [
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.99999),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=50),  # more than the peaked row's candidates
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=300, top_p=0.5, min_p=0.01),
    SamplingParams(temperature=1.2),
]


def test_candidates_give_the_whole_rows_probabilities_and_tokens(monkeypatch):
    """Top-k and top-p from each row's candidates leave exactly what the definition over the
    whole sorted row leaves, whichever way the row settles (each way is counted and taken:
    by the bound on the tokens left out, by the row's exact total, or over the whole row);
    the draws are the inverse CDF of those probabilities, in float64."""
    logits = _rows()
    ways = set()
    floor = sampling.kept_floor

    def counted(probs, top_k, top_p, mass, partial):
        out = floor(probs, top_k, top_p, mass, partial)
        ways.add(("whole row" if probs.size == VOCAB else "candidates", mass[0] == mass[1], out))
        return out

    monkeypatch.setattr(sampling, "kept_floor", counted)
    uniforms = np.random.default_rng(3).random((10, len(logits)))
    for params in CANDIDATE_CASES:
        got = filtered(logits, [params] * len(logits))
        want = np.stack([reference(row, params) for row in logits])
        np.testing.assert_array_equal(got, want, err_msg=str(params))
        cum = np.cumsum(want, axis=-1, dtype=np.float64)
        for u in uniforms:
            inverse_cdf = (cum <= u[:, None] * cum[:, -1:]).sum(axis=-1).tolist()
            assert draw_tokens(got, u).tolist() == inverse_cdf
    settled = {(where, exact) for where, exact, out in ways if out is not None}
    assert ("candidates", False) in settled  # by the bound on the tokens left out
    assert ("candidates", True) in settled  # by the row's exact total
    assert ("candidates", True, None) in ways  # ... or not: done over the whole row
    assert ("whole row", True) in settled


def test_sample_draws_what_filtered_and_draw_tokens_give():
    """``sample`` (the candidates' kept tokens, drawn) against ``filtered`` + ``draw_tokens``
    on the same uniforms, for every case."""
    logits = _rows()
    for params in CANDIDATE_CASES:
        for seed in range(5):
            rows = [row(params, seed=seed) for _ in logits]
            uniforms = np.array([make_rng(params, seed).random()] * len(logits))
            want = draw_tokens(filtered(logits, [params] * len(logits)), uniforms).tolist()
            assert [s.token for s in sample(mx.array(logits), rows)] == want


def test_argmax_tokens_take_the_first_of_equals_as_mlx_does():
    logits = mx.array([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 2.0, 2.0]])
    assert sampling.argmax_tokens(logits) == [1, 0, 2]
    assert sampling.argmax_tokens(logits) == mx.argmax(logits, axis=-1).tolist()
    assert sampling.argmax_tokens(logits.astype(mx.bfloat16)) == [1, 0, 2]  # MLX's own


def test_argmax_params_are_greedy_without_penalties_or_logprobs():
    assert SamplingParams(temperature=0).argmax
    assert SamplingParams(temperature=0, min_tokens=3).argmax  # bans are the row's to say
    assert not SamplingParams(temperature=0.5).argmax
    assert not SamplingParams(temperature=0, repetition_penalty=1.1).argmax
    assert not SamplingParams(temperature=0, logprobs=0).argmax
