"""``kvbench-load-sweep``: a latency-throughput curve per policy without guessing request rates.

    kvbench-load-sweep allocator=free_list,radix               5 rates for both allocators
    kvbench-load-sweep --rates 8 --up-to 1.5 experiment=prefix_caching

As vLLM's ``bench sweep serve_workload``, two ordinary kvbench multiruns of the same overrides:

1. Saturation: every job once with ``trace.rate=inf`` (the same requests, all at t=0), into
   ``<sweep folder>-saturation``; a job's saturation is that run's ``request_throughput``.
2. The load sweep: every job at ``trace.rate=r1,...,rN`` (``spread_rates``: N rates evenly
   spread up to ``--up-to`` x the highest saturation) into the sweep folder, which also gets
   ``load_sweep.json`` (the saturations and the rates), so ``kvbench-compare`` and
   ``kvbench-report`` (load curves against ``trace.rate``) read it like any sweep.

One set of rates serves every policy, so at each rate all policies replay the same arrivals; a
policy slower than the fastest is driven further past its own knee. Every job's config is
composed and checked, and its trace built at ``trace.rate=inf`` (where every arrival must be
0), before anything runs. Re-running with the same ``sweep_id`` skips finished jobs in both
passes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, InstantiationException
from hydra.utils import instantiate
from omegaconf import open_dict

from harness.analysis import results
from harness.cli.config import validate
from harness.cli.run import CONFIG_DIR, run_id

PROG = "kvbench-load-sweep"
RATE = "trace.rate"
RECORD_FILE = "load_sweep.json"
SATURATION_SUFFIX = "-saturation"  # the saturation pass's folder: <sweep folder>-saturation
DEFINITION = (
    "saturation: request_throughput (docs/results.md) of the job's run at trace.rate=inf (the "
    "same requests, every one at t=0); rates: up_to x max_saturation x i / num_rates for "
    "i = 1..num_rates, rounded to the fewest significant digits (at least 3) that keep them "
    "distinct"
)


class LoadSweepError(Exception):
    """An option or override cannot make a load sweep; the message names it and the fix."""


class KvbenchFailed(Exception):
    """A ``kvbench`` multirun exited with ``status``; it printed its own error."""

    def __init__(self, status: int) -> None:
        super().__init__(f"kvbench exited with status {status}")
        self.status = status


def spread_rates(saturation: float, num_rates: int, up_to: float = 1.1) -> list[float]:
    """``num_rates`` request rates (req/s) evenly spread up to ``up_to`` x ``saturation``:
    ``up_to * saturation * i / num_rates`` for i = 1..num_rates, increasing, rounded to the
    fewest significant digits (at least 3) at which they stay distinct."""
    exact = [up_to * saturation * i / num_rates for i in range(1, num_rates + 1)]
    digits = 3
    while len({float(f"{r:.{digits}g}") for r in exact}) < num_rates:
        digits += 1  # distinct floats are distinct at 17 digits, so this ends
    return [float(f"{r:.{digits}g}") for r in exact]


def jobs(overrides: Sequence[str], sweeper_params: dict[str, str]) -> list[list[str]]:
    """The multirun's jobs, as Hydra's basic sweeper makes them: the config's
    ``hydra.sweeper.params`` then the command line (a key given twice: the later wins), each
    comma list or ``range`` expanded, one job per combination."""
    given = [f"{k}={v}" for k, v in sweeper_params.items()] + list(overrides)
    choices: dict[str, list[str]] = {}
    for o in OverridesParser.create().parse_overrides(given):
        key = o.get_key_element()
        if o.is_sweep_override():
            choices[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
        else:
            choices[key] = [o.input_line]
    return [list(job) for job in itertools.product(*choices.values())]


def plan(overrides: Sequence[str]) -> tuple[str, Path, int]:
    """Check every job of the sweep before any work; return the ``sweep_id``, the sweep
    folder and the number of jobs.

    Raises ``LoadSweepError`` naming what to change: ``trace.rate`` or a list of ``sweep_id``
    given, a trace without ``trace.rate``, a trace whose requests do not all arrive at t=0
    with ``trace.rate=inf`` (multi_turn: later turns follow ``think_time``), jobs in several
    sweep folders; a bad config with ``validate``'s message, a bad override with Hydra's.
    """
    for item in overrides:
        if results.override_key(item) == RATE:
            raise LoadSweepError(
                f"{item}: {PROG} sets trace.rate itself; remove it (--rates and --up-to "
                "choose the rates)"
            )
    ids = [i for i in overrides if results.override_key(i) == "sweep_id"]
    sweep_id = ids[-1].partition("=")[2] if ids else run_id()
    if "," in sweep_id:
        raise LoadSweepError(f"sweep_id={sweep_id}: a load sweep has one sweep_id, not a list")
    rest = [i for i in overrides if results.override_key(i) != "sweep_id"]
    parser = OverridesParser.create()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name=PROG):
            base = [i for i in rest if not parser.parse_override(i).is_sweep_override()]
            hydra_cfg = compose("config", overrides=base, return_hydra_config=True).hydra
            todo = jobs(rest, dict(hydra_cfg.sweeper.params or {}))
            folders = {_check_job(job, sweep_id) for job in todo}
    except HydraException as e:  # a bad override: Hydra's message on one line, less its paths
        raise LoadSweepError(" ".join(str(e).split("\nConfig search path")[0].split())) from None
    if len(folders) > 1:
        raise LoadSweepError(
            f"the jobs would write to {len(folders)} sweep folders ({', '.join(sorted(folders))}): "
            "sweep one experiment_name per load sweep"
        )
    return sweep_id, Path(folders.pop()), len(todo)


def _check_job(job: list[str], sweep_id: str) -> str:
    """Compose one job, validate it, build its trace at ``trace.rate=inf`` and check that
    every request arrives at t=0; return the job's sweep folder."""
    cfg = compose("config", overrides=[*job, f"sweep_id={sweep_id}"], return_hydra_config=True)
    folder = str(cfg.hydra.sweep.dir)
    trace_choice = cfg.hydra.runtime.choices.get("trace")
    with open_dict(cfg):
        del cfg["hydra"]
    where = " ".join(job) or "the default config"
    if "rate" not in cfg.trace:
        raise LoadSweepError(
            f"trace={trace_choice} has no trace.rate to vary: choose a trace with one, e.g. "
            "trace=poisson"
        )
    try:
        validate(cfg)
        cfg.trace.rate = math.inf
        trace = instantiate(cfg.trace.generator, _convert_="all")
    except InstantiationException as e:  # the component's own error names the setting
        raise LoadSweepError(f"{where}: {e.__cause__ or e}") from None
    except (ValueError, OSError) as e:
        raise LoadSweepError(f"{where}: {e}") from None
    last = max((r.arrival_time for r in trace), default=0.0)
    if last > 0:
        raise LoadSweepError(
            f"trace={trace_choice}: at trace.rate=inf its requests still arrive over {last:.3g} s "
            "(not only trace.rate sets them, as multi_turn's think_time), so it has no offline "
            "pass to measure saturation with; choose another trace, e.g. trace=poisson"
        )
    return folder


