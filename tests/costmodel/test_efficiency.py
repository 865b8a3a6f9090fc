"""Efficiencies fitted to published measurements (harness/costmodel/efficiency.py): the
table's provenance, the seeded split, the fit on prices computed by hand, the command."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.costmodel.efficiency import Cell, cells, fit, split
from harness.costmodel.roofline import (
    SHAPES_DIR,
    device_class,
    devices,
    fitted_efficiency,
    main,
    price_cell,
)


def cell(device: str = "d", weights: str = "f16", decode: float = 50.0, prefill: float = 500.0):
    return Cell("m", weights, device, decode, prefill, 512, 128, "https://example.org/x")


def test_every_cell_names_its_source_device_and_model():
    table = cells()
    assert len(table) >= 30 and len({c.device for c in table}) >= 8
    for c in table:
        assert c.source.startswith("https://"), c
        assert c.device in devices(), c
        assert (SHAPES_DIR / f"{c.model}.json").is_file(), c
        assert c.decode > 0 and (c.prefill is None or c.prefill > 0), c


def test_the_split_is_fixed_by_the_seed_and_halves_each_class():
    table = [cell(device=f"{kind}{i}") for kind in "ab" for i in range(5)]

    def kind(c: Cell) -> str:
        return c.device[0]

    train, test = split(table, kind, seed=3)
    assert (train, test) == split(table, kind, seed=3)
    assert split(table, kind, seed=4) != (train, test)
    # five cells a class: two fitted, three held out, none in both
    assert sorted(kind(c) for c in train) == ["a", "a", "b", "b"]
    assert len(test) == 6 and not set(train) & set(test)


def test_fit_scales_each_efficiency_to_the_measurements():
    # A device whose decode runs 100 tokens/s per unit of memory efficiency and prefill 1000
    # per unit of compute efficiency: measured 50 and 250 take 0.5 and 0.25 of peak.
    def price(c: Cell, eff: dict[str, float]) -> tuple[float, float]:
        return 100 * eff["memory"], 1000 * eff["compute"]

    train = [cell(decode=50, prefill=250), cell(weights="q4_0", decode=80, prefill=400)]
    fitted = fit(train, price, lambda c: ("apple", c.weights))
    assert fitted[("apple", "f16")] == pytest.approx({"memory": 0.5, "compute": 0.25})
    assert fitted[("apple", "q4_0")] == pytest.approx({"memory": 0.8, "compute": 0.4})
    # the class's pooled fit: the median of the two ratios
    assert fitted[("apple", "*")] == pytest.approx({"memory": 0.65, "compute": 0.325})
    # a format published without a prefill figure takes its class's compute efficiency
    decode_only = [*train, cell(weights="bf16", decode=90, prefill=None)]
    fitted = fit(decode_only, price, lambda c: ("apple", c.weights))
    assert fitted[("apple", "bf16")] == pytest.approx({"memory": 0.9, "compute": 0.325})
    # a measurement faster than the peaks says the sheet is wrong: capped at 1
    fast = fit([replace(train[0], decode=300)], price, lambda c: ("apple", "f16"))
    assert fast[("apple", "f16")]["memory"] == 1.0


def test_validate_prints_the_held_out_table(capsys):
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    assert "held out" in out and "decode:  median |error|" in out
    assert device_class("h100") == "nvidia" and device_class("m4-max") == "apple"
    assert device_class("m3-ultra") == "apple-ultra"  # two dies: a class of its own


def test_fitted_efficiency_takes_the_format_with_the_most_cells():
    fitted = fit(cells(), price_cell, lambda c: (device_class(c.device), c.weights))
    # Apple at 4 bits: llama.cpp's q4_0 (12 cells; mlx_4bit has 1, an Ultra's)
    assert fitted_efficiency("m4-max", 4) == fitted[("apple", "q4_0")]
    # NVIDIA has no 16-bit cell: the class's pooled fit
    assert fitted_efficiency("h100", 16) == fitted[("nvidia", "*")]
