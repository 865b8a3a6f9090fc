"""Finished runs side by side: one row per run, labelled by the overrides that differ between
them, a column per key figure. Printed at the end of every multirun (``CompareCallback``,
registered in conf/config.yaml) and by ``kvbench-compare`` for any results folder:

    kvbench-compare results/default/multiruns/<sweep_id>     a sweep
    kvbench-compare results/ --markdown                       every run, as a Markdown table
    kvbench-compare results/prefix_caching --csv > runs.csv   unrounded, with each run's folder

Figures are read from the runs' summary.json files (``harness.analysis.results.load``), so
jobs that ran in other processes or on other machines count as long as their folders are
under the path.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from harness.analysis import results
from harness.analysis.metrics import has_tiers

PROG = "kvbench-compare"


@dataclass(frozen=True)
class Column:
    """A summary.json figure (``key``, defined in docs/results.md) shown as ``name`` in
    ``unit``: the summary's value times ``scale``, printed with ``digits`` decimals."""

    key: str
    name: str
    unit: str
    scale: float = 1.0
    digits: int = 0
    timed: bool = False  # measured on a measuring clock: compared against the runs' noise

    @property
    def header(self) -> str:
        return f"{self.name} ({self.unit})"


COLUMNS = (
    Column("completed_requests", "done", "req"),
    Column("request_throughput", "thruput", "req/s", digits=2, timed=True),
    Column("output_throughput", "output", "tok/s", digits=1, timed=True),
    Column("ttft_p50", "TTFT p50", "ms", 1e3, 1, timed=True),
    Column("ttft_p99", "TTFT p99", "ms", 1e3, 1, timed=True),
    Column("tpot_p50", "TPOT p50", "ms", 1e3, 1, timed=True),
    Column("itl_p99", "ITL p99", "ms", 1e3, 1, timed=True),
    Column("goodput", "goodput", "req/s", digits=2, timed=True),
    Column("timing_noise", "noise", "%", 100, 1),
    Column("kv_tokens_frac_mean", "KV tokens", "%", 100, 1),
    Column("kv_utilisation", "KV util", "%", 100, 1),
    Column("preemptions", "preempt", "count"),
    Column("prefix_hit_rate", "prefix hit", "%", 100, 1),
)
# Figures an experiment can name as its headline beside COLUMNS (conf/experiment/*.yaml,
# hydra.callbacks.compare.headline): the end-of-sweep table shows them after the run's label.
HEADLINES = (
    Column("kv_sharing_saving", "KV shared", "%", 100, 1),
    Column("blocks_used_mean", "blocks", "mean", digits=1),
    Column("kv_future_frac_mean", "KV future", "%", 100, 1),
    Column("kv_internal_frac_mean", "KV internal", "%", 100, 1),
    Column("kv_external_frac_mean", "KV external", "%", 100, 1),
    Column("batch_size_mean", "batch", "seqs", digits=1),
    Column("max_prefix_hit_rate", "hit bound", "%", 100, 1),
    Column("max_prefix_hit_rate_blocks", "block bound", "%", 100, 1),
    Column("total_token_throughput", "total", "tok/s", digits=1, timed=True),
    Column("tpot_mean", "TPOT mean", "ms", 1e3, 1, timed=True),
    Column("e2e_p50", "E2E p50", "ms", 1e3, 1, timed=True),
    Column("spec_acceptance_rate", "alpha", "%", 100, 1),
    Column("spec_tokens_per_verification", "tok/verif", "tok", digits=2),
    Column("num_blocks", "arena", "blocks"),
    Column("ttft_p90", "TTFT p90", "ms", 1e3, 1, timed=True),
)
# The lower KV tiers' figures (kv_tier), shown after COLUMNS when a run has tiers
# (metrics.has_tiers), so a table without any is unchanged.
TIER_COLUMNS = (
    Column("prefix_hit_rate_device", "device hit", "%", 100, 1),
    Column("prefix_hit_rate_host", "host hit", "%", 100, 1),
    Column("prefix_hit_rate_disk", "disk hit", "%", 100, 1),
    Column("reachable_hits_recovered", "recovered", "%", 100, 1),
    Column("tier_bytes_loaded", "tier loaded", "MiB", 2.0**-20, 1),
    Column("tier_bytes_written", "tier written", "MiB", 2.0**-20, 1),
)
_BY_KEY = {c.key: c for c in (*COLUMNS, *HEADLINES, *TIER_COLUMNS)}
RUN = "run"  # the label column
SAME_WORK = "same work"  # a letter shared by measured runs that did the same work
NOISE = _BY_KEY["timing_noise"]


