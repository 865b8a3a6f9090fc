"""Instructions: CPU instructions per sequence-step of a model-clock replay, counted, not timed.

``python -m harness.bench instructions [--sizes 300,900] [--allocators free_list,radix]
[--schedulers fcfs] [--traces azure_like] [--batches 1,32] [--against REF] [--jobs 2]
[--timeout 1800]``

On a shared machine a replay's time moves by up to 30 % from run to run, so a change that
saves 3 % cannot be seen by timing it. The number of instructions it executes barely moves
(two identical runs here differed by 0.04 %). Each cell (trace x allocator x scheduler) is
the ``scale`` benchmark's cell (a kvbench ``run`` on the model clock: same profile, arena
and rate) run in a subprocess under valgrind's callgrind, which counts the instructions the
process executed, at two sizes; the difference of the counts over the difference of the
runs' sequence-steps (a sequence's row in a step) is the replay's **instructions per
sequence-step**, with what both runs do once (imports, the model's build, the tables' fixed
costs) cancelled; runs of tens of requests read far off (20 and 40: 10k against 33k at 300
and 900), so give hundreds. Python's hash seed is fixed (``PYTHONHASHSEED=0``) so that both
runs make the same choices. ``--against REF`` counts git commit ``REF``'s code (a temporary
checkout) the same way and prints this code's count over REF's; a REF whose replay took
other steps is flagged, since its count is then per other work.

An instruction is not a unit of time: a change that trades instructions for cache misses (a
bigger table, a walk over a dict of millions) moves the time and not this count, and the
reverse. Use this to tell whether a change makes the replay's Python do less, side by side;
use ``scale`` for the time.

``--batches`` counts every cell at each ``scheduler.max_num_seqs`` given and splits a step's
instructions, as ``scale --batches`` splits its time, into what a step executes whatever its
batch and what each sequence adds: per configuration, the least-squares line through (mean
batch, instructions a step) of its batches, each from the two sizes' differences (steps and
sequence-steps). What a run does once a request (its trace entry, admission, finish, request
row) grows with the requests, so it lands in the per-sequence figure, spread over a request's
sequence-steps. ``scale``'s split is of the replay's wall time alone, each batch's whole run;
the two also differ because a step's fixed path, spread over dozens of functions, runs fewer
instructions a nanosecond than a tight loop over its sequences.

Needs valgrind (Linux; ``apt install valgrind``); runs are ~50x slower under it, a 900-request
cell ~4 minutes; at batch 1 every step is its own, ~10 minutes for 300 requests and ~30 for
900 (give ``--timeout 5400``). Valgrind lets no process change a hard
resource limit, which mlx_lm does at import: the subprocess sets only the soft one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROG = "python -m harness.bench instructions"
REPO = Path(__file__).resolve().parents[2]
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def collected(stderr: str) -> int:
    """The instructions callgrind counted, from its report on ``stderr``."""
    found = _COLLECTED.findall(stderr)
    if not found:
        raise ValueError("callgrind reported no instruction count")
    return int(found[-1])


def per_seq_step(small: dict, big: dict) -> float:
    """Instructions per sequence-step of the replay, from runs of two sizes (``ir``: the
    run's instructions, ``seq_steps``: its sequence-steps): what the bigger run did more,
    per sequence-step more."""
    more = big["seq_steps"] - small["seq_steps"]
    if more <= 0:
        raise ValueError("the bigger run took no more sequence-steps: give sizes further apart")
    return (big["ir"] - small["ir"]) / more


def count(cell: dict, num_blocks: int, timeout: float, code: Path = REPO) -> dict:
    """One cell's run under callgrind on the code in ``code``: its instructions (``ir``),
    steps and sequence-steps, or ``{"error": message}``."""
    from harness.bench.scale import other_batch  # not above: see ``main``

    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
        cmd += [sys.executable, "-P", str(Path(__file__).resolve()), "--cell", json.dumps(cell)]
        cmd += ["--num-blocks", str(num_blocks), "--out", str(Path(tmp) / "run")]  # run_cell's
        env = os.environ | {"PYTHONPATH": str(code), "PYTHONHASHSEED": "0"}
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, cwd=code, env=env
            )
        except subprocess.TimeoutExpired:
            return {"error": "timeout"}
    lines = [line for line in done.stderr.splitlines() if not line.startswith("==")]
    if done.returncode:
        return {"error": (lines or ["failed"])[-1]}
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return other_batch(cell, got) or {
        "ir": collected(done.stderr),
        "steps": got["steps"],
        "seq_steps": got["seq_steps"],
    }


def measure(sizes: tuple[int, int], runs: dict[tuple[str, int], dict]) -> dict:
    """A cell's figures from its ``runs`` at both ``sizes`` (keyed by code, ``got`` or
    ``old``, and size): per code, instructions per sequence-step (``per``) and per step
    (``per_step``) and the mean batch of the steps the bigger run took more, or an error."""
    out = {}
    for which in ("got", "old"):
        small, big = (runs.get((which, size)) for size in sizes)
        if small is None:
            continue
        failed = [r for r in (small, big) if "error" in r]
        if failed:
            out[which] = failed[0]
            continue
        try:
            steps = big["steps"] - small["steps"]
            if steps <= 0:
                raise ValueError("the bigger run took no more steps: give sizes further apart")
            out[which] = {
                "per": per_seq_step(small, big),
                "seq_steps": big["seq_steps"],
                "per_step": (big["ir"] - small["ir"]) / steps,
                "batch": (big["seq_steps"] - small["seq_steps"]) / steps,
            }
        except ValueError as e:
            out[which] = {"error": str(e)}
    return out


def format_rows(rows: list[dict], sizes: tuple[int, int]) -> str:
    """One line per cell: its instructions per sequence-step; against REF, REF's, the ratio,
    and whether both replays took the same sequence-steps."""
    from harness.bench.support.tables import format_table

    against = any("old" in r for r in rows)
    header = ["trace", "allocator", "scheduler", f"seq-steps at {sizes[1]:,}", "instr/seq-step"]
    if against:
        header += ["REF instr/seq-step", "instr vs REF", "same steps"]
    lines = []
    for r in rows:
        got = r["got"]
        batch = f" ({r['batch']})" if r.get("batch") else ""
        cells = [r["trace"], r["allocator"], r["scheduler"] + batch]
        if "error" in got:
            lines.append(cells + ["", got["error"]] + [""] * (len(header) - 5))
            continue
        cells += [f"{got['seq_steps']:,}", f"{got['per']:,.0f}"]
        if against:
            old = r["old"]
            if "error" in old:
                cells += [old["error"], "", ""]
            else:
                same = "yes" if old["seq_steps"] == got["seq_steps"] else "NO"
                cells += [f"{old['per']:,.0f}", f"{got['per'] / old['per']:.3f}x", same]
        lines.append(cells)
    return format_table(header, lines)


def format_fits(rows: list[dict]) -> str:
    """Per configuration counted at several batches (``--batches``) and per code, the line
    through its cells' (mean batch, instructions a step): the instructions a step executes
    whatever its batch, and those each sequence adds ("" without two batches)."""
    from harness.bench.scale import fit_lines
    from harness.bench.support.tables import format_table

    points: dict[tuple, list[tuple[float, float]]] = {}
    for r in rows:
        for which in ("got", "old"):
            got = r.get(which, {})
            if r.get("batch") and "per_step" in got:
                key = (r["trace"], r["allocator"], r["scheduler"], which)
                points.setdefault(key, []).append((got["batch"], got["per_step"]))
    header = ["trace", "allocator", "scheduler", "code", "batches (mean)",
              "fixed instr/step", "instr/seq a step"]  # fmt: skip
    lines = []
    for (trace, alloc, sched, which), batches, fixed, per in fit_lines(points):
        code = "this" if which == "got" else "REF"
        lines.append([trace, alloc, sched, code, batches, f"{fixed:,.0f}", f"{per:,.0f}"])
    return format_table(header, lines) if lines else ""


def keep_hard_limits() -> None:
    """Under valgrind: a resource limit keeps the hard limit valgrind set, which it lets no
    one change (mlx_lm sets its file descriptors' at import); only the soft one is set."""
    set_limit = resource.setrlimit

    def soft_only(which: int, limits: tuple[int, int]) -> None:
        hard = resource.getrlimit(which)[1]
        soft = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        set_limit(which, (soft, hard))

    resource.setrlimit = soft_only


def main(argv: list[str] | None = None) -> None:
    # Imported here, not above: this file also runs as REF's subprocess (``run_cell``)
    from harness.bench.scale import add_cell_options, checkout, chosen_batches, chosen_options

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="300,900",
                        help="the two numbers of requests whose difference is counted")  # fmt: skip
    add_cell_options(parser, "free_list,radix", "fcfs", "azure_like")
    parser.add_argument("--against", metavar="REF",
                        help="also count each cell on git commit REF, side by side")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="runs under valgrind at once")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a run under valgrind may take")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        small, big = sorted(int(s) for s in args.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes: {args.sizes!r}; give two numbers of requests, e.g. 300,900")
    if not 0 < small < big:
        parser.error(f"--sizes: {args.sizes!r}; give two different sizes above 0, e.g. 300,900")
    if args.jobs < 1:
        parser.error(f"--jobs: {args.jobs}; give a number of runs at once >= 1, e.g. 2")
    if shutil.which("valgrind") is None:
        sys.exit(f"{PROG}: valgrind not found; install it (Debian/Ubuntu: apt install valgrind)")
    chosen, batches = chosen_options(parser, args), chosen_batches(parser, args)
    cells = [
        {"trace": t, "allocator": a, "scheduler": s, "rate": args.rate, "batch": b}
        for t in chosen["trace"]
        for a in chosen["allocator"]
        for s in chosen["scheduler"]
        for b in batches
    ]
    with tempfile.TemporaryDirectory() as tmp:
        codes = {"got": REPO}
        if args.against:
            codes["old"] = checkout(args.against, Path(tmp) / "against")
        # Every run at once, ``--jobs`` at a time: counts do not depend on the load.
        jobs = [(i, which, size) for i in range(len(cells)) for which in codes for size in
                (small, big)]  # fmt: skip
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            done = pool.map(
                lambda job: count(
                    cells[job[0]] | {"size": job[2]}, args.num_blocks, args.timeout, codes[job[1]]
                ),
                jobs,
            )
            runs: list[dict[tuple[str, int], dict]] = [{} for _ in cells]
            for (i, which, size), got in zip(jobs, done, strict=True):
                runs[i][(which, size)] = got
    rows = [cell | measure((small, big), got) for cell, got in zip(cells, runs, strict=True)]
    against = f"; REF = {args.against}" if args.against else ""
    print(f"model clock, {args.num_blocks} blocks, rate {args.rate:g}/s; instructions counted by "
          f"callgrind, runs of {small:,} and {big:,} requests{against}")  # fmt: skip
    print(format_rows(rows, (small, big)))
    if fits := format_fits(rows):
        print()
        print(fits)


def run_cell(argv: list[str]) -> None:
    """The subprocess under valgrind (this file run as a script, on this code or REF's):
    ``scale``'s cell, ``argv`` its ``--cell``, ``--num-blocks`` and ``--out``, in this
    process. It imports nothing of the project but that cell, which every REF has."""
    from harness.bench.scale import main as scale_main

    keep_hard_limits()
    scale_main(argv)


if __name__ == "__main__":
    run_cell(sys.argv[1:])
