"""Public LLM-serving traces as kvbench traces (Hydra ``_target_``s of ``conf/trace/``).

    azure      Azure LLM inference traces 2023 and 2024 (github.com/Azure/AzurePublicDataset,
               AzureLLMInferenceDataset2023/2024): CSV ``TIMESTAMP,ContextTokens,
               GeneratedTokens``; TIMESTAMP a date and time (``2023-11-16 18:15:46.6805900``)
    burstgpt   BurstGPT (github.com/HPMLL/BurstGPT): CSV ``Timestamp,Model,Request tokens,
               Response tokens,Total tokens,Log Type``; Timestamp in seconds; filtered by
               ``model`` (``ChatGPT``, ``GPT-4``) and ``log_type`` (``Conversation log``,
               ``API log``)
    mooncake   Mooncake's FAST'25 traces (github.com/kvcache-ai/Mooncake): JSONL
               ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``, one hash id
               per ``hash_block`` (512) prompt tokens, the last block partial

``write_mooncake`` writes a kvbench trace as a Mooncake file (for Dynamo's mocker: harness/bench/
dynamo.py), its hash ids chained so that equal ids mean equal prefixes.

Records with 0 prompt or 0 output tokens (BurstGPT's failed requests) are skipped and
counted (``skipped_empty`` in the trace's metadata): replaying them would invent a decode.
The first two carry lengths only: prompts are seeded random tokens, so nothing is shared.
Mooncake's hash ids say which prompt blocks are equal: block ``h`` becomes ``hash_block``
tokens hashed from ``(seed, h)`` (``block_tokens``), so equal ids give equal tokens and
the radix cache sees the trace's real sharing. A kvbench block size other than
``hash_block`` works: sharing is at the trace's granularity (a 16-token kvbench block inside a
shared 512-token block is shared; the partial last block is as long as ``input_length`` says,
so two prompts sharing its id share its first tokens only up to the shorter).

For all three: arrivals are seconds from the first record; ``start`` and ``duration``
(seconds) keep the records arriving in ``[start, start + duration)``; ``time_scale`` divides
the kept arrivals (2.0 replays twice as fast), measured from ``start``; ``max_requests`` keeps
the first so many. Lengths are clipped so that prompt + output <= ``max_len`` (``None``: not
clipped; the configs' default is ``engine.max_model_len``): the output first (at least 1
token), then the prompt's tail; the count of clipped requests and the mean lengths before and
after are in the trace's metadata (``clipped_requests``, ``clipped_means``), and so in the
run's ``summary.json`` (``trace_metadata``). A file whose records all have 0 prompt or 0
output tokens is refused, saying so. A malformed file is a ``TraceError`` naming the file,
line and column.
"""

from __future__ import annotations

import csv
import json
import math
import os
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from hashlib import blake2b
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from harness.workload.traces import (
    Trace,
    TraceError,
    TraceRequest,
    atomic_write,
    max_prefix_hit_rate,
    random_prompts,
    token_arrays,
)


@dataclass(frozen=True)
class Record:
    """One request of a public trace: arrival (s from the trace's first record), lengths,
    and the prompt's block hash ids (Mooncake; empty otherwise)."""

    arrival: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Window:
    """Which records to keep and how fast to replay them (module docstring)."""

    start: float = 0.0
    duration: float | None = None
    time_scale: float = 1.0
    max_requests: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("start", self.start >= 0, "a number of seconds >= 0"),
            ("duration", self.duration is None or self.duration > 0, "seconds > 0, or null"),
            ("time_scale", self.time_scale > 0, "a factor > 0 (2.0: twice as fast)"),
            ("max_requests", self.max_requests is None or self.max_requests >= 1, ">= 1"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"trace.{name}={getattr(self, name)!r} is invalid: {want}")

    def apply(self, records: Iterable[Record]) -> list[Record]:
        end = math.inf if self.duration is None else self.start + self.duration
        kept = []
        for r in records:
            if r.arrival < self.start:
                continue
            if r.arrival >= end or len(kept) == self.max_requests:
                break
            at = (r.arrival - self.start) / self.time_scale
            kept.append(Record(at, r.prompt_len, r.output_len, r.hash_ids))
        return kept


