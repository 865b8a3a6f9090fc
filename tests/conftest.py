"""Shared fixtures: MKL before MLX (on one thread), the session's models, the modules'
prompts and mlx_lm's tokens for them, and kvbench at tiny sizes (helpers: support.py)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import DictConfig

# Tests time nothing, and a two-thread MKL pool stalls on a machine with other load (its
# threads wait at a barrier for one descheduled): harness/platform/blas.py "Threads". Set
# before MKL loads; inherited by every subprocess a test starts; a user's value wins.
os.environ.setdefault("MKL_NUM_THREADS", "1")

from support import TINY, compose_config, random_prompts, run_kvbench  # noqa: E402

import harness  # noqa: F401,E402  (switches MLX to MKL before a test module imports mlx)
from harness.platform.models import LoadedModel, random_model  # noqa: E402


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


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """``compose_cfg(["allocator=radix"])``: a composed config at tiny sizes."""
    return compose_config


@pytest.fixture
def kvbench(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run kvbench at tiny sizes with results under ``tmp_path`` (its working directory)."""

    def call(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        # Hydra's flags (-m) must precede the overrides.
        flags = [a for a in args if a.startswith("-")]
        overrides = [a for a in args if not a.startswith("-")]
        return run_kvbench(*flags, *TINY, *overrides, cwd=tmp_path, check=check)

    return call
