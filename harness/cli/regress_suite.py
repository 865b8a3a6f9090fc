"""The suite of ``kvbench-regress`` (harness/cli/regress.py): its figures, how each gates
(``FIGURES``: better direction, tolerance) and how each is measured (``measure``).

Counts gate; timings are printed. The ``work`` figures count what the engine does (the step
rows' ``model_runner.Work`` columns and a profile of Python calls) on workloads whose every
request arrives at t=0, so the schedule, hence every count, is the same on any machine under
any load (identical to the last digit in runs alone, beside two busy loops and after other
groups). They gate exactly, or within 1 % for Python calls (an interpreter or library version
may add a few), so padding or host work coming back fails on any machine. Python calls are
each platform's own (``Figure.per_platform``: the device picks the sampler's code path); the
other counts and the policy figures below gate everywhere against ``COMMON_BASELINE``:

    work.<w>.query_padding     query positions computed / tokens fed (1.0: no padding)
    work.<w>.kv_read_waste     KV slots gathered / KV slots attended (block tails, padding)
    work.<w>.row_groups        padded batches over the run (each a pass over the weights)
    work.<w>.calls_per_step    Python function calls per engine step (host overhead; a list
                               comprehension is a call, a map over the batch is none, though
                               it may execute more: bench instructions counts what runs)
                               <w>: bench engine's uniform and mixed workloads (tiny model,
                               free list, FCFS, at most 8 running); general: the mixed one
                               with engine.batch_steps off, every step the general one (the
                               path of every policy, allocator and mode the running batch
                               does not cover)
    work.contiguous.block_copies   block copies of the mixed workload on contiguous regions
    work.padding.prefill, work.padding.decode   bench padding's mixed batch / the sum of its
                               parts, in query positions (prefill) and KV slots read (decode)
    sweep.prefix_hit_rate      the radix sweep run's prefix hit rate (a count too: exact)

The ``policy`` figures are the policies' own latencies and throughput on the model clock
(engine.clock=model) priced by a profile committed beside the baselines (``POLICY_PROFILE``,
the tiny model, calibrated once here): no step is timed, so they are the same to the last
digit on any machine under any load, and a change to what a scheduler or allocator decides
moves them. They gate near-exactly (``PRICED``: float summation order aside):

    policy.<p>.ttft_p50, .tpot_p50, .throughput (total tokens/s), .preemptions, .hit_rate
        <p>: POLICY_RUNS (free list and radix on a shared-prefix Poisson trace, chunked
        prefill and preemption by swap on ShareGPT-like lengths in a small arena)

The timed figures below are ratios of things timed side by side in this process (interleaved
``--rounds`` times), printed beside their baseline and never failing the run: under load they
move further than any regression they could catch (two suites at once: engine.uniform 31 %
below its baseline, padding.prefill 55 % above and 40 % below, sweep.ttft_p50 56 % above;
docs/design.md section 11), and what they caught, padding and host work, the counts catch
exactly. Read them on a quiet machine.

    engine.uniform, engine.mixed   BatchGenerator seconds / LLMEngine seconds for the same
                                   requests (the work workloads), the fastest round of each
    engine.outside_forward         share of the engine's decode step time outside the model
                                   forward (uniform workload, median over rounds)
    allocators.<variant>           the allocator's calls/s on bench allocators' replay / calls/s
                                   of a fixed reference call (one block id moved between two
                                   lists) timed alike just before and after it; median
    padding.prefill, padding.decode   bench padding's mixed batch / sum of its parts (medians)
    sweep.ttft_p50, sweep.throughput  radix / free list, kvbench runs on a shared-prefix batch
                                   (16 requests at t=0, FCFS): TTFT p50 and total token
                                   throughput, the best round of each
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from hydra import compose, initialize_config_dir

from harness.analysis import compare
from harness.bench import allocators as bench_allocators
from harness.bench import engine as bench_engine
from harness.bench import padding as bench_padding
from harness.cli.run import CONFIG_DIR, run
from harness.engine.kv_cache import KVArena
from harness.engine.model_runner import ModelRunner
from harness.platform.models import LoadedModel, random_model

PROG = "kvbench-regress"
BASELINES = Path("results/baselines")  # the committed baselines, and the policy profile
# The figures no machine changes (Figure.per_platform false), one file for every platform;
# each platform's own, <platform>.json, holds the rest.
COMMON_BASELINE = BASELINES / "common.json"

ROUNDS = 5  # interleaved repeats of each timed comparison (--rounds)
BLOCK_SIZE = 16
UNIFORM = {"batch": 8, "prompt": 64, "new": 32}
MIXED = {"requests": 8, "batch": 8}
ALLOCATOR_SEQUENCES = 500  # bench allocators' trace, smaller (its defaults otherwise)
REFERENCE_CALLS = 100_000
SWEEP = (
    "trace=shared_prefix",
    "trace.num_system_prompts=2",
    "trace.users_per_prompt=8",
    "trace.rate=inf",  # every request at t=0: the schedule does not depend on timings
    "trace.generator.output_len.low=8",
    "trace.generator.output_len.high=24",
    "engine.num_blocks=512",
    "progress=false",
)
SWEEP_POLICIES = ("allocator=free_list", "allocator=radix")
POLICY_PROFILE = BASELINES / "profile-llama-tiny.json"
_SHARED = ("trace=shared_prefix", "trace.users_per_prompt=12", "trace.rate=8")
_SHAREGPT = ("trace=sharegpt", "trace.num_requests=48", "engine.num_blocks=96")
POLICY_RUNS: dict[str, tuple[str, ...]] = {
    "free_list": (*_SHARED, "allocator=free_list"),
    "radix": (*_SHARED, "allocator=radix"),
    "chunked": (*_SHAREGPT, "trace.rate=4", "scheduler=chunked_prefill",
                "scheduler.max_chunk=128", "scheduler.max_num_batched_tokens=160"),
    "swap": (*_SHAREGPT, "trace.rate=inf", "scheduler.preemption_mode=swap"),
}  # fmt: skip
POLICY_FIGURES = {  # summary key -> (figure, better)
    "ttft_p50": ("ttft_p50", "lower"),
    "tpot_p50": ("tpot_p50", "lower"),
    "total_token_throughput": ("throughput", "higher"),
    "preemptions": ("preemptions", "lower"),
    "prefix_hit_rate": ("hit_rate", "higher"),
}
ENGINE_WORKLOADS = ("uniform", "mixed")


@dataclass(frozen=True)
class Figure:
    """A figure of the suite and which way is better. A figure that gates has a relative
    ``tolerance``: worse than the baseline by more fails the run. ``tolerance`` None: a timed
    figure, printed beside its baseline, never failing (it moves with load: module docstring).
    """

    name: str
    group: str
    better: Literal["higher", "lower"]
    tolerance: float | None = None
    python_calls: bool = False

    @property
    def gates(self) -> bool:
        return self.tolerance is not None

    @property
    def per_platform(self) -> bool:
        """Kept in the platform's own baseline: a timed figure (the machine's speed), or a
        count of Python calls (the interpreter, the libraries' versions and the device's code
        path: sampling runs in MLX on a GPU and in numpy on a CPU). Every other figure is the
        same on any machine and gates everywhere against ``COMMON_BASELINE``."""
        return not self.gates or self.python_calls

    def limit(self, baseline: float) -> float:
        """The worst value that still passes against ``baseline``."""
        if self.better == "higher":
            return baseline * (1 - self.tolerance)
        return baseline * (1 + self.tolerance)

    def regressed(self, value: float, baseline: float) -> bool:
        limit = self.limit(baseline)
        return value < limit if self.better == "higher" else value > limit

    def improved(self, value: float, baseline: float) -> bool:
        """Better than ``baseline`` by more than the tolerance: the baseline is stale."""
        mirror = 2 * baseline - self.limit(baseline)
        return value > mirror if self.better == "higher" else value < mirror


EXACT = 0.0  # a count: the same code on the same inputs does the same work
CALLS = 0.01  # Python calls: exact for one interpreter and library versions; 1 % for others
PRICED = 1e-9  # a model clock's figure: deterministic, up to float summation order

_VARIANTS = [v.name for v in bench_allocators.variants(max_len=0)]
FIGURES = {
    f.name: f
    for f in (
        *(
            fig
            for name in ENGINE_WORKLOADS
            for fig in (
                Figure(f"work.{name}.query_padding", "work", "lower", EXACT),
                Figure(f"work.{name}.kv_read_waste", "work", "lower", EXACT),
                Figure(f"work.{name}.row_groups", "work", "lower", EXACT),
                Figure(f"work.{name}.calls_per_step", "work", "lower", CALLS, python_calls=True),
            )
        ),
        Figure("work.general.calls_per_step", "work", "lower", CALLS, python_calls=True),
        Figure("work.contiguous.block_copies", "work", "lower", EXACT),
        Figure("work.padding.prefill", "work", "lower", EXACT),
        Figure("work.padding.decode", "work", "lower", EXACT),
        Figure("engine.uniform", "engine", "higher"),
        Figure("engine.mixed", "engine", "higher"),
        Figure("engine.outside_forward", "engine", "lower"),
        *(Figure(f"allocators.{name}", "allocators", "higher") for name in _VARIANTS),
        Figure("padding.prefill", "padding", "lower"),
        Figure("padding.decode", "padding", "lower"),
        Figure("sweep.ttft_p50", "sweep", "lower"),
        Figure("sweep.throughput", "sweep", "higher"),
        Figure("sweep.prefix_hit_rate", "sweep", "higher", EXACT),
        *(
            Figure(f"policy.{run_name}.{name}", "policy", better, PRICED)
            for run_name in POLICY_RUNS
            for name, better in POLICY_FIGURES.values()
        ),
    )
}
GROUPS = tuple(dict.fromkeys(f.group for f in FIGURES.values()))

Workload = tuple[list[list[int]], list[int], int]  # prompts, new tokens each, running at most


def engine_workloads(vocab: int) -> dict[str, Workload]:
    """Bench engine's uniform and mixed workloads at the sizes of ``UNIFORM`` and ``MIXED``."""
    rng = np.random.default_rng(0)
    uniform = [rng.integers(1, vocab, UNIFORM["prompt"]).tolist() for _ in range(UNIFORM["batch"])]
    mixed = bench_engine.mixed_workload(vocab, MIXED["requests"], seed=0)
    return {
        "uniform": (uniform, [UNIFORM["new"]] * UNIFORM["batch"], UNIFORM["batch"]),
        "mixed": (*mixed, MIXED["batch"]),
    }