def azure(
    path: str,
    *,
    max_len: int | None,
    vocab_size: int,
    seed: int = 0,
    start: float = 0.0,
    duration: float | None = None,
    time_scale: float = 1.0,
    max_requests: int | None = None,
) -> Trace:
    """An Azure LLM inference trace (2023 or 2024) as a kvbench trace."""
    window = Window(start, duration, time_scale, max_requests)
    rows = _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    records, first, empty = [], None, 0
    for where, row in rows:
        t = _timestamp(row["TIMESTAMP"], where)
        first = t if first is None else first
        prompt = _count(row, "ContextTokens", where, low=0)
        output = _count(row, "GeneratedTokens", where, low=0)
        if not (prompt and output):  # nothing to prefill or nothing generated
            empty += 1
            continue
        records.append(_ordered(records, Record(t - first, prompt, output), where))
    _some_replayable(path, records, empty, "ContextTokens or GeneratedTokens")
    params = {"path": str(path), "seed": seed, **_describe(window)}
    trace = _random_trace("azure", window.apply(records), params, max_len, vocab_size, seed)
    trace.metadata["skipped_empty"] = empty
    return trace


def burstgpt(
    path: str,
    *,
    max_len: int | None,
    vocab_size: int,
    model: str | None = None,
    log_type: str | None = None,
    seed: int = 0,
    start: float = 0.0,
    duration: float | None = None,
    time_scale: float = 1.0,
    max_requests: int | None = None,
) -> Trace:
    """BurstGPT as a kvbench trace, the rows of ``model`` and ``log_type`` (None: all)."""
    window = Window(start, duration, time_scale, max_requests)
    columns = ("Timestamp", "Model", "Request tokens", "Response tokens", "Log Type")
    records, first, failed, seen = [], None, 0, ({}, {})
    for where, row in _csv_rows(path, columns):
        t = _number(row, "Timestamp", where)
        first = t if first is None else first
        for kept, column in zip(seen, ("Model", "Log Type"), strict=True):
            kept[row[column]] = kept.get(row[column], 0) + 1
        if (model is not None and row["Model"] != model) or (
            log_type is not None and row["Log Type"] != log_type
        ):
            continue
        prompt = _count(row, "Request tokens", where, low=0)
        output = _count(row, "Response tokens", where, low=0)
        if not (prompt and output):  # a failed request: nothing was generated
            failed += 1
            continue
        records.append(_ordered(records, Record(t - first, prompt, output), where))
    for name, value, kept in (("model", model, seen[0]), ("log_type", log_type, seen[1])):
        if value is not None and value not in kept:
            raise TraceError(
                f"{path}: trace.{name}={value!r} matches no row; the file has "
                f"{sorted(kept)} (null: all)"
            )
    _some_replayable(path, records, failed, "Request tokens or Response tokens")
    params = {
        "path": str(path),
        "model": model,
        "log_type": log_type,
        "seed": seed,
        **_describe(window),
    }
    trace = _random_trace("burstgpt", window.apply(records), params, max_len, vocab_size, seed)
    trace.metadata["skipped_empty"] = failed
    return trace


def mooncake(
    path: str,
    *,
    max_len: int | None,
    vocab_size: int,
    hash_block: int = 512,
    seed: int = 0,
    start: float = 0.0,
    duration: float | None = None,
    time_scale: float = 1.0,
    max_requests: int | None = None,
) -> Trace:
    """A Mooncake trace as a kvbench trace; equal hash ids give equal token blocks."""
    window = Window(start, duration, time_scale, max_requests)
    if hash_block < 1:
        raise ValueError(f"trace.hash_block={hash_block} is invalid: tokens per hash id >= 1")
    records, first = [], None
    for where, obj in _jsonl_objects(path):
        t = _field(obj, "timestamp", where, float, "a number of milliseconds")
        first = t if first is None else first
        prompt = _field(obj, "input_length", where, int, "an integer >= 1", low=1)
        output = _field(obj, "output_length", where, int, "an integer >= 1", low=1)
        ids = obj.get("hash_ids")
        want = -(-prompt // hash_block)
        if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
            raise TraceError(f"{where}, column 'hash_ids': {ids!r} is not a list of integers")
        if len(ids) != want:
            raise TraceError(
                f"{where}, column 'hash_ids': {len(ids)} ids for input_length {prompt}; "
                f"one per {hash_block} tokens is {want} (set trace.hash_block to the trace's)"
            )
        record = Record((t - first) / 1000.0, prompt, output, tuple(ids))
        records.append(_ordered(records, record, where))
    params = {"path": str(path), "hash_block": hash_block, "seed": seed, **_describe(window)}
    return hashed_trace(
        "mooncake", window.apply(records), params, max_len, vocab_size, seed, hash_block
    )


def write_mooncake(trace: Trace, path: str | os.PathLike, hash_block: int) -> None:
    """Write ``trace`` as a Mooncake file (the module docstring's format), atomically: one
    record per request, its arrival in milliseconds, its lengths, and one hash id per
    ``hash_block`` prompt tokens (the last block partial). An id names a block with all the
    blocks before it (a chain, as vLLM's block hashes and Mooncake's ids are), numbered from
    0 in the order first met: two prompts share a block's id exactly when they share every
    token up to its end, which is when a prefix cache of ``hash_block``-token blocks shares
    it. ``mooncake`` reads the file back with the same lengths and sharing. A follow-up turn
    (``TraceRequest.after``) is refused: a Mooncake file's requests arrive on their own."""
    if hash_block < 1:
        raise ValueError(f"hash_block={hash_block} is invalid: tokens per hash id >= 1")
    ids: dict[tuple[int, bytes], int] = {}  # (parent id, the block's digest) -> its id
    lines = []
    for r in trace:
        if r.after is not None:
            raise TraceError(
                f"request {r.request_id!r} continues {r.after!r} (a follow-up turn): a "
                "Mooncake file has no turns; write a trace whose requests all arrive on "
                "their own"
            )
        tokens = np.asarray(r.prompt_token_ids, dtype=np.int64).tobytes()  # 8 bytes a token
        chain, parent = [], -1
        for at in range(0, len(tokens), 8 * hash_block):
            digest = blake2b(tokens[at : at + 8 * hash_block], digest_size=16).digest()
            parent = ids.setdefault((parent, digest), len(ids))
            chain.append(parent)
        record = {
            "timestamp": round(r.arrival_time * 1000.0, 6),
            "input_length": len(r.prompt_token_ids),
            "output_length": r.max_tokens,
            "hash_ids": chain,
        }
        lines.append(json.dumps(record))
    text = "\n".join(lines) + "\n"
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text))


