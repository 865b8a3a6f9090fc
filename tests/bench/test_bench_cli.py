"""python -m harness.bench: the listing, an unknown name, and every benchmark's options."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from harness.bench.__main__ import benchmarks

NAMES = sorted(benchmarks())


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_benchmark_has_a_description() -> None:
    assert {"allocators", "blas", "engine", "eviction", "speculative"} <= set(NAMES)
    assert all(benchmarks().values()), benchmarks()


def test_no_name_lists_the_benchmarks_with_their_descriptions() -> None:
    proc = bench()
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: python -m harness.bench NAME")
    rows = lines[lines.index("benchmarks:") + 1 :]
    listed = dict(row.split(None, 1) for row in rows)
    assert listed == benchmarks()
    assert listed["eviction"].startswith("Eviction-policy benchmark")


def test_an_unknown_name_says_which_exist() -> None:
    proc = bench("nope")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"python -m harness.bench: error: no benchmark 'nope'; choose one of {', '.join(NAMES)}\n"
    )


@pytest.mark.parametrize("name", NAMES)
def test_help_runs(name: str) -> None:
    proc = bench(name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m harness.bench {name}")


class Parsed(Exception):
    """Raised in place of parsing: carries the parser a benchmark built."""


@pytest.mark.parametrize("name", NAMES)
def test_every_option_has_help_text(name: str, monkeypatch) -> None:
    def capture(self, *args, **kwargs):
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Parsed) as parsed:
        importlib.import_module(f"harness.bench.{name}").main([])
    parser = parsed.value.args[0]
    options = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]
    assert options, f"{name} has no options"
    assert [a.option_strings for a in options if not a.help] == []
