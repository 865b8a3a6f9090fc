"""A run's files and how to read many of them back.

Every run folder (Hydra makes it: ``results/<experiment>/runs/<time>_<hex>`` or
``results/<experiment>/multiruns/<sweep_id>/<overrides>``) holds ``.hydra/`` (the resolved
config and the overrides), ``requests.parquet``, ``steps.parquet``, ``vllm_bench.json`` (the
summary under ``vllm bench serve``'s names, harness.analysis.vllm_bench) and ``summary.json``.
Files are written to a temporary name and renamed (``os.replace``), so a reader never sees
a half-written file, and ``summary.json`` is written last: a folder with it is a finished run.
A run that fails writes ``failed.txt`` (the error) instead.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from harness.analysis.metrics import MetricsError, requests_frame, steps_frame
from harness.analysis.vllm_bench import vllm_summary

SUMMARY_FILE = "summary.json"
REQUESTS_FILE = "requests.parquet"
STEPS_FILE = "steps.parquet"
FAILED_FILE = "failed.txt"
VLLM_BENCH_FILE = "vllm_bench.json"
JOBS_FILE = "jobs.json"  # a sweep folder's: the jobs its last launch planned


class ResultFileError(ValueError):
    """A run's file is missing or cannot be read (not JSON, not a table, damaged bytes): the
    message names the file and what to do about it."""


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; results are read by others, like .hydra/
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_tables(run_dir: str | os.PathLike, requests: pd.DataFrame, steps: pd.DataFrame) -> None:
    """Write the per-request and per-step tables atomically."""
    run_dir = Path(run_dir)
    _atomic(run_dir / REQUESTS_FILE, lambda tmp: _write_parquet(requests, tmp))
    _atomic(run_dir / STEPS_FILE, lambda tmp: _write_parquet(steps, tmp))


_ROW_GROUP = 1 << 13  # rows converted to Arrow at a time


def _write_parquet(frame: pd.DataFrame, path: str) -> None:
    """``frame.to_parquet(path, index=False)``, converted to Arrow ``_ROW_GROUP`` rows at a
    time (one row group each), Arrow's unused memory handed back after each: a 100k-request
    run's tables are never in memory twice over, and what the write took is not kept under
    the summary's arrays."""
    schema = _schema(frame)
    pool = pa.default_memory_pool()
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, max(len(frame), 1), _ROW_GROUP):
            part = frame.iloc[start : start + _ROW_GROUP]
            writer.write_table(pa.Table.from_pandas(part, schema=schema, preserve_index=False))
            del part
            pool.release_unused()


def _schema(frame: pd.DataFrame) -> pa.Schema:
    """The whole frame's Arrow schema, read from a few of its rows: the first, and the first
    non-missing value of each object column (a column's values are of one kind, checked by
    ``requests_frame``/``steps_frame``), so that the types are those of every row without
    converting a whole object column, such as ``token_times``, to infer them."""
    rows = {0} if len(frame) else set()
    for name in frame.columns:
        column = frame[name]
        if column.dtype == object:
            present = np.flatnonzero(column.notna().to_numpy())
            rows.update(present[:1].tolist())
    return pa.Schema.from_pandas(frame.iloc[sorted(rows)], preserve_index=False)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    # NaN as null and infinity as "inf" (vLLM's offline request_rate): any JSON reader takes it
    text = json.dumps(_plain(obj), indent=2, allow_nan=False) + "\n"
    _atomic(path, lambda tmp: Path(tmp).write_text(text))


def write_vllm_bench(run_dir: str | os.PathLike, summary: dict[str, Any]) -> None:
    """Write ``vllm_bench.json``: ``summary`` under ``vllm bench serve``'s result keys and
    units (``harness.analysis.vllm_bench.vllm_summary``). Written before summary.json."""
    _write_json(Path(run_dir) / VLLM_BENCH_FILE, vllm_summary(summary))


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> None:
    """Write ``summary.json`` atomically (NaN as null); a failure mark left by an earlier
    attempt in the same folder goes."""
    _write_json(Path(run_dir) / SUMMARY_FILE, summary)
    (Path(run_dir) / FAILED_FILE).unlink(missing_ok=True)


def write_failure(run_dir: str | os.PathLike, error: BaseException) -> None:
    """Mark a run folder as failed: ``failed.txt`` holds the error; no summary.json."""
    text = f"{type(error).__name__}: {error}\n"
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    _atomic(Path(run_dir) / FAILED_FILE, lambda tmp: Path(tmp).write_text(text))


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run's summary, or None if it has not finished (no summary.json). Raises
    ``ResultFileError`` naming the file when it is not a JSON object."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultFileError(f"{path} is not JSON ({e}); {_RERUN}") from None
    if not isinstance(summary, dict):
        raise ResultFileError(
            f"{path} holds a JSON {type(summary).__name__}, not an object of figures; {_RERUN}"
        )
    return {k: math.nan if v is None else v for k, v in summary.items()}


# what to do about a damaged file: the run is lost, its folder must go for a re-run to repeat it
_RERUN = "delete the run's folder and run it again (a sweep re-run with its sweep_id repeats it)"


