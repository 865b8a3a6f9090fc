"""Recompute against swap: the cost of one preemption by the victim's length, per allocator.

``python -m harness.bench preemption [--sizes tiny,small] [--lengths 16,64,256,1024]
[--allocators free_list,contiguous,buddy] [--repeats 3] [--csv FILE]``

One controlled preemption through the real engine (LLMEngine, PriorityScheduler with
``preempt_lower``), for each model size, allocator, victim length L and mode, on a fresh
engine whose arena holds L + 8 tokens (buddy: rounded up to a power of two blocks):

    step 0     the victim (priority 1, prompt L - 1 tokens) is prefilled
    step 1     it decodes once: L tokens hold KV
    step 2     an intruder (priority 0) whose prompt needs the whole arena arrives: the victim
               is preempted (recompute: its blocks freed; swap: copied to host, then freed),
               the intruder is prefilled and finishes (1 token)
    then       the victim comes back: recompute prefills its L + 1 tokens in one step; swap
               copies its blocks back in a step of its own and decodes from the next

Cost of the preemption, from the engine's own step rows (steps.parquet's columns): the time it
adds before the victim's next token beyond the decode step it would have run anyway.

    recompute  duration of the recompute step - median duration of the victim's decode steps
    swap       swap_time of the swap-out step + duration of the swap-in step

Figures are medians in ms over ``--repeats`` rounds after a warm-up round, every mode and
allocator interleaved within a round. ``crossover`` is the shortest L from which swap stays
cheaper than recompute (``-``: not in the lengths measured). ``--csv`` also writes one row per
figure (model, allocator, length, recompute_ms, swap_ms).
"""

from __future__ import annotations

import argparse
import csv
import statistics

import numpy as np

from allocators.base import blocks_for
from harness.bench.support.components import compose_config, options
from harness.cli.run import build_component
from harness.engine import build_engine
from harness.engine.sampling_params import SamplingParams
from harness.platform.models import LoadedModel

MODES = ("recompute", "swap")
BLOCK_SIZE = 16
SLACK = 8  # tokens of room beyond the victim's length


def one_preemption(loaded: LoadedModel, allocator: str, mode: str, length: int) -> float:
    """Seconds one preemption of an ``length``-token victim adds (the module docstring), with
    ``allocator`` a conf/allocator/ option."""
    num_blocks = blocks_for(length + SLACK, BLOCK_SIZE)
    if allocator == "buddy":  # one chunk, so that the intruder fits the arena alone
        num_blocks = 1 << (num_blocks - 1).bit_length()
    cfg = compose_config(
        [
            f"allocator={allocator}",
            "scheduler=priority",
            f"scheduler.preemption_mode={mode}",
            "scheduler.max_num_seqs=2",
        ]
    )
    engine = build_engine(
        loaded,
        build_component(cfg.allocator),
        build_component(cfg.scheduler),
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_model_len=max(2048, num_blocks * BLOCK_SIZE),
    )
    rng = np.random.default_rng(length)
    vocab = loaded.vocab_size
    engine.add_request(
        "victim",
        rng.integers(0, vocab, length - 1).tolist(),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        priority=1,
    )
    engine.step()
    engine.step()
    engine.add_request(
        "intruder",
        rng.integers(0, vocab, num_blocks * BLOCK_SIZE - BLOCK_SIZE // 2).tolist(),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        priority=0,
    )
    while engine.has_unfinished_requests():
        engine.step()
    steps = engine.recorder.steps
    out = next(i for i, s in enumerate(steps) if s["preempted"])
    if steps[out]["preempted"] != 1:
        raise AssertionError(f"{steps[out]['preempted']} preemptions, expected 1")
    back = out + 1  # the intruder finished in the preemption step
    decodes = [
        s["duration"]
        for i, s in enumerate(steps)
        if i not in (0, out, back) and s["batch_size"] == 1 and s["prefill_tokens"] == 0
    ]
    if mode == "swap":
        if not steps[back]["swap_in_blocks"] or steps[back]["batch_size"]:
            raise AssertionError("the step after the swap-out should only swap in")
        return steps[out]["swap_time"] + steps[back]["duration"]
    if steps[back]["prefill_tokens"] != length + 1:
        raise AssertionError(f"recompute of {steps[back]['prefill_tokens']} tokens, not {length}")
    return steps[back]["duration"] - statistics.median(decodes)


def measure(
    loaded: LoadedModel, allocators: list[str], lengths: list[int], repeats: int
) -> dict[tuple[str, int, str], float]:
    """Median ms of one preemption per (allocator, length, mode), interleaved rounds."""
    times: dict[tuple[str, int, str], list[float]] = {}
    for round_ in range(repeats + 1):
        for length in lengths:
            for allocator in allocators:
                for mode in MODES:
                    t = one_preemption(loaded, allocator, mode, length)
                    if round_:  # round 0 is the warm-up
                        times.setdefault((allocator, length, mode), []).append(t)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def crossover(costs: dict[tuple[str, int, str], float], allocator: str, lengths: list[int]):
    """The shortest length from which swap stays cheaper than recompute, or None."""
    cheaper = [costs[allocator, n, "swap"] < costs[allocator, n, "recompute"] for n in lengths]
    for i, n in enumerate(lengths):
        if all(cheaper[i:]):
            return n
    return None


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.bench preemption",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="tiny,small", help="random model sizes, comma-separated")
    parser.add_argument(
        "--lengths", default="16,64,256,1024", help="victim lengths in tokens, comma-separated"
    )
    parser.add_argument(
        "--allocators",
        default="free_list,contiguous,buddy",
        help=f"allocators, comma-separated, of {', '.join(options('allocator'))}",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per figure")
    parser.add_argument("--csv", help="also write the figures to this CSV file")
    args = parser.parse_args(argv)
    rows = []
    lengths = sorted(map(int, args.lengths.split(",")))
    allocators = args.allocators.split(",")
    print(f"block size {BLOCK_SIZE}; ms per preemption, median of {args.repeats} rounds")
    for size in args.sizes.split(","):
        loaded = build_component(compose_config([f"model={size}"]).model)
        costs = measure(loaded, allocators, lengths, args.repeats)
        kv = loaded.kv_bytes_per_token()
        print(f"{loaded.name}: {loaded.num_params / 1e6:.1f}M params, {kv} KV bytes per token")
        print(
            f"{'allocator':<12} {'length':>6} {'KV MB':>7} {'recompute':>10} {'swap':>8} "
            f"{'swap/recompute':>15}"
        )
        for allocator in allocators:
            for n in lengths:
                r, s = costs[allocator, n, "recompute"], costs[allocator, n, "swap"]
                rows.append([loaded.name, allocator, n, r, s])
                print(
                    f"{allocator:<12} {n:>6} {n * kv / 1e6:>7.2f} {r:>10.2f} {s:>8.2f} "
                    f"{s / r if r > 0 else float('nan'):>15.2f}"
                )
            cross = crossover(costs, allocator, lengths)
            print(f"{allocator:<12} crossover: {'-' if cross is None else cross}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["model", "allocator", "length", "recompute_ms", "swap_ms"])
            out.writerows(rows)
