"""Sliding-window identity matrix: greedy tokens against mlx_lm's rotating caches, by allocator.

``python -m harness.bench sliding_window [--models tiny_gemma3,tiny_gpt_oss,tiny_llama_swa]
[--window 16] [--block-size 8] [--prompts 3,20,45,90] [--max-tokens 40] [--batch 4]``

For each random tiny model with sliding-window layers (conf/model/ options, the window set to
``--window``: tiny_gemma3, every third layer full; tiny_gpt_oss, window and full layers
alternating; tiny_llama_swa, a Mistral-style Llama, the same alternation through mlx_lm's
``layer_types``) and each allocator, one engine (FCFS,
``max_num_seqs=--batch``) generates every prompt at once, greedily; a cell is ``identical``
when every request's tokens equal mlx_lm's ``generate_step`` over ``model.make_cache()``
(``RotatingKVCache`` for window layers), else how many requests differ. Beside it, the most
ring blocks one sequence held (never above k = ceil(window / block size) + 1), and whether a
model without the window (same weights, window 4096) gives other tokens on these prompts:
``yes`` means the matrix tests the window.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from harness.bench.support.components import ALLOCATORS, compose_config
from harness.cli.run import build_component
from harness.engine import build_engine
from harness.engine.sampling_params import SamplingParams
from harness.platform.models import LoadedModel
from schedulers.kv_groups import ring_blocks

# conf/model/ options with sliding-window layers, one per way of placing them.
MODELS = "tiny_gemma3,tiny_gpt_oss,tiny_llama_swa"


def build_model(name: str, window: int) -> LoadedModel:
    """The conf/model/ option ``name`` with its sliding window set to ``window`` tokens."""
    return build_component(
        compose_config([f"model={name}", f"++model.sliding_window={window}"]).model
    )


def mlx_lm_tokens(model: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model.model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


def run(model: LoadedModel, allocator: str, prompts, args) -> tuple[list[list[int]], int]:
    """Every prompt's tokens, and the most ring blocks one sequence held at a step, with
    ``allocator`` a conf/allocator/ option."""
    cfg = compose_config(
        [f"allocator={allocator}", "scheduler=fcfs", f"scheduler.max_num_seqs={args.batch}"]
    )
    engine = build_engine(
        model,
        build_component(cfg.allocator),
        build_component(cfg.scheduler),
        block_size=args.block_size,
        num_blocks=sum(-(-(len(p) + args.max_tokens) // args.block_size) for p in prompts) * 2,
        record=False,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        ring = engine.window.allocator
        for seq in engine.scheduler.running:
            most = max(most, len(ring.block_table(seq.request_id)))
    return [outputs[str(i)] for i in range(len(prompts))], most


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.bench sliding_window", description=__doc__
    )
    parser.add_argument(
        "--models", default=MODELS, help="conf/model/ options, comma-separated, e.g. " + MODELS
    )
    parser.add_argument("--window", type=int, default=16, help="sliding window in tokens")
    parser.add_argument("--block-size", type=int, default=8, help="KV block size in tokens")
    parser.add_argument(
        "--prompts", default="3,20,45,90", help="prompt lengths in tokens, comma-separated"
    )
    parser.add_argument("--max-tokens", type=int, default=40, help="tokens generated per prompt")
    parser.add_argument("--batch", type=int, default=4, help="max_num_seqs (running at once)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(13)
    lengths = [int(n) for n in args.prompts.split(",")]
    prompts = [rng.integers(1, 1024, n).tolist() for n in lengths]
    k = ring_blocks(args.window, args.block_size)
    print(
        f"window {args.window}, block size {args.block_size} (ring k = {k} blocks), prompts "
        f"{lengths} tokens, {args.max_tokens} generated each, greedy, FCFS, batch {args.batch}; "
        "reference: mlx_lm generate_step over make_cache() (RotatingKVCache)"
    )
    header = f"{'model':<15}" + "".join(f"{a:>12}" for a in ALLOCATORS)
    print(header + f"{'ring max':>10}{'window matters':>16}")
    for name in args.models.split(","):
        model = build_model(name, args.window)
        reference = [mlx_lm_tokens(model, p, args.max_tokens) for p in prompts]
        wide = build_model(name, 4096)
        matters = [mlx_lm_tokens(wide, p, args.max_tokens) for p in prompts] != reference
        cells, most = [], 0
        for allocator in ALLOCATORS:
            got, held = run(model, allocator, prompts, args)
            most = max(most, held)
            differ = sum(g != r for g, r in zip(got, reference, strict=True))
            cells.append("identical" if not differ else f"{differ}/{len(prompts)} differ")
        row = f"{name:<15}" + "".join(f"{c:>12}" for c in cells)
        print(row + f"{most:>10}{'yes' if matters else 'no':>16}")
