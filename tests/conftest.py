"""Shared test set-up: MKL before MLX (on one thread), and Hydra's compose API over conf/ at
tiny sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

# Tests time nothing, and a two-thread MKL pool stalls on a machine with other load (its
# threads wait at a barrier for one descheduled): harness/platform/blas.py "Threads". Set
# before MKL loads; inherited by every subprocess a test starts; a user's value wins.
os.environ.setdefault("MKL_NUM_THREADS", "1")

import harness  # noqa: F401  (switches MLX to MKL before a test module imports mlx)
from allocators.base import BlockAllocator
from harness.cli.run import CONFIG_DIR
from harness.engine import LLMEngine, build_engine
from harness.platform.models import LoadedModel, random_model
from schedulers.base import Scheduler
from schedulers.fcfs import FCFSScheduler

ROOT = Path(__file__).resolve().parent.parent  # this checkout
ALLOCATOR_CONF = Path(CONFIG_DIR) / "allocator"

# Seconds-long experiments: six short requests, a small arena, no progress bar.
TINY = ("trace=smoke", "engine.num_blocks=64", "progress=false")


@pytest.fixture(scope="session")
def model() -> LoadedModel:
    """The tiny random Llama most engine tests run (built once per session)."""
    return random_model("llama", "tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A per-session cache folder for converted models (never the user's own)."""
    return str(tmp_path_factory.mktemp("kvbench-cache"))


@pytest.fixture(scope="session")
def smollm2(smollm2_cache: str) -> LoadedModel:
    """SmolLM2-135M-Instruct (harness/platform/smollm2.py), converted once per session: a real
    trained model, for what random weights cannot show."""
    from harness.platform.smollm2 import load_smollm2

    return load_smollm2(cache=smollm2_cache)


def random_prompts(lengths: Iterable[int], seed: int) -> list[list[int]]:
    """One prompt of each length, of random token ids from 1 to 1023, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1024, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def prompts(request: pytest.FixtureRequest) -> list[list[int]]:
    """The requesting module's prompts: ``random_prompts(PROMPT_LENS, PROMPT_SEED)``, its own
    two constants, so that each module keeps the prompts its expectations were computed on."""
    return random_prompts(request.module.PROMPT_LENS, request.module.PROMPT_SEED)


@pytest.fixture(scope="module")
def reference(
    request: pytest.FixtureRequest, model: LoadedModel, prompts: list[list[int]]
) -> list[list[int]]:
    """mlx_lm's greedy tokens for each of the module's prompts, its ``MAX_TOKENS`` of them."""
    # Not at the top: reference imports mlx, which must come after harness's BLAS switch.
    from reference import mlx_lm_tokens

    return [mlx_lm_tokens(model, p, request.module.MAX_TOKENS) for p in prompts]


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


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """``compose_cfg(["allocator=radix"])``: a composed config at tiny sizes."""
    return compose_config


def _allocator_classes() -> list[type[BlockAllocator]]:
    """Every class conf/allocator/ targets, once each, the default config's first."""
    default = compose_config(tiny=False).allocator._target_
    targets = {OmegaConf.load(p)._target_ for p in ALLOCATOR_CONF.glob("*.yaml")}
    return [get_class(t) for t in sorted(targets, key=lambda t: (t != default, t))]


# The allocators the engine and scheduler tests run every case over: one per class (conf's
# contiguous_* options are ContiguousAllocator's reservations). Tests needing one take [0].
ALLOCATORS = _allocator_classes()


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


@pytest.fixture
def kvbench(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run kvbench at tiny sizes with results under ``tmp_path`` (its working directory)."""

    def call(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        # Hydra's flags (-m) must precede the overrides.
        flags = [a for a in args if a.startswith("-")]
        overrides = [a for a in args if not a.startswith("-")]
        return run_kvbench(*flags, *TINY, *overrides, cwd=tmp_path, check=check)

    return call
