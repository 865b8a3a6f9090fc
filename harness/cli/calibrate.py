"""kvbench-calibrate: measure step costs on a designed grid and fit a cost profile.

    kvbench-calibrate [model=...] [allocator=...] [engine.block_size=...] [speculative=draft]

The real engine (virtual clock, recorder on) runs cells of requests that all arrive at once
(decode cells: ``batches`` x ``contexts``, each sequence decoding ``decode_tokens``, and
``spread`` cells per batch of prompts of log-uniform lengths over the contexts' range, whose
decodes run at unequal contexts, in one padded batch or in several, as a replay's do; their
prefills are the prefill steps) and cells of staggered mixed-length requests under chunked
prefill (``chunks``: prefill chunks over prior context beside running decodes, the mixed
steps). With ``speculative=draft`` the decode cells speculate (verification steps). A cell
runs ``repeats`` times; where the schedule repeats, each step's duration is the median over
the runs. Block copies and swaps are timed apart, per block. Every step's counts and
measured duration go into the fit (harness/costmodel/fit.py); the profile, the steps it was
fitted on and the residuals land in the run's folder (``results/calibrate/runs/<id>/``).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from harness.analysis.metrics import acceptance_rate, steps_frame
from harness.cli.config import validate
from harness.cli.replay import replay
from harness.cli.run import CONFIG_DIR
from harness.cli.run import build_component as _build
from harness.costmodel import profile as profiles
from harness.costmodel.fit import fit_kinds
from harness.costmodel.work import PRICED, StepWork
from harness.engine import LLMEngine
from harness.platform import machine
from harness.workload.traces import Trace, TraceRequest

PROFILE_FILE = "profile.json"
STEPS_FILE = "calibration_steps.parquet"


@dataclass(frozen=True)
class Grid:
    """The cells kvbench-calibrate runs (conf/calibrate.yaml documents each knob)."""

    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    contexts: list[int] = field(default_factory=lambda: [16, 128, 512, 1024])
    decode_tokens: int = 8
    spread: int = 2  # decode cells per batch > 1 at unequal contexts
    chunks: list[int] = field(default_factory=lambda: [64, 256])
    mixed_requests: int = 24
    move_blocks: list[int] = field(default_factory=lambda: [1, 8, 32])
    repeats: int = 3  # runs of each cell (median step) and timings of each move size
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batches", "contexts", "chunks", "move_blocks"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"calibrate.{name}={values!r} is invalid: a list of ints >= 1")
        for name in ("decode_tokens", "mixed_requests", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"calibrate.{name} must be >= 1")
        if self.spread < 0:
            raise ValueError("calibrate.spread must be >= 0")

    def decode_cells(self, vocab: int, max_len: int) -> list[Trace]:
        """``b`` prompts of ``c`` tokens at once, each decoding ``decode_tokens``; then, per
        ``b`` > 1, ``spread`` cells of ``b`` prompts of log-uniform lengths over the
        contexts' range. A batch at one context always runs as one padded batch at that
        context; only unequal contexts tell the fit what more padded batches (row groups),
        and reading a longer context for a shorter row, cost."""
        rng = np.random.default_rng([self.seed, 1])
        longest = max_len - self.decode_tokens
        cells = []
        for c in self.contexts:
            c = min(c, longest)
            for b in self.batches:
                cells.append(
                    _trace(
                        f"decode-b{b}-c{c}",
                        [(0.0, rng.integers(0, vocab, c), self.decode_tokens) for _ in range(b)],
                    )
                )
        low, high = np.log(min(self.contexts)), np.log(min(max(self.contexts), longest))
        for i in range(self.spread):
            for b in (b for b in self.batches if b > 1):
                lengths = np.exp(rng.uniform(low, high, b)).astype(int)
                cells.append(
                    _trace(
                        f"decode-b{b}-spread{i}",
                        [(0.0, rng.integers(0, vocab, c), self.decode_tokens) for c in lengths],
                    )
                )
        return cells

    def mixed_cell(self, vocab: int, max_len: int) -> Trace:
        """Staggered arrivals of log-uniform prompt and output lengths, so prefill chunks
        meet running decodes at many contexts."""
        rng = np.random.default_rng([self.seed, 2])
        n = self.mixed_requests
        prompts = np.exp(rng.uniform(np.log(16), np.log(max_len // 2), n)).astype(int)
        outputs = np.exp(rng.uniform(np.log(8), np.log(128), n)).astype(int)
        arrivals = np.cumsum(rng.exponential(0.05, n))
        return _trace(
            "mixed",
            [
                (float(t), rng.integers(0, vocab, p), int(o))
                for t, p, o in zip(arrivals, prompts, outputs, strict=True)
            ],
        )


def _trace(name: str, requests: list[tuple[float, np.ndarray, int]]) -> Trace:
    return Trace(
        [
            TraceRequest(f"{name}-{i}", t, tuple(int(x) for x in p), o)
            for i, (t, p, o) in enumerate(requests)
        ],
        metadata={"cell": name},
    )


def calibrate(cfg: DictConfig, out: Path) -> dict[str, Any]:
    """Run the grid, fit, write ``profile.json`` and the steps into ``out``; return the
    profile."""
    grid: Grid = _build(cfg.calibrate)
    plain = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "calibrate"])
    validate(plain)
    model = _build(cfg.model)
    speculative = _build(cfg.speculative) if cfg.get("speculative") is not None else None
    if cfg.engine.get("clock", "virtual") != "virtual":
        raise ValueError("kvbench-calibrate measures on engine.clock=virtual; drop engine.clock")
    if speculative is not None and speculative.name != "draft":
        raise ValueError(
            f"kvbench-calibrate prices verification steps for the model clock, which runs "
            f"speculative=draft only, not speculative={speculative.name}: use speculative=draft"
        )
    allocator, engine_of = _build(cfg.allocator), _build(cfg.engine)
    scheduler = _build(cfg.scheduler)
    chunked = OmegaConf.load(Path(CONFIG_DIR) / "scheduler" / "chunked_prefill.yaml")

    def build(policy=scheduler, spec=speculative) -> LLMEngine:
        return engine_of(model, allocator, policy, speculative=spec)

    machine.set_mlx_cache_limit(cfg.mlx_cache_limit)
    max_len = build().scheduler.max_model_len
    decode = grid.decode_cells(model.vocab_size, max_len)
    cells = [(c, scheduler, None) for c in decode]
    if speculative is not None:  # verification steps too, over the same cells
        cells += [(c, scheduler, speculative) for c in decode]
    for chunk in grid.chunks:
        with open_dict(chunked):
            chunked.max_chunk = chunk
            chunked.max_num_batched_tokens = max(chunk, 64)
        cells.append((grid.mixed_cell(model.vocab_size, max_len), _build(chunked), None))
    rows = []
    _run_cell(build, *cells[0])  # warm-up: first-time costs are not a step's
    for trace, policy, spec in cells:
        cell = trace.metadata["cell"] + ("-spec" if spec else "")
        print(f"  cell {cell}: {len(trace)} requests", file=sys.stderr)
        rows += [r | {"cell": cell} for r in _run_cell(build, trace, policy, spec, grid.repeats)]
    engine = build(spec=None)
    moves = time_moves(engine, grid)
    steps = steps_frame([{k: v for k, v in r.items() if k != "cell"} for r in rows])
    steps["cell"] = [r["cell"] for r in rows]
    measured = [(StepWork.from_row(r), r["duration"]) for r in steps.to_dict("records")]
    alpha = acceptance_rate(steps)
    data = {
        "format": profiles.FORMAT,
        "version": profiles.VERSION,
        "kind": "measured",
        "model": (shape := model.shape()) | {"fingerprint": profiles.fingerprint(shape)},
        "block_size": engine.allocator.block_size,
        "machine": machine.info(),
        "features": list(PRICED),
        "kinds": fit_kinds(measured, moves),
        "moves": moves,
        "acceptance_rate": None if np.isnan(alpha) else alpha,
        "calibration": {
            "cells": len(cells),
            "steps": len(steps),
            "allocator": cfg.allocator._target_,
            "scheduler": cfg.scheduler._target_,
        },
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    out.mkdir(parents=True, exist_ok=True)
    steps.to_parquet(out / STEPS_FILE)
    profiles.save(data, out / PROFILE_FILE)
    return data


def _run_cell(build, trace: Trace, policy, spec, repeats: int = 1) -> list[dict]:
    """The cell's step rows, each step's duration the median over ``repeats`` runs when the
    schedule repeats (every request at t=0: the same steps each run), so a step slowed by
    another process does not set its cost; a cell whose schedule moved (staggered arrivals)
    keeps every run's steps."""
    runs = []
    for _ in range(repeats):
        engine = build(policy, spec)
        replay(engine, trace, progress=False)
        runs.append(engine.recorder.steps)
    same = all(len(r) == len(runs[0]) for r in runs) and all(
        StepWork.from_row(a) == StepWork.from_row(b)
        for r in runs[1:]
        for a, b in zip(runs[0], r, strict=True)
    )
    if not same:
        return [step for r in runs for step in r]
    return [
        step | {"duration": statistics.median(r[i]["duration"] for r in runs)}
        for i, step in enumerate(runs[0])
    ]


