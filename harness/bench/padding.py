"""Does a step cost the sum of its rows' costs? A mixed batch against its parts alone.

``python -m harness.bench padding [--size tiny] [--repeats 5]``

Two mixed batches, each timed beside its parts run alone (same runner, same arena, one
process; each figure the median of ``--repeats`` synchronised forwards after a warm-up):

    prefill  one 1024-token prompt + seven 16-token prompts   parts: the long one; the seven
    decode   31 rows at context 64 + one row at context 3000   parts: the 31; the long one

ratio = mixed / (sum of the parts): 1.0 means no row pays for another's length or context.
A padded batch pays the longest row's length (prefill) or context (decode) for every row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from harness.engine.kv_cache import KVArena
from harness.engine.model_runner import ModelRunner, Row
from harness.platform.models import LoadedModel, random_model

BLOCK_SIZE = 16
ARENA_BLOCKS = 512  # the decode case's rows take 312


def make_rows(specs: list[tuple[int, int]], rng: np.random.Generator, vocab: int) -> list[Row]:
    """Rows computing ``n`` tokens after ``context`` cached ones, on disjoint blocks."""
    rows, next_block = [], 0
    for n, context in specs:
        blocks = -(-(context + n) // BLOCK_SIZE)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        rows.append(Row(rng.integers(0, vocab, n).tolist(), context, table))
    return rows


def time_forwards(runner: ModelRunner, batches: list[list[Row]], repeats: int) -> list[float]:
    """Median seconds of one synchronised forward of each batch, timed in interleaved rounds
    (so drifting machine load hits all alike), after a warm-up round."""
    times: list[list[float]] = [[] for _ in batches]
    for round_ in range(repeats + 1):
        for rows, spent in zip(batches, times, strict=True):
            start = time.perf_counter()
            runner.run(rows)
            if round_:  # round 0 is the warm-up: first-time allocations are not the cost
                spent.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


CASES = {
    "prefill": ([(1024, 0)], [(16, 0)] * 7),
    "decode": ([(1, 63)] * 31, [(1, 2999)]),
}


def batches(vocab: int) -> dict[str, list[list[Row]]]:
    """Each case of ``CASES`` as the rows of [part A, part B, both mixed] (seeded tokens, on
    disjoint blocks of an arena of ``ARENA_BLOCKS``)."""
    rng = np.random.default_rng(0)
    out = {}
    for case, (a, b) in CASES.items():
        rows = make_rows(a + b, rng, vocab)
        out[case] = [rows[: len(a)], rows[len(a) :], rows]
    return out


def measure(loaded: LoadedModel, repeats: int = 5) -> dict[str, tuple[float, float, float]]:
    """Each case of ``CASES``: median seconds of (part A alone, part B alone, both mixed)."""
    runner = ModelRunner(loaded, KVArena.for_model(loaded, ARENA_BLOCKS, BLOCK_SIZE))
    return {
        case: tuple(time_forwards(runner, rows, repeats))
        for case, rows in batches(loaded.vocab_size).items()
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench padding", description=__doc__)
    parser.add_argument("--size", default="tiny", help="random model size (tiny | small)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per figure")
    args = parser.parse_args(argv)
    loaded = random_model("llama", args.size, seed=0)
    print(f"model {loaded.name}, block size {BLOCK_SIZE}, median of {args.repeats}")
    print(f"{'case':<8} {'part A ms':>10} {'part B ms':>10} {'mixed ms':>10} {'ratio':>7}")
    for case, (part_a, part_b, mixed) in measure(loaded, args.repeats).items():
        ratio = mixed / (part_a + part_b)
        print(
            f"{case:<8} {part_a * 1e3:>10.1f} {part_b * 1e3:>10.1f} {mixed * 1e3:>10.1f} "
            f"{ratio:>7.2f}"
        )
