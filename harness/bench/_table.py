"""The benchmarks' fixed-width tables."""

from __future__ import annotations


def underlined(header: str) -> str:
    """A table's header line and a rule of dashes as wide, one under the other."""
    return f"{header}\n{'-' * len(header)}"