class CompareError(Exception):
    """The folder to compare does not exist or is not a folder."""


def columns(headline: Sequence[str] = ()) -> list[Column]:
    """The table's figures: the ``headline`` keys first, in their order, then the rest of
    ``COLUMNS``. A key with no column is a ``CompareError`` naming those there are."""
    unknown = [k for k in headline if k not in _BY_KEY]
    if unknown:
        raise CompareError(
            f"headline {', '.join(unknown)}: no column shows it; choose from "
            f"{', '.join(_BY_KEY)} (or add one to compare.HEADLINES)"
        )
    return [_BY_KEY[k] for k in dict.fromkeys(headline)] + [
        c for c in COLUMNS if c.key not in headline
    ]


def table(path: str | Path, headline: Sequence[str] = ()) -> pd.DataFrame:
    """Every finished run under ``path``, one row each: ``run`` (its label), a column per
    figure of ``columns(headline)`` (then ``TIER_COLUMNS`` when a run has tiers) named by its
    header and holding the figure in that unit
    (NaN where the summary has none), ``clock``, ``run_dir`` and ``SAME_WORK`` (a letter
    shared by runs on a measuring clock that did the same work, read from their steps
    tables). Empty when no run under ``path`` has finished.

    A label is the run's overrides whose text differs between the runs (a key a run does not
    override differs too), in the order given on its command line; a label shared by several
    runs gets the run's folder, relative to ``path``, after it, and a run with no such
    override is labelled by its folder. Rows are ordered by those overrides' values (numbers
    as numbers), then by folder.
    """
    path = Path(path)
    if not path.exists():
        raise CompareError(f"{path} does not exist")
    if not path.is_dir():
        raise CompareError(f"{path} is not a folder")
    shown = columns(headline)
    runs = results.load(path)
    if runs.empty:
        return pd.DataFrame(
            columns=[RUN, *(c.header for c in shown), "clock", "run_dir", SAME_WORK]
        )
    if any(has_tiers(run) for _, run in runs.iterrows()):
        shown += [c for c in TIER_COLUMNS if c not in shown]
    items = {d: results.override_items(d) for d in runs["run_dir"]}
    keys: list[str] = []  # every overridden key, first seen first
    for its in items.values():
        keys += [k for k in map(results.override_key, its) if k not in keys]
    varying = [k for k in keys if len({_value_text(its, k) for its in items.values()}) > 1]
    labels = {
        d: ",".join(i for i in its if results.override_key(i) in varying)
        for d, its in items.items()
    }
    shared = {lab for lab in labels.values() if list(labels.values()).count(lab) > 1}
    for d, lab in labels.items():
        folder = Path(d).relative_to(path).as_posix()
        if not lab:
            labels[d] = folder
        elif lab in shared:
            labels[d] = f"{lab} @ {folder}"
    out = pd.DataFrame({RUN: [labels[d] for d in runs["run_dir"]]})
    for c in shown:
        values = runs[c.key] if c.key in runs else pd.Series(math.nan, index=runs.index)
        out[c.header] = values.astype(float) * c.scale
    # summary.json from before the clock was recorded has none: missing, as any figure
    out["clock"] = runs.get("clock")
    out["run_dir"] = runs["run_dir"]
    order = sorted(out.index, key=lambda i: (_sort_key(items[out.run_dir[i]], varying), i))
    out = out.loc[order].reset_index(drop=True)
    out[SAME_WORK] = _same_work(out)
    return out


