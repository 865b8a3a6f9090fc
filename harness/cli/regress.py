"""``kvbench-regress``: a fixed small suite (harness/cli/regress_suite.py) compared with the
committed baselines (harness/cli/regress_baseline.py): ``results/baselines/common.json`` for
the figures no machine changes (work counts, model-clock policy figures), gated on every
platform, and ``results/baselines/<platform>.json`` for the platform's own (timed figures,
printed; Python calls per step, gated).

    kvbench-regress                        run, write results/regress/<run id>/regress.json, compare
    kvbench-regress --update-baseline      the same, then make this run's figures the baselines
    kvbench-regress --only work,padding    some groups of figures (the others are not compared)

Exit status: 0 no regression, or no baseline at all (the figures are written;
``--update-baseline`` starts them; a platform without its own still gates the common ones);
1 some figure regressed (each named on stderr with its value, baseline and limit); 2 wrong
input (a malformed baseline, an unknown group).
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
from harness.cli.regress_suite import (
    BASELINES,
    COMMON_BASELINE,
    FIGURES,
    GROUPS,
    PROG,
    ROUNDS,
    measure,
)
from harness.cli.run import run_id
from harness.platform import machine

FILE = "regress.json"


def kind(baseline: dict | None, per_platform: bool) -> dict[str, float]:
    """The figures of ``baseline`` (None: no file) that are, or are not, ``per_platform``."""
    figures = baseline["figures"] if baseline else {}
    return {
        k: v for k, v in figures.items() if k in FIGURES and FIGURES[k].per_platform == per_platform
    }


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
        help=f"one baseline file for every figure (default: {COMMON_BASELINE} for the figures "
        f"no machine changes, {BASELINES}/{platform_name()}.json for this platform's own)",
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
    own_path = args.baseline or BASELINES / f"{platform_name()}.json"
    common_path = None if args.baseline else COMMON_BASELINE
    try:
        own = read_baseline(own_path)
        common = read_baseline(common_path) if common_path else None
    except BaselineError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    out = args.output or Path("results/regress") / run_id()

    machine.set_mlx_cache_limit()  # as kvbench runs do
    started = time.perf_counter()
    figures = measure(groups, out, args.rounds)
    # each figure from the file that holds its kind (an older platform file holds them all)
    baseline = {**kind(own, per_platform=True), **kind(common, per_platform=False)}
    if common_path is None:  # one file of the user's own: every figure from it
        baseline = own["figures"] if own else {}
    checks = compare_figures(figures, baseline)
    report = {
        "platform": platform_name(),
        "figures": figures,
        "baselines": [str(p) for p, b in ((common_path, common), (own_path, own)) if b],
        "checks": checks,
        "seconds": time.perf_counter() - started,
        "machine": machine.info(),
    }
    write_json(out / FILE, report)
    print(format_checks(checks))
    print(f"wrote {out / FILE}")

    if args.update_baseline:
        for path, old, per_platform in ((common_path, common, False), (own_path, own, True)):
            if path is None:
                continue
            ours = {
                k: v
                for k, v in figures.items()
                if common_path is None or FIGURES[k].per_platform == per_platform
            }
            kept = old["figures"] if common_path is None and old else kind(old, per_platform)
            write_json(
                path,
                {"platform": platform_name() if per_platform else "any",
                 "figures": {**kept, **ours}, "machine": report["machine"]},
            )  # fmt: skip
            print(f"baseline written: {path}")
        return
    if own is None and common is None:
        print(
            f"{PROG}: no baseline for {platform_name()} ({own_path}); nothing compared. "
            "Start one with --update-baseline and commit it."
        )
        return
    if own is None:
        print(
            f"{PROG}: no baseline of {platform_name()}'s own ({own_path}): its timed figures "
            f"and Python calls per step are not compared, the figures no machine changes are "
            f"({common_path}); --update-baseline on this platform starts one"
        )
    elif own.get("machine", {}).get("cpu") != report["machine"]["cpu"]:
        print(
            f"{PROG}: note: the baseline was measured on {own.get('machine', {}).get('cpu')},"
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
