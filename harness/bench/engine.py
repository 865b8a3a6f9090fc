"""``python -m harness.bench engine``: LLMEngine against mlx_lm's BatchGenerator.

One process, one random model, one workload (B prompts of P tokens, G new tokens each,
greedy, all arriving at once): mlx_lm's BatchGenerator, then LLMEngine with each allocator.
Prefill tokens/s = B*P / time until every sequence has its first token; decode tokens/s =
B*(G-1) / the time after that. "outside fwd" is the share of the engine's decode step time
spent outside the model forward (scheduling, allocation, index building, sampling,
bookkeeping); the paged gather runs inside the forward, in the attention layers.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator

from allocators.buddy import BuddyAllocator
from allocators.contiguous import ContiguousAllocator
from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from harness import blas
from harness.engine import LLMEngine
from harness.models import LoadedModel, random_model
from harness.sampling import SamplingParams
from schedulers.fcfs import FCFSScheduler

ALLOCATORS = {
    "free_list": FreeListAllocator,
    "contiguous": ContiguousAllocator,
    "buddy": BuddyAllocator,
    "radix": RadixAllocator,
}


def run_batch_generator(loaded: LoadedModel, prompts: list[list[int]], new: int):
    gen = BatchGenerator(
        loaded.model,
        max_tokens=new,
        completion_batch_size=len(prompts),
        prefill_batch_size=min(len(prompts), 8),
    )
    start = time.perf_counter()
    gen.insert(prompts)
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
    assert counts == [new] * len(prompts), counts
    return first_all - start, end - first_all, None


def run_engine(loaded: LoadedModel, allocator, prompts: list[list[int]], new: int, block_size: int):
    batch = len(prompts)
    need = batch * -(-(len(prompts[0]) + new) // block_size)
    engine = LLMEngine.build(
        loaded,
        allocator,
        partial(
            FCFSScheduler,
            max_num_seqs=batch,
            max_num_batched_tokens=max(2048, batch * len(prompts[0])),
        ),
        block_size=block_size,
        num_blocks=2 * need + 16,  # slack so region allocators grow without preempting
    )
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    first_all = None
    while engine.has_unfinished_requests():
        engine.step()
        if first_all is None and all(s.first_token_time is not None for s in _live(engine)):
            first_all = time.perf_counter()
            first_step = len(engine.recorder.steps)
    end = time.perf_counter()
    decode = engine.recorder.steps[first_step:]
    total = sum(s["duration"] for s in decode)
    outside = 1 - sum(s["forward_time"] for s in decode) / total
    assert all(r["output_tokens"] == new for r in engine.recorder.requests)
    return first_all - start, end - first_all, outside


def _live(engine: LLMEngine):
    return list(engine.scheduler.running) + list(engine.scheduler.waiting)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench engine")
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = blas.info()
    print(f"mlx {mx.__version__}, device {mx.default_device()}, BLAS {info['blas']}")
    print(
        f"prompt {args.prompt}, new tokens {args.new}, block size {args.block_size}, "
        f"greedy, seed {args.seed}; ratio = engine / BatchGenerator"
    )
    header = (
        f"{'model':6} {'batch':>5} {'system':18} {'prefill tok/s':>13} {'decode tok/s':>12} "
        f"{'prefill ratio':>13} {'decode ratio':>12} {'outside fwd':>11}"
    )
    print(header)
    print("-" * len(header))
    for size in args.sizes.split(","):
        loaded = random_model("llama", size, seed=args.seed)
        rng = np.random.default_rng(args.seed)
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = [
                rng.integers(1, loaded.vocab_size, args.prompt).tolist() for _ in range(batch)
            ]
            # Warm up both paths (first-call compilation, allocator caches).
            run_batch_generator(loaded, prompts[:1], 4)
            run_engine(loaded, FreeListAllocator, prompts[:1], 4, args.block_size)
            systems = [("BatchGenerator", partial(run_batch_generator, loaded, prompts, args.new))]
            systems += [
                (
                    f"LLMEngine/{name}",
                    partial(run_engine, loaded, cls, prompts, args.new, args.block_size),
                )
                for name, cls in ALLOCATORS.items()
            ]
            base = None
            for name, run in systems:
                prefill_s, decode_s, outside = run()
                prefill = batch * args.prompt / prefill_s
                decode = batch * (args.new - 1) / decode_s
                base = base or (prefill, decode)
                share = "" if outside is None else f"{100 * outside:10.1f}%"
                print(
                    f"{size:6} {batch:5d} {name:18} {prefill:13.0f} {decode:12.0f} "
                    f"{prefill / base[0]:13.2f} {decode / base[1]:12.2f} {share:>11}",
                    flush=True,
                )
