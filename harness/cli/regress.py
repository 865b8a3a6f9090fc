"""``kvbench-regress``: a fixed small suite (harness/cli/regress_suite.py) compared with the
baseline committed for this platform (``results/baselines/<platform>.json``;
harness/cli/regress_baseline.py).

    kvbench-regress                        run, write results/regress/<run id>/regress.json, compare
    kvbench-regress --update-baseline      the same, then make this run's figures the baseline
    kvbench-regress --only work,padding    some groups of figures (the others are not compared)

Exit status: 0 no regression, or no baseline for this platform yet (the figures are written;
``--update-baseline`` starts one); 1 some figure regressed (each named on stderr with its
value, baseline and limit); 2 wrong input (a malformed baseline, an unknown group).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness.cli.regress_baseline import (
    BaselineError,
    compare_figures,
    format_checks,
    platform_name,
    read_baseline,
    write_json,
)
from harness.cli.regress_suite import BASELINES, GROUPS, PROG, ROUNDS, measure
from harness.cli.run import run_id
from harness.platform import machine

FILE = "regress.json"


def main(argv: list[str] | None = None) -> None:
    """The ``kvbench-regress`` console script."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run the regression suite and compare its figures with this platform's "
        "baseline.",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help=f"baseline file (default: {BASELINES}/{platform_name()}.json)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help=f"folder for {FILE} and the sweep's runs (default: results/regress/<run id>)",
    )
    parser.add_argument(
        "--update-baseline",
        action="store_true",
        help="write this run's figures into the baseline (replacing those it measured)",
    )
    parser.add_argument(
        "--only",
        default=",".join(GROUPS),
        help=f"groups of figures to measure, comma list of {', '.join(GROUPS)}",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="interleaved repeats of each timed comparison (more: steadier on a busy machine)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    groups = tuple(args.only.split(","))
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"--only: no group {unknown[0]!r}; choose from {', '.join(GROUPS)}")
    baseline_path = args.baseline or BASELINES / f"{platform_name()}.json"
    try:
        baseline = read_baseline(baseline_path)
    except BaselineError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    out = args.output or Path("results/regress") / run_id()

    machine.set_mlx_cache_limit()  # as kvbench runs do
    started = time.perf_counter()
    figures = measure(groups, out, args.rounds)
    checks = compare_figures(figures, baseline["figures"] if baseline else {})
    report = {
        "platform": platform_name(),
        "figures": figures,
        "baseline": str(baseline_path) if baseline else None,
        "checks": checks,
        "seconds": time.perf_counter() - started,
        "machine": machine.info(),
    }
    write_json(out / FILE, report)
    print(format_checks(checks))
    print(f"wrote {out / FILE}")

    if args.update_baseline:
        kept = baseline["figures"] if baseline else {}
        write_json(
            baseline_path,
            {
                "platform": platform_name(),
                "figures": {**kept, **figures},
                "machine": report["machine"],
            },
        )
        print(f"baseline written: {baseline_path}")
        return
    if baseline is None:
        print(
            f"{PROG}: no baseline for {platform_name()} ({baseline_path}); nothing compared. "
            "Start one with --update-baseline and commit it."
        )
        return
    if baseline.get("machine", {}).get("cpu") != report["machine"]["cpu"]:
        print(
            f"{PROG}: note: the baseline was measured on {baseline.get('machine', {}).get('cpu')},"
            f" this run on {report['machine']['cpu']}; ratios can differ between CPUs"
        )
    status = [c["status"] for c in checks]
    new = [c["figure"] for c in checks if c["status"] == "new"]
    if new:
        print(
            f"{PROG}: note: not in the baseline, not compared yet: {', '.join(new)} "
            "(--update-baseline adds them)"
        )
    for c in checks:
        if c["status"] == "improved":
            print(
                f"{PROG}: note: improved: {c['figure']} = {c['value']:.6g}, baseline "
                f"{c['baseline']:.6g}; once intended, rewrite the baseline to guard it"
            )
    print(
        f"figures: {status.count('ok') + status.count('improved')} passed, "
        f"{status.count('regressed')} failed"
        + (f", {len(new)} not compared yet" if new else "")
        + (f", {status.count('timed')} timed (not gated)" if "timed" in status else "")
    )
    regressed = [c for c in checks if c["status"] == "regressed"]
    for c in regressed:
        print(
            f"{PROG}: regressed: {c['figure']} = {c['value']:.6g}, baseline {c['baseline']:.6g}, "
            f"tolerance {c['tolerance']:.0%} ({c['better']} is better: limit {c['limit']:.6g})",
            file=sys.stderr,
        )
    if regressed:
        sys.exit(1)


if __name__ == "__main__":
    main()
