"""Arrival processes and length distributions for synthetic traces.

Each is a frozen dataclass with plain constructor arguments (so Hydra builds it from
``_target_``) and ``sample(n, rng) -> np.ndarray``: arrival times in seconds from the trace
start (non-decreasing, first at 0.0 unless offline), or integer lengths >= 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class ArrivalProcess(Protocol):
    """Draws ``n`` non-decreasing arrival times (s from trace start) from ``rng``."""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray: ...


def _check_rate(rate: float) -> None:
    # inf is vLLM's --request-rate inf: every gap is 0, yet the same random numbers are drawn
    # as at any finite rate, so the requests after the arrivals in a trace stay the same.
    if not rate > 0:  # NaN fails too
        raise ValueError(f"rate must be > 0 requests/s, got {rate}; inf puts every request at t=0")


def _cumulative(gaps: np.ndarray) -> np.ndarray:
    # The first request arrives at t=0 so a replay does not open with an idle gap.
    return np.concatenate(([0.0], np.cumsum(gaps)))


@dataclass(frozen=True)
class Poisson:
    """Exponential inter-arrival gaps with mean ``1/rate``."""

    rate: float

    def __post_init__(self) -> None:
        _check_rate(self.rate)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return _cumulative(rng.exponential(1.0 / self.rate, max(n - 1, 0)))[:n]


@dataclass(frozen=True)
class Gamma:
    """Gamma gaps as in vLLM's benchmark_serving: shape ``burstiness``, scale
    ``1/(rate*burstiness)``; the gaps' CV^2 is ``1/burstiness`` (1 = Poisson, < 1 burstier)."""

    rate: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        scale = 1.0 / (self.rate * self.burstiness)
        return _cumulative(rng.gamma(self.burstiness, scale, max(n - 1, 0)))[:n]


@dataclass(frozen=True)
class Constant:
    """One arrival every ``1/rate`` seconds."""

    rate: float

    def __post_init__(self) -> None:
        _check_rate(self.rate)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.arange(n, dtype=np.float64) / self.rate


@dataclass(frozen=True)
class AllAtOnce:
    """Offline batch: every request arrives at 0.0."""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(n)


class LengthDist(Protocol):
    """Draws ``n`` integer token counts >= 1 from ``rng``."""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray: ...


def _check_bounds(low: int, high: int | None) -> None:
    if low < 1 or (high is not None and high < low):
        raise ValueError(f"length bounds must satisfy 1 <= min <= max, got [{low}, {high}]")


@dataclass(frozen=True)
class Fixed:
    """Every length is ``value``."""

    value: int

    def __post_init__(self) -> None:
        _check_bounds(self.value, self.value)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    """Integers uniform on ``[low, high]`` (both inclusive)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        _check_bounds(self.low, self.high)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, n, dtype=np.int64)


@dataclass(frozen=True)
class LogNormal:
    """Lognormal lengths given their ``mean`` or their ``median`` (exactly one), rounded and
    clipped to ``[min, max]``; ``sigma`` is the std of the underlying normal. Clipping moves
    the realised mean slightly off ``mean``."""

    mean: float | None = None
    sigma: float = 1.0
    min: int = 1
    max: int | None = None
    median: float | None = None

    def __post_init__(self) -> None:
        _check_bounds(self.min, self.max)
        if (self.mean is None) == (self.median is None):
            raise ValueError("LogNormal needs exactly one of mean= or median=")
        center = self.mean if self.mean is not None else self.median
        if not (self.sigma > 0 and center > 0):
            raise ValueError("LogNormal needs sigma > 0 and a positive mean or median")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.median is not None:
            mu = math.log(self.median)
        else:  # E[X] = exp(mu + sigma^2 / 2)
            mu = math.log(self.mean) - self.sigma**2 / 2
        x = np.rint(rng.lognormal(mu, self.sigma, n))
        return np.clip(x, self.min, self.max).astype(np.int64)


@dataclass(frozen=True)
class Zipf:
    """Bounded Zipf on ``[min, max]``: P(length) proportional to (length - min + 1)^-a, so
    ``min`` is the most likely length and large ``a`` concentrates mass there."""

    a: float
    min: int = 1
    max: int = 4096

    def __post_init__(self) -> None:
        _check_bounds(self.min, self.max)
        if not self.a > 0:
            raise ValueError(f"Zipf exponent a must be > 0, got {self.a}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        weights = np.arange(1, self.max - self.min + 2, dtype=np.float64) ** -self.a
        return self.min + rng.choice(len(weights), n, p=weights / weights.sum())


# vLLM paper (Kwon et al., SOSP 2023), Fig. 11: tokenised ShareGPT has mean input 161.31 and
# mean output 337.99 tokens (8.4x / 5.8x Alpaca's 19.31 / 58.45). The paper gives no spread,
# so sigma = 1.0 is kvbench's assumption; clip max 2048 is the OPT context used there.
SHAREGPT_MEAN = {"prompt": 161.31, "output": 337.99}


@dataclass(frozen=True)
class ShareGPT:
    """Lognormal fit to ShareGPT's published means (``SHAREGPT_MEAN``, from the vLLM paper's
    Fig. 11) with an assumed sigma of 1.0, clipped to ``[1, max]``. ``kind``: prompt|output."""

    kind: str = "prompt"
    max: int = 2048

    def __post_init__(self) -> None:
        if self.kind not in SHAREGPT_MEAN:
            raise ValueError(f"ShareGPT kind must be 'prompt' or 'output', got {self.kind!r}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return LogNormal(mean=SHAREGPT_MEAN[self.kind], sigma=1.0, max=self.max).sample(n, rng)
