"""Run a benchmark: ``python -m harness.bench NAME args...`` calls ``harness.bench.NAME.main``;
with no NAME, list the benchmarks."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

import harness.bench
from harness.platform import machine

PROG = "python -m harness.bench"


def benchmarks() -> dict[str, str]:
    """Every benchmark, ``{name: the first line of its module docstring}``, read from the
    source so that listing them imports none."""
    out = {}
    for module in pkgutil.iter_modules(harness.bench.__path__):
        if module.ispkg or module.name.startswith("_"):  # __main__; support/: no benchmark
            continue
        spec = importlib.util.find_spec(f"harness.bench.{module.name}")
        doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
        out[module.name] = doc.strip().splitlines()[0] if doc.strip() else ""
    return out


def usage() -> str:
    """The usage line and the benchmarks, one a line with its description."""
    names = benchmarks()
    width = max(map(len, names))
    lines = [f"usage: {PROG} NAME [args...]   ({PROG} NAME --help: its options)", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {doc}" for name, doc in names.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Import ``harness.bench.<argv[0]>`` and hand it the remaining arguments."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    names = benchmarks()
    if argv[0] not in names:
        print(
            f"{PROG}: error: no benchmark {argv[0]!r}; choose one of {', '.join(names)}",
            file=sys.stderr,
        )
        sys.exit(2)
    machine.set_mlx_cache_limit()  # as kvbench runs do
    importlib.import_module(f"harness.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
