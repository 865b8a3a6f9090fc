"""The sampler's cost per step: greedy against penalties, temperature, top-p, on numpy and MLX.

``python -m harness.bench sampling [--batch 32] [--vocab 128256] [--repeats 7]``

One batch of random logits [batch, vocab] (normal, scale 3), each figure the median of
``--repeats`` synchronised calls after a warm-up, all in one process:

    sample()         what the engine calls (greedy: one mx.argmax; otherwise the batched
                     pipeline on the backend MLX's device selects: numpy on CPU, MLX on GPU)
    numpy / mlx      the same batched pipeline (adjust, filter, draw) forced onto each
                     backend, so the choice between them is measured, not assumed

ratio = the figure / greedy sample(): the issue's goal is <= 2 for temperature + top-p.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from harness.bench._table import underlined
from harness.bench._timing import median_seconds
from harness.engine.sampling import (
    SampleRow,
    SamplingParams,
    adjust,
    draw_tokens,
    filtered,
    make_rng,
    sample,
)

CASES = {
    "greedy": SamplingParams(temperature=0),
    "greedy + repetition 1.1": SamplingParams(temperature=0, repetition_penalty=1.1),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.8 + top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
}


def _pipeline(logits, rows: list[SampleRow]):
    """The batched pipeline on the backend of ``logits`` (numpy or MLX), evaluated."""
    adjusted = adjust(logits, rows)
    params = [r.params for r in rows]
    if params[0].greedy:
        out = adjusted.argmax(axis=-1)
    else:
        uniforms = np.array([r.rng.random() for r in rows], dtype=np.float32)
        out = draw_tokens(filtered(adjusted, params), uniforms)
    return out.tolist()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench sampling", description=__doc__)
    parser.add_argument("--batch", type=int, default=32, help="rows sampled per step")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary size")
    parser.add_argument("--history", type=int, default=512, help="prompt + output tokens/row")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per figure")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    host = (rng.normal(size=(args.batch, args.vocab)) * 3).astype(np.float32)
    logits = mx.array(host)
    mx.eval(logits)
    history = [rng.integers(0, args.vocab, args.history).tolist() for _ in range(args.batch)]
    print(
        f"batch {args.batch}, vocab {args.vocab}, {args.history} tokens of history per row, "
        f"device {mx.default_device()}; ms per step, median of {args.repeats}"
    )
    header = f"{'case':30} {'sample()':>9} {'numpy':>9} {'mlx':>9} {'ratio':>7}"
    print(underlined(header))
    greedy = None
    for name, params in CASES.items():

        def rows(p=params):
            return [SampleRow(p, h, len(h) // 2, make_rng(p, i)) for i, h in enumerate(history)]

        fixed = rows()
        engine = median_seconds(lambda r=fixed: sample(logits, r), args.repeats)
        on_numpy = median_seconds(lambda r=fixed: _pipeline(np.array(logits), r), args.repeats)
        on_mlx = median_seconds(lambda r=fixed: _pipeline(logits, r), args.repeats)
        greedy = greedy or engine
        print(
            f"{name:30} {engine * 1e3:9.1f} {on_numpy * 1e3:9.1f} {on_mlx * 1e3:9.1f} "
            f"{engine / greedy:7.2f}",
            flush=True,
        )
