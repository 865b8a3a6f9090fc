"""Host time per decode step of the real engine, outside the forward, split by part.

``python -m harness.bench host_time [--size tiny] [--batches 1,8,32,64] [--prompt 64]
[--warmup 16] [--steps 64] [--repeats 3] [--against REF] [--profile]``

The real engine (LLMEngine over the model's paged arena, FCFS, ``free_list``, greedy,
``ignore_eos``) runs B requests of ``--prompt`` random tokens, all admitted at once, in
steady decode: after every prompt is computed and ``--warmup`` decode steps, ``--steps``
decode steps are timed, each with all B sequences decoding one token. Per step:
``forward``, the step row's own ``forward_time`` (building the model's lazy graph, launching
it and waiting for it), and ``host``, the wall time of ``LLMEngine.step`` outside it (the
step row's ``duration`` leaves out the row's own recording); and the host time split at the
engine's public seams, timed by wrapping the methods of its parts on the one engine a run
builds:

    build      the rows and the forward's index arrays: from the step's decision (its
               block moves' end) to ``runner.forward``, plus the step row's ``build_time``
    scheduler  ``scheduler.schedule`` (``schedule_batch``, and ``schedule`` when that
               decides nothing), then from the sampler's end through ``scheduler.update``
               (``update_batch``: the step's results handed back)
    sampler    ``sampler.draw`` (``draw_rows``, a step over the running batch's)
    outputs    from ``scheduler.update``'s end to the step's record (settling, the outputs)
    recorder   the step's KV statistics and snapshot (from ``runner.launch``'s end to
               ``runner.wait``) and ``recorder.step``
    other      the rest of ``host``: owed outputs, block moves, the clock

Each figure is the median over the timed steps, then the median over ``--repeats`` runs;
every run is a subprocess of its own. ``--against REF`` runs each cell a second time on the
code of git commit ``REF`` (``git archive`` into a temporary folder; this file drives it,
through the public names above, which REF must have), alternately and side by side, REF
first in every other run, and prints this code's host and forward time over REF's, then
REF's own split. With
``--profile`` each cell of this code also prints a cProfile of its timed steps (top 25 by
own time), in a run of its own.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROG = "python -m harness.bench host_time"
REPO = Path(__file__).resolve().parents[2]
PARTS = ("build", "scheduler", "sampler", "outputs", "recorder", "other")


class Stamps:
    """Per step, the perf_counter times at which the engine's parts began and ended."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner: object, name: str, label: str) -> None:
        """Time ``owner.name(...)``: stamps ``label`` and ``label/`` at its entry and exit."""
        method = getattr(owner, name)
        now, clock = self.now, time.perf_counter

        def timed(*args, **kwargs):
            now[label] = clock()
            result = method(*args, **kwargs)
            now[f"{label}/"] = clock()
            return result

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        """The last step's stamps; the next step starts afresh."""
        taken = dict(self.now)
        self.now.clear()
        return taken


def split(stamps: dict[str, float], row: dict) -> dict[str, float]:
    """One step's host time by part (the module docstring), from its ``stamps`` and its step
    ``row`` (``forward_time``, ``build_time``)."""
    s = stamps
    decided = max(s.get(k, 0.0) for k in ("schedule/", "schedule_batch/", "move_blocks/"))
    spent = {k: s[f"{k}/"] - s[k] for k in ("schedule", "schedule_batch", "draw", "draw_rows")
             if k in s}  # fmt: skip
    parts = {
        "build": s["forward"] - decided + row["build_time"],
        "scheduler": spent.get("schedule", 0.0)
        + spent.get("schedule_batch", 0.0)
        + (s["update/"] - s.get("draw/", s.get("draw_rows/"))),
        "sampler": spent["draw"] if "draw" in spent else spent["draw_rows"],
        "outputs": s["record"] - s["update/"],
        "recorder": (s["wait"] - s["launch/"]) + (s["record/"] - s["record"]),
    }
    host = s["engine/"] - s["engine"] - row["forward_time"]
    parts["other"] = host - sum(parts.values())
    return parts | {"host": host, "forward": row["forward_time"]}


def run_cell(cell: dict) -> dict:
    """One cell in this process: the engine built, its prompts computed, ``warmup`` decode
    steps, then ``steps`` timed ones; per figure the median over the timed steps."""
    import numpy as np

    from harness.bench.engine import workload_engine
    from harness.bench.support.components import compose_config
    from harness.cli.run import build_component
    from harness.platform import machine

    machine.set_mlx_cache_limit()
    model = compose_config([f"model={cell['size']}"]).model
    loaded = build_component(model)
    rng = np.random.default_rng(cell["seed"])
    batch = cell["batch"]
    prompts = [rng.integers(1, loaded.vocab_size, cell["prompt"]).tolist() for _ in range(batch)]
    new = cell["warmup"] + cell["steps"] + 2
    engine = workload_engine(loaded, "free_list", prompts, [new] * batch, batch, 16)
    stamps = Stamps()
    for owner, name, label in [
        (engine, "step", "engine"),
        (engine.scheduler, "schedule", "schedule"),
        (engine.scheduler, "schedule_batch", "schedule_batch"),
        (engine.scheduler, "update", "update"),
        (engine.scheduler, "update_batch", "update"),
        (engine.host, "move_blocks", "move_blocks"),
        (engine.runner, "forward", "forward"),
        (engine.runner, "launch", "launch"),
        (engine.runner, "wait", "wait"),
        (engine.sampler, "draw", "draw"),
        (engine.sampler, "draw_rows", "draw_rows"),
        (engine.recorder, "step", "record"),
    ]:
        if hasattr(owner, name):  # a step over the running batch has seams of its own
            stamps.wrap(owner, name, label)
    decoding = 0
    while decoding < cell["warmup"]:  # the prompts, then warm-up decode steps
        engine.step()
        decoding += engine.recorder.step_columns()["prefill_tokens"][-1] == 0
    profile = cProfile.Profile() if cell.get("profile") else None
    first = len(engine.recorder.step_columns()["step"])
    taken = []
    if profile is not None:
        profile.enable()
    for _ in range(cell["steps"]):
        stamps.take()
        engine.step()
        taken.append(stamps.take())
    if profile is not None:
        profile.disable()
    columns = engine.recorder.step_columns()
    got: dict[str, list[float]] = {}
    for k, step in enumerate(taken):
        names = ("forward_time", "build_time", "batch_size", "prefill_tokens")
        row = {name: columns[name][first + k] for name in names}
        if row["batch_size"] != batch or row["prefill_tokens"]:
            raise RuntimeError(f"step {first + k} is not a decode of all {batch} sequences")
        for name, value in split(step, row).items():
            got.setdefault(name, []).append(value)
    out = {name: statistics.median(values) for name, values in got.items()}
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        out["profile"] = text.getvalue()
    return out


