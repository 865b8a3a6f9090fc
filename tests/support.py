"""Test helpers shared across packages: the checkout, Hydra's compose API over conf/ at tiny
sizes, the allocator options, kvbench in a subprocess, random prompts and engine builders.
Test modules import these (``from support import ...``); fixtures live in the conftest.py
files, which pytest finds by itself, so that each package may have one of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from hydra import compose, initialize_config_dir
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

import harness  # noqa: F401  (switches MLX to MKL before anything imports mlx)
from allocators.base import BlockAllocator
from harness.cli.run import CONFIG_DIR
from harness.engine import LLMEngine, build_engine
from harness.engine.model_runner import ModelRunner, Row
from harness.platform.models import LoadedModel
from schedulers.base import Scheduler
from schedulers.fcfs import FCFSScheduler

ROOT = Path(__file__).resolve().parent.parent  # this checkout
ALLOCATOR_CONF = Path(CONFIG_DIR) / "allocator"

# Seconds-long experiments: six short requests, a small arena, no progress bar.
TINY = ("trace=smoke", "engine.num_blocks=64", "progress=false")


def random_prompts(lengths: Iterable[int], seed: int) -> list[list[int]]:
    """One prompt of each length, of random token ids from 1 to 1023, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1024, n).tolist() for n in lengths]


class LetterTokenizer:
    """A real (if tiny) tokenizer: token i is the letter chr(97 + i % 26)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 97 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


class FakeTime:
    """An injected ``time.perf_counter`` and ``time.sleep``: time moves only when the test
    (or a sleep) moves it, so a test asserts durations it set instead of reading the wall."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.now += seconds


def timed_forwards(monkeypatch, cost: Callable[[Sequence[Row]], float]) -> FakeTime:
    """Injected time in which a model forward of ``rows`` takes ``cost(rows)`` seconds and
    nothing else takes any: step durations become counts a test can give by hand."""
    fake = FakeTime()
    monkeypatch.setattr(time, "perf_counter", fake.perf_counter)
    forward = ModelRunner.forward

    def timed(self, rows, carried=None):
        fake.sleep(cost(rows))
        return forward(self, rows, carried)

    monkeypatch.setattr(ModelRunner, "forward", timed)
    return fake


def build_with_policy(
    model: LoadedModel,
    allocator: Callable[..., BlockAllocator],
    policy: Callable[..., Scheduler] = FCFSScheduler,
    *,
    block_size: int,
    num_blocks: int,
    engine_options: Mapping[str, Any] = MappingProxyType({}),
    **policy_options: Any,
) -> LLMEngine:
    """``build_engine`` over ``num_blocks`` blocks of ``block_size``, its scheduler ``policy``
    with ``policy_options``; ``engine_options`` are build_engine's others (pipeline, ...)."""
    return build_engine(
        model,
        allocator,
        partial(policy, **policy_options),
        block_size=block_size,
        num_blocks=num_blocks,
        **engine_options,
    )


def assert_all_free(engine: LLMEngine) -> None:
    """Every block of the engine's arena is free or evictable, its invariants holding."""
    engine.allocator.check()
    stats = engine.allocator.stats()
    assert stats.used_blocks == 0
    assert stats.free_blocks + stats.cached_blocks == stats.num_blocks


def compose_config(overrides: Sequence[str] = (), *, tiny: bool = True) -> DictConfig:
    """conf/config.yaml composed with ``overrides`` (after the ``TINY`` ones when ``tiny``)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=[*(TINY if tiny else ()), *overrides])


def allocator_classes() -> list[type[BlockAllocator]]:
    """Every class conf/allocator/ targets, once each, the default config's first."""
    default = compose_config(tiny=False).allocator._target_
    targets = {OmegaConf.load(p)._target_ for p in ALLOCATOR_CONF.glob("*.yaml")}
    return [get_class(t) for t in sorted(targets, key=lambda t: (t != default, t))]


# The allocators the engine and scheduler tests run every case over: one per class (conf's
# contiguous_* options are ContiguousAllocator's reservations). Tests needing one take [0].
ALLOCATORS = allocator_classes()


def allocator_options(max_len: int) -> dict[str, Callable[..., BlockAllocator]]:
    """Each conf/allocator/ option, instantiated: ``name -> partial(num_blocks, block_size)``,
    contiguous_max_len reserving ``max_len`` slots. Not contiguous_oracle and contiguous_pow2:
    they reserve from the scheduler's ``expect`` hint and, without one, as contiguous does."""
    names = [p.stem for p in ALLOCATOR_CONF.glob("*.yaml")]
    return {
        name: instantiate(
            compose_config([f"allocator={name}", f"engine.max_model_len={max_len}"]).allocator
        )
        for name in sorted(names)
        if name not in ("contiguous_oracle", "contiguous_pow2")
    }


def run_kvbench(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m harness.cli.run *args`` in a subprocess (a fresh Hydra, as from a shell), on
    this checkout's code (not only the installed one: a git worktree tests its own)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli.run", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": path},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"kvbench {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_alone(engine: LLMEngine, request_id: str, prompt, params, **kv) -> list[int]:
    """One request to completion (others the engine holds run too); its output tokens."""
    engine.add_request(request_id, prompt, params, **kv)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final.outputs[0].token_ids
