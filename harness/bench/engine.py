"""LLMEngine against mlx_lm's BatchGenerator, uniform and mixed lengths, side by side.

``python -m harness.bench engine [--sizes tiny,small] [--workloads uniform,mixed]``
``python -m harness.bench engine --sizes smollm2 --prompt 32 --new 32 --requests 16
--mixed-scale 0.25 --allocators free_list,radix --repeats 3``  (a trained model, shorter)

One process, one model at a time (a seeded random size or the trained SmolLM2), greedy, every
request arriving at once; mlx_lm's BatchGenerator, then LLMEngine with each allocator, side
by side; with ``--repeats`` R, R interleaved rounds of them and each figure the median.
Two workloads:

    uniform  B prompts of P tokens, G new tokens each. Prefill tokens/s = B*P / time until
             every sequence has its first token; decode tokens/s = B*(G-1) / the time after.
    mixed    N requests of ShareGPT-like lengths (prompt lognormal median 120, sigma 1,
             clipped to 4..1536; output lognormal median 100, sigma 0.8, clipped to 2..512;
             ``--mixed-scale`` multiplies the medians and upper clips), at most B running
             at once. Total tokens/s = (prompt + output tokens) / time.
             Uniform lengths hide padding; this row shows it.

"outside fwd" is the share of the engine's step time spent outside the model forward
(scheduling, allocation, index building, sampling, bookkeeping); the paged gather runs
inside the forward, in the attention layers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator

from harness.bench.support.components import ALLOCATORS, compose_config
from harness.bench.support.tables import underlined
from harness.cli.run import build_component
from harness.engine import LLMEngine, build_engine
from harness.engine.sampling_params import SamplingParams
from harness.platform import blas
from harness.platform.models import LoadedModel
from harness.workload.distributions import LogNormal


def run_batch_generator(
    loaded: LoadedModel, prompts: list[list[int]], new: list[int], batch: int
) -> tuple[float, float, None]:
    """(seconds until every request has a token, seconds after that, None)."""
    gen = BatchGenerator(
        loaded.model,
        max_tokens=max(new),
        completion_batch_size=batch,
        prefill_batch_size=min(batch, 8),
    )
    start = time.perf_counter()
    gen.insert(prompts, max_tokens=list(new))
    counts = [0] * len(prompts)
    first_all = None
    remaining = len(prompts)
    while remaining:
        for r in gen.next_generated():
            counts[r.uid] += 1
            if r.finish_reason is not None:
                remaining -= 1
        if first_all is None and all(counts):
            first_all = time.perf_counter()
    end = time.perf_counter()
    gen.close()
    assert counts == list(new), counts
    return first_all - start, end - first_all, None


def workload_engine(
    loaded: LoadedModel,
    allocator: str,
    prompts: list[list[int]],
    new: list[int],
    batch: int,
    block_size: int,
    batch_steps: bool = True,
) -> LLMEngine:
    """An FCFS engine with room for every request at once, at most ``batch`` running, and
    the greedy requests added (all at t=0): stepping it to the end runs the workload.
    ``allocator`` is a conf/allocator/ option; ``batch_steps`` the engine's."""
    longest = max(len(p) + n for p, n in zip(prompts, new, strict=True))
    need = sum(-(-(len(p) + n) // block_size) for p, n in zip(prompts, new, strict=True))
    cfg = compose_config(
        [
            f"allocator={allocator}",
            "scheduler=fcfs",
            f"scheduler.max_num_seqs={batch}",
            f"scheduler.max_num_batched_tokens={max(2048, sum(len(p) for p in prompts))}",
        ]
    )
    engine = build_engine(
        loaded,
        build_component(cfg.allocator),
        build_component(cfg.scheduler),
        block_size=block_size,
        num_blocks=2 * need + 16,  # slack so region allocators grow without preempting
        max_model_len=longest,
        batch_steps=batch_steps,
    )
    for i, (p, n) in enumerate(zip(prompts, new, strict=True)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return engine


def run_engine(engine: LLMEngine) -> tuple[float, float, float]:
    """Step a ``workload_engine`` to the end: (seconds until every request has a token,
    seconds after, share outside the forward)."""
    requests = _live(engine)
    start = time.perf_counter()  # the requests are in, none has run
    first_all = None
    while engine.has_unfinished_requests():
        engine.step()
        if first_all is None and all(s.first_token_time is not None for s in _live(engine)):
            first_all = time.perf_counter()
            first_step = len(engine.recorder.steps)
    end = time.perf_counter()
    steps = engine.recorder.steps[first_step:] or engine.recorder.steps
    total = sum(s["duration"] for s in steps)
    outside = 1 - sum(s["forward_time"] for s in steps) / total
    got = {r["request_id"]: r["output_tokens"] for r in engine.recorder.requests}
    assert all(got[s.request_id] == s.params.max_tokens for s in requests), got
    return first_all - start, end - first_all, outside


def _live(engine: LLMEngine):
    return list(engine.scheduler.running) + list(engine.scheduler.waiting)


def mixed_workload(
    vocab: int, num_requests: int, seed: int, scale: float = 1.0
) -> tuple[list, list[int]]:
    """ShareGPT-like prompts and output lengths (the module docstring's distributions), the
    medians and upper clips times ``scale``."""
    rng = np.random.default_rng(seed)
    plens = LogNormal(median=120 * scale, sigma=1.0, min=4, max=round(1536 * scale))
    olens = LogNormal(median=100 * scale, sigma=0.8, min=2, max=round(512 * scale))
    plens, olens = plens.sample(num_requests, rng), olens.sample(num_requests, rng)
    prompts = [rng.integers(1, vocab, int(n)).tolist() for n in plens]
    return prompts, [int(n) for n in olens]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench engine", description=__doc__)
    parser.add_argument(
        "--sizes",
        default="tiny,small",
        help="conf/model options, comma list: random sizes (tiny, small) or smollm2",
    )
    parser.add_argument("--workloads", default="uniform,mixed", help="uniform and/or mixed")
    parser.add_argument("--batches", default="1,8,32", help="uniform: batch sizes, comma list")
    parser.add_argument("--prompt", type=int, default=128, help="uniform: prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="uniform: new tokens per request")
    parser.add_argument("--requests", type=int, default=32, help="mixed: number of requests")
    parser.add_argument("--mixed-batch", type=int, default=32, help="mixed: most running at once")
    parser.add_argument(
        "--mixed-scale", type=float, default=1.0, help="mixed: times the length medians and clips"
    )
    parser.add_argument(
        "--allocators", default=",".join(ALLOCATORS), help="LLMEngine's allocators, comma list"
    )
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds per row")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (tokens)")
    parser.add_argument("--seed", type=int, default=0, help="model weights and workload seed")
    args = parser.parse_args(argv)
    info = blas.info()
    print(f"mlx {mx.__version__}, device {mx.default_device()}, BLAS {info['blas']}")
    print(
        f"block size {args.block_size}, greedy, seed {args.seed}; ratio = system / BatchGenerator"
    )
    workloads = args.workloads.split(",")
    for size in args.sizes.split(","):
        model = compose_config([f"model={size}"]).model
        if "seed" in model:  # a random model; a trained one has its weights
            model.seed = args.seed
        loaded = build_component(model)
        rng = np.random.default_rng(args.seed)
        warm = [rng.integers(1, loaded.vocab_size, 16).tolist()]
        # Warm up both paths (first-call allocations, thread pools).
        run_batch_generator(loaded, warm, [4], 1)
        run_engine(workload_engine(loaded, "free_list", warm, [4], 1, args.block_size))
        if "uniform" in workloads:
            _uniform(loaded, size, rng, args)
        if "mixed" in workloads:
            _mixed(loaded, size, args)


def _measured(loaded, prompts, new, batch, args):
    """Each system's (seconds to every first token, seconds after, share outside the
    forward), medians of ``args.repeats`` interleaved rounds: BatchGenerator first."""
    systems = {"BatchGenerator": partial(run_batch_generator, loaded, prompts, new, batch)}
    for name in args.allocators.split(","):
        engine = partial(workload_engine, loaded, name, prompts, new, batch, args.block_size)
        systems[f"LLMEngine/{name}"] = lambda engine=engine: run_engine(engine())
    rounds = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, run in systems.items():
            rounds[name].append(run())
    for name, runs in rounds.items():
        yield name, [None if None in f else statistics.median(f) for f in zip(*runs, strict=True)]


def _uniform(loaded, size, rng, args) -> None:
    print(f"\nuniform: prompt {args.prompt}, new tokens {args.new}")
    header = (
        f"{'model':7} {'batch':>5} {'system':20} {'prefill tok/s':>13} {'decode tok/s':>12} "
        f"{'prefill ratio':>13} {'decode ratio':>12} {'outside fwd':>11}"
    )
    print(underlined(header))
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [rng.integers(1, loaded.vocab_size, args.prompt).tolist() for _ in range(batch)]
        base = None
        for name, (prefill_s, decode_s, outside) in _measured(
            loaded, prompts, [args.new] * batch, batch, args
        ):
            prefill = batch * args.prompt / prefill_s
            decode = batch * (args.new - 1) / decode_s
            base = base or (prefill, decode)
            share = "" if outside is None else f"{100 * outside:10.1f}%"
            print(
                f"{size:7} {batch:5d} {name:20} {prefill:13.0f} {decode:12.0f} "
                f"{prefill / base[0]:13.2f} {decode / base[1]:12.2f} {share:>11}",
                flush=True,
            )


def _mixed(loaded, size, args) -> None:
    prompts, new = mixed_workload(loaded.vocab_size, args.requests, args.seed, args.mixed_scale)
    tokens = sum(len(p) for p in prompts) + sum(new)
    print(
        f"\nmixed: {args.requests} requests, at most {args.mixed_batch} at once, prompt "
        f"tokens {sum(len(p) for p in prompts)} (max {max(len(p) for p in prompts)}), output "
        f"tokens {sum(new)} (max {max(new)})"
    )
    header = f"{'model':7} {'system':20} {'total tok/s':>11} {'ratio':>7} {'outside fwd':>11}"
    print(underlined(header))
    base = None
    for name, (first_s, rest_s, outside) in _measured(loaded, prompts, new, args.mixed_batch, args):
        rate = tokens / (first_s + rest_s)
        base = base or rate
        share = "" if outside is None else f"{100 * outside:10.1f}%"
        print(f"{size:7} {name:20} {rate:11.0f} {rate / base:7.2f} {share:>11}", flush=True)
