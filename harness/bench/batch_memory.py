"""KV memory of mlx_lm's BatchGenerator (padded caches) against kvbench's allocators, one trace.

``python -m harness.bench batch_memory [--allocators free_list,...] [--rounds 1] [--csv FILE]
[OVERRIDES]``

The trace, model and engine settings are kvbench's own config composed with
``experiment=padding_waste`` and OVERRIDES (e.g. ``trace.num_requests=8``, ``model=smollm2``,
``trace=chat``); every request is handed over at t=0. Side by side in one process, each system
replays it greedily, EOS ignored unless the trace's requests heed it (``trace=chat``: the model's
EOS ends each answer in both systems, so output lengths are the model's own):

    BatchGenerator  mlx_lm's continuous batching (completion_batch_size = scheduler.max_num_seqs,
                    its other defaults): each batch's per-layer cache is one left-padded
                    rectangle [B, heads, capacity, head_dim], grown 256 slots at a time, padded
                    to the longest row when batches merge, trimmed on the left when rows leave.
    kvbench         LLMEngine over the configured arena with each allocator (FCFS).

Memory, time-weighted over the replay, in MiB of K and V over all layers:

    allocated  BatchGenerator: the nbytes of every live cache array (its prompt and generation
               batches), read after each ``next()`` call and weighted by that call's duration.
               kvbench: blocks held (``blocks_used``) x bytes per block, weighted by step duration.
    tokens     bytes holding a token's KV: BatchGenerator rows' ``offset`` (their real length);
               kvbench ``slots_tokens``.
    util       tokens / allocated (kvbench's ``kv_utilisation``).
    active     BatchGenerator only: ``mx.get_active_memory()`` above what it was before the
               replay (the weights), time-weighted: buffers a sliced cache still pins count here,
               not in ``allocated``. kvbench reserves its whole arena up front (printed).

Throughput is (prompt + output tokens) / wall seconds of the replay (``output`` the tokens the
system produced: the trace's lengths, or fewer when EOS ends answers), the fastest of
``--rounds`` (memory figures are the last round's; they barely move between rounds). ``--csv``
also writes one row per system (bytes and tokens/s, unrounded).
"""

from __future__ import annotations

import argparse
import csv
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, StopSequences
from omegaconf import DictConfig

from harness.analysis.metrics import requests_frame, steps_frame
from harness.bench.support.components import compose_config
from harness.cli.replay import replay
from harness.cli.run import build_component, warm_up
from harness.engine import LLMEngine
from harness.workload.traces import Trace

FIELDS = ("allocated", "tokens", "peak_allocated", "active", "tokens_per_s", "output_tokens")
EXPERIMENT = "experiment=padding_waste"  # composed under every run's overrides
MIB = 2**20


@dataclass
class Memory:
    """One system's replay: time-weighted KV bytes and throughput."""

    allocated: float
    tokens: float
    peak_allocated: float
    tokens_per_s: float
    active: float = float("nan")  # BatchGenerator: active MLX memory above the weights
    output_tokens: int = 0  # tokens generated in all: the trace's, or the model's (EOS)

    @property
    def utilisation(self) -> float:
        return self.tokens / self.allocated if self.allocated else float("nan")


def cache_bytes(gen: BatchGenerator) -> tuple[int, int]:
    """(allocated, holding token states) bytes of a BatchGenerator's live KV caches: the
    cache arrays' sizes, and each row's ``offset`` (tokens it holds) times a row-slot's bytes.

    Reads mlx_lm 0.32's private batches (``_prompt_batch``, ``_generation_batch``); a version
    without them fails here, naming it, rather than measuring nothing."""
    try:
        caches = [*gen._prompt_batch.prompt_cache, *gen._generation_batch.prompt_cache]
    except AttributeError as e:
        raise ValueError(f"this mlx_lm's BatchGenerator has no batch caches to read: {e}") from e
    allocated = tokens = 0
    for c in caches:
        if c.keys is None:
            continue
        size = c.keys.nbytes + c.values.nbytes
        rows, capacity = c.keys.shape[0], c.keys.shape[2]
        held = np.clip(np.array(c.offset.tolist()).reshape(-1), 0, capacity).sum()
        allocated += size
        tokens += int(held) * size // (rows * capacity)
    return allocated, tokens


def run_batch_generator(cfg: DictConfig, model, trace: Trace) -> Memory:
    """Replay ``trace`` (all at once) through BatchGenerator, sampling its caches per call.

    A request with ``ignore_eos`` False stops at the model's EOS, as kvbench's do."""
    eos = StopSequences([(t,) for t in model.eos_token_ids] or None)
    stops = [StopSequences() if r.ignore_eos else eos for r in trace.requests]
    gen = BatchGenerator(
        model.model,
        max_tokens=max(r.max_tokens for r in trace),
        completion_batch_size=cfg.scheduler.max_num_seqs,
    )
    mx.eval(model.model.parameters())
    base = mx.get_active_memory()
    start = time.perf_counter()
    gen.insert(
        [list(r.prompt_token_ids) for r in trace.requests],
        max_tokens=[r.max_tokens for r in trace],
        stop_sequences=stops,
    )
    weights, allocated, tokens, active = [], [], [], []
    done, left = 0, len(trace)
    while left:
        tic = time.perf_counter()
        _, generated = gen.next()
        weights.append(time.perf_counter() - tic)
        a, t = cache_bytes(gen)
        allocated.append(a)
        tokens.append(t)
        active.append(mx.get_active_memory() - base)
        done += len(generated)
        left -= sum(r.finish_reason is not None for r in generated)
    wall = time.perf_counter() - start
    gen.close()
    cap = sum(r.max_tokens for r in trace)
    if done > cap or (done < cap and all(r.ignore_eos for r in trace)):
        raise AssertionError(f"BatchGenerator produced {done} tokens, the trace asks {cap}")
    w = np.array(weights)
    return Memory(
        allocated=float(np.average(allocated, weights=w)),
        tokens=float(np.average(tokens, weights=w)),
        peak_allocated=float(max(allocated)),
        tokens_per_s=(_prompt_tokens(trace) + done) / wall,
        active=float(np.average(active, weights=w)),
        output_tokens=done,
    )


