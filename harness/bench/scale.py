"""Scale: kvbench runs of 1k to 100k requests on the model clock; wall time and peak memory.

``python -m harness.bench scale [--sizes 1000,10000,100000] [--allocators ...]
[--schedulers fcfs,chunked_prefill] [--traces azure_like,mooncake_like] [--timeout 600]
[--against REF] [--batches 4,8,16,32] [--repeats 3]`` (sizes up to 1000000 run; 1M
azure_like takes minutes to an hour)

On the model clock (``engine.clock=model``, priced by the committed profile
``results/baselines/profile-llama-tiny.json``) no model runs: a replay's cost is the per-step
Python of the engine, scheduler, recorder and allocator, which this benchmark measures. Each
cell (size x trace x allocator x scheduler) is one kvbench ``run`` (trace built, replayed,
tables and summary written) in a subprocess of its own, so its peak RSS is its own. Per cell:
wall seconds of ``run`` and the CPU seconds of its process (user + system: on a machine other
work shares, the wall time includes waiting for a core), peak RSS, engine steps, request
throughput on the model clock, and sequence-steps (a sequence's row in a step) per wall
second of the replay and its inverse, microseconds of replay wall per sequence-step; then,
per configuration, the wall time of the largest size over the one before (linear: the sizes'
ratio). ``--against REF`` runs every cell a second time on the code of git commit ``REF`` (a
temporary checkout: ``git archive``), on the same machine in the same run, beside this code
cell by cell (REF first in every other cell: the order alone moved a ratio by 20-30 % here)
so that both see the same load, and prints REF's wall time (a change outside the replay, such
as the trace's build or the summary, shows there alone) and µs per sequence-step, and this
code's CPU per sequence-step over REF's.

``--repeats K`` runs every cell (and its REF) K times, REF first in every other run of a
cell too, and reports per cell the run of median CPU per sequence-step (the lower middle of
an even count: every figure of a row is one run's), with the spread of that CPU over the K
runs, (slowest - fastest) / median (``noise.spread``): on a shared machine identical replays
here differed by up to 2x, so a ratio nearer 1 than its cells' spread says nothing.

``--batches`` runs every cell at each ``scheduler.max_num_seqs`` given and splits the cost
of a step into what it costs whatever its batch and what each sequence in it adds: per
configuration, the least-squares line through (mean batch, replay wall µs a step) of its
batches, ``µs a step = fixed + per sequence x batch`` (the replay's wall time: run it on a
quiet machine). ``fixed / batch + per sequence`` is a step's µs a sequence-step; the fixed
part is what no change to the per-sequence work can remove. Batches above 32 may preempt in
the default arena (``--num-blocks``). Against a commit whose bench takes no ``--batches`` (it
would run its default batch), every REF cell is an error that says so.

The arena (``--num-blocks 4096`` of 16 slots) holds ``max_num_seqs`` (32) sequences of
``max_model_len`` (2048) even rounded up to a buddy allocator's powers of two, so requests
queue for a place in the batch rather than preempt each other. Arrivals come at
``--rate 40`` requests/s (mooncake_like: sessions/s), at least four times what the tiny
model's profile serves (about 10 short requests/s): the waiting queue grows to most of the
trace, as in a saturated replay. A cell that takes longer than ``--timeout`` seconds is
reported as ``timeout``. Trace options name ``conf/trace/`` groups; ``shared_prefix`` is
sized by its users (4 system prompts x size/4 users), any other by ``trace.num_requests``.
``mooncake_conversation`` (the real Mooncake conversation trace's shape: 12,031 requests,
prompts up to 32k) keeps its own arrivals and runs with ``engine.max_model_len=32768`` in an
arena of 8 M blocks that never evicts: ``--traces mooncake_conversation --sizes 12031
--allocators radix --schedulers fcfs``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from itertools import product
from pathlib import Path

from harness.bench.support.components import ALLOCATORS, compose_config, options
from harness.bench.support.tables import format_table
from harness.platform.noise import spread

PROG = "python -m harness.bench scale"
PROFILE = "results/baselines/profile-llama-tiny.json"
REPO = Path(__file__).resolve().parents[2]


# A trace shaped like a real one keeps its own arrivals and needs a longer context, in an
# arena that never evicts (sized by use: its blocks cost nothing until taken).
REAL_SHAPED = {
    "mooncake_conversation": [
        "engine.max_model_len=32768",  # fcfs's token budget follows it
        "engine.num_blocks=8000000",
    ]
}


def trace_overrides(trace: str, size: int, rate: float) -> list[str]:
    """The ``trace=`` option sized to ``size`` requests at ``rate`` requests/s (a real-shaped
    trace at its own rate, with the engine it needs)."""
    if trace == "shared_prefix":
        return [f"trace={trace}", f"trace.users_per_prompt={size // 4}", f"trace.rate={rate}"]
    if trace in REAL_SHAPED:
        return [f"trace={trace}", f"trace.num_requests={size}", *REAL_SHAPED[trace]]
    return [f"trace={trace}", f"trace.num_requests={size}", f"trace.rate={rate}"]


def cell_overrides(cell: dict, num_blocks: int) -> list[str]:
    """A cell's kvbench overrides: its trace, allocator and scheduler (and batch, if it has
    one) on the model clock (the trace's own engine settings last: they win)."""
    batch = [f"scheduler.max_num_seqs={cell['batch']}"] if cell.get("batch") else []
    return [
        "engine.clock=model",
        f"engine.profile={REPO / PROFILE}",
        f"engine.num_blocks={num_blocks}",
        "progress=false",
        f"allocator={cell['allocator']}",
        f"scheduler={cell['scheduler']}",
        *batch,
        *trace_overrides(cell["trace"], cell["size"], cell["rate"]),
    ]


def run_cell(overrides: list[str], out: Path) -> dict:
    """One kvbench ``run`` in this process: its figures and this process's peak RSS."""
    import pyarrow.parquet as pq

    from harness.analysis.results import REQUESTS_FILE, STEPS_FILE
    from harness.cli.run import run

    cfg = compose_config(overrides)
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    summary = run(cfg, out)
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime
    rss = usage.ru_maxrss  # KiB on Linux, bytes on macOS
    steps = pq.read_table(out / STEPS_FILE, columns=["batch_size"]).column(0)
    output = pq.read_table(out / REQUESTS_FILE, columns=["output_tokens"]).column(0)
    return {
        "wall": wall,
        "cpu": cpu,
        "replay": summary["wall_time"],
        "rss_mib": rss / (2**20 if sys.platform == "darwin" else 2**10),
        "steps": summary["num_steps"],
        "seq_steps": int(steps.to_numpy().sum()),
        "throughput": summary["request_throughput"],
        "completed": summary["completed"],
        "output_tokens": int(output.to_numpy().sum()),
        "max_num_seqs": cfg.scheduler.max_num_seqs,
    }


def measure(cell: dict, num_blocks: int, timeout: float, out: Path, code: Path = REPO) -> dict:
    """Run one cell in a subprocess on the code in ``code`` (this checkout, or another
    commit's); its figures, or ``{"error": "timeout" | message}``."""
    cmd = [sys.executable, "-m", "harness.bench.scale", "--cell", json.dumps(cell)]
    cmd += ["--num-blocks", str(num_blocks), "--out", str(out)]
    env = os.environ | {"PYTHONPATH": str(code)}
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=code, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return other_batch(cell, got) or got


def other_batch(cell: dict, got: dict) -> dict | None:
    """An error if the run ``got`` of ``cell`` ran another batch than the cell's (a REF whose
    bench predates ``--batches`` runs its default ``max_num_seqs``), else None."""
    if not cell.get("batch") or got.get("max_num_seqs") == cell["batch"]:
        return None
    batch = cell["batch"]
    if "max_num_seqs" not in got:
        return {"error": f"its bench predates --batches: ran its default batch, not {batch}"}
    return {"error": f"ran max_num_seqs={got['max_num_seqs']}, not {batch}"}


def median_run(runs: list[dict]) -> dict:
    """A cell's figures over its repeated runs (``--repeats``): the run of median CPU per
    sequence-step (the lower middle of an even count), with how many runs there were and the
    ``spread`` of that CPU over them; the first error if any run failed."""
    return median_of(runs, lambda r: r["cpu"] / r["seq_steps"] if r["seq_steps"] else 0.0, "cpu")


def median_of(runs: list[dict], value: Callable[[dict], float], name: str) -> dict:
    """The run of median ``value`` among ``runs`` (the lower middle of an even count), with
    how many runs there were (``runs``) and the ``spread`` of that value over them
    (``{name}_spread``); the first error if any run failed."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    values = list(map(value, runs))
    middle = sorted(range(len(runs)), key=values.__getitem__)[(len(runs) - 1) // 2]
    return runs[middle] | {"runs": len(runs), f"{name}_spread": spread(values)}


def run_repeats(
    cell: dict, args: argparse.Namespace, out: Path, tmp: Path, old_code: Path | None, index: int
) -> dict:
    """The ``index``-th cell's ``got`` (and ``old``, on REF's ``old_code``): its
    ``args.repeats`` runs, each in a folder of its own under ``out`` (kept only with
    ``--out``), reduced by ``median_run``."""
    name = "-".join(str(v) for v in cell.values())
    runs: dict[str, list[dict]] = {"got": [], "old": []}
    for k in range(args.repeats):
        # Against REF, every other run of a cell runs REF first: on a shared machine the
        # order alone moved a ratio by 20-30 %.
        first = (index + k) % 2 if old_code is not None else 0
        for which in ("got", "old")[::-1] if first else ("got", "old"):
            if which == "got":
                folder = out / (f"{name}-run{k}" if args.repeats > 1 else name)
                runs["got"].append(measure(cell, args.num_blocks, args.timeout, folder))
                if not args.out:  # a 100k-request run's tables take ~100 MB
                    shutil.rmtree(folder, ignore_errors=True)
            elif old_code is not None:
                folder = tmp / "against-run"
                runs["old"].append(measure(cell, args.num_blocks, args.timeout, folder, old_code))
                shutil.rmtree(folder, ignore_errors=True)
    return {key: median_run(got) for key, got in runs.items() if got}


def add_cell_options(parser: argparse.ArgumentParser, allocators: str, schedulers: str,
                     traces: str) -> None:  # fmt: skip
    """The options that choose a replay bench's cells (conf options, comma-separated, with
    these defaults), its arrival rate and arena: ``scale``'s and ``instructions``'."""
    parser.add_argument("--allocators", default=allocators,
                        help="conf/allocator options, comma-separated")  # fmt: skip
    parser.add_argument("--schedulers", default=schedulers,
                        help="conf/scheduler options, comma-separated")  # fmt: skip
    parser.add_argument("--traces", default=traces, help="conf/trace options, comma-separated")
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    parser.add_argument("--num-blocks", type=int, default=4096, help="KV arena blocks (of 16)")
    parser.add_argument("--batches",
                        help="scheduler.max_num_seqs values, comma-separated: each cell at "
                        "each, then a step's fixed and per-sequence cost")  # fmt: skip


def chosen_batches(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int | None]:
    """The ``max_num_seqs`` of each cell ``--batches`` chose (``[None]``: the scheduler's
    own); anything but distinct integers >= 1 is a usage error."""
    try:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else [None]
    except ValueError:
        batches = [0]
    if any(b is not None and b < 1 for b in batches) or len(set(batches)) < len(batches):
        parser.error(f"--batches: {args.batches!r}; give distinct max_num_seqs values >= 1, "
                     "comma-separated, e.g. 4,8,16,32")  # fmt: skip
    return batches


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """The least-squares line ``y = fixed + per x`` through ``points`` (x, y): ``(fixed,
    per)``; None without two distinct x (one batch: no line)."""
    if len({round(x, 6) for x, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    per = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - per * mx, per


def fit_lines(points: dict[tuple, list[tuple[float, float]]]) -> Iterator[tuple]:
    """Per configuration of ``points`` (its (mean batch, cost a step) points) with a line:
    the configuration, its mean batches as printed, and ``fit_line``'s fixed and per."""
    for key, xy in points.items():
        if (fit := fit_line(xy)) is not None:
            yield key, ", ".join(f"{x:.1f}" for x, _ in xy), *fit


