"""``kvbench-report``: a results folder as figures (harness/analysis/plots.py), one PNG per
question, every run on it, and a Markdown page linking them (``report.md``), written next to
the results:

    kvbench-report results/default/multiruns/<sweep_id>            into <that folder>/report/
    kvbench-report results/prefix_caching --out /tmp/prefix-report

report.md holds the ``kvbench-compare`` table, then each figure under its heading, or why it
is left out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from harness.analysis import compare
from harness.analysis.plots import (
    RATE,
    has_rate_dimension,
    has_speculation,
    kv_breakdown,
    kv_timeline,
    latency_cdfs,
    load_curves,
    pareto,
    reuse_and_preemption,
    runs,
)

PROG = "kvbench-report"
REPORT_FILE = "report.md"


def _no_rate(frame: pd.DataFrame) -> str:
    if has_rate_dimension(frame):
        return ""
    return f"Left out: the runs do not vary `{RATE}` (sweep it, e.g. `{RATE}=1,2,4`)."


def _no_speculation(frame: pd.DataFrame) -> str:
    if has_speculation(frame):
        return ""
    return "No run used speculative decoding (`speculative=draft`): no acceptance to show."


def _nothing(frame: pd.DataFrame) -> str:
    return ""


@dataclass(frozen=True)
class Plot:
    """A report figure: its file, its heading in report.md and how to draw it. ``left_out``
    says why the figure is not drawn (empty: it is); ``caveat``, what it lacks and why."""

    file: str
    title: str
    draw: Callable[[pd.DataFrame], Figure]
    left_out: Callable[[pd.DataFrame], str] = _nothing
    caveat: Callable[[pd.DataFrame], str] = _nothing


PLOTS = (
    Plot("latency_cdfs.png", "Latency distributions", latency_cdfs),
    Plot(
        "load_curves.png",
        "Throughput, p99 TTFT and goodput against request rate",
        load_curves,
        left_out=_no_rate,
    ),
    Plot("pareto.png", "Throughput against per-user token rate (Pareto)", pareto),
    Plot("kv_timeline.png", "KV blocks over time", kv_timeline),
    Plot("kv_breakdown.png", "KV memory breakdown (vLLM paper)", kv_breakdown),
    Plot(
        "reuse_preemption.png",
        "Prefix reuse, preemptions, speculative acceptance",
        reuse_and_preemption,
        caveat=_no_speculation,
    ),
)


def write(path: str | Path, out: str | Path | None = None) -> Path:
    """Draw every figure of the finished runs under ``path`` into ``out`` (default
    ``path/report``) and write ``report.md`` there, linking each; returns report.md's path.
    The files are drawn in a temporary folder beside ``out`` and moved in once all are drawn,
    so a report that fails (a damaged run) leaves ``out`` as it was. Raises ``CompareError``
    when ``path`` is not a folder, ``ValueError`` when no run under it has finished or a
    run's file cannot be read (``ResultFileError``, ``MetricsError``: naming the file)."""
    frame = runs(path)
    if frame.empty:
        raise ValueError(f"no finished run in {path} (a run is finished once its folder holds "
                         "summary.json)")  # fmt: skip
    out = Path(path) / "report" if out is None else Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    drawn = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        _draw(frame, path, drawn)
        out.mkdir(exist_ok=True)
        for file in drawn.iterdir():
            os.replace(file, out / file.name)
    finally:
        shutil.rmtree(drawn, ignore_errors=True)
    return out / REPORT_FILE


def _draw(frame: pd.DataFrame, path: str | Path, out: Path) -> None:
    """The figures of ``frame`` (the runs under ``path``) and report.md, into ``out``."""
    n = len(frame)
    lines = [
        f"# kvbench report: {n} run{'s' if n != 1 else ''} in `{path}`",
        "",
        compare.format_markdown(compare.table(path), path),
    ]
    for plot in PLOTS:
        lines += ["", f"## {plot.title}", ""]
        if why := plot.left_out(frame):
            lines.append(why)
            continue
        plot.draw(frame).savefig(out / plot.file)
        lines.append(f"![{plot.title}]({plot.file})")
        if caveat := plot.caveat(frame):
            lines += ["", caveat]
    (out / REPORT_FILE).write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    """The ``kvbench-report`` console script."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Draw the finished runs under a results folder as PNG figures and a "
        "Markdown page linking them.",
    )
    parser.add_argument(
        "path",
        metavar="DIR",
        help="a sweep folder, an experiment folder, results/, or any folder holding runs",
    )
    parser.add_argument(
        "--out",
        metavar="OUTDIR",
        help="where to write the figures and report.md (default: DIR/report)",
    )
    args = parser.parse_args(argv)
    try:
        report = write(args.path, args.out)
    except compare.CompareError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, OSError) as e:  # no run; a run's missing or damaged file (named)
        print(f"{PROG}: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"report: {report} ({len(list(report.parent.glob('*.png')))} figures)")


if __name__ == "__main__":
    main()
