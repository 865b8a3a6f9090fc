"""A results folder's runs as figures, one function per question: every run on it, labelled
as ``kvbench-compare`` labels them (``harness.analysis.compare.table``: the overrides that
differ between the runs), each keeping one colour in every figure. Each figure function takes
the frame of ``runs(path)`` and returns a matplotlib ``Figure`` (made without pyplot, drawn by
the Agg canvas), so notebooks and ``kvbench-report`` (harness/analysis/report.py) show the same
figures. What each figure plots is named by the columns and keys of docs/results.md, in the
figure's footnote.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from harness.analysis import compare, results
from harness.analysis.metrics import KV_PARTS

RATE = "trace.rate"  # the override a load sweep varies (req/s)
KV_NAMES = {  # metrics.KV_PARTS as the vLLM paper names them
    "tokens": "token states",
    "future": "future (reservation)",
    "internal": "internal fragmentation",
    "external": "external fragmentation",
    "free": "free",
}
KV_COLOURS = {
    "tokens": "tab:green",
    "future": "tab:olive",
    "internal": "tab:orange",
    "external": "tab:red",
    "free": "0.85",
}
MS = 1e3
LATENCY_AXES = (  # (title, x label, y label) of latency_cdfs' panels
    ("TTFT", "time to first token (ms)", "fraction of requests"),
    ("TPOT", "time per output token after the first (ms)", "fraction of requests"),
    ("ITL", "inter-token latency (ms)", "fraction of token gaps"),
)


def runs(path: str | Path) -> pd.DataFrame:
    """Every finished run under ``path`` (``harness.analysis.results.load``'s columns)
    with ``label`` and ``colour`` first, in ``kvbench-compare``'s row order. Raises
    ``CompareError`` when ``path`` is not a folder; empty when no run under it has finished."""
    table = compare.table(path)
    frame = results.load(path)
    if frame.empty:
        return frame
    frame = frame.set_index("run_dir").loc[table["run_dir"]].reset_index()
    palette = colormaps["tab10" if len(frame) <= 10 else "tab20"].colors
    frame.insert(0, "colour", [to_hex(palette[i % len(palette)]) for i in range(len(frame))])
    frame.insert(0, "label", table[compare.RUN].to_numpy())
    return frame


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained", dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _wrap(label: str, width: int = 34) -> str:
    """A run label on lines of at most ``width`` characters, broken after its commas (an
    override longer than that keeps a line of its own)."""
    lines = [""]
    for item in label.split(","):
        if lines[-1] and len(lines[-1]) + len(item) + 1 > width:
            lines.append("")
        lines[-1] += ("," if lines[-1] else "") + item
    return ",\n".join(lines)


def _run_legend(
    fig: Figure, frame: pd.DataFrame, *, marker: str | None = None, extra: Sequence[Line2D] = ()
) -> None:
    """One legend for the figure above the axes: a handle per run in its colour, then
    ``extra`` (labelled artists drawn on the axes)."""
    handles = [
        Line2D([], [], color=c, marker=marker, linestyle="none" if marker else "-")
        for c in frame["colour"]
    ]
    labels = [_wrap(lab, 60) for lab in frame["label"]] + [a.get_label() for a in extra]
    fig.legend([*handles, *extra], labels, loc="outside upper center", ncols=min(len(labels), 2))


def _footnote(fig: Figure, text: str) -> None:
    """What the figure plots, by docs/results.md's names (drawn under everything)."""
    fig.supxlabel(textwrap.fill(text, 150), fontsize=7, color="0.3")


def latency_samples(requests: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per-request TTFT and TPOT and the pooled ITL gaps (s) of the completed requests, the
    values whose percentiles summary.json's ``ttft_*``, ``tpot_*`` and ``itl_*`` are."""
    done = requests[requests["finish_reason"] != "abort"]
    multi = done[done["output_tokens"] > 1]
    ttft = (done["first_token_time"] - done["arrival_time"]).dropna()
    tpot = (multi["finish_time"] - multi["first_token_time"]) / (multi["output_tokens"] - 1)
    itl = [g for times in done["token_times"] for g in np.diff(np.unique(times))]
    return {
        "ttft": ttft.to_numpy(np.float64),
        "tpot": tpot.dropna().to_numpy(np.float64),
        "itl": np.asarray(itl, dtype=np.float64),
    }


def latency_cdfs(frame: pd.DataFrame) -> Figure:
    """TTFT, TPOT and ITL as empirical CDFs, one line per run (ms, log scale)."""
    fig = _figure(12, 4.6)
    axes = fig.subplots(1, 3, sharey=True)
    for run in frame.itertuples():
        requests, _ = results.load_tables(run.run_dir)
        for ax, values in zip(axes, latency_samples(requests).values(), strict=True):
            if values.size:
                x = np.sort(values) * MS
                y = np.arange(1, x.size + 1) / x.size
                ax.plot(x, y, drawstyle="steps-post", color=run.colour, label=run.label)
    for ax, (title, xlabel, ylabel) in zip(axes, LATENCY_AXES, strict=True):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_xscale("log")
        # 1-2-5 ticks as plain numbers: the default 3x10^1-style minor labels collide
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(0, 1.02)
    _run_legend(fig, frame)
    _footnote(
        fig,
        "requests.parquet, completed requests: TTFT = first_token_time - arrival_time; TPOT = "
        "(finish_time - first_token_time) / (output_tokens - 1), requests with > 1 token; ITL "
        "= gaps between distinct token_times, pooled (docs/results.md: ttft_*, tpot_*, itl_*).",
    )
    return fig


def rate_groups(frame: pd.DataFrame) -> pd.Series:
    """Each run's overrides that vary between the runs, ``trace.rate`` left out: the policy a
    point of a load curve belongs to (``"all runs"`` when only the rate varies)."""
    items = [results.override_items(d) for d in frame["run_dir"]]
    common = set.intersection(*(set(its) for its in items))
    return pd.Series(
        [
            ",".join(i for i in its if i not in common and results.override_key(i) != RATE)
            or "all runs"
            for its in items
        ],
        index=frame.index,
    )


def finite_rates(frame: pd.DataFrame) -> pd.Series:
    """Each run's ``trace.rate`` override as a number, NaN where it has none or it is ``inf``
    (every request at t=0: no place on a rate axis). Overrides come back as int, float or the
    string ``"inf"``, so they are converted before they are compared."""
    if RATE not in frame:
        return pd.Series(np.nan, index=frame.index)
    rates = pd.to_numeric(frame[RATE].astype(str), errors="coerce")
    return rates.where(np.isfinite(rates))


def has_rate_dimension(frame: pd.DataFrame) -> bool:
    """Whether the runs were given at least two finite request rates (``trace.rate``)."""
    return finite_rates(frame).dropna().nunique() > 1


def load_curves(frame: pd.DataFrame) -> Figure:
    """Output throughput, p99 TTFT and goodput against the request rate (``trace.rate``),
    one line per policy (``rate_groups``). Needs ``has_rate_dimension(frame)``."""
    if not has_rate_dimension(frame):
        raise ValueError(f"the runs do not vary {RATE}: no load curve to draw")
    rate = finite_rates(frame)
    rated = frame.assign(group=rate_groups(frame), rate=rate)[rate.notna()]
    fig = _figure(12, 4.4)
    axes = fig.subplots(1, 3)
    panels = [
        ("output_throughput", 1.0, "output throughput (tok/s)"),
        ("ttft_p99", MS, "TTFT p99 (ms)"),
        ("goodput", 1.0, "goodput (req/s)"),
    ]
    for i, (group, points) in enumerate(rated.groupby("group", sort=False)):
        points = points.sort_values("rate")
        for ax, (key, scale, _) in zip(axes, panels, strict=True):
            ax.plot(
                points["rate"],
                points[key].astype(float) * scale,
                marker="o",
                color=f"C{i % 10}",
                label=group,
            )
    for ax, (_, _, ylabel) in zip(axes, panels, strict=True):
        ax.set_xlabel("request rate, trace.rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside upper center",
        ncols=min(rated["group"].nunique(), 3),
    )
    _footnote(
        fig,
        "summary.json: output_throughput, ttft_p99, goodput (docs/results.md), one point per "
        f"run at its {RATE} override; runs without one, or at {RATE}=inf, are left out.",
    )
    return fig


def pareto_front(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats (higher is better on x and y; at least
    as high on both and higher on one), by increasing x: scanning from the highest x, a
    point is on the front when its y beats every y seen so far. ``vllm bench sweep
    plot_pareto`` scans the same way but keeps ties in y, which this leaves out."""
    front, best = [], -math.inf
    for i in sorted(range(len(x)), key=lambda i: (-x[i], -y[i])):
        if y[i] > best:
            front.append(i)
            best = y[i]
    return np.asarray(front[::-1], dtype=int)


def pareto(frame: pd.DataFrame) -> Figure:
    """Output throughput against per-user token rate (1 / ``tpot_mean``), a point per run,
    the Pareto front drawn through the runs no other beats on both."""
    fig = _figure(8, 5.6)
    ax = fig.subplots()
    rated = frame[frame["tpot_mean"] > 0]
    x = 1.0 / rated["tpot_mean"].to_numpy(np.float64)
    y = rated["output_throughput"].to_numpy(np.float64)
    for xi, yi, run in zip(x, y, rated.itertuples(), strict=True):
        ax.plot(xi, yi, marker="o", markersize=8, linestyle="none", color=run.colour)
    front = pareto_front(x, y)
    (line,) = ax.plot(
        x[front],
        y[front],
        color="k",
        linewidth=1,
        marker="o",
        markersize=13,
        markerfacecolor="none",
        label="Pareto front",
    )
    ax.set_xlabel("per-user token rate, 1 / TPOT mean (tok/s per user)")
    ax.set_ylabel("output throughput (tok/s)")
    if len(x):  # room around the outermost points for their front markers
        ax.set_xlim(0, x.max() * 1.1)
        ax.set_ylim(0, y.max() * 1.1)
    ax.grid(True, alpha=0.3)
    _run_legend(fig, rated, marker="o", extra=[line])
    _footnote(
        fig,
        "summary.json: output_throughput against 1 / tpot_mean (docs/results.md), as vllm "
        "bench sweep plot_pareto (its tokens/s/user is throughput / concurrency); circled: "
        "the front. Runs without a TPOT are left out.",
    )
    return fig


def _grid(fig: Figure, n: int, ncols: int = 2) -> list[Axes]:
    cols = min(n, ncols)
    rows = math.ceil(n / cols)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False, sharey=True)).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return list(axes[:n])


def kv_timeline(frame: pd.DataFrame) -> Figure:
    """The arena's blocks over the replay, stacked (used, cached, free; they sum to the
    arena), one panel per run: each step's values hold from its start until the next step
    (until its end for the last)."""
    n = len(frame)
    fig = _figure(12, 1.2 + 2.6 * math.ceil(n / 2))
    series = {"used": "tab:red", "cached": "tab:blue", "free": "0.85"}
    for ax, run in zip(_grid(fig, n), frame.itertuples(), strict=True):
        _, steps = results.load_tables(run.run_dir)
        if len(steps):
            end = steps["start_time"].iloc[-1] + steps["duration"].iloc[-1]
            t = np.append(steps["start_time"].to_numpy(np.float64), end)
            columns = [steps[f"blocks_{s}"].to_numpy() for s in series]
            blocks = [np.append(v, v[-1]) for v in columns]
            ax.stackplot(t, *blocks, step="post", colors=list(series.values()),
                         labels=list(series))  # fmt: skip
            ax.set_xlim(t[0], t[-1])
        ax.set_title(_wrap(run.label, 60), fontsize=9, color=run.colour)
        ax.set_xlabel(f"time ({run.clock} clock, s)")
        ax.set_ylabel("KV blocks")
        ax.set_ylim(0, run.num_blocks)
    fig.legend(
        [Patch(color=c) for c in series.values()], list(series), loc="outside upper right", ncols=3
    )
    _footnote(
        fig,
        "steps.parquet: blocks_used, blocks_cached, blocks_free against start_time "
        "(docs/results.md); a step's memory as its forward runs.",
    )
    return fig


def _bar_axes(fig: Figure, frame: pd.DataFrame, ncols: int) -> list[Axes]:
    """Panels of horizontal bars, one bar row per run, labelled once on the left."""
    axes = list(np.atleast_1d(fig.subplots(1, ncols, sharey=True)))
    y = np.arange(len(frame))
    axes[0].set_yticks(y, [_wrap(lab) for lab in frame["label"]], fontsize=8)
    axes[0].invert_yaxis()
    for ax in axes:
        ax.grid(True, axis="x", alpha=0.3)
    return axes


def _height(frame: pd.DataFrame) -> float:
    lines = sum(_wrap(lab).count("\n") + 1 for lab in frame["label"])
    return 1.8 + 0.28 * max(lines, 2 * len(frame))


def kv_breakdown(frame: pd.DataFrame) -> Figure:
    """The vLLM paper's KV breakdown, time-weighted over each run, as one stacked bar per
    run: token states, future (reservation), internal, external fragmentation, free (% of
    the arena's slots)."""
    fig = _figure(10, _height(frame) + 0.6)
    (ax,) = _bar_axes(fig, frame, 1)
    y = np.arange(len(frame))
    left = np.zeros(len(frame))
    for part in KV_PARTS:
        share = frame[f"kv_{part}_frac_mean"].astype(float).fillna(0.0).to_numpy() * 100
        ax.barh(y, share, left=left, color=KV_COLOURS[part], label=KV_NAMES[part])
        left += share
    ax.set_xlim(0, 100)
    ax.set_xlabel("KV slots, time-weighted mean (% of the arena)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside upper center", ncols=5)
    _footnote(
        fig,
        "summary.json: kv_tokens_frac_mean, kv_future_frac_mean, kv_internal_frac_mean, "
        "kv_external_frac_mean, kv_free_frac_mean (docs/results.md, after Kwon et al. 2023, "
        "Fig. 2): slot fractions weighted by step duration.",
    )
    return fig


def has_speculation(frame: pd.DataFrame) -> bool:
    """Whether any run verified draft tokens (a speculative acceptance rate to show)."""
    return bool(frame.get("spec_acceptance_rate", pd.Series(dtype=float)).notna().any())


def _bars(ax: Axes, frame: pd.DataFrame, key: str, scale: float, fmt: str) -> None:
    """A bar per run that has the figure (NaN: no bar), its value printed at its end."""
    values = frame[key].astype(float) * scale
    shown = values.notna().to_numpy()
    y = np.arange(len(frame))[shown]
    bars = ax.barh(y, values[shown], color=list(frame["colour"][shown]), height=0.6)
    ax.bar_label(bars, fmt=fmt, padding=3, fontsize=8)
    top = values.max(skipna=True) if shown.any() else 0.0
    ax.set_xlim(0, top * 1.25 if top > 0 else 1)  # room for the printed values


def reuse_and_preemption(frame: pd.DataFrame) -> Figure:
    """Prefix hit rate with the trace's bounds (token-level and whole-block), preemptions,
    and, when a run used speculative decoding, its acceptance rate and tokens per
    verification: one bar per run."""
    spec = has_speculation(frame)
    fig = _figure(13 if spec else 10, _height(frame) + 0.6)
    axes = _bar_axes(fig, frame, 4 if spec else 2)
    hits = axes[0]
    _bars(hits, frame, "prefix_hit_rate", 100, "%.1f")
    y = np.arange(len(frame))
    for key, marker, label in [
        ("max_prefix_hit_rate", "|", "trace bound (tokens)"),
        ("max_prefix_hit_rate_blocks", "x", "trace bound (whole blocks)"),
    ]:
        if key in frame:
            hits.plot(frame[key].astype(float) * 100, y, marker=marker, markersize=12,
                      linestyle="none", color="k", label=label)  # fmt: skip
    hits.set_xlim(0, 100)
    hits.set_xlabel("prefix hit rate (% of prompt tokens)")
    hits.legend(loc="lower left", bbox_to_anchor=(0, 1), ncols=2, fontsize=7, frameon=False)
    _bars(axes[1], frame, "preemptions", 1, "%d")
    axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].set_xlabel("preemptions (count)")
    keys = "prefix_hit_rate, max_prefix_hit_rate, max_prefix_hit_rate_blocks, preemptions"
    if spec:
        _bars(axes[2], frame, "spec_acceptance_rate", 100, "%.1f")
        axes[2].set_xlim(0, 100)
        axes[2].set_xlabel("speculative acceptance rate α (%)")
        _bars(axes[3], frame, "spec_tokens_per_verification", 1, "%.2f")
        axes[3].set_xlabel("tokens per verification (tokens)")
        keys += ", spec_acceptance_rate, spec_tokens_per_verification"
    _footnote(fig, f"summary.json: {keys} (docs/results.md); no bar: not applicable.")
    return fig