def chosen_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The allocators, schedulers and traces ``add_cell_options`` chose, by group; an
    unknown one is a usage error naming those that exist."""
    groups = {"allocator": args.allocators, "scheduler": args.schedulers, "trace": args.traces}
    chosen = {group: names.split(",") for group, names in groups.items()}
    for group, names in chosen.items():
        unknown = [n for n in names if n not in options(group)]
        if unknown:
            parser.error(f"--{group}s: unknown {unknown}; choose from {', '.join(options(group))}")
    return chosen


def checkout(ref: str, into: Path) -> Path:
    """The files of git commit ``ref`` of this repository, unpacked into ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref], capture_output=True
    )
    if archive.returncode:
        message = archive.stderr.decode().strip().splitlines()
        sys.exit(f"{PROG}: --against {ref}: {message[-1] if message else 'git archive failed'}")
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def format_cells(rows: list[dict]) -> str:
    """One line per cell (a cell run ``--against`` a commit adds its wall time, its µs per
    sequence-step and this code's CPU per sequence-step over the commit's; one run at a
    ``--batches`` value, its max_num_seqs; cells run ``--repeats`` times, the runs and their
    CPU spread)."""
    against = any("old" in r for r in rows)
    batched = any("batch" in r for r in rows)
    repeated = any(r["got"].get("runs", 1) > 1 for r in rows)
    header = ["trace", "allocator", "scheduler", *(["max_num_seqs"] if batched else []),
              "requests", "wall s", "CPU s", "peak RSS MiB", "steps", "req/s (model)",
              "seq-steps/s", "µs/seq-step"]  # fmt: skip
    if repeated:
        header += ["runs", "CPU spread"]
    if against:
        header += ["REF wall s", "REF µs/seq-step", "REF peak RSS MiB", "CPU/seq-step vs REF"]
        header += ["REF CPU spread"] if repeated else []
    lines = []
    for r in rows:
        got = r["got"]
        cells = [r["trace"], r["allocator"], r["scheduler"]]
        cells += [str(r.get("batch", ""))] if batched else []
        cells.append(f"{r['size']:,}")
        if "error" in got:
            cells += [got["error"], "", "", "", "", "", ""]
        else:
            rate = got["seq_steps"] / got["replay"] if got["replay"] else float("nan")
            cells += [f"{got['wall']:.1f}", f"{got['cpu']:.1f}", f"{got['rss_mib']:.0f}",
                      f"{got['steps']:,}", f"{got['throughput']:.2f}", f"{rate:,.0f}",
                      f"{1e6 / rate:.2f}"]  # fmt: skip
        if repeated:
            cells += _runs(got)
        if against:
            old = r.get("old", {})
            if "error" in got or "error" in old or not old:
                cells += [old.get("error", ""), "", "", "n/a"] + ([""] if repeated else [])
            else:
                ratio = (got["cpu"] / got["seq_steps"]) / (old["cpu"] / old["seq_steps"])
                cells += [f"{old['wall']:.1f}", f"{1e6 * old['replay'] / old['seq_steps']:.2f}",
                          f"{old['rss_mib']:.0f}", f"{ratio:.2f}x"]  # fmt: skip
                cells += _runs(old)[1:] if repeated else []
        lines.append(cells)
    return format_table(header, lines)