def saturations(folder: Path) -> list[dict[str, Any]]:
    """Each finished run of the saturation pass in ``folder``: its overrides (``trace.rate``
    and ``sweep_id`` left out), ``request_throughput`` (req/s) and folder, in folder order."""
    out = []
    for row in results.load(folder).itertuples():
        items = results.override_items(row.run_dir)
        policy = [i for i in items if results.override_key(i) not in (RATE, "sweep_id")]
        out.append(
            {
                "overrides": policy,
                "request_throughput": float(row.request_throughput),
                "run_dir": row.run_dir,
            }
        )
    return out


def kvbench(*args: str) -> None:
    """Run ``kvbench -m *args`` from the current folder; ``KvbenchFailed`` if it fails."""
    status = subprocess.run([sys.executable, "-m", "harness.cli.run", "-m", *args]).returncode
    if status != 0:
        raise KvbenchFailed(status)


def sweep(overrides: Sequence[str], num_rates: int = 5, up_to: float = 1.1) -> Path:
    """Run the saturation pass, then the load sweep (module docstring); return the sweep
    folder.

    Raises ``LoadSweepError`` before any work for what ``plan`` rejects, or after the
    saturation pass if the sweep folder already holds a load sweep at other rates;
    ``KvbenchFailed`` if a kvbench multirun fails.
    """
    sweep_id, folder, num_jobs = plan(overrides)
    rest = [i for i in overrides if results.override_key(i) != "sweep_id"]
    saturation_dir = folder.with_name(folder.name + SATURATION_SUFFIX)
    print(f"{PROG}: saturation pass, {num_jobs} job(s) at trace.rate=inf", flush=True)
    kvbench(*rest, f"{RATE}=inf", f"sweep_id={sweep_id}{SATURATION_SUFFIX}")
    measured = saturations(saturation_dir)
    highest = max(m["request_throughput"] for m in measured)
    rates = spread_rates(highest, num_rates, up_to)
    _write_record(
        folder,
        {
            "definition": DEFINITION,
            "overrides": rest,
            "num_rates": num_rates,
            "up_to": up_to,
            "saturation_dir": str(saturation_dir),
            "saturation": measured,
            "max_saturation": highest,
            "rates": rates,
        },
    )
    for m in measured:
        label = ",".join(m["overrides"]) or "(no overrides)"
        print(f"saturation {m['request_throughput']:.3g} req/s: {label}")
    print(f"rates (req/s, up to {up_to} x {highest:.3g}): {', '.join(map(str, rates))}", flush=True)
    kvbench(*rest, f"{RATE}={','.join(map(str, rates))}", f"sweep_id={sweep_id}")
    print(f"load sweep: {folder} ({RECORD_FILE}); kvbench-report {folder} draws its curves")
    return folder


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    """Write ``load_sweep.json``; refuse a folder holding a load sweep at other rates (its
    runs and these would mix on one curve)."""
    path = folder / RECORD_FILE
    if path.exists():
        before = json.loads(path.read_text())["rates"]
        if before != record["rates"]:
            raise LoadSweepError(
                f"{folder} already holds a load sweep at rates {before}, not {record['rates']}: "
                "use a new sweep_id (or delete that folder)"
            )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def _num_rates(text: str) -> int:
    if not (text.isdigit() and int(text) >= 2):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 2, got {text!r}")
    return int(text)


def _multiple(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    """The ``kvbench-load-sweep`` console script."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Measure each job's saturation throughput with an offline pass "
        "(trace.rate=inf), then run the sweep at request rates spread up to it.",
    )
    parser.add_argument(
        "--rates",
        type=_num_rates,
        default=5,
        help="how many request rates to run (default 5; at least 2: a curve needs two points)",
    )
    parser.add_argument(
        "--up-to",
        type=_multiple,
        default=1.1,
        help="the highest rate as a multiple of the highest saturation measured (default 1.1)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="OVERRIDE",
        help="kvbench's Hydra overrides, sweeps included (allocator=free_list,radix)",
    )
    args = parser.parse_args(argv)
    try:
        sweep(args.overrides, args.rates, args.up_to)
    except LoadSweepError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KvbenchFailed as e:
        sys.exit(e.status)  # kvbench has said why


if __name__ == "__main__":
    main()
