"""``kvbench-regress``'s baseline files: read and checked, written, and the measured figures
compared with them.

A gating figure regresses when it is worse than its baseline by more than its tolerance
(``FIGURES``); one better by more is "improved": it passes, with a note to rewrite the
baseline (else a later regression back to the old value would pass). A figure missing from the
baseline (one written before it existed, or a platform's not regenerated yet) is not compared
yet: named in a note, never failing.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

from harness.cli.regress_suite import FIGURES


class BaselineError(ValueError):
    """The baseline file is not what ``--update-baseline`` writes."""


def platform_name() -> str:
    """``linux-x86_64``, ``darwin-arm64``, ...: baselines are per platform."""
    return f"{sys.platform}-{platform.machine().lower()}"


def read_baseline(path: Path) -> dict[str, Any] | None:
    """The baseline at ``path`` (None if there is none), its figures checked."""
    if not path.exists():
        return None
    try:
        baseline = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BaselineError(
            f"{path} is not JSON ({e}); fix it or rewrite it with --update-baseline"
        ) from None
    figures = baseline.get("figures") if isinstance(baseline, dict) else None
    if not isinstance(figures, dict):
        raise BaselineError(
            f"{path}: field 'figures' is missing or not an object of name: number; "
            "rewrite it with --update-baseline"
        )
    for name, value in figures.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise BaselineError(
                f"{path}: field 'figures.{name}' is {value!r}, not a number; "
                "rewrite it with --update-baseline"
            )
    return baseline


def compare_figures(figures: dict[str, float], baseline: dict[str, float]) -> list[dict[str, Any]]:
    """One check per figure measured, its ``status``: regressed, ok, improved (a gating figure
    better than its baseline by more than its tolerance: passes, the baseline is stale), new
    (not in the baseline: not compared yet) or timed (printed, never gating)."""
    checks = []
    for name, value in figures.items():
        figure, base = FIGURES[name], baseline.get(name)
        compared = base is not None and figure.gates
        check = {
            "figure": name,
            "value": value,
            "baseline": base,
            "better": figure.better,
            "tolerance": figure.tolerance,
            "limit": figure.limit(base) if compared else None,
            "status": "new" if base is None else "timed",
        }
        if compared:
            check["status"] = (
                "regressed"
                if figure.regressed(value, base)
                else "improved"
                if figure.improved(value, base)
                else "ok"
            )
        checks.append(check)
    return checks


def format_checks(checks: list[dict[str, Any]]) -> str:
    """A fixed-width table: figure, value, baseline, the limit it must not cross, status."""
    head = f"{'figure':<32}{'value':>12}{'baseline':>12}{'limit':>12}  {'better':<7}status"
    rows = [head, "-" * len(head)]
    for c in checks:
        base = "-" if c["baseline"] is None else f"{c['baseline']:.6g}"
        limit = "-" if c["limit"] is None else f"{c['limit']:.6g}"
        rows.append(
            f"{c['figure']:<32}{c['value']:>12.6g}{base:>12}{limit:>12}  {c['better']:<7}"
            f"{c['status']}"
        )
    return "\n".join(rows)


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` to ``path`` as indented JSON, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
