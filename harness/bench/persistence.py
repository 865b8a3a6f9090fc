"""KV restore against recompute: the first token of a prompt whose KV is in a file, by length.

``python -m harness.bench persistence [--sizes tiny,small] [--lengths 128,512,2048]
[--repeats 3]``

For each model size and prompt length L, a file holds the KV of the prompt's first L - 1
tokens (saved by an engine when a request of those tokens finished). Side by side in one
process, in interleaved rounds (the first a warm-up), each on a freshly built engine whose
model fingerprint is already computed (a once-per-engine cost, printed per model):

    restore    add_request(prompt, restore_kv=file) and step until its one output token:
               read and check the file, write its blocks into the arena, compute 1 token
    recompute  add_request(prompt) and step until its one output token: prefill L tokens

Figures are medians in ms; ``load`` is the file's read and checks alone (part of restore);
speed-up = recompute / restore. Both produce the same token (checked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from allocators.free_list import FreeListAllocator
from harness.engine import LLMEngine, build_engine, persistence
from harness.engine.sampling_params import SamplingParams
from harness.platform.models import LoadedModel, random_model
from schedulers.fcfs import FCFSScheduler

BLOCK_SIZE = 16
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _engine(loaded: LoadedModel, length: int) -> LLMEngine:
    engine = build_engine(
        loaded,
        FreeListAllocator,
        FCFSScheduler,
        block_size=BLOCK_SIZE,
        num_blocks=-(-length // BLOCK_SIZE) + 4,
        max_model_len=max(length + 1, 2048),
        record=False,
    )
    _ = engine.kv_spec  # the fingerprint: once per engine, not per request
    return engine


def _first_token(engine: LLMEngine, prompt: list[int], **kv) -> tuple[float, int]:
    """Seconds from add_request to the request's one token, and the token."""
    start = time.perf_counter()
    engine.add_request("r", prompt, ONE, **kv)
    token = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            token = out.outputs[0].token_ids[0]
    return time.perf_counter() - start, token


def measure(loaded: LoadedModel, length: int, folder: Path, repeats: int = 3) -> dict[str, float]:
    """Median ms of restore, recompute and the file's load for an ``length``-token prompt;
    the file's size in MB."""
    prompt = np.random.default_rng(length).integers(0, loaded.vocab_size, length).tolist()
    path = folder / f"{loaded.name}-{length}.safetensors"
    _first_token(_engine(loaded, length), prompt[:-1], save_kv=path)
    spec = _engine(loaded, length).kv_spec
    times: dict[str, list[float]] = {"restore": [], "recompute": [], "load": []}
    for round_ in range(repeats + 1):
        restore, restored = _first_token(_engine(loaded, length), prompt, restore_kv=path)
        recompute, computed = _first_token(_engine(loaded, length), prompt)
        if restored != computed:
            raise AssertionError(f"restore gave token {restored}, recompute {computed}")
        start = time.perf_counter()
        persistence.load(path, spec)
        load = time.perf_counter() - start
        if round_:  # round 0 is the warm-up
            for name, t in (("restore", restore), ("recompute", recompute), ("load", load)):
                times[name].append(t)
    out = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    out["file_mb"] = os.path.getsize(path) / 1e6
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.bench persistence", description=__doc__
    )
    parser.add_argument("--sizes", default="tiny,small", help="random model sizes, comma-separated")
    parser.add_argument(
        "--lengths", default="128,512,2048", help="prompt lengths in tokens, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per figure")
    args = parser.parse_args(argv)
    print(f"block size {BLOCK_SIZE}, free list, FCFS; median of {args.repeats} rounds, ms")
    header = (
        f"{'model':<25} {'prompt':>6} {'file MB':>8} {'load':>8} {'restore':>8} "
        f"{'recompute':>10} {'speed-up':>9}"
    )
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes.split(","):
            loaded = random_model("llama", size, seed=0)
            start = time.perf_counter()
            persistence.model_fingerprint(loaded)
            fingerprint = (time.perf_counter() - start) * 1e3
            print(
                f"{loaded.name}: {loaded.num_params / 1e6:.1f}M params, "
                f"fingerprint {fingerprint:.1f} ms"
            )
            print(header)
            for length in map(int, args.lengths.split(",")):
                r = measure(loaded, length, Path(folder), args.repeats)
                print(
                    f"{loaded.name:<25} {length:>6} {r['file_mb']:>8.1f} {r['load']:>8.1f} "
                    f"{r['restore']:>8.1f} {r['recompute']:>10.1f} "
                    f"{r['recompute'] / r['restore']:>8.1f}x"
                )
