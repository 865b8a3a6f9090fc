"""Run a benchmark: ``python -m harness.bench NAME args...`` calls ``harness.bench.NAME.main``."""

from __future__ import annotations

import importlib
import sys

from harness import machine


def main(argv: list[str]) -> None:
    """Import ``harness.bench.<argv[0]>`` and hand it the remaining arguments."""
    if not argv or argv[0] in ("-h", "--help"):
        sys.exit("usage: python -m harness.bench NAME [args...]")
    machine.set_mlx_cache_limit()  # as kvbench runs do
    importlib.import_module(f"harness.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
