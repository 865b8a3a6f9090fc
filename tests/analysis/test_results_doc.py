"""docs/results.md defines every column and key a run writes, and nothing else."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.analysis import results
from harness.analysis.metrics import REQUEST_COLUMNS, STEP_COLUMNS
from harness.cli.run import run

DOC = Path(__file__).resolve().parents[2] / "docs" / "results.md"
PIPE = re.compile(r"(?<!\\)\|")  # a cell border; "\|" is a pipe inside a cell


def table(section: str) -> list[tuple[str, str, str]]:
    """(name, unit, definition) of each row under ``## {section}`` whose first cell is `name`."""
    text = DOC.read_text()
    heading = f"\n## {section}\n"
    assert heading in text, f"docs/results.md has no section '## {section}'"
    body = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in PIPE.split(line.strip())[1:-1]]
        if cells and (name := re.fullmatch(r"`([^`]+)`", cells[0])):
            assert len(cells) == 3, f"## {section}: row {name[1]!r} needs 3 cells, got {cells}"
            rows.append((name[1], cells[1], cells[2]))
    return rows


def check(section: str, expected) -> None:
    rows = table(section)
    names = [name for name, _, _ in rows]
    dup = sorted({n for n in names if names.count(n) > 1})
    missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
    assert not (dup or missing or extra), (
        f"docs/results.md ## {section}: missing {missing}, extra {extra}, duplicated {dup}"
    )
    blank = [name for name, unit, definition in rows if not unit or not definition]
    assert not blank, f"docs/results.md ## {section}: no unit or definition for {blank}"


@pytest.mark.parametrize(
    ("section", "columns"),
    [("requests.parquet", REQUEST_COLUMNS), ("steps.parquet", STEP_COLUMNS)],
)
def test_every_table_column_is_defined(section: str, columns: tuple[str, ...]) -> None:
    check(section, columns)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real tiny run's folder."""
    from support import compose_config

    out = tmp_path_factory.mktemp("run")
    run(compose_config(["warmup=0"]), out)
    return out


def test_every_summary_key_is_defined(run_dir: Path) -> None:
    check("summary.json", json.loads((run_dir / results.SUMMARY_FILE).read_text()))


def test_every_vllm_bench_key_is_defined(run_dir: Path) -> None:
    check("vllm_bench.json", json.loads((run_dir / results.VLLM_BENCH_FILE).read_text()))
