"""How the benchmarks time a call: one untimed warm-up (first-call allocations, thread pools),
then the median of N timed calls, so one stall on a shared machine does not move the figure."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``call()`` over ``repeats`` calls, after one untimed warm-up.
    ``call`` must finish its work before returning (``mx.eval`` what MLX computes lazily)."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
