"""What a run ran on, recorded in its summary.json: figures are comparable only side by side
on the same machine, software and BLAS."""

from __future__ import annotations

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from harness.platform import blas


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _cpu_model() -> str:
    # platform.processor() is empty or just the architecture on Linux; /proc/cpuinfo names it.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# MLX keeps freed buffers for reuse up to this many bytes (its CPU default is 32 MiB, so a
# step's gathers larger than that were allocated afresh every step: 95 -> 46 ms per step).
MLX_CACHE_LIMIT = 4 << 30


def set_mlx_cache_limit(limit: int = MLX_CACHE_LIMIT) -> None:
    """MLX's buffer-cache limit, a process-wide setting: made once by the process's entry
    point (``kvbench``, ``python -m harness.bench``), never by a library constructor."""
    import mlx.core as mx

    mx.set_cache_limit(limit)


def info() -> dict[str, Any]:
    """Platform, CPU, Python, package versions, MLX's default device and BLAS (as probed)."""
    import mlx.core as mx

    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(affinity) if affinity is not None else os.cpu_count(),
        "python": sys.version.split()[0],
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "kvbench": _version("kvbench"),
        "numpy": _version("numpy"),
        "mx_default_device": str(mx.default_device()),
        "blas": blas.info(),
    }