def replay(
    loaded: LoadedModel, allocator: str, workload: Workload, batch_steps: bool = True
) -> tuple[list[dict], int]:
    """Run ``workload`` to the end on a fresh FCFS engine over ``allocator`` (a
    conf/allocator/ option), every request in before the first step (so the schedule, hence
    every step row's counts, is the same on any machine under any load); its step rows, and
    the Python function calls made while stepping (profile "call" events: functions,
    methods, generator resumptions; C functions not counted)."""
    engine = bench_engine.workload_engine(loaded, allocator, *workload, BLOCK_SIZE, batch_steps)
    calls = 0

    def count(frame, event: str, arg) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        sys.setprofile(None)
    return engine.recorder.steps, calls


def work_figures(loaded: LoadedModel) -> dict[str, float]:
    """Counts of the work the engine does, from the step rows (``model_runner.Work``) and a
    profile of the replay; no timing in any of them."""
    figures: dict[str, float] = {}
    workloads = engine_workloads(loaded.vocab_size)
    for name, workload in workloads.items():
        replay(loaded, "free_list", workload)  # first calls (caches, imports) not counted
        steps, calls = replay(loaded, "free_list", workload)
        total = {c: sum(s[c] for s in steps) for c in steps[0]}
        tokens = total["prefill_tokens"] + total["decode_tokens"]
        figures |= {
            f"work.{name}.query_padding": total["query_tokens_padded"] / tokens,
            f"work.{name}.kv_read_waste": total["kv_slots_read"] / total["kv_slots_attended"],
            f"work.{name}.row_groups": total["row_groups"],
            f"work.{name}.calls_per_step": calls / len(steps),
        }
    steps, calls = replay(loaded, "free_list", workloads["mixed"], batch_steps=False)
    figures["work.general.calls_per_step"] = calls / len(steps)
    steps, _ = replay(loaded, "contiguous", workloads["mixed"])
    figures["work.contiguous.block_copies"] = sum(s["block_copies"] for s in steps)
    # bench padding's cases in work instead of seconds: mixed batch / the parts' sum
    runner = ModelRunner(
        loaded, KVArena.for_model(loaded, bench_padding.ARENA_BLOCKS, bench_padding.BLOCK_SIZE)
    )
    for case, field in (("prefill", "query_tokens_padded"), ("decode", "kv_slots_read")):
        part_a, part_b, mixed = (
            getattr(runner.forward(rows).work, field)
            for rows in bench_padding.batches(loaded.vocab_size)[case]
        )
        figures[f"work.padding.{case}"] = mixed / (part_a + part_b)
    return figures


