"""harness.platform.blas: MLX's CPU GEMM on MKL is correct, and info() reports what MLX bound to.

The BLAS choice is fixed when mlx.core is imported, and pytest may have imported mlx
(through another test module) before harness, so every check of a configuration runs
in a fresh interpreter with a controlled import order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from harness.platform import blas

MKL_PATH = blas.find_mkl()
needs_mkl = pytest.mark.skipif(
    MKL_PATH is None,
    reason=f"libmkl_rt not found in {sys.prefix}/lib (Linux x86_64 only): "
    "pip install 'kvbench[fast-cpu]'",
)
needs_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="MLX links Accelerate on macOS; no switch"
)

# Prints info() and the worst relative error of MLX GEMM vs numpy (float64) over shapes
# covering a decode step, a non-square product and the transposed-operand paths.
GEMM_CHECK = textwrap.dedent(
    """
    import json
    import harness
    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    worst = 0.0
    for m, k, n in [(32, 256, 704), (67, 129, 33), (128, 128, 128)]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        want = a.astype(np.float64) @ b.astype(np.float64)
        for got in (
            mx.array(a) @ mx.array(b),
            mx.array(np.ascontiguousarray(a.T)).T @ mx.array(b),
            mx.array(a) @ mx.array(np.ascontiguousarray(b.T)).T,
        ):
            err = np.abs(np.array(got) - want).max() / np.abs(want).max()
            worst = max(worst, float(err))
    print(json.dumps({"info": harness.platform.blas.info(), "worst": worst}))
    """
)


def _run(code: str, blas_env: str | None) -> dict:
    """Run ``code`` in a fresh interpreter with KVBENCH_BLAS set (or unset); parse its JSON."""
    env = dict(os.environ)
    env.pop(blas.ENV_VAR, None)
    if blas_env is not None:
        env[blas.ENV_VAR] = blas_env
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_mkl
def test_mkl_is_default_and_gemm_matches_numpy() -> None:
    out = _run(GEMM_CHECK, None)
    assert out["info"]["blas"] == "mkl", out["info"]
    assert os.path.realpath(out["info"]["library"]) == os.path.realpath(MKL_PATH)
    assert out["info"]["threads"] >= 1
    # fp32 accumulation over k <= 256 terms: a few ulp times sqrt(k), far below 1e-5.
    assert out["worst"] < 1e-5


@needs_linux
def test_reference_is_reported_and_correct() -> None:
    out = _run(GEMM_CHECK, "reference")
    assert out["info"]["blas"] == "reference", out["info"]
    assert "mlx" in out["info"]["library"]
    assert out["worst"] < 1e-5


@needs_mkl
def test_mlx_imported_first_warns_once_and_reports_reference() -> None:
    code = textwrap.dedent(
        """
        import json, warnings
        import mlx.core
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import harness
            harness.platform.blas.configure()
            harness.platform.blas.configure()
        print(json.dumps({"info": harness.platform.blas.info(),
                          "warnings": [str(w.message) for w in caught]}))
        """
    )
    out = _run(code, None)
    assert len(out["warnings"]) == 1 and "before" in out["warnings"][0]
    assert out["info"]["blas"] == "reference"
    assert "too late" in out["info"]["note"]


@pytest.mark.parametrize("value", ["openblas", "MKL2", "accelerate"])
def test_bad_value_names_variable_and_choices(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(blas.ENV_VAR, value)
    with pytest.raises(ValueError, match=blas.ENV_VAR) as err:
        blas.configure()
    assert "mkl" in str(err.value) and "reference" in str(err.value)


def test_configure_is_idempotent() -> None:
    # harness/__init__ already called it in this process; calling again is a no-op.
    before = blas.loaded_mkl()
    blas.configure()
    blas.configure()
    assert blas.loaded_mkl() is before
