"""Engine clocks: virtual (replay without sleeping), wall (real time) and model (a cost
profile's price of each step, harness/engine/modelled.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from harness.costmodel.work import StepWork


class Clock(Protocol):
    """Time as the engine and the metrics see it, in seconds."""

    name: str
    measures: bool  # False: durations are priced (a model clock), not measured

    def now(self) -> float: ...

    def after(self, elapsed: float) -> float:
        """The time ``elapsed`` seconds after the current step began."""
        ...

    def charge(self, work: StepWork) -> None:
        """The current step's work, for a clock that prices it rather than measures it."""
        ...

    def advance(self, duration: float) -> float:
        """A step of ``duration`` measured seconds has ended; returns the step's duration
        on this clock."""
        ...

    def wait_until(self, t: float) -> None:
        """Nothing to do until ``t`` (the next arrival)."""
        ...


class VirtualClock:
    """Advances by each step's measured, synchronised duration; idle gaps are skipped.

    A replay never sleeps, so a trace with long idle gaps runs as fast as the engine does,
    while TTFT and TPOT still include the real cost of every step.
    """

    name = "virtual"
    measures = True

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def after(self, elapsed: float) -> float:
        return self._now + elapsed

    def charge(self, work: StepWork) -> None:
        pass

    def advance(self, duration: float) -> float:
        self._now += duration
        return duration

    def wait_until(self, t: float) -> None:
        self._now = max(self._now, t)


class WallClock:
    """Real time since the clock was made; idle gaps are slept through."""

    name = "wall"
    measures = True

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def after(self, elapsed: float) -> float:
        return self.now()

    def charge(self, work: StepWork) -> None:
        pass

    def advance(self, duration: float) -> float:
        return duration

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


# The measuring clocks by the name ``engine.clock`` gives (harness.engine.builder.build_engine);
# ``model`` (harness/engine/modelled.py's ModelClock) needs a profile.
CLOCKS: dict[str, type[Clock]] = {c.name: c for c in (VirtualClock, WallClock)}