def engine_figures(loaded: LoadedModel, rounds: int) -> dict[str, float]:
    """BatchGenerator / LLMEngine seconds on bench engine's uniform and mixed workloads, and
    the engine's share of decode step time outside the forward."""
    workloads = engine_workloads(loaded.vocab_size)
    warm = [np.random.default_rng(1).integers(1, loaded.vocab_size, 16).tolist()]
    bench_engine.run_batch_generator(loaded, warm, [4], 1)
    bench_engine.run_engine(
        bench_engine.workload_engine(loaded, "free_list", warm, [4], 1, BLOCK_SIZE)
    )
    seconds: dict[tuple[str, str], list[float]] = {}
    outside = []
    for _ in range(rounds):
        for name, (prompts, new, batch) in workloads.items():
            first, rest, _ = bench_engine.run_batch_generator(loaded, prompts, new, batch)
            seconds.setdefault((name, "bg"), []).append(first + rest)
            engine = bench_engine.workload_engine(
                loaded, "free_list", prompts, new, batch, BLOCK_SIZE
            )
            first, rest, share = bench_engine.run_engine(engine)
            seconds.setdefault((name, "engine"), []).append(first + rest)
            if name == "uniform":
                outside.append(share)
    # The fastest run of each: load from other processes only ever adds time.
    figures = {
        f"engine.{name}": min(seconds[name, "bg"]) / min(seconds[name, "engine"])
        for name in workloads
    }
    figures["engine.outside_forward"] = statistics.median(outside)
    return figures


