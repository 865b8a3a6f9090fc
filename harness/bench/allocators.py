"""Allocator micro-benchmark: replay one seeded trace against every allocator.

``python -m harness.bench allocators [--sequences 10000] [--seed 0]``

The trace is a list of sequences arriving at Poisson times (in decode steps),
with log-normal prompt and exponential output lengths; half of them start with
one of a few shared system prompts. Each replay is a tiny FCFS engine without a
model: every step each running sequence grows by one token (``allocate(n + 1)``),
then waiting sequences are admitted in arrival order (``allocate(prompt)``) until
one does not fit. A growth that fails preempts that sequence (it is freed and
re-queued first, keeping its tokens, as recompute preemption does); every ``None``
counts as a failed allocation. Prefix variants also call ``match_prefix`` on
admission and ``commit`` at each block boundary. Only time spent inside allocator
calls is timed; a second table gives per-call latency percentiles (p50/p99) of the
growth ``allocate`` (one token), the admission ``allocate`` (a whole prompt) and
``free``, next to the timer's own cost (an empty call timed the same way).
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from allocators.base import BlockAllocator, blocks_for
from harness.bench.support.tables import underlined

MAX_PROMPT, MAX_OUTPUT, SYSTEM_LEN, NUM_SYSTEM_PROMPTS = 1024, 512, 256, 4
TOKEN_SPACE = 1 << 20  # per-sequence token ids are unique, so only system prompts are shared


@dataclass(frozen=True)
class SeqSpec:
    """One traced sequence; ``system`` indexes a shared system prompt or is -1."""

    arrival: int
    prompt: int
    output: int
    system: int


@dataclass(frozen=True)
class Variant:
    """An allocator configuration to replay; ``prefix`` enables match_prefix/commit."""

    name: str
    target: str
    kwargs: dict = field(default_factory=dict)
    prefix: bool = False


@dataclass
class Result:
    """What one replay measured."""

    name: str
    ops: int = 0
    seconds: float = 0.0
    steps: int = 0
    peak_used: int = 0
    utilisation: list[float] = field(default_factory=list)
    fragmentation: list[float] = field(default_factory=list)
    latency: dict[str, list[int]] = field(default_factory=dict)  # call kind -> ns per call
    relocations: int = 0
    copied_blocks: int = 0
    failed: int = 0
    preemptions: int = 0
    hit_rate: float = 0.0


def make_trace(n: int, seed: int, concurrency: int) -> list[SeqSpec]:
    """``n`` sequences whose arrival rate keeps about ``concurrency`` of them decoding."""
    rng = random.Random(seed)
    mean_output = 64
    rate = concurrency / mean_output
    t, trace = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        system = rng.randrange(NUM_SYSTEM_PROMPTS) if rng.random() < 0.5 else -1
        prompt = min(MAX_PROMPT, max(1, int(rng.lognormvariate(5.0, 0.8))))
        output = min(MAX_OUTPUT, 1 + int(rng.expovariate(1 / mean_output)))
        trace.append(SeqSpec(int(t), prompt + (SYSTEM_LEN if system >= 0 else 0), output, system))
    return trace


def tokens(index: int, spec: SeqSpec, n: int) -> list[int]:
    """The first ``n`` token ids of sequence ``index`` (system prompt first)."""
    system = spec.system * SYSTEM_LEN
    head = list(range(system, system + SYSTEM_LEN)) if spec.system >= 0 else []
    own = (index + 1) * TOKEN_SPACE
    return (head + list(range(own, own + n)))[:n]


def build(variant: Variant, num_blocks: int, block_size: int) -> BlockAllocator:
    """A fresh allocator of ``variant``, imported by dotted path as Hydra's _target_ is."""
    module, _, cls = variant.target.rpartition(".")
    return getattr(importlib.import_module(module), cls)(
        num_blocks=num_blocks, block_size=block_size, **variant.kwargs
    )


def replay(variant: Variant, trace: list[SeqSpec], num_blocks: int, block_size: int) -> Result:
    """Run the trace to completion against a fresh allocator."""
    alloc, res = build(variant, num_blocks, block_size), Result(variant.name)
    waiting: deque[tuple[int, int]] = deque()  # (trace index, tokens to prefill)
    running: dict[str, list[int]] = {}  # seq id -> [trace index, tokens]
    arrived, step = 0, 0

    clock = time.perf_counter_ns

    def call(method: str, *args: object, kind: str = "") -> object:
        fn = getattr(alloc, method)
        start = clock()
        out = fn(*args)
        took = clock() - start
        res.seconds += took * 1e-9
        res.ops += 1
        res.latency.setdefault(kind or method, []).append(took)
        return out

    while arrived < len(trace) or waiting or running:
        if not waiting and not running:
            step = max(step, trace[arrived].arrival)  # idle: jump to the next arrival
        while arrived < len(trace) and trace[arrived].arrival <= step:
            waiting.append((arrived, trace[arrived].prompt))
            arrived += 1
        for seq, state in list(running.items()):
            index, n = state
            spec = trace[index]
            if call("allocate", seq, n + 1, kind="grow") is None:
                res.failed += 1
                res.preemptions += 1
                call("free", seq)
                del running[seq]
                waiting.appendleft((index, n))
                continue
            state[1] = n = n + 1
            if variant.prefix and n % block_size == 0:
                call("commit", seq, tokens(index, spec, n))
            if n == spec.prompt + spec.output:
                call("free", seq)
                del running[seq]
        while waiting:
            index, n = waiting[0]
            seq, spec = str(index), trace[index]
            if variant.prefix:
                call("match_prefix", seq, tokens(index, spec, n))
            if call("allocate", seq, n, kind="admit") is None:
                res.failed += 1
                call("free", seq)  # drops the references match_prefix took
                break
            if variant.prefix:
                call("commit", seq, tokens(index, spec, n))
            running[seq] = [index, n]
            waiting.popleft()
        res.peak_used = max(res.peak_used, num_blocks - alloc.num_free_blocks())
        if running:
            res.utilisation.append(alloc.stats().utilisation)
            unusable = alloc.unusable_free_blocks(waiting[0][1]) if waiting else 0
            res.fragmentation.append(unusable / num_blocks)
        step += 1
    alloc.check()
    stats = alloc.stats()
    res.steps, res.hit_rate = step, stats.hit_rate
    res.relocations = stats.relocations
    res.copied_blocks = stats.relocated_blocks + stats.cow_copies + stats.fork_copies
    return res


