"""The benchmarks' fixed-width tables."""

from __future__ import annotations


def underlined(header: str) -> str:
    """A table's header line and a rule of dashes as wide, one under the other."""
    return f"{header}\n{'-' * len(header)}"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns as wide as their widest cell, the header underlined."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    line = "  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=True))
    body = ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([underlined(line.rstrip()), *(b.rstrip() for b in body)])
