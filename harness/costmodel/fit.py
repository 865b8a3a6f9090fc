"""Fitting a measured profile: per step kind, step durations as a non-negative linear
function of the step's counts (harness/costmodel/work.py).

Each kind's coefficients minimise the squared *relative* error (rows weighted by one over
the measured duration), so short decode steps weigh as much as long prefills, under
non-negativity (Lawson and Hanson's NNLS): no count makes a step cheaper; steps far off the
first fit (another process slowed them) are dropped and the fit made again. Block moves are
measured and priced apart (``moves``) and taken off each step's duration before the fit.
The residuals reported per kind are those of the fitted steps themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from harness.costmodel.profile import INTERCEPT, MOVES
from harness.costmodel.work import KINDS, PRICED, StepWork

MIN_STEPS = 8  # fewer steps of a kind than this fit nothing
OUTLIER_MADS = 4.0  # refit without steps this many deviations off the first fit


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ x)
        if free.all() or gradient[~free].max(initial=0) <= 1e-12 * max(1.0, np.abs(b).max()):
            break
        free[np.argmax(np.where(free, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            shrink = free & (z <= 0)
            alpha = np.min(x[shrink] / (x[shrink] - z[shrink]))
            x = x + alpha * (z - x)
            free &= x > 1e-15
            x[~free] = 0.0
    return x


def fit_kinds(
    steps: Iterable[tuple[StepWork, float]], moves: Mapping[str, float]
) -> dict[str, dict]:
    """Per kind with at least ``MIN_STEPS`` steps: {"coefficients": {"step": intercept,
    feature: seconds per unit}, "residuals": ``residuals``}. Features that never vary within
    a kind (a decode's rows are its logits) are left at 0 and the others carry them."""
    by_kind: dict[str, list[tuple[StepWork, float]]] = {}
    for work, seconds in steps:
        by_kind.setdefault(work.kind, []).append((work, seconds))
    fitted = {}
    for kind in KINDS:
        rows = by_kind.get(kind, [])
        if kind == "idle" or len(rows) < MIN_STEPS:
            continue
        x = np.array([(1, *w.vector()) for w, _ in rows], dtype=float)
        moved = np.array([_moves(w, moves) for w, _ in rows])
        y = np.array([s for _, s in rows]) - moved
        coef = _robust_fit(x, y, y + moved)
        names = (INTERCEPT, *PRICED)
        predicted = x @ coef + moved
        fitted[kind] = {
            "coefficients": {n: float(c) for n, c in zip(names, coef, strict=True) if c > 0},
            "residuals": residuals(predicted, y + moved),
        }
    return fitted


def _robust_fit(x: np.ndarray, y: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """NNLS on relative error, then again without the steps whose relative residual is
    beyond ``OUTLIER_MADS`` median absolute deviations: a step slowed by another process
    (a shared machine) is not the step's cost."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    weight = 1.0 / np.maximum(measured, 1e-9)
    coef = nnls(x / scale * weight[:, None], y * weight) / scale
    rel = (x @ coef - y) * weight
    mad = np.median(np.abs(rel - np.median(rel)))
    kept = np.abs(rel - np.median(rel)) <= OUTLIER_MADS * max(mad, 1e-6)
    if kept.sum() >= MIN_STEPS and not kept.all():
        coef = nnls(x[kept] / scale * weight[kept, None], y[kept] * weight[kept]) / scale
    return coef


def _moves(work: StepWork, moves: Mapping[str, float]) -> float:
    counts = work.vector()
    return sum(moves.get(m, 0.0) * counts[PRICED.index(m)] for m in MOVES)


def residuals(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    """How far ``predicted`` step durations are from ``measured`` ones:

    steps          how many
    median_abs     median of |predicted / measured - 1|
    p90_abs        90th percentile of the same
    bias           mean of predicted / measured - 1 (signed)
    total          sum predicted / sum measured - 1: the error of the run's duration
    """
    rel = predicted / measured - 1
    return {
        "steps": int(len(measured)),
        "median_abs": float(np.median(np.abs(rel))),
        "p90_abs": float(np.percentile(np.abs(rel), 90)),
        "bias": float(rel.mean()),
        "total": float(predicted.sum() / measured.sum() - 1),
    }