def load_tables(run_dir: str | os.PathLike) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One run's (requests, steps) tables, validated against the metrics schemas. Raises
    ``ResultFileError`` naming a table that is missing or unreadable, ``MetricsError`` (with
    the file) for one that does not match its schema."""
    run_dir = Path(run_dir)
    requests = _read_table(run_dir / REQUESTS_FILE, requests_frame)
    steps = _read_table(run_dir / STEPS_FILE, steps_frame)
    return requests, steps


def _read_table(path: Path, schema: Callable[[pd.DataFrame], pd.DataFrame]) -> pd.DataFrame:
    if not path.exists():
        raise ResultFileError(f"{path} is missing; {_RERUN}")
    try:
        frame = pd.read_parquet(path)
    except (OSError, pa.ArrowException) as e:  # damaged bytes: pyarrow names no file
        raise ResultFileError(f"{path} is damaged ({e}); {_RERUN}") from None
    try:
        return schema(frame)
    except MetricsError as e:
        raise MetricsError(f"{path}: {e}") from None


# What a run computed, step by step: the same totals mean the policies decided the same
# steps, batches and tokens, whatever the clock made of them.
WORK_COLUMNS = (
    "prefill_tokens",
    "decode_tokens",
    "preempted",
    "block_copies",
    "row_groups",
    "query_tokens_padded",
    "kv_slots_read",
)


def work_counts(run_dir: str | os.PathLike) -> tuple[int, ...] | None:
    """The run's steps, then the totals of its steps table's ``WORK_COLUMNS``; None when
    the table cannot be read (the run's other figures do not need it)."""
    try:
        steps = pd.read_parquet(Path(run_dir) / STEPS_FILE, columns=list(WORK_COLUMNS))
    except (OSError, ValueError, pa.ArrowException):
        return None
    return (len(steps), *(int(steps[c].sum()) for c in WORK_COLUMNS))


def override_items(run_dir: str | os.PathLike) -> list[str]:
    """The run's command-line overrides as written (``["allocator=radix", "trace.rate=2"]``),
    from ``.hydra/overrides.yaml``."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if path.exists():
        return [str(item) for item in yaml.safe_load(path.read_text()) or []]
    # a run made by harness.cli.run.run() without Hydra: the summary keeps them
    return list((read_summary(run_dir) or {}).get("overrides", []))


def override_key(item: str) -> str:
    """The config key an override sets: ``+engine.seed=3`` -> ``engine.seed``."""
    return item.partition("=")[0].lstrip("+~")


def overrides(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's command-line overrides as {key: value}, values parsed as YAML."""
    out = {}
    for item in override_items(run_dir):
        value = item.partition("=")[2]
        out[override_key(item)] = yaml.safe_load(value) if value else None
    return out


def _hidden(run_dir: Path, root: Path) -> bool:
    """A folder under a dot-named one (a sweep job's ``.partial/`` folder, being written)."""
    return any(part.startswith(".") for part in run_dir.relative_to(root).parts)


def load(path: str | os.PathLike) -> pd.DataFrame:
    """Every finished run under ``path``: one row per run, sorted by folder.

    Columns: ``run_dir``; the config group options chosen (``model``, ``allocator``, ...);
    the overrides (e.g. ``trace.rate``); then the summary's scalar figures. Nested records
    (``machine``, ``trace_metadata``) stay in summary.json; ``load_tables(row.run_dir)``
    gives a run's request and step tables. A job still being written (under a dot-named
    folder) is not a finished run; a damaged summary.json raises ``ResultFileError``.
    """
    rows = []
    for summary_path in sorted(Path(path).rglob(SUMMARY_FILE)):
        run_dir = summary_path.parent
        if _hidden(run_dir, Path(path)):
            continue
        summary = read_summary(run_dir) or {}
        row: dict[str, Any] = {"run_dir": str(run_dir)}
        row.update(summary.get("choices", {}))
        row.update(overrides(run_dir))
        row.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
        rows.append(row)
    return pd.DataFrame(rows)


def write_jobs(sweep_dir: str | os.PathLike, jobs: list[list[str]], ignore: list[str]) -> None:
    """Record in ``sweep_dir`` the jobs a sweep's launch planned (each its overrides) and the
    override keys that do not name a job's folder (``sweep_id``, ``progress``, ...)."""
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    _write_json(Path(sweep_dir) / JOBS_FILE, {"jobs": jobs, "ignore": ignore})


def unfinished(path: str | os.PathLike) -> list[tuple[Path, str]]:
    """Every run folder under ``path`` without summary.json (a run folder holds Hydra's
    ``.hydra/`` or a ``failed.txt``), sorted, each with why: the error its failed.txt names,
    else that its process was stopped before writing (killed) or is still running; then each
    job a sweep under ``path`` planned (its ``JOBS_FILE``) that has no folder at all, as
    the folder it would have had: not started."""
    root = Path(path)
    folders = {p.parent for p in root.rglob(".hydra")} | {p.parent for p in root.rglob(FAILED_FILE)}
    out = []
    for run_dir in sorted(folders):
        if (run_dir / SUMMARY_FILE).exists():
            continue
        failed = run_dir / FAILED_FILE
        if failed.exists():
            first = (failed.read_text().strip().splitlines() or ["(no message)"])[0]
            out.append((run_dir, f"failed: {first}"))
        else:
            out.append((run_dir, "no result: still running, or its process was killed"))
    for plan_path in sorted(root.rglob(JOBS_FILE)):
        try:
            plan = json.loads(plan_path.read_text())
            jobs = [[str(item) for item in job] for job in plan["jobs"]]
            ignore = {str(key) for key in plan["ignore"]}
        except (ValueError, KeyError, TypeError) as e:
            raise ResultFileError(f"{plan_path} is not a sweep's plan ({e}); delete it") from None

        def key(items: list[str], ignore: set[str] = ignore) -> frozenset[str]:
            return frozenset(i for i in items if override_key(i) not in ignore)

        sweep = plan_path.parent
        started = {key(override_items(d)) for d in folders if sweep in d.parents}
        for job in jobs:
            if key(job) not in started:
                # the folder Hydra would have made: the overrides sorted, as override_dirname
                named = ",".join(sorted(i for i in job if override_key(i) not in ignore))
                out.append((sweep / named, "not started"))
    return out


def _plain(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
