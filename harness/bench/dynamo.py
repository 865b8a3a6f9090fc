"""Dynamo: kvbench's model-clock replay beside NVIDIA Dynamo's mocker on the same trace, timed.

``python -m harness.bench dynamo --python PATH [--sizes 1000,10000] [--allocators
free_list,radix] [--schedulers fcfs,chunked_prefill] [--traces azure_like] [--batches 1,32]
[--repeats 3] [--timeout 1800]``

Dynamo's mocker (the ``ai-dynamo-runtime`` wheel, in Rust) simulates vLLM's scheduler over a
paged KV block manager with prefix caching; its offline trace replay is a discrete-event
simulation priced by its own timing model. It is the anchor issue 34 names for a replay's
speed. ``PATH`` is an interpreter that has it: its wheels pin pydantic, so give it a venv of
its own (``python3 -m venv .venv-dynamo && .venv-dynamo/bin/pip install
ai-dynamo-runtime==1.6.1``; Linux wheels only).

Each cell is ``scale``'s (a kvbench ``run`` on the model clock, in a subprocess: the same
trace, arena and rate; ``--rate``, ``--num-blocks``). Its trace is also written as a Mooncake
file (``write_mooncake``: a hash id per ``engine.block_size`` tokens) and replayed by Dynamo
(``support/dynamo_replay.py``, a subprocess of ``PATH``) with the engine the cell's kvbench
run builds: block size, arena blocks, ``max_num_seqs``, ``max_num_batched_tokens``,
``max_model_len``, prefix caching when the allocator caches prefixes (radix), chunked
prefill when the scheduler chunks, and the latest admitted preempted first (``lifo``:
FCFS's victim). Both replay the same requests: the same output tokens.

Per cell: requests and output tokens; kvbench's replay wall time (the summary's
``wall_time``: the replay loop, not the trace's build nor the tables' writing) and Dynamo's
(its replay call: reading the file, simulating, summing up), each in µs per output token, and
kvbench's over Dynamo's. Both are wall clocks, measured side by side in one run (with
``--repeats K``, each side's run of median wall, the two alternating, kvbench first in every
other run). The replays' own clocks are not compared: kvbench's model clock and Dynamo's
timing model price different things. The work differs too, and the figure says how much
that costs, not which is right: kvbench runs its engine's whole step path (Python scheduler
policies and allocators, the model clock's padded groups) and records every step's row and
every request's token times; Dynamo's mocker keeps the counters of its summary, and its
watermark is its own (1 % of blocks; kvbench's cells keep none).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from itertools import product
from pathlib import Path

from harness.bench.scale import (
    add_cell_options,
    cell_overrides,
    chosen_batches,
    chosen_options,
    measure,
)
from harness.bench.support.components import compose_config
from harness.bench.support.tables import format_table

PROG = "python -m harness.bench dynamo"
DRIVER = Path(__file__).parent / "support" / "dynamo_replay.py"


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


def run_dynamo(python: str, trace: Path, args: dict, timeout: float) -> dict:
    """Dynamo's replay of ``trace`` with engine ``args``, in a subprocess of ``python``: its
    figures, or ``{"error": message}``."""
    cmd = [python, str(DRIVER), str(trace), json.dumps(args)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    except OSError as e:
        return {"error": f"--python {python}: {e.strerror}"}
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_wall(runs: list[dict], key: str) -> dict:
    """The run of median ``key`` (the lower middle of an even count), with how many runs
    there were; the first error if any run failed."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    middle = sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]
    return middle | {"runs": len(runs)}


def format_rows(rows: list[dict]) -> str:
    """One line per cell: its requests and output tokens, each side's wall time and µs per
    output token, kvbench's over Dynamo's (module docstring)."""
    header = ["trace", "allocator", "scheduler", "max_num_seqs", "requests", "output tokens",
              "kvbench replay s", "kvbench µs/token", "Dynamo replay s", "Dynamo µs/token",
              "kvbench / Dynamo", "completed (kvbench, Dynamo)"]  # fmt: skip
    lines = []
    for r in rows:
        ours, theirs, tokens = r["kvbench"], r["dynamo"], r["output_tokens"]
        cells = [
            r["trace"],
            r["allocator"],
            r["scheduler"],
            str(r["engine"]["max_num_seqs"]),
            f"{r['size']:,}",
            f"{tokens:,}",
        ]
        for side, wall in ((ours, "replay"), (theirs, "wall")):
            if "error" in side:
                cells += [side["error"], ""]
            else:
                cells += [f"{side[wall]:.2f}", f"{1e6 * side[wall] / tokens:.2f}"]
        if "error" in ours or "error" in theirs:
            cells += ["n/a", ""]
        else:
            cells.append(f"{ours['replay'] / theirs['wall']:.1f}x")
            cells.append(f"{ours['completed']:,}, {theirs['completed_requests']:,}")
        lines.append(cells)
    return format_table(header, lines)


def run_cell(cell: dict, args: argparse.Namespace, tmp: Path, index: int) -> dict:
    """``cell``'s row: its trace written for Dynamo, then ``args.repeats`` runs of each
    side, alternating (kvbench first in every other run), reduced by ``median_wall``."""
    trace = tmp / "trace.jsonl"
    engine, tokens = write_cell_trace(cell, args.num_blocks, trace)
    runs: dict[str, list[dict]] = {"kvbench": [], "dynamo": []}
    for k in range(args.repeats):
        sides = ("kvbench", "dynamo") if (index + k) % 2 == 0 else ("dynamo", "kvbench")
        for side in sides:
            if side == "kvbench":
                folder = Path(tempfile.mkdtemp(dir=tmp))  # a fresh folder a run
                runs[side].append(measure(cell, args.num_blocks, args.timeout, folder))
            else:
                runs[side].append(run_dynamo(args.python, trace, engine, args.timeout))
    return cell | {
        "output_tokens": tokens,
        "engine": engine,
        "kvbench": median_wall(runs["kvbench"], "replay"),
        "dynamo": median_wall(runs["dynamo"], "wall"),
    }


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
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            for trace in chosen["trace"]:
                for allocator in chosen["allocator"]:
                    for scheduler, batch in product(chosen["scheduler"], batches):
                        cell = {"trace": trace, "allocator": allocator, "scheduler": scheduler,
                                "size": size, "rate": args.rate}  # fmt: skip
                        if batch is not None:
                            cell["batch"] = batch
                        rows.append(run_cell(cell, args, Path(tmp), len(rows)))
                        print(" ".join(format_rows(rows[-1:]).splitlines()[-1].split()),
                              flush=True)  # fmt: skip
    print(f"\nwall clocks, measured side by side ({time.perf_counter() - started:.0f} s); "
          f"{args.num_blocks} blocks, rate {args.rate:g}/s; Dynamo: {args.python}")  # fmt: skip
    print(format_rows(rows))
    errors = [r[side]["error"] for r in rows for side in ("kvbench", "dynamo")
              if "error" in r[side]]  # fmt: skip
    if errors:
        sys.exit(f"{PROG}: {len(errors)} run(s) failed; the first: {errors[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