def run_kvbench(cfg: DictConfig, model, trace: Trace) -> tuple[Memory, float]:
    """Replay ``trace`` through LLMEngine as ``cfg`` configures it; (its memory, arena bytes)."""

    def new_engine() -> LLMEngine:
        return build_component(cfg.engine)(
            model, build_component(cfg.allocator), build_component(cfg.scheduler)
        )

    sampling = build_component(cfg.sampling)
    if cfg.warmup:
        warm_up(new_engine(), trace, cfg.warmup, sampling)
    engine = new_engine()
    start = time.perf_counter()
    replay(engine, trace, sampling=sampling, progress=False)
    wall = time.perf_counter() - start
    steps = steps_frame(engine.recorder.steps)
    produced = int(requests_frame(engine.recorder.requests)["output_tokens"].sum())
    per_slot = model.kv_bytes_per_token()
    block = per_slot * engine.allocator.block_size
    w = steps["duration"]
    memory = Memory(
        allocated=float(np.average(steps["blocks_used"], weights=w)) * block,
        tokens=float(np.average(steps["slots_tokens"], weights=w)) * per_slot,
        peak_allocated=float(steps["blocks_used"].max()) * block,
        tokens_per_s=(_prompt_tokens(trace) + produced) / wall,
        output_tokens=produced,
    )
    return memory, engine.allocator.num_blocks * block


def _prompt_tokens(trace: Trace) -> int:
    return sum(len(r.prompt_token_ids) for r in trace.requests)


def _tokens(trace: Trace) -> int:
    """Prompt tokens plus the most output the trace allows (its lengths when EOS is ignored)."""
    return _prompt_tokens(trace) + sum(r.max_tokens for r in trace.requests)


def measure(
    overrides: list[str], allocators: list[str], rounds: int = 1
) -> tuple[dict[str, Memory], dict]:
    """Every system's ``Memory`` on the composed trace, interleaved ``rounds`` times (the fastest
    throughput kept); and facts for the header."""
    cfg = compose_config([EXPERIMENT, *overrides])
    model = build_component(cfg.model)
    trace = build_component(cfg.trace.generator)
    out: dict[str, Memory] = {}
    arena = 0
    for _ in range(rounds):
        results = {"BatchGenerator": run_batch_generator(cfg, model, trace)}
        for name in allocators:
            results[name], arena = run_kvbench(
                compose_config([EXPERIMENT, *overrides, f"allocator={name}"]), model, trace
            )
        for name, m in results.items():
            if name in out and out[name].tokens_per_s > m.tokens_per_s:
                m.tokens_per_s = out[name].tokens_per_s
            out[name] = m
    facts = {
        "model": model.name,
        "requests": len(trace),
        "tokens": _tokens(trace),
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "arena_mib": arena / MIB,
        "block_size": cfg.engine.block_size,
    }
    return out, facts


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.bench batch_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--allocators",
        default="free_list,radix,contiguous,buddy",
        help="kvbench allocators (conf/allocator/ options), comma-separated",
    )
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (fastest kept)")
    parser.add_argument("--csv", help="also write the figures to this CSV file")
    parser.add_argument("overrides", nargs="*", help="kvbench config overrides (key=value)")
    args = parser.parse_args(argv)
    results, facts = measure(args.overrides, args.allocators.split(","), args.rounds)
    print(
        f"{facts['model']}, {facts['requests']} requests ({facts['tokens']} tokens at most) "
        f"at t=0, {facts['max_num_seqs']} running at most; kvbench arena "
        f"{facts['arena_mib']:.1f} MiB reserved, block size {facts['block_size']}"
    )
    print(
        f"{'system':<16} {'allocated':>10} {'tokens':>8} {'util':>6} {'peak':>8} "
        f"{'active':>8} {'tok/s':>8} {'output':>7}   (MiB, time-weighted; peak: allocated)"
    )
    for name, m in results.items():
        active = "" if np.isnan(m.active) else f"{m.active / MIB:.2f}"
        print(
            f"{name:<16} {m.allocated / MIB:>10.2f} {m.tokens / MIB:>8.2f} "
            f"{m.utilisation:>6.1%} {m.peak_allocated / MIB:>8.2f} {active:>8} "
            f"{m.tokens_per_s:>8.0f} {m.output_tokens:>7}"
        )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["system", *FIELDS, "utilisation"])
            for name, m in results.items():
                out.writerow([name, *(getattr(m, k) for k in FIELDS), m.utilisation])