# -- building the trace ----------------------------------------------------------------------
def _random_trace(
    name: str,
    records: list[Record],
    params: dict[str, Any],
    max_len: int | None,
    vocab_size: int,
    seed: int,
) -> Trace:
    """Seeded random prompts of the records' (clipped) lengths."""
    rng = np.random.default_rng(seed)
    clipped = [clip(r.prompt_len, r.output_len, max_len) for r in records]
    prompts = random_prompts(rng, [p for p, _ in clipped], vocab_size)
    requests = [
        TraceRequest(f"{name}-{i}", r.arrival, prompt, o)
        for i, (r, prompt, (_, o)) in enumerate(zip(records, prompts, clipped, strict=True))
    ]
    return _finish(name, requests, params, records, clipped, max_len, vocab_size)


def hashed_trace(
    name: str,
    records: list[Record],
    params: dict[str, Any],
    max_len: int | None,
    vocab_size: int,
    seed: int,
    hash_block: int,
) -> Trace:
    """Prompts built from the records' hash ids: block ``h`` is ``hash_block`` tokens hashed
    from ``(seed, h)`` (``block_tokens``), the same wherever ``h`` appears."""
    clipped = [clip(r.prompt_len, r.output_len, max_len) for r in records]
    used = [r.hash_ids[: -(-p // hash_block)] for r, (p, _) in zip(records, clipped, strict=True)]
    unique = np.unique(np.fromiter(chain.from_iterable(used), dtype=np.int64))
    blocks: dict[int, array] = {}
    for part in np.array_split(unique, max(1, len(unique) // 4096)):  # bounded temporaries
        rows = block_tokens(seed, part, hash_block, vocab_size).reshape(-1)
        tokens = token_arrays(rows, [hash_block] * len(part), vocab_size)
        blocks.update(zip(part.tolist(), tokens, strict=True))
    requests = []
    for i, (r, ids, (p, o)) in enumerate(zip(records, used, clipped, strict=True)):
        prompt = array(blocks[ids[0]].typecode, b"".join(blocks[h].tobytes() for h in ids))
        del prompt[p:]  # one copy, joined in C
        requests.append(TraceRequest(f"{name}-{i}", r.arrival, prompt, o))
    return _finish(name, requests, params, records, clipped, max_len, vocab_size)


def block_tokens(seed: int, ids: np.ndarray, hash_block: int, vocab_size: int) -> np.ndarray:
    """[len(ids), hash_block] token ids in [1, vocab_size): a SplitMix64 hash of (seed, id,
    position), so a block's tokens depend on its id alone, whatever else the trace holds."""
    with np.errstate(over="ignore"):
        x = (
            np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
            + ids.astype(np.uint64)[:, None] * np.uint64(0xBF58476D1CE4E5B9)
            + np.arange(hash_block, dtype=np.uint64)[None, :] * np.uint64(0x94D049BB133111EB)
        )
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            x = (x ^ (x >> np.uint64(shift))) * np.uint64(mult)
        x ^= x >> np.uint64(31)
    return (x % np.uint64(vocab_size - 1)).astype(np.int64) + 1


def clip(prompt: int, output: int, max_len: int | None) -> tuple[int, int]:
    """Lengths with prompt + output <= ``max_len``: the output first (at least 1), then the
    prompt's tail (``None``: as they are)."""
    if max_len is None:
        return prompt, output
    output = max(1, min(output, max_len - prompt))
    return min(prompt, max_len - output), output


def _finish(
    name: str,
    requests: list[TraceRequest],
    params: dict[str, Any],
    records: list[Record],
    clipped: list[tuple[int, int]],
    max_len: int | None,
    vocab_size: int,
) -> Trace:
    changed = sum((r.prompt_len, r.output_len) != c for r, c in zip(records, clipped, strict=True))
    before = [(r.prompt_len, r.output_len) for r in records]
    metadata = {
        "generator": name,
        "parameters": params,
        "seed": params["seed"],
        "vocab_size": vocab_size,
        "max_len": max_len,
        "clipped_requests": changed,
        # mean prompt and output lengths of the file's records, then of the trace's requests
        "clipped_means": {
            part: [_mean(lengths, i) for lengths in (before, clipped)]
            for i, part in enumerate(("prompt", "output"))
        },
        "max_prefix_hit_rate": max_prefix_hit_rate(requests),
    }
    return Trace(tuple(requests), metadata)


def _mean(lengths: list[tuple[int, int]], i: int) -> float | None:
    return sum(n[i] for n in lengths) / len(lengths) if lengths else None


def _some_replayable(path: str, records: list[Record], empty: int, columns: str) -> None:
    """Refuse a file whose every (selected) record was skipped for 0 tokens, saying so: the
    empty trace's own message could only name the knobs."""
    if empty and not records:
        raise TraceError(
            f"{path}: all {empty} rows have 0 {columns} (failed requests: nothing to prefill "
            "or nothing generated) and were skipped; the trace has no request to replay"
        )


def _describe(window: Window) -> dict[str, Any]:
    return {
        "start": window.start,
        "duration": window.duration,
        "time_scale": window.time_scale,
        "max_requests": window.max_requests,
    }


# -- reading files ---------------------------------------------------------------------------
def _open(path: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise TraceError(
            f"trace.path={path!r} is not a file (relative paths start at {Path.cwd()})"
        )
    return p


def _csv_rows(path: str, columns: tuple[str, ...]) -> Iterator[tuple[str, dict[str, str]]]:
    """(where, row) of a CSV file with a header holding ``columns``."""
    p = _open(path)
    with p.open(newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in columns if c not in header]
        if missing:
            raise TraceError(
                f"{p} line 1: header {header} lacks column {missing[0]!r}; this format's "
                f"columns are {list(columns)}"
            )
        for n, values in enumerate(reader, 2):
            if not values:
                continue
            if len(values) != len(header):
                raise TraceError(
                    f"{p} line {n}: {len(values)} fields for the header's {len(header)}"
                )
            yield f"{p} line {n}", {h: v.strip() for h, v in zip(header, values, strict=True)}


def _jsonl_objects(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    p = _open(path)
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{p} line {n}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{p} line {n}: expected an object, got {obj!r}")
            yield f"{p} line {n}", obj


def _timestamp(text: str, where: str) -> float:
    """Seconds since the epoch of an Azure timestamp; fractions of up to 7 digits."""
    main, _, fraction = text.partition(".")
    try:
        t = datetime.fromisoformat(main.replace("T", " ")).timestamp()
        return t + (float(f"0.{fraction}") if fraction else 0.0)
    except ValueError:
        raise TraceError(
            f"{where}, column 'TIMESTAMP': {text!r} is not a date and time like "
            "'2023-11-16 18:15:46.6805900'"
        ) from None


def _number(row: dict[str, str], column: str, where: str) -> float:
    try:
        value = float(row[column])
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}, column {column!r}: {row[column]!r} is not a number >= 0")
    return value


def _count(row: dict[str, str], column: str, where: str, *, low: int) -> int:
    text = row[column]
    if not text.lstrip("-").isdigit() or int(text) < low:
        raise TraceError(f"{where}, column {column!r}: {text!r} is not an integer >= {low}")
    return int(text)


def _field(obj: dict, name: str, where: str, kind: type, want: str, low: int = 0):
    value = obj.get(name)
    ok = _is_int(value) if kind is int else _is_int(value) or isinstance(value, float)
    if not ok or value < low or (kind is float and not math.isfinite(value)):
        raise TraceError(f"{where}, column {name!r}: {value!r} is not {want}")
    return kind(value)


def _ordered(records: list[Record], record: Record, where: str) -> Record:
    if records and record.arrival < records[-1].arrival:
        raise TraceError(
            f"{where}: its time is earlier than the previous record's; the trace must be "
            "sorted by time"
        )
    return record


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
