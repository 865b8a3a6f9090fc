"""Dynamo: kvbench's model-clock replay beside NVIDIA Dynamo's mocker on the same trace, timed.

``python -m harness.bench dynamo --python PATH [--sizes 1000,10000] [--allocators
free_list,radix] [--schedulers fcfs,chunked_prefill] [--traces azure_like] [--batches 1,32]
[--repeats 3] [--timeout 1800]``

Dynamo's mocker (the ``ai-dynamo-runtime`` wheel, in Rust) simulates vLLM's scheduler over a
paged KV block manager with prefix caching; its offline trace replay is a discrete-event
simulation priced by its own timing model. It is the anchor issue 34 names for a replay's
speed. ``PATH`` is an interpreter that has it: its wheels pin pydantic, so give it a venv of
its own (``python3 -m venv .venv-dynamo && .venv-dynamo/bin/pip install
ai-dynamo-runtime==1.6.1``; Linux wheels only). It is checked before any cell runs.

Each cell is ``scale``'s (a kvbench ``run`` on the model clock, in a subprocess: the same
trace, arena and rate; ``--rate``, ``--num-blocks``, ``--batches``). Its trace is also written
as a Mooncake file (``write_mooncake``: a hash id per ``engine.block_size`` tokens) and
replayed by Dynamo (``support/dynamo_replay.py``, a subprocess of ``PATH``) with the engine
the cell's kvbench run builds: block size, arena blocks, ``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``, prefix caching for radix, chunked prefill for
chunked_prefill, and the latest admitted preempted first (``lifo``, FCFS's victim). Only those
allocators and schedulers have a counterpart there (vLLM's paged blocks, with or without its
prefix cache; FCFS, with or without chunked prefill): any other is a usage error. A cell's
figures count only if both sides emitted every output token the trace asks for (Dynamo
shortens an output that does not fit ``max_model_len``): else the cell is an error.

Per cell: requests, output tokens, blocks, kvbench's mean batch (sequences a step: at the
default rate both sides keep ``max_num_seqs`` running, which makes a token's cost comparable);
kvbench's replay wall time (the summary's ``wall_time``: the replay loop, not the trace's
build nor the tables' writing) and Dynamo's (its summary's ``wall_time_ms``: the simulation,
not the file's parsing), each in µs per output token, and kvbench's over Dynamo's. Both are
wall clocks, measured side by side in one run: with ``--repeats K`` each side's run of median
wall, with its spread over the K runs (``(slowest - fastest) / median``), the sides
alternating (kvbench first in every other run). The replays' own clocks are not compared:
kvbench's model clock and Dynamo's timing model price different things, so their latencies
and schedules differ. The work differs too, and the figure says what that costs, not which
is right: kvbench runs its engine's whole step path (Python scheduler policies and
allocators, the model clock's padded groups) and records every step's row and every token's
time; Dynamo's mocker keeps per-request records for its summary's percentiles.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import product
from operator import itemgetter
from pathlib import Path

from harness.bench.scale import (
    add_cell_options,
    cell_overrides,
    chosen_batches,
    chosen_options,
    measure,
    median_of,
)
from harness.bench.support.components import compose_config
from harness.bench.support.tables import format_table

PROG = "python -m harness.bench dynamo"
DRIVER = Path(__file__).parent / "support" / "dynamo_replay.py"
# The options with a counterpart in Dynamo's vLLM mocker: a paged allocator (radix: with its
# prefix cache) and FCFS (chunked_prefill: with chunked prefill); both preempt the latest.
COUNTERPARTS = {"allocator": ("free_list", "radix"), "scheduler": ("fcfs", "chunked_prefill")}


def engine_args(cfg) -> dict:
    """Dynamo's engine for the kvbench run ``cfg`` composes: its allocator and scheduler
    built as the run builds them (an allocator costs nothing until its blocks are used),
    their limits read back."""
    from harness.cli.run import build_component

    engine = cfg.engine
    allocator = build_component(cfg.allocator)(
        num_blocks=engine.num_blocks, block_size=engine.block_size
    )
    scheduler = build_component(cfg.scheduler)(allocator, max_model_len=engine.max_model_len)
    return {
        "block_size": allocator.block_size,
        "num_gpu_blocks": allocator.num_blocks,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_model_len": scheduler.max_model_len,
        "enable_prefix_caching": allocator.caches_prefixes,
        "enable_chunked_prefill": scheduler.chunked_prefill,
        "preemption_mode": "lifo",
    }


def write_cell_trace(cell: dict, num_blocks: int, path: Path) -> tuple[dict, int]:
    """Write ``cell``'s trace as a Mooncake file at ``path``; Dynamo's engine for the cell
    and the trace's output tokens."""
    from harness.cli.run import build_component
    from harness.workload.public import write_mooncake

    cfg = compose_config(cell_overrides(cell, num_blocks))
    trace = build_component(cfg.trace.generator)
    args = engine_args(cfg)
    write_mooncake(trace, path, args["block_size"])
    return args, sum(r.max_tokens for r in trace)