def variants(max_len: int) -> list[Variant]:
    """The configurations compared: every allocator, both reserve policies, radix +/- prefix."""
    contiguous = "allocators.contiguous.ContiguousAllocator"
    return [
        Variant("free_list", "allocators.free_list.FreeListAllocator"),
        Variant("contiguous/exact", contiguous, {"reserve": "exact"}),
        Variant("contiguous/max_len", contiguous, {"reserve": "max_len", "max_len": max_len}),
        Variant("buddy", "allocators.buddy.BuddyAllocator"),
        Variant("radix", "allocators.radix.RadixAllocator"),
        Variant("radix+prefix", "allocators.radix.RadixAllocator", prefix=True),
    ]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _timer_floor_ns(repeats: int = 100_000) -> float:
    """Median cost of timing an empty call the way ``replay`` times allocator calls."""
    clock, samples = time.perf_counter_ns, []

    def empty() -> None:
        return None

    for _ in range(repeats):
        start = clock()
        empty()
        samples.append(clock() - start)
    return statistics.median(samples)


def _percentile(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def format_latency(results: list[Result]) -> str:
    """Per-call latency percentiles (microseconds) of growth, admission and free."""
    kinds = ("grow", "admit", "free")
    head = f"{'allocator':<19}" + "".join(f"{k + ' p50':>11}{k + ' p99':>11}" for k in kinds)
    rows = [underlined(head)]
    for r in results:
        cells = "".join(
            f"{_percentile(r.latency.get(k, []), 0.5) / 1e3:>11.2f}"
            f"{_percentile(r.latency.get(k, []), 0.99) / 1e3:>11.2f}"
            for k in kinds
        )
        rows.append(f"{r.name:<19}{cells}")
    return "\n".join(rows)


def format_table(results: list[Result]) -> str:
    """A fixed-width table, one row per replay."""
    head = (
        f"{'allocator':<19}{'ops':>9}{'ops/s':>11}{'us/op':>7}{'steps':>8}{'peak':>6}"
        f"{'util':>6}{'frag':>6}{'reloc':>7}{'copied':>8}{'failed':>8}{'preempt':>8}{'hit':>6}"
    )
    rows = [underlined(head)]
    for r in results:
        rows.append(
            f"{r.name:<19}{r.ops:>9}{r.ops / r.seconds:>11,.0f}{r.seconds / r.ops * 1e6:>7.2f}"
            f"{r.steps:>8}{r.peak_used:>6}{_mean(r.utilisation):>6.3f}"
            f"{_mean(r.fragmentation):>6.3f}{r.relocations:>7}{r.copied_blocks:>8}"
            f"{r.failed:>8}{r.preemptions:>8}{r.hit_rate:>6.3f}"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    """Parse ``argv``, replay the trace against every variant and print the table."""
    parser = argparse.ArgumentParser(prog="python -m harness.bench allocators")
    parser.add_argument("--sequences", type=int, default=10_000, help="sequences in the trace")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV blocks in the arena")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--concurrency", type=int, default=64, help="target decoding sequences")
    args = parser.parse_args(argv)
    trace = make_trace(args.sequences, args.seed, args.concurrency)
    max_len = SYSTEM_LEN + MAX_PROMPT + MAX_OUTPUT
    if blocks_for(max_len, args.block_size) > args.num_blocks:
        parser.error(f"--num-blocks must hold one {max_len}-token sequence")
    print(
        f"seed={args.seed} sequences={args.sequences} num_blocks={args.num_blocks} "
        f"block_size={args.block_size} concurrency~{args.concurrency} max_len={max_len}\n"
        f"mean prompt {_mean([s.prompt for s in trace]):.0f} tokens, mean output "
        f"{_mean([s.output for s in trace]):.0f}, "
        f"{_mean([s.system >= 0 for s in trace]):.0%} with one of {NUM_SYSTEM_PROMPTS} "
        f"{SYSTEM_LEN}-token system prompts"
    )
    results = [replay(v, trace, args.num_blocks, args.block_size) for v in variants(max_len)]
    print(format_table(results))
    print(
        "peak = blocks held at once; util = used/reserved slots and frag = free blocks in runs "
        "too small for the next waiting sequence's region / arena blocks (external "
        "fragmentation, vLLM paper), both means over steps with a running sequence; copied = "
        "blocks copied (relocation + COW); failed = allocate calls returning None\n"
    )
    print(format_latency(results))
    print(
        "us per call: grow = allocate by one token, admit = allocate of a whole prompt; timer "
        f"floor (an empty call timed the same way) {_timer_floor_ns() / 1e3:.2f} us"
    )
