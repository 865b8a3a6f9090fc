"""Eviction-policy benchmark: the radix cache's policies against the offline optimum.

``python -m harness.bench eviction [--seed 0] [--block-size 16] [--fractions 0.25,0.5,1]
[--mooncake N [--only-mooncake]]``

Two seeded traces from ``harness.workload.generators`` (shared system prompts; multi-turn chats;
with ``--mooncake N`` also ``trace=mooncake_like`` of N requests, the replay at scale) are
replayed one request at a time, in arrival order, through ``RadixAllocator`` with each
eviction policy, and through Belady's offline optimum under the same model
(``allocators.offline``: outputs are fresh ids, so only prompts are reusable). Running one
request at a time isolates eviction from concurrency: the numbers say how well a policy
picks victims, not how much memory running sequences take.

Budgets are fractions of the trace's working set W = the distinct blocks some later request
hits (``reusable_blocks``) + the largest request's blocks, and never below the largest
request. At 100 % Belady reaches the trace bound (``max_prefix_hit_rate``, an infinite
cache); below it, the gap between a policy and Belady is what that policy leaves on the
table. Cells: prefix hit rate (hit / prompt tokens) and blocks evicted. Deterministic.

fifo comes out (nearly) equal to lru here, and not by a bug: with outputs of at least a
block, a request that hits a block then commits a new child under it, so the hit block is
a leaf again only once that younger child is evicted, and by then it is both the oldest and
the least recently used candidate. Only a whole-block prompt whose unmatchable last block
is already cached adds no child.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

import pandas as pd

from allocators.base import blocks_for
from allocators.offline import (
    Request,
    belady_hit_rate,
    online_hit_rate,
    reusable_blocks,
    trace_requests,
)
from allocators.radix import RadixAllocator
from harness.bench.support.components import compose_config
from harness.cli.run import build_component
from harness.workload.distributions import Poisson, Uniform
from harness.workload.generators import multi_turn, shared_prefix
from harness.workload.traces import Trace, max_prefix_hit_rate

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "slru")
BELADY, BOUND = "belady (offline optimum)", "trace bound (infinite cache)"
VOCAB = 32000


def make_traces(seed: int) -> dict[str, Trace]:
    """The two workloads, sized to run in seconds yet put several policies under pressure."""
    return {
        "shared_prefix": shared_prefix(
            num_system_prompts=16,
            users_per_prompt=32,
            system_prompt_len=512,
            user_prompt_len=Uniform(16, 256),
            output_len=Uniform(16, 128),
            arrival=Poisson(4.0),
            seed=seed,
            vocab_size=VOCAB,
        ),
        "multi_turn": multi_turn(
            num_conversations=64,
            turns=8,
            user_prompt_len=Uniform(32, 128),
            output_len=Uniform(32, 128),
            arrival=Poisson(1.0),
            think_time=8.0,
            seed=seed,
            vocab_size=VOCAB,
        ),
    }


def mooncake_trace(num_requests: int, seed: int) -> Trace:
    """``trace=mooncake_like`` (conf/trace/mooncake_like.yaml) of ``num_requests``."""
    cfg = compose_config(["trace=mooncake_like", f"trace.num_requests={num_requests}",
                          f"trace.seed={seed}"])  # fmt: skip
    return build_component(cfg.trace.generator)


def radix(budget: int, block_size: int, policy: str) -> Callable[[], RadixAllocator]:
    """A fresh allocator per replay, as ``online_hit_rate`` wants."""
    return lambda: RadixAllocator(num_blocks=budget, block_size=block_size, eviction=policy)


def budgets(
    requests: list[Request], block_size: int, fractions: list[float]
) -> tuple[int, int, list[int]]:
    """(working set W, largest request, one budget per fraction of W) in blocks."""
    largest = max(blocks_for(len(p) + len(o), block_size) for p, o in requests)
    working_set = reusable_blocks(requests, block_size) + largest
    return working_set, largest, [max(largest, round(f * working_set)) for f in fractions]


def hit_rates(trace: Trace, block_size: int, fractions: list[float]) -> pd.DataFrame:
    """Hit rate against cache budget: one row per policy (``POLICIES``, then ``BELADY``, then
    ``BOUND``) and budget, with columns ``policy``, ``fraction`` (of W), ``budget`` (blocks),
    ``hit_rate`` (hit / prompt tokens) and ``evictions`` (blocks; NaN for the bound)."""
    requests = trace_requests(trace)
    _, _, sizes = budgets(requests, block_size, fractions)
    bound = max_prefix_hit_rate(trace, block_size)
    rows = []
    for f, b in zip(fractions, sizes, strict=True):
        for policy in POLICIES:
            stats = online_hit_rate(radix(b, block_size, policy), requests)
            rows.append((policy, f, b, stats.hit_rate, stats.evictions))
        stats = belady_hit_rate(requests, block_size, b)
        rows.append((BELADY, f, b, stats.hit_rate, stats.evictions))
        rows.append((BOUND, f, b, bound, math.nan))
    return pd.DataFrame(rows, columns=["policy", "fraction", "budget", "hit_rate", "evictions"])


def cell(hit_rate: float, evictions: float) -> str:
    """``hit %`` and evictions (``-`` for the bound, which evicts nothing)."""
    evicted = "-" if math.isnan(evictions) else f"{evictions:.0f}"
    return f"{hit_rate:>9.1%}{evicted:>9}"


def table(name: str, trace: Trace, block_size: int, fractions: list[float]) -> str:
    """One trace's table: rows = policies, Belady and the bound; columns = budgets."""
    requests = trace_requests(trace)
    working_set, largest, sizes = budgets(requests, block_size, fractions)
    prompt = sum(len(p) for p, _ in requests)
    lines = [
        f"{name}: {len(requests)} requests, {prompt} prompt tokens, seed {trace.metadata['seed']}, "
        f"vocab {trace.metadata['vocab_size']}",
        f"  parameters {json.dumps(trace.metadata['parameters'])}",
        f"  working set W = {working_set} blocks ({working_set - largest} reusable + {largest} "
        f"for the largest request), block_size {block_size}",
    ]
    width = 32
    head = "".join(f"{f'{b} ({f:.0%} W)':>18}" for f, b in zip(fractions, sizes, strict=True))
    lines.append(f"{'budget (blocks)':<{width}}{head}")
    lines.append(f"{'policy':<{width}}" + f"{'hit':>9}{'evicted':>9}" * len(sizes))
    lines.append("-" * (width + 18 * len(sizes)))
    for policy, rows in hit_rates(trace, block_size, fractions).groupby("policy", sort=False):
        cells = "".join(cell(r.hit_rate, r.evictions) for r in rows.itertuples())
        lines.append(f"{policy:<{width}}{cells}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Parse ``argv``, build both traces and print one table per trace."""
    parser = argparse.ArgumentParser(prog="python -m harness.bench eviction")
    parser.add_argument("--seed", type=int, default=0, help="seed of both traces")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument(
        "--fractions",
        default="0.25,0.5,1",
        help="cache budgets as fractions of the working set, comma-separated",
    )
    parser.add_argument(
        "--mooncake",
        type=int,
        default=0,
        help="also a trace=mooncake_like of this many requests (multi-turn sessions over "
        "shared system prompts; 100000: the replay at scale)",
    )
    parser.add_argument("--only-mooncake", action="store_true", help="skip the two small traces")
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    if args.block_size < 1 or not all(f > 0 for f in fractions) or args.mooncake < 0:
        parser.error("--block-size must be >= 1, every fraction > 0, --mooncake >= 0")
    traces = {} if args.only_mooncake else make_traces(args.seed)
    if args.mooncake:
        traces["mooncake_like"] = mooncake_trace(args.mooncake, args.seed)
    for name, trace in traces.items():
        print(table(name, trace, args.block_size, fractions), end="\n\n")
    print(
        "One request at a time in arrival order; outputs are fresh token ids (only prompts are "
        "reusable).\nhit = prefix-cache hit tokens / prompt tokens; evicted = cached blocks "
        "evicted; W = blocks hit again later + the largest request."
    )