def time_moves(engine: LLMEngine, grid: Grid) -> dict[str, float]:
    """Seconds per block of a block copy and of a swap (out, then in), from the median of
    ``repeats`` timings at the largest of ``move_blocks`` (the smaller sizes are printed)."""
    runner = engine.runner
    per_block = {}
    for n in sorted(grid.move_blocks):
        blocks = list(range(n))
        copies, swaps = [], []
        for _ in range(grid.repeats):
            t0 = time.perf_counter()
            runner.copy_blocks([(b, b + n) for b in blocks])
            runner.wait([])
            t1 = time.perf_counter()
            host = runner.swap_out(blocks)
            runner.swap_in(host, blocks)
            runner.wait([])
            t2 = time.perf_counter()
            copies.append(t1 - t0)
            swaps.append((t2 - t1) / 2)  # out and in: each block moves twice
        per_block[n] = (statistics.median(copies) / n, statistics.median(swaps) / n)
        print(
            f"  moves of {n} blocks: copy {per_block[n][0] * 1e6:.1f} us/block, "
            f"swap {per_block[n][1] * 1e6:.1f} us/block",
            file=sys.stderr,
        )
    copy, swap = per_block[max(per_block)]
    return {"block_copies": copy, "swap_blocks": swap}


def format_residuals(data: dict[str, Any]) -> str:
    """The fit's residuals per step kind, one line each."""
    lines = [f"{'kind':<8} {'steps':>6} {'median |err|':>13} {'p90 |err|':>10} {'total':>8}"]
    for kind, fit in data["kinds"].items():
        r = fit["residuals"]
        lines.append(
            f"{kind:<8} {r['steps']:>6} {r['median_abs']:>13.1%} {r['p90_abs']:>10.1%} "
            f"{r['total']:>+8.1%}"
        )
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="calibrate")
def main(cfg: DictConfig) -> None:
    """The ``kvbench-calibrate`` console script."""
    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        data = calibrate(cfg, out)
    except (ValueError, OSError) as e:
        print(f"kvbench-calibrate: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(format_residuals(data))
    print(f"profile: {out / PROFILE_FILE}")


if __name__ == "__main__":
    main()