class _Reference:
    """The least an allocator call does: move one block id between a free list and a table."""

    def __init__(self) -> None:
        self.free, self.table = list(range(1024)), []

    def grow(self, seq: str) -> None:
        self.table.append(self.free.pop())

    def shrink(self, seq: str) -> None:
        self.free.append(self.table.pop())


def reference_calls_per_second(calls: int = REFERENCE_CALLS) -> float:
    """Calls/s of ``_Reference``'s methods, each timed as bench allocators' replay times an
    allocator call (``perf_counter_ns`` around it)."""
    ref, clock, spent = _Reference(), time.perf_counter_ns, 0
    for _ in range(calls // 2):
        for fn in (ref.grow, ref.shrink):
            start = clock()
            fn("0")
            spent += clock() - start
    return calls / (spent * 1e-9)


def allocator_figures(rounds: int) -> dict[str, float]:
    """Each allocator's calls/s on bench allocators' replay over the reference's calls/s
    timed just before and just after it (so both see the same load), median over rounds."""
    a = bench_allocators
    trace = a.make_trace(ALLOCATOR_SEQUENCES, seed=0, concurrency=64)
    max_len = a.SYSTEM_LEN + a.MAX_PROMPT + a.MAX_OUTPUT
    ratios: dict[str, list[float]] = {}
    for _ in range(rounds):
        for variant in a.variants(max_len):
            before = reference_calls_per_second()
            r = a.replay(variant, trace, num_blocks=2048, block_size=BLOCK_SIZE)
            reference = (before + reference_calls_per_second()) / 2
            ratios.setdefault(variant.name, []).append(r.ops / r.seconds / reference)
    return {f"allocators.{name}": statistics.median(x) for name, x in ratios.items()}


def padding_figures(loaded: LoadedModel, rounds: int) -> dict[str, float]:
    """bench padding's mixed / (sum of the parts) per case, medians of ``rounds`` forwards."""
    return {
        f"padding.{case}": mixed / (part_a + part_b)
        for case, (part_a, part_b, mixed) in bench_padding.measure(loaded, rounds).items()
    }


def sweep_figures(out: Path, rounds: int) -> dict[str, float]:
    """Radix against the free list on one shared-prefix batch: ``rounds`` interleaved kvbench
    runs of each (warm-up included, written under ``out/round<r>/<policy>``), the best kept."""
    ttft: dict[str, list[float]] = {}
    throughput: dict[str, list[float]] = {}
    for r in range(rounds):
        for policy in SWEEP_POLICIES:
            with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name=PROG):
                cfg = compose(config_name="config", overrides=[*SWEEP, policy])
            summary = run(cfg, out / f"round{r}" / policy, overrides=[policy])
            ttft.setdefault(policy, []).append(summary["ttft_p50"])
            throughput.setdefault(policy, []).append(summary["total_token_throughput"])
    print(compare.format_text(compare.table(out), out))
    base, radix = SWEEP_POLICIES
    return {
        "sweep.ttft_p50": min(ttft[radix]) / min(ttft[base]),
        "sweep.throughput": max(throughput[radix]) / max(throughput[base]),
        "sweep.prefix_hit_rate": summary["prefix_hit_rate"],
    }