def _runs(got: dict) -> list[str]:
    """A cell's ``runs`` and ``CPU spread`` columns (blank for an error)."""
    if "error" in got:
        return ["", ""]
    return [str(got.get("runs", 1)), f"{got.get('cpu_spread', 0.0):.0%}"]


def format_ratios(rows: list[dict], sizes: list[int]) -> str:
    """Per configuration, the largest size over the one before it: wall time, the work
    (sequence-steps: a trace's mix can change with its size, e.g. mooncake_like keeps more
    of its sessions' later, longer turns at 100k than at 10k) and CPU time per unit of work
    (1.0: the harness's cost is linear in the work)."""
    if len(sizes) < 2:
        return ""
    big, small = sizes[-1], sizes[-2]
    got = {(r["trace"], r["allocator"], r["scheduler"], r.get("batch"), r["size"]): r["got"]
           for r in rows}  # fmt: skip
    wall = f"wall {big:,} / {small:,} (linear: {big / small:g})"
    header = ["trace", "allocator", "scheduler", wall, "seq-steps", "CPU per seq-step"]
    lines = []
    for trace, alloc, sched, batch, size in got:
        if size != big:
            continue
        a, b = got[trace, alloc, sched, batch, big], got.get((trace, alloc, sched, batch, small))
        sched = sched if batch is None else f"{sched} ({batch})"
        if "error" in a or not b or "error" in b:
            lines.append([trace, alloc, sched, "n/a", "n/a", "n/a"])
            continue
        per_step = (a["cpu"] / a["seq_steps"]) / (b["cpu"] / b["seq_steps"])
        lines.append([trace, alloc, sched, f"{a['wall'] / b['wall']:.1f}x",
                      f"{a['seq_steps'] / b['seq_steps']:.1f}x", f"{per_step:.2f}x"])  # fmt: skip
    return format_table(header, lines)


