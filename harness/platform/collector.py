"""Python's cyclic garbage collector, paused while a trace replays.

A replay makes no garbage that only the cyclic collector can free: reference counting frees
everything it lets go (every golden replay checks it: ``Paused.cyclic`` stays 0). Yet each
pass of the collector walks live objects, and its oldest generation walks all of them: a
replay shaped like the Mooncake conversation trace (12k requests, millions of prefix-cache
nodes) spent 6.0 of its 57.3 s in 3,764 passes, 4.2 s of it in 14 full ones. On a measuring
clock a full pass over a large heap (hundreds of ms) would land inside one step's duration:
a latency spike that measures the harness, not the policy. vLLM freezes its engine's heap
out of the collector's reach for the same reason (vllm-project/vllm#24008).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Paused:
    """``cyclic``: objects in reference cycles found when the pause ended, made while the
    collector was off (the garbage from before was collected as it began)."""

    cyclic: int = 0


@contextmanager
def collector_paused() -> Iterator[Paused]:
    """Collect once, then keep the collector off until the block ends, then collect again
    (counting what only it could free: ``Paused.cyclic``) and put it back as it was."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    paused = Paused()
    try:
        yield paused
    finally:
        if enabled:
            gc.enable()
        paused.cyclic = gc.collect()