def policy_figures(out: Path) -> dict[str, float]:
    """Each of ``POLICY_RUNS`` once on the model clock priced by ``POLICY_PROFILE`` (runs
    under ``out/<name>``): its summary's latencies, throughput, preemptions and hit rate."""
    priced = ("engine.clock=model", f"engine.profile={POLICY_PROFILE}", "progress=false")
    figures = {}
    for name, overrides in POLICY_RUNS.items():
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name=PROG):
            cfg = compose(config_name="config", overrides=[*overrides, *priced])
        summary = run(cfg, out / name, overrides=list(overrides))
        figures |= {
            f"policy.{name}.{figure}": summary[key] for key, (figure, _) in POLICY_FIGURES.items()
        }
    return figures


def measure(groups: tuple[str, ...], out: Path, rounds: int = ROUNDS) -> dict[str, float]:
    """The figures of ``groups``, in ``FIGURES`` order; the sweep's runs go under ``out``."""
    tiny = {"work", "engine", "padding"} & set(groups)
    loaded = random_model("llama", "tiny", seed=0) if tiny else None
    steps: dict[str, Callable[[], dict[str, float]]] = {
        "work": lambda: work_figures(loaded),
        "engine": lambda: engine_figures(loaded, rounds),
        "allocators": lambda: allocator_figures(rounds),
        "padding": lambda: padding_figures(loaded, rounds),
        "sweep": lambda: sweep_figures(out / "sweep", rounds),
        "policy": lambda: policy_figures(out / "policy"),
    }
    figures: dict[str, float] = {}
    for group in groups:
        started = time.perf_counter()
        figures.update(steps[group]())
        print(f"{PROG}: {group} measured in {time.perf_counter() - started:.0f} s", flush=True)
    return {name: figures[name] for name in FIGURES if name in figures}