def format_batches(rows: list[dict]) -> str:
    """Per configuration run at several batches (``--batches``), the least-squares line
    through its cells' (mean batch, replay µs a step): the fixed µs a step and the µs each
    sequence adds (module docstring)."""
    points: dict[tuple, list[tuple[float, float]]] = {}
    for r in rows:
        got = r["got"]
        if "batch" not in r or "error" in got or not got["steps"]:
            continue
        key = (r["trace"], r["allocator"], r["scheduler"], r["size"])
        batch = got["seq_steps"] / got["steps"]
        points.setdefault(key, []).append((batch, 1e6 * got["replay"] / got["steps"]))
    header = ["trace", "allocator", "scheduler", "requests", "batches (mean)",
              "fixed µs/step", "µs/seq a step"]  # fmt: skip
    lines = []
    for (trace, alloc, sched, size), batches, fixed, per in fit_lines(points):
        lines.append([trace, alloc, sched, f"{size:,}", batches, f"{fixed:.1f}", f"{per:.2f}"])
    return format_table(header, lines) if lines else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="requests per run")
    add_cell_options(parser, ",".join(ALLOCATORS), "fcfs,chunked_prefill",
                     "azure_like,mooncake_like")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a cell may run before it counts as a timeout")  # fmt: skip
    parser.add_argument("--out", help="folder for the runs (default: a temporary one)")
    parser.add_argument("--against", metavar="REF",
                        help="also run each cell on git commit REF, side by side")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each cell (and of its REF): the median's figures, "
                        "and their CPU spread")  # fmt: skip
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # the subprocess: one cell
    args = parser.parse_args(argv)
    if args.cell:
        cell = json.loads(args.cell)
        print(json.dumps(run_cell(cell_overrides(cell, args.num_blocks), Path(args.out))))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = chosen_batches(parser, args)
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats}; give a number of runs >= 1, e.g. 3")
    chosen = chosen_options(parser, args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        old_code = checkout(args.against, Path(tmp) / "against") if args.against else None
        for size in sizes:
            for trace in chosen["trace"]:
                for allocator in chosen["allocator"]:
                    for scheduler, batch in product(chosen["scheduler"], batches):
                        cell = {"trace": trace, "allocator": allocator, "scheduler": scheduler,
                                "size": size, "rate": args.rate}  # fmt: skip
                        if batch is not None:
                            cell["batch"] = batch
                        rows.append(cell | run_repeats(cell, args, out, Path(tmp), old_code,
                                                       len(rows)))  # fmt: skip
                        print(" ".join(format_cells(rows[-1:]).splitlines()[-1].split()),
                              flush=True)  # fmt: skip
    against = f"; REF = {args.against}" if args.against else ""
    print(f"\nmodel clock ({PROFILE}), {args.num_blocks} blocks, rate {args.rate:g}/s{against}")
    for trace in set(chosen["trace"]) & REAL_SHAPED.keys():
        print(f"{trace}: at its own rate, with {' '.join(REAL_SHAPED[trace])}")
    print(format_cells(rows))
    if ratios := format_ratios(rows, sizes):
        print()
        print(ratios)
    if fits := format_batches(rows):
        print()
        print(fits)


if __name__ == "__main__":
    main(sys.argv[1:])
