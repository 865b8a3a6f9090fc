"""How much of a data sheet's peaks kernels achieve, fitted to published measurements and
judged on measurements the fit never saw.

``measurements.yaml`` holds published batch-1 figures, each cell with the URL it was read
from: decode tokens/s (a token at a time from an empty context, ``decode_tokens`` of them)
and prefill tokens/s (a ``prompt``-token prompt) of a named model shape
(harness/costmodel/shapes/), weight format and device (devices.yaml). ``split`` shuffles
the cells with a fixed seed and keeps the first half to fit, the rest to judge. ``fit``
finds, per device class and weight format, a memory efficiency (decode is bound by reading
the weights) and a compute efficiency (a long prefill is bound by FLOPs) such that the
roofline's median predicted time over the fitted cells equals the measured one; a group
with no fitted cell takes its device class's pooled factors.

``price`` (roofline.py ``price_cell``) turns a cell and efficiencies into predicted decode
and prefill tokens/s; it is passed in, since roofline.py derives profiles and this module
sits below it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import numpy as np
import yaml

MEASUREMENTS_FILE = Path(__file__).with_name("measurements.yaml")
SEED = 0
ITERATIONS = 40  # fixed-point steps of the fit; it settles in a few


@dataclass(frozen=True)
class Cell:
    """One published measurement (measurements.yaml's columns)."""

    model: str
    weights: str
    device: str
    decode: float  # tokens/s, batch 1
    prefill: float | None  # tokens/s over a prompt of ``prompt`` tokens (None: unpublished)
    prompt: int
    decode_tokens: int
    source: str


Efficiency = dict[str, float]  # "memory", "compute" -> a fraction of peak
Price = Callable[[Cell, Efficiency], tuple[float, float]]  # -> decode, prefill tokens/s


def cells(path: Path = MEASUREMENTS_FILE) -> list[Cell]:
    """The measurement table, in file order."""
    table = yaml.safe_load(path.read_text())
    defaults = table.get("defaults", {})
    return [Cell(**{**defaults, **row}) for row in table["cells"]]


def weight_bits(weights: str, path: Path = MEASUREMENTS_FILE) -> int:
    """The bits a weight format is priced at (measurements.yaml ``formats``)."""
    return yaml.safe_load(path.read_text())["formats"][weights]


def split(
    table: Sequence[Cell], key: Callable[[Cell], str], seed: int = SEED
) -> tuple[list[Cell], list[Cell]]:
    """The cells to fit and the cells held out: per ``key`` (a device class, so that every
    class is both fitted and judged), a seeded shuffle cut in half, the odd cell held out."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for value in sorted({key(c) for c in table}):
        members = [c for c in table if key(c) == value]
        order = rng.permutation(len(members))
        half = len(members) // 2
        train += [members[i] for i in order[:half]]
        test += [members[i] for i in order[half:]]
    return train, test


def fit(
    train: Sequence[Cell], price: Price, group: Callable[[Cell], tuple[str, str]]
) -> dict[tuple[str, str], Efficiency]:
    """Per ``group`` (device class, weight format): the efficiencies that make the median
    predicted/measured time 1 on ``train`` (module docstring); each class's pooled fit
    under the key (class, "*"). Efficiencies stay in (0, 1]: a cell faster than its peaks
    says the data sheet is wrong, not the kernel. A group without a prefill figure takes its
    class's compute efficiency."""
    groups: dict[tuple[str, str], list[Cell]] = {}
    for cell in train:
        kind, weights = group(cell)
        groups.setdefault((kind, weights), []).append(cell)
        groups.setdefault((kind, "*"), []).append(cell)
    fitted = {key: _fit_one(members, price) for key, members in groups.items()}
    for (kind, weights), members in groups.items():
        if all(c.prefill is None for c in members):
            fitted[kind, weights]["compute"] = fitted[kind, "*"]["compute"]
    return fitted


def _fit_one(members: Sequence[Cell], price: Price) -> Efficiency:
    eff = {"memory": 1.0, "compute": 1.0}
    for _ in range(ITERATIONS):
        predicted = [price(c, eff) for c in members]
        # predicted/measured time = measured/predicted tokens/s; scaling a rate by this
        # median brings the median ratio to 1 (time is ~1/efficiency where it binds)
        pairs = list(zip(members, predicted, strict=True))
        decode = median(c.decode / p[0] for c, p in pairs)
        prefill = [c.prefill / p[1] for c, p in pairs if c.prefill is not None]
        eff = {
            "memory": min(1.0, eff["memory"] * decode),
            "compute": min(1.0, eff["compute"] * median(prefill)) if prefill else 1.0,
        }
    return eff


def efficiency_for(
    fitted: dict[tuple[str, str], Efficiency], kind: str, weights: str
) -> Efficiency | None:
    """The fitted efficiencies of a (class, format) group, else the class's pooled ones."""
    return fitted.get((kind, weights)) or fitted.get((kind, "*"))


def errors(
    test: Sequence[Cell],
    price: Price,
    fitted: dict[tuple[str, str], Efficiency],
    group: Callable[[Cell], tuple[str, str]],
) -> list[tuple[Cell, float, float]]:
    """Per held-out cell: the relative error of predicted decode and prefill tokens/s
    (predicted / measured - 1; prefill None where unpublished); cells of a class the fit
    never saw are left out."""
    rows = []
    for cell in test:
        eff = efficiency_for(fitted, *group(cell))
        if eff is None:
            continue
        decode, prefill = price(cell, eff)
        missed = None if cell.prefill is None else prefill / cell.prefill - 1
        rows.append((cell, decode / cell.decode - 1, missed))
    return rows


def summary(values: Sequence[float | None]) -> str:
    """Median and 90th percentile of |error| (of the cells that have one), as percentages."""
    absolute = np.abs(np.asarray([v for v in values if v is not None]))
    return (
        f"median |error| {np.median(absolute):.1%}, p90 {np.percentile(absolute, 90):.1%} "
        f"({len(absolute)} cells)"
    )


def validate_main(argv: Sequence[str], price: Price, device_class: Callable[[str], str]) -> int:
    """``python -m harness.costmodel.roofline validate [--seed N]``: fit on half the cells,
    print the fitted factors and the held-out table."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.costmodel.roofline validate",
        description="Fit roofline efficiencies on half the published measurements; print "
        "the error on the other half.",
    )
    parser.add_argument("--seed", type=int, default=SEED, help="the split's seed")
    args = parser.parse_args(list(argv))
    table = cells()

    def group(cell: Cell) -> tuple[str, str]:
        return device_class(cell.device), cell.weights

    train, test = split(table, lambda c: device_class(c.device), args.seed)
    fitted = fit(train, price, group)
    print(
        f"{len(table)} published cells on {len({c.device for c in table})} devices; fitted on "
        f"{len(train)}, held out {len(test)} (seed {args.seed})"
    )
    print("fitted efficiency (fraction of peak), per device class and weight format:")
    for (kind, weights), eff in sorted(fitted.items()):
        n = sum(1 for c in train if weights in ("*", c.weights) and group(c)[0] == kind)
        print(
            f"  {kind:7} {weights:5} memory {eff['memory']:.3f}  compute {eff['compute']:.3f}"
            f"  ({n} cells)"
        )
    rows = errors(test, price, fitted, group)
    if len(rows) < len(test):
        print(f"{len(test) - len(rows)} held-out cells of a class the fit never saw: left out")
    print("held out (tokens/s: measured, predicted, error):")
    print(f"  {'device':10} {'model':12} {'weights':8} {'decode':>26} {'prefill':>30}")
    for cell, decode_error, prefill_error in rows:
        eff = efficiency_for(fitted, *group(cell))
        decode, prefill = price(cell, eff)
        measured = "-" if cell.prefill is None else f"{cell.prefill:9.1f}"
        missed = "-" if prefill_error is None else f"{prefill_error:+7.1%}"
        print(
            f"  {cell.device:10} {cell.model:12} {cell.weights:8} {cell.decode:8.1f} "
            f"{decode:8.1f} {decode_error:+7.1%} {measured:>9} {prefill:9.1f} {missed:>7}"
        )
    print(f"decode:  {summary([r[1] for r in rows])}")
    print(f"prefill: {summary([r[2] for r in rows])}")
    return 1 if any(math.isnan(r[1]) for r in rows) else 0
