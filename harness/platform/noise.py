"""How much this machine's speed moves while a run is timed: a fixed probe timed before and
after the run.

On a shared machine one timed run of a policy can be 25 % faster than another doing exactly
the same work, and the order can flip in the next sweep. A timed difference means something
only when it is larger than that. ``probe`` times ``REPEATS`` times the same fixed MLX work
(``MATMULS`` chained products of ``SIZE`` x ``SIZE`` float32 matrices, evaluated each time:
20-30 ms on 2 CPU cores, the kind of work a step does, no model needed), and ``spread`` turns the
durations timed before and after a run into its noise figure: (slowest - fastest) / median.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import mlx.core as mx

REPEATS = 7  # timed probes each side of a run: its noise spans 2 x REPEATS durations
SIZE = 384
MATMULS = 8


def probe(repeats: int = REPEATS) -> list[float]:
    """Seconds of each of ``repeats`` runs of the fixed work, after one untimed run."""
    a = mx.random.normal((SIZE, SIZE), key=mx.random.key(0)) / SIZE**0.5
    mx.eval(a)

    def work() -> None:
        x = a
        for _ in range(MATMULS):
            x = x @ a
        mx.eval(x)

    work()  # first-call costs (kernels, buffers) are not the machine's noise
    durations = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        durations.append(time.perf_counter() - started)
    return durations


def spread(durations: Sequence[float]) -> float:
    """(slowest - fastest) / median of ``durations``: the relative change in speed the
    machine showed over them (0: none); NaN when the clock did not move (an injected one)."""
    median = statistics.median(durations)
    return (max(durations) - min(durations)) / median if median > 0 else math.nan