def call_driver(python: str, argv: list[str], timeout: float) -> dict:
    """``support/dynamo_replay.py argv`` run by ``python``: the JSON it printed, or
    ``{"error": message}`` (its last line on stderr, a timeout, no such interpreter, or
    output that is not its result)."""
    try:
        done = subprocess.run(
            [python, str(DRIVER), *argv], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    except OSError as e:
        return {"error": f"--python {python}: {e.strerror}"}
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"--python {python}: printed no result; is it a Python interpreter?"}


def run_dynamo(python: str, trace: Path, args: dict, tokens: int, timeout: float) -> dict:
    """Dynamo's replay of ``trace`` (``tokens`` output tokens) with engine ``args``: its
    figures, ``replay`` its simulation's wall seconds; an error if it fails or emits
    another number of tokens."""
    got = call_driver(python, [str(trace), json.dumps(args)], timeout)
    if "error" in got:
        return got
    if (emitted := got.get("total_output_tokens")) != tokens:
        return {"error": f"Dynamo emitted {emitted} of {tokens} tokens"}
    return got | {"replay": got["wall_time_ms"] / 1000.0}


def run_kvbench(cell: dict, num_blocks: int, tokens: int, timeout: float, tmp: Path) -> dict:
    """kvbench's run of ``cell`` (``scale``'s, in a folder deleted after it); an error if it
    fails or emits another number of tokens than the trace's ``tokens``."""
    folder = Path(tempfile.mkdtemp(dir=tmp))
    try:
        got = measure(cell, num_blocks, timeout, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a 100k-request run's tables take ~100 MB
    if "error" not in got and got["output_tokens"] != tokens:
        return {"error": f"kvbench emitted {got['output_tokens']} of {tokens} tokens"}
    return got


def run_cell(cell: dict, args: argparse.Namespace, tmp: Path, index: int) -> dict:
    """``cell``'s row: its trace written for Dynamo, then ``args.repeats`` runs of each
    side, alternating (kvbench first in every other run), each side's run of median wall."""
    trace = tmp / "trace.jsonl"
    engine, tokens = write_cell_trace(cell, args.num_blocks, trace)
    runs: dict[str, list[dict]] = {"kvbench": [], "dynamo": []}
    for k in range(args.repeats):
        for side in ("kvbench", "dynamo")[:: 1 if (index + k) % 2 == 0 else -1]:
            if side == "kvbench":
                runs[side].append(run_kvbench(cell, args.num_blocks, tokens, args.timeout, tmp))
            else:
                runs[side].append(run_dynamo(args.python, trace, engine, tokens, args.timeout))
    return cell | {
        "output_tokens": tokens,
        "engine": engine,
        **{side: median_of(got, itemgetter("replay"), "wall") for side, got in runs.items()},
    }


def format_rows(rows: list[dict]) -> str:
    """One line per cell: its requests, output tokens, blocks and kvbench's mean batch,
    each side's replay wall time and µs per output token, kvbench's over Dynamo's, and with
    repeated runs their count and each side's spread (module docstring)."""
    repeated = any(r[side].get("runs", 1) > 1 for r in rows for side in ("kvbench", "dynamo"))
    header = ["trace", "allocator", "scheduler", "max_num_seqs", "requests", "output tokens",
              "blocks", "mean batch", "kvbench replay s", "kvbench µs/token", "Dynamo replay s",
              "Dynamo µs/token", "kvbench / Dynamo"]  # fmt: skip
    header += ["runs", "spread (kvbench, Dynamo)"] if repeated else []
    lines = []
    for r in rows:
        ours, theirs, tokens, engine = r["kvbench"], r["dynamo"], r["output_tokens"], r["engine"]
        cells = [r["trace"], r["allocator"], r["scheduler"], str(engine["max_num_seqs"]),
                 f"{r['size']:,}", f"{tokens:,}", f"{engine['num_gpu_blocks']:,}"]  # fmt: skip
        cells.append("" if "error" in ours else f"{ours['seq_steps'] / ours['steps']:.1f}")
        for side in (ours, theirs):
            if "error" in side:
                cells += [side["error"], ""]
            else:
                cells += [f"{side['replay']:.2f}", f"{1e6 * side['replay'] / tokens:.2f}"]
        failed = "error" in ours or "error" in theirs
        cells.append("n/a" if failed else f"{ours['replay'] / theirs['replay']:.1f}x")
        if repeated:
            spreads = "" if failed else f"{ours['wall_spread']:.0%}, {theirs['wall_spread']:.0%}"
            cells += ["" if failed else str(ours["runs"]), spreads]
        lines.append(cells)
    return format_table(header, lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True,
                        help="an interpreter with ai-dynamo-runtime installed")  # fmt: skip
    parser.add_argument("--sizes", default="1000,10000", help="requests per run")
    add_cell_options(parser, "free_list,radix", "fcfs,chunked_prefill", "azure_like")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a side's run may take: then a timeout")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each side of a cell: the median's figures")  # fmt: skip
    args = parser.parse_args(argv)
    batches = chosen_batches(parser, args)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        sizes = [0]
    if min(sizes) < 1:
        parser.error(f"--sizes: {args.sizes!r}; give request counts >= 1, comma-separated")
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats}; give a number of runs >= 1, e.g. 3")
    chosen = chosen_options(parser, args)
    for group, names in COUNTERPARTS.items():
        if other := [n for n in chosen[group] if n not in names]:
            parser.error(f"--{group}s: {other} have no counterpart in Dynamo's vLLM mocker; "
                         f"choose from {', '.join(names)}")  # fmt: skip
    version = call_driver(args.python, ["--check"], timeout=120)
    if "error" in version:
        parser.error(version["error"])
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for size, trace, allocator in product(sizes, chosen["trace"], chosen["allocator"]):
            for scheduler, batch in product(chosen["scheduler"], batches):
                cell = {"trace": trace, "allocator": allocator, "scheduler": scheduler,
                        "size": size, "rate": args.rate}  # fmt: skip
                if batch is not None:
                    cell["batch"] = batch
                rows.append(run_cell(cell, args, Path(tmp), len(rows)))
                print(" ".join(format_rows(rows[-1:]).splitlines()[-1].split()), flush=True)
    print(f"\nwall clocks, measured side by side ({time.perf_counter() - started:.0f} s); rate "
          f"{args.rate:g}/s; Dynamo: ai-dynamo-runtime {version['version']} "
          f"({args.python})")  # fmt: skip
    print(format_rows(rows))
    errors = [r[side]["error"] for r in rows for side in ("kvbench", "dynamo")
              if "error" in r[side]]  # fmt: skip
    if errors:
        sys.exit(f"{PROG}: {len(errors)} run(s) failed; the first: {errors[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
