"""The sampler's cost per step, greedy against penalties, temperature, top-k and top-p.

``python -m harness.bench sampling [--logits random,smollm2] [--batch 32] [--vocab 128256]``

A batch of logits [batch, vocab] of each kind, each figure the median of ``--repeats``
synchronised calls after a warm-up, all in one process:

    random   normal, scale 3, ``--vocab`` wide: flat, a top-p 0.9 nucleus of thousands
    smollm2  SmolLM2-135M-Instruct's next-token log-probabilities (logits less a per-row
             constant, which no filter sees) along its greedy answers to chat prompts:
             peaked, as a served model's are (vocabulary 49,152)

and per case:

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
from mlx_lm.generate import generate_step

from harness.bench.support.tables import underlined
from harness.bench.support.timing import median_seconds
from harness.engine.sampling import SampleRow, adjust, draw_tokens, filtered, sample
from harness.engine.sampling_params import SamplingParams, make_rng
from harness.platform.smollm2 import load_smollm2

CASES = {
    "greedy": SamplingParams(temperature=0),
    "greedy + repetition 1.1": SamplingParams(temperature=0, repetition_penalty=1.1),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.8 + top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "temperature 0.8 + top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "temperature 0.8 + top_p 0.95 + top_k 50": SamplingParams(
        temperature=0.8, top_p=0.95, top_k=50
    ),
}
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "What is 17 times 23?",
    "Give me a name for a grey cat.",
    "Summarise the plot of Romeo and Juliet.",
)


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


def random_logits(batch: int, vocab: int) -> mx.array:
    """Normal logits, scale 3 (seeded)."""
    rng = np.random.default_rng(0)
    return mx.array((rng.normal(size=(batch, vocab)) * 3).astype(np.float32))


def smollm2_logits(batch: int) -> mx.array:
    """``batch`` rows of SmolLM2's next-token log-probabilities: the first steps of its greedy
    answer to each of ``PROMPTS`` (chat template applied), the prompts taken in turn."""
    loaded = load_smollm2()
    steps = -(-batch // len(PROMPTS))
    answers = []
    for text in PROMPTS:
        chat = [{"role": "user", "content": text}]
        prompt = loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        stepper = generate_step(mx.array(prompt), loaded.model, max_tokens=steps)
        answers.append([logprobs for _, logprobs in stepper])
    rows = [answer[i] for i in range(steps) for answer in answers]
    return mx.stack(rows[:batch]).astype(mx.float32)


def describe(logits: mx.array) -> str:
    """How peaked the rows are at temperature 0.8: the median top-1 probability and the
    median number of tokens in the top-p 0.9 nucleus."""
    scaled = np.array(logits, dtype=np.float64) / 0.8
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    desc = -np.sort(-probs / probs.sum(axis=-1, keepdims=True), axis=-1)
    nucleus = (np.cumsum(desc, axis=-1) < 0.9).sum(axis=-1) + 1
    return (
        f"at temperature 0.8: top-1 probability median {np.median(desc[:, 0]):.2f}, "
        f"top-p 0.9 nucleus median {np.median(nucleus):.0f} tokens"
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench sampling", description=__doc__)
    parser.add_argument("--logits", default="random,smollm2", help="random and/or smollm2")
    parser.add_argument("--batch", type=int, default=32, help="rows sampled per step")
    parser.add_argument("--vocab", type=int, default=128256, help="random: vocabulary size")
    parser.add_argument("--history", type=int, default=512, help="prompt + output tokens/row")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per figure")
    args = parser.parse_args(argv)
    print(
        f"batch {args.batch}, {args.history} tokens of history per row, device "
        f"{mx.default_device()}; ms per step, median of {args.repeats}"
    )
    for kind in args.logits.split(","):
        logits = (
            smollm2_logits(args.batch)
            if kind == "smollm2"
            else random_logits(args.batch, args.vocab)
        )
        mx.eval(logits)
        print(f"\n{kind} logits, vocab {logits.shape[-1]}; {describe(logits)}")
        _table(logits, args)


def _table(logits: mx.array, args) -> None:
    rng = np.random.default_rng(0)
    vocab = logits.shape[-1]
    history = [rng.integers(0, vocab, args.history).tolist() for _ in range(args.batch)]
    header = f"{'case':40} {'sample()':>9} {'numpy':>9} {'mlx':>9} {'ratio':>7}"
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
            f"{name:40} {engine * 1e3:9.1f} {on_numpy * 1e3:9.1f} {on_mlx * 1e3:9.1f} "
            f"{engine / greedy:7.2f}",
            flush=True,
        )