def measure(cell: dict, code: Path) -> dict:
    """Run one cell in a subprocess on the code in ``code`` (this checkout or REF's): this
    file drives it, its imports come from ``code``."""
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--cell", json.dumps(cell)]
    env = os.environ | {"PYTHONPATH": str(code)}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=code, env=env)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def medians(runs: list[dict]) -> dict:
    """Per figure, the median of the runs' (an error if any run failed)."""
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "profile"}


def format_rows(rows: list[dict]) -> str:
    """One line per batch size: ms per step of the forward, the host time and its parts;
    against REF, REF's host and forward time and the ratios (this code / REF)."""
    from harness.bench.support.tables import format_table

    against = any("old" in r for r in rows)
    header = ["batch", "forward ms", "host ms", *[f"{p} ms" for p in PARTS]]
    if against:
        header += ["REF forward ms", "REF host ms", "forward vs REF", "host vs REF"]
    lines = []
    for r in rows:
        got = r["got"]
        if "error" in got:
            lines.append([str(r["batch"]), got["error"]] + [""] * (len(header) - 2))
            continue
        cells = [str(r["batch"])] + [f"{1e3 * got[k]:.3f}" for k in ("forward", "host", *PARTS)]
        if against:
            old = r["old"]
            if "error" in old:
                cells += [old["error"], "", "", ""]
            else:
                cells += [f"{1e3 * old['forward']:.3f}", f"{1e3 * old['host']:.3f}",
                          f"{got['forward'] / old['forward']:.2f}x",
                          f"{got['host'] / old['host']:.2f}x"]  # fmt: skip
        lines.append(cells)
    return format_table(header, lines)


def checkout(ref: str, into: Path) -> Path:
    """The files of git commit ``ref`` of this repository, unpacked into ``into``."""
    from harness.bench.scale import checkout as scale_checkout

    try:
        return scale_checkout(ref, into)
    except SystemExit as stop:  # scale's message names its own program
        sys.exit(str(stop).replace("python -m harness.bench scale", PROG))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", help="conf/model option (tiny, small, ...)")
    parser.add_argument("--batches", default="1,8,32,64", help="batch sizes, comma list")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--warmup", type=int, default=16, help="decode steps before timing")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (and per REF)")
    parser.add_argument("--seed", type=int, default=0, help="model weights and prompts seed")
    parser.add_argument("--against", metavar="REF",
                        help="also run each cell on git commit REF, side by side")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of each cell's timed steps (this code)")  # fmt: skip
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # the subprocess: one run
    args = parser.parse_args(argv)
    if args.cell:
        print(json.dumps(run_cell(json.loads(args.cell))))
        return
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches {args.batches!r}: give whole numbers, e.g. 1,8,32")
    if min(batches) < 1 or min(args.steps, args.repeats, args.prompt) < 1:
        parser.error("--batches, --steps, --repeats and --prompt must be at least 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_code = checkout(args.against, Path(tmp) / "against") if args.against else None
        for batch in batches:
            cell = {"size": args.size, "batch": batch, "prompt": args.prompt, "seed": args.seed,
                    "warmup": args.warmup, "steps": args.steps}  # fmt: skip
            runs: dict[str, list[dict]] = {"got": [], "old": []}
            for k in range(args.repeats):
                # Against REF, every other run goes REF first: the order alone moves a ratio.
                order = ("old", "got") if old_code is not None and k % 2 else ("got", "old")
                for which in order:
                    if which == "got":
                        runs["got"].append(measure(cell, REPO))
                    elif old_code is not None:
                        runs["old"].append(measure(cell, old_code))
            row = {"batch": batch, "got": medians(runs["got"])}
            if old_code is not None:
                row["old"] = medians(runs["old"])
            rows.append(row)
            print(" ".join(format_rows(rows[-1:]).splitlines()[-1].split()), flush=True)
            if args.profile:
                profiled = measure(cell | {"profile": True}, REPO)
                print(profiled.get("profile", profiled.get("error")), flush=True)
    against = f"; REF = {args.against}" if args.against else ""
    print(
        f"\nmodel {args.size}, prompt {args.prompt}, {args.warmup} warm-up + {args.steps} timed "
        f"decode steps, medians of {args.repeats} runs; ms per step{against}"
    )
    print(format_rows(rows))
    if args.against:  # REF's own split, to see which parts moved
        print(f"\nREF = {args.against}")
        print(format_rows([{"batch": r["batch"], "got": r["old"]} for r in rows]))


if __name__ == "__main__":
    main(sys.argv[1:])