def _same_work(frame: pd.DataFrame) -> list[str]:
    """A letter per run on a measuring clock whose work counts (``results.work_counts``:
    steps, tokens, batches) another such run repeats exactly, shared by those runs, in row
    order; empty for the others. Their timed differences are the machine's and the policies'
    host work, not what the policies decided."""
    work = [
        results.work_counts(d) if clock != "model" else None
        for d, clock in zip(frame["run_dir"], frame["clock"], strict=True)
    ]
    repeated = [w for w in dict.fromkeys(work) if w is not None and work.count(w) > 1]
    # a, b, ..., z, then a1, b1, ...
    letters = {w: chr(ord("a") + i % 26) + (str(i // 26) if i >= 26 else "") for i, w in
               enumerate(repeated)}  # fmt: skip
    return [letters.get(w, "") for w in work]


def within_noise(frame: pd.DataFrame) -> set[tuple[int, str]]:
    """The (row, header) cells of timed figures that cannot be told from another run's: the
    two runs did the same work (``SAME_WORK``), or the two values differ, relative to the
    larger, by less than the larger of the two runs' ``timing_noise``."""
    timed = [c.header for c in _shown(frame) if c.timed]
    values = {h: frame[h].tolist() for h in timed}  # lists: a table can hold 1,000s of runs
    noise = (frame[NOISE.header] / NOISE.scale).tolist() if NOISE.header in frame else None
    clock, work = frame["clock"].tolist(), frame[SAME_WORK].tolist()
    marked = set()
    for i, j in itertools.combinations(range(len(frame)), 2):
        if clock[i] != clock[j] or clock[i] == "model":
            continue  # a priced figure has no noise; figures of two clocks do not compare
        same = work[i] != "" and work[i] == work[j]
        # the larger noise of the two; none recorded (runs from older versions): NaN
        pair = [n for n in (noise[i], noise[j]) if not math.isnan(n)] if noise else []
        bound = max(pair, default=math.nan)
        for header in timed:
            a, b = values[header][i], values[header][j]
            if math.isnan(a) or math.isnan(b):
                continue
            scale = max(abs(a), abs(b))
            if same or (scale == 0 and not math.isnan(bound)) or abs(a - b) / scale < bound:
                marked |= {(frame.index[i], header), (frame.index[j], header)}
    return marked


def _value_text(items: list[str], key: str) -> str | None:
    """What the run's overrides set ``key`` to, as written (None: not overridden)."""
    for item in items:
        if results.override_key(item) == key:
            return item.partition("=")[2]
    return None


def _sort_key(items: list[str], keys: list[str]) -> tuple:
    out = []
    for key in keys:
        text = _value_text(items, key)
        value = yaml.safe_load(text) if text else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((0, value, ""))
        else:
            out.append((1, 0, "" if text is None else text))
    return tuple(out)


def _cell(value: float, column: Column) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.{column.digits}f}"


MARK = "~"  # a timed figure within the noise of another run's, or of a run of the same work


def _cells(frame: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """The headers and each run's cells past its label: the figures (a timed one followed by
    ``MARK`` when ``within_noise``, else by a space to keep the digits aligned, when any
    is), then ``SAME_WORK`` when any run shares its work."""
    shown = _shown(frame)
    marked = within_noise(frame)
    headers = [c.header for c in shown]
    rows = []
    for i in frame.index:
        row = []
        for c in shown:
            text = _cell(frame[c.header][i], c)
            if c.timed and marked:
                text += MARK if (i, c.header) in marked else " "
            row.append(text)
        rows.append(row)
    if any(frame[SAME_WORK]):
        headers.append(SAME_WORK)
        for row, letter in zip(rows, frame[SAME_WORK], strict=True):
            row.append(letter or "-")
    return headers, rows


def _noise_note(frame: pd.DataFrame) -> str:
    """What ``MARK`` and ``SAME_WORK`` mean, when the table shows either."""
    if not within_noise(frame) and not any(frame[SAME_WORK]):
        return ""
    return textwrap.fill(
        f"{MARK}: a timed figure this table cannot rank against another run's: the two differ by "
        "less than the larger of their noise (timing_noise: the machine's speed moving over "
        f"the run), or the two did the same work ({SAME_WORK}: one letter for runs with the "
        "same steps, tokens and batches, whose timed differences are the machine's and host "
        "work, not the policies' decisions). To compare policies, replay on the model clock "
        "(README: which clock for a policy comparison).",
        width=100,
    )


def _shown(frame: pd.DataFrame) -> list[Column]:
    """The figures ``frame`` holds, in its order."""
    by_header = {c.header: c for c in _BY_KEY.values()}
    return [by_header[h] for h in frame.columns if h in by_header]


def _notes(frame: pd.DataFrame) -> str:
    """Where each column comes from: summary.json keys, defined in docs/results.md."""
    keys = ", ".join(c.key for c in _shown(frame))
    recorded = [c for c in frame["clock"] if isinstance(c, str)]
    clocks = " and ".join(sorted(set(recorded)))
    unknown = len(frame) - len(recorded)
    where = [f"latencies on the {clocks} clock"] if clocks else []
    if unknown:
        where.append(f"clock not recorded for {unknown} run{'s' if unknown != 1 else ''}")
    return textwrap.fill(
        f"Columns are summary.json's {keys} (definitions: docs/results.md); {'; '.join(where)}.",
        width=100,
    )


def format_unfinished(path: str | Path) -> list[str]:
    """A line per run folder under ``path`` that holds no summary.json (a failed or
    interrupted job), its folder relative to ``path`` and why, after a line counting them."""
    jobs = results.unfinished(path)
    if not jobs:
        return []
    n = len(jobs)
    lines = [f"{n} unfinished run{'s' if n != 1 else ''} (not in the table):"]
    for run_dir, why in jobs:
        lines.append(f"  {Path(run_dir).relative_to(path).as_posix()}: {why}")
    return lines


def format_text(frame: pd.DataFrame, path: str | Path) -> str:
    """The table for a terminal: the folder, a two-line header (figure, unit), one line per
    run, a note naming each column's summary key and one on ``MARK`` when any cell has it,
    then the unfinished runs under ``path``."""
    n = len(frame)
    by_header = {c.header: c for c in _shown(frame)}
    headers, cells = _cells(frame)
    rows = [
        [by_header[h].name if h in by_header else h for h in headers],
        [by_header[h].unit if h in by_header else "" for h in headers],
        *cells,
    ]
    labels = [RUN, "", *frame[RUN]]
    width = max(len(s) for s in labels)
    widths = [max(len(r[j]) for r in rows) for j in range(len(headers))]
    lines = [f"{n} finished run{'s' if n != 1 else ''} in {path}"]
    for label, row in zip(labels, rows, strict=True):
        cells_text = "  ".join(f"{s:>{w}}" for s, w in zip(row, widths, strict=True))
        lines.append(f"{label:<{width}}  {cells_text}")
    notes = [_notes(frame), _noise_note(frame)]
    return "\n".join([*lines, *filter(None, notes), *format_unfinished(path)])


def format_markdown(frame: pd.DataFrame, path: str | Path) -> str:
    """The table as GitHub Markdown, headers ``figure (unit)``, then the folder and the note."""
    headers, cells = _cells(frame)
    lines = ["| " + " | ".join([RUN, *headers]) + " |", "|---" + "|---:" * len(headers) + "|"]
    for label, row in zip(frame[RUN], cells, strict=True):
        label = str(label).replace("|", "\\|")
        lines.append("| " + " | ".join([f"`{label}`", *(c.strip() for c in row)]) + " |")
    listed = []
    if unfinished := format_unfinished(path):
        listed = ["", unfinished[0], "", *(f"- {line.strip()}" for line in unfinished[1:])]
    noise = _noise_note(frame)
    notes = [f"Runs in `{path}`. {_notes(frame)}", *(["", noise] if noise else [])]
    return "\n".join([*lines, "", *notes, *listed])


def format_csv(frame: pd.DataFrame) -> str:
    """The table as CSV: full precision in each column's unit, empty where not applicable,
    and each run's folder."""
    counts = {c.header: "Int64" for c in _shown(frame) if c.digits == 0 and c.scale == 1}
    return frame.astype(counts).to_csv(index=False)


class CompareCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in conf/config.yaml): when a multirun ends, print
    its jobs side by side, read from the sweep folder (so any launcher works), with the
    ``headline`` figures an experiment names (``hydra.callbacks.compare.headline``) first."""

    def __init__(self, headline: Sequence[str] = ()) -> None:
        columns(headline)  # a key without a column fails as the sweep starts, not at its end
        self.headline = tuple(headline)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            frame = table(sweep_dir, self.headline)
            text = format_text(frame, sweep_dir) if not frame.empty else ""
        except results.ResultFileError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return
        print(text or f"no finished run in {sweep_dir}")


def main(argv: list[str] | None = None) -> None:
    """The ``kvbench-compare`` console script."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Print the finished runs under a results folder side by side.",
    )
    parser.add_argument(
        "path",
        metavar="DIR",
        help="a sweep folder, an experiment folder, results/, or any folder holding runs",
    )
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="CSV, unrounded, with each run's folder")
    form.add_argument("--markdown", action="store_true", help="a GitHub Markdown table")
    args = parser.parse_args(argv)
    try:
        frame = table(args.path)
        if frame.empty:
            text = ""
        elif args.csv:
            text = format_csv(frame).removesuffix("\n")
        elif args.markdown:
            text = format_markdown(frame, args.path)
        else:
            text = format_text(frame, args.path)
    except CompareError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except results.ResultFileError as e:  # a damaged file (summary.json, jobs.json): named
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1)
    if frame.empty:
        print(
            f"{PROG}: no finished run in {args.path} (a run is finished once its folder holds "
            "summary.json)",
            file=sys.stderr,
        )
        sys.exit(1)
    print(text)


if __name__ == "__main__":
    main()
