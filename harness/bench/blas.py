"""MLX CPU GEMM throughput on the reference BLAS vs MKL.

``python -m harness.bench blas [--trials 5]``

Each configuration runs in its own subprocess, because the BLAS MLX binds to is fixed
when ``mlx.core`` is imported (see harness.platform.blas): ``KVBENCH_BLAS=reference`` vs the
default (MKL when installed), plus numpy as a reference point. The subprocesses run one
after another so their BLAS thread pools never compete for the cores. Each size gets
one warm-up product, then the median of ``--trials`` timed ones. The row labels come
from ``harness.platform.blas.info()`` in each worker, i.e. what MLX actually bound to.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from harness.bench.support.timing import median_seconds

# (M, K, N): a prefill-like MLP projection, a square reference, and a batch-32 decode step.
SIZES: list[tuple[int, int, int]] = [(512, 1024, 2816), (1024, 1024, 1024), (32, 1024, 2816)]


def _worker_mlx(trials: int) -> dict[str, Any]:
    """GFLOP/s of fp32 MLX GEMM on the CPU, with the BLAS this process was configured for."""
    # No ordering to get right here: this module lives in the harness package, so
    # harness/__init__.py has already configured the BLAS before this import of mlx.
    import mlx.core as mx

    from harness.platform import blas

    mx.set_default_device(mx.cpu)  # the CPU BLAS is what is measured, also on macOS
    mx.random.seed(0)
    gflops = {}
    for m, k, n in SIZES:
        a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
        mx.eval(a, b)
        seconds = median_seconds(lambda a=a, b=b: mx.eval(a @ b), trials)
        gflops[f"{m}x{k}x{n}"] = 2 * m * k * n / seconds / 1e9
    return {"info": blas.info(), "gflops": gflops}


def _worker_numpy(trials: int) -> dict[str, Any]:
    """GFLOP/s of fp32 numpy GEMM (numpy's own BLAS, OpenBLAS in the PyPI wheels)."""
    import numpy as np

    try:
        name = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    except (TypeError, KeyError):  # numpy < 1.26 has no dict mode
        name = "numpy's BLAS"
    rng = np.random.default_rng(0)
    gflops = {}
    for m, k, n in SIZES:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        seconds = median_seconds(lambda a=a, b=b: a @ b, trials)
        gflops[f"{m}x{k}x{n}"] = 2 * m * k * n / seconds / 1e9
    return {"info": {"blas": name}, "gflops": gflops}


def _run_worker(kind: str, trials: int, blas_env: str | None) -> dict[str, Any]:
    """Run one worker in a fresh interpreter and return its JSON result."""
    env = dict(os.environ)
    env.pop("KVBENCH_BLAS", None)
    if blas_env is not None:
        env["KVBENCH_BLAS"] = blas_env
    cmd = [sys.executable, "-m", "harness.bench.blas", "--worker", kind, "--trials", str(trials)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    """Print a GFLOP/s table: MLX on reference BLAS, MLX on MKL, their ratio, numpy."""
    parser = argparse.ArgumentParser(prog="python -m harness.bench blas", description=__doc__)
    parser.add_argument("--trials", type=int, default=5, help="timed products per size")
    parser.add_argument("--worker", choices=("mlx", "numpy"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker == "mlx":
        print(json.dumps(_worker_mlx(args.trials)))
        return
    if args.worker == "numpy":
        print(json.dumps(_worker_numpy(args.trials)))
        return

    ref = _run_worker("mlx", args.trials, "reference")
    fast = _run_worker("mlx", args.trials, None)
    npy = _run_worker("numpy", args.trials, None)
    cols = [f"{m}x{k}x{n}" for m, k, n in SIZES]

    def row(label: str, values: list[str]) -> str:
        return f"{label:<28}" + "".join(f"{v:>16}" for v in values)

    print(f"fp32 GEMM GFLOP/s (M x K x N), median of {args.trials} after 1 warm-up")
    print(row("", cols))
    for label, res in (("mlx, KVBENCH_BLAS=reference", ref), ("mlx, default", fast)):
        values = [f"{res['gflops'][c]:.1f}" for c in cols]
        print(row(label, values) + f"  [{res['info']['blas']}]")
    ratios = [fast["gflops"][c] / ref["gflops"][c] for c in cols]
    print(row("ratio default / reference", [f"{r:.1f}x" for r in ratios]))
    print(
        row("numpy (reference row)", [f"{npy['gflops'][c]:.1f}" for c in cols])
        + f"  [{npy['info']['blas']}]"
    )
    for label, res in (("reference", ref), ("default", fast)):
        print(f"{label}: {res['info']['evidence']}; threads={res['info']['threads']}")


if __name__ == "__main__":
    main(sys.argv[1:])
