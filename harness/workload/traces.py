"""Request traces: the record a run replays, its theoretical prefix reuse, and its files.

A trace is the open-loop input of a run: who arrives when, with which prompt tokens and how
many output tokens. Concrete token ids (not just lengths) are stored because prefix caching
matches real tokens. Generators live in ``harness.workload.generators``; files are ``.jsonl`` or
``.parquet``, written atomically and validated on load.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names file, line/row, field and fix."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: prompt tokens, arrival (s from trace start) and output length.

    With ``ignore_eos`` (the default) ``max_tokens`` is exactly the output length; without,
    the model's EOS ends the answer and ``max_tokens`` caps it (a real model's own lengths).
    SLOs are in seconds; ``None`` means the request has no such objective.

    A follow-up turn names the request it continues in ``after``: it is sent
    ``arrival_time`` seconds (think time) after that request finishes, and its prompt is that
    request's prompt, its answer (the tokens the model generated), then ``prompt_token_ids``
    (the new user turn). The replay is closed-loop for these: who arrives when depends on
    the engine (harness/cli/replay.py).
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: array  # token_array: a compact sequence of ints
    max_tokens: int
    priority: int = 0
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    ignore_eos: bool = True
    after: str | None = None

    def __post_init__(self) -> None:
        # however it was built (a tuple, a list, a file's ids), held as a compact array
        object.__setattr__(self, "prompt_token_ids", token_array(self.prompt_token_ids))


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival, plus metadata (generator, parameters, seed, vocab_size,
    ``max_prefix_hit_rate``)."""

    requests: tuple[TraceRequest, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)


def token_array(ids: Iterable[int]) -> array:
    """Token ids stored compactly: 2 bytes an id when every id is below 65,536 (most
    synthetic vocabularies), else 4 (int32, as the radix cache keys them). A 100k-request
    trace holds ~10^8 prompt tokens: 0.2 GB so, where a tuple of shared ints took 0.8 GB
    (8 bytes a pointer) and one of fresh ints 3.6 GB. A sequence of Python ints, sliced and
    compared in C; convert with ``list``/``tuple`` where a list or tuple is wanted."""
    ids = ids if isinstance(ids, array) else array("i", ids)
    if ids.typecode == _NARROW or (ids and (min(ids) < 0 or max(ids) >= 1 << 16)):
        return ids
    return array(_NARROW, ids)


def token_arrays(flat: np.ndarray, lengths: Iterable[int], vocab_size: int) -> list[array]:
    """Prompts cut from ``flat`` (a numpy array of ids in ``[0, vocab_size)``) at
    ``lengths``, each a ``token_array`` of the width the vocabulary needs (so that prompts of
    one vocabulary concatenate); one conversion of ``flat``."""
    typecode = _typecode(vocab_size)
    data = flat.astype(np.uint16 if typecode == _NARROW else np.int32)
    out, at = [], 0
    for n in lengths:
        prompt = array(typecode)
        prompt.frombytes(data[at : at + n].tobytes())
        out.append(prompt)
        at += n
    return out


def random_prompts(
    rng: np.random.Generator, lengths: Iterable[int], vocab_size: int
) -> list[array]:
    """Prompts of uniform random ids in ``[1, vocab_size)`` (id 0 left out: many tokenizers
    reserve it for padding/BOS), the ids ``rng.integers(1, vocab_size, sum(lengths))`` would
    give cut at ``lengths``, drawn a few million at a time (numpy's stream does not depend on
    how a draw is split), so no 8-byte copy of a whole trace's tokens is ever held."""
    out: list[array] = []
    batch: list[int] = []
    total = 0  # sum(batch)
    for n in [*map(int, lengths), None]:
        if batch and (n is None or total + n > _DRAW):
            out += token_arrays(rng.integers(1, vocab_size, total), batch, vocab_size)
            batch, total = [], 0
        if n is not None:
            batch.append(n)
            total += n
    return out


def _typecode(vocab_size: int) -> str:
    return _NARROW if vocab_size <= 1 << 16 else "i"


_DRAW = 1 << 22  # token ids a draw (32 MiB as int64)
_NARROW = "H"  # unsigned 16-bit


def max_prefix_hit_rate(
    requests: Iterable[TraceRequest],
    block_size: int | None = None,
    answers: Mapping[str, tuple[int, ...]] | None = None,
) -> float:
    """Upper bound on the prefix-cache hit rate of a trace replayed in its order.

    Each prompt can hit at most its longest common prefix with an earlier prompt (capped at
    len-1: the last token is always computed, as in ``BlockAllocator.match_prefix``), rounded
    down to full blocks if ``block_size`` is given. ``answers`` (request id -> the tokens it
    generated) adds an earlier request's prompt and answer as one more sequence a later
    prompt can share: a follow-up turn's prompt holds the turn before and its answer, whose
    KV a cache that keeps generated tokens (radix) holds. Returns hits / total prompt tokens
    (0.0 for an empty trace). ``prefix_hit_bounds`` gives it in tokens and in whole blocks
    from one pass.
    """
    tokens, blocks = prefix_hit_bounds(requests, block_size or 1, answers)
    return blocks if block_size else tokens


def prefix_hit_bounds(
    requests: Iterable[TraceRequest],
    block_size: int,
    answers: Mapping[str, tuple[int, ...]] | None = None,
) -> tuple[float, float]:
    """``max_prefix_hit_rate`` in tokens and in whole blocks of ``block_size``, from one pass.

    Among a set of sequences, the one sharing the longest prefix with a prompt is a neighbour
    of it in sorted order, and two sequences share the least common prefix of the neighbours
    between them. So the sequences are sorted once, each compared with the next alone, and
    each prompt takes the longer prefix it shares with the nearest earlier sequence on either
    side of it in that order (``_shared_with_earlier``): n - 1 comparisons, O(n log n) in all,
    and no memory beyond the prompts, where a token trie took a dict per token (~10^8 of them
    for 100,000 prompts of 1,000 tokens).
    """
    reqs = list(requests)
    answers = answers or {}
    # request i's prompt is sequence 2i; its prompt and answer 2i + 1, earlier than 2j, j > i
    seqs = {2 * i: r.prompt_token_ids for i, r in enumerate(reqs)}
    for i, r in enumerate(reqs):
        if answers.get(r.request_id):
            seqs[2 * i + 1] = token_array([*r.prompt_token_ids, *answers[r.request_id]])
    order = sorted(seqs, key=seqs.__getitem__)  # stable: ties by arrival
    ordered = list(map(seqs.__getitem__, order))
    next_to = list(map(_common_prefix, ordered, ordered[1:]))  # neighbours in sorted order
    before = _shared_with_earlier(order, next_to)
    after = _shared_with_earlier(order[::-1], next_to[::-1])[::-1]
    hits = blocks = 0
    for i, ids, left, right in zip(order, ordered, before, after, strict=True):
        if i % 2:
            continue  # a prompt and answer is only ever shared, never looked up
        hit = min(max(left, right), len(ids) - 1)
        hits += hit
        blocks += hit - hit % block_size
    total = sum(len(r.prompt_token_ids) for r in reqs)
    return (hits / total, blocks / total) if total else (0.0, 0.0)


def _shared_with_earlier(order: list[int], next_to: list[int]) -> list[int]:
    """For each position of ``order`` (sequence indices, sorted by their tokens), the prefix
    it shares with the nearest earlier sequence to its left (a smaller index), 0 if none;
    ``next_to[k]``: the prefix shared by positions k and k + 1. A stack of indices, increasing
    upwards, each with the prefix it shares with the one above it (the top: with the current
    position): the least of ``next_to`` between them."""
    stack: list[list[int]] = []  # [index, prefix shared with the entry above / the current]
    out: list[int] = []
    for k, i in enumerate(order):
        if stack:
            stack[-1][1] = min(stack[-1][1], next_to[k - 1])
        while stack and stack[-1][0] > i:
            shared = stack.pop()[1]
            if stack:
                stack[-1][1] = min(stack[-1][1], shared)
        out.append(stack[-1][1] if stack else 0)
        stack.append([i, _UNBOUNDED])
    return out


_UNBOUNDED = 1 << 62  # a position shares all of itself with itself


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``: slices compared in C,
    each step past the common part so far, doubling while they match and halving when not
    (most prompts differ at once, shared ones for hundreds of tokens)."""
    n = min(len(a), len(b))
    common, step = 0, 1  # a[:common] == b[:common]
    while step:
        end = min(common + step, n)
        if end > common and a[common:end] == b[common:end]:
            common, step = end, step * 2
        else:
            step //= 2
    return common


_FIELDS = tuple(f.name for f in fields(TraceRequest))
_REQUIRED = ("request_id", "arrival_time", "prompt_token_ids", "max_tokens")
_PARQUET_KEY = b"kvbench.trace_metadata"
_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("arrival_time", pa.float64()),
        ("prompt_token_ids", pa.list_(pa.int64())),
        ("max_tokens", pa.int64()),
        ("priority", pa.int64()),
        ("ttft_slo", pa.float64()),
        ("tpot_slo", pa.float64()),
        ("ignore_eos", pa.bool_()),
        ("after", pa.string()),
    ]
)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _parse(obj: Any, where: str) -> TraceRequest:
    def fail(name: str, problem: str) -> TraceError:
        return TraceError(f"{where}: field '{name}' {problem}")

    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected an object with fields {list(_FIELDS)}")
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise fail(unknown[0], f"is unknown; remove it or rename it to one of {list(_FIELDS)}")
    for name in _REQUIRED:
        if obj.get(name) is None:
            raise fail(name, "is missing; every request needs it")
    if not isinstance(obj["request_id"], str) or not obj["request_id"]:
        raise fail("request_id", f"must be a non-empty string, got {obj['request_id']!r}")
    arrival = obj["arrival_time"]
    if not _is_number(arrival):
        raise fail("arrival_time", f"must be a finite number of seconds, got {arrival!r}")
    if arrival < 0:
        raise fail("arrival_time", f"is negative ({arrival}); use seconds from trace start >= 0")
    ids = obj["prompt_token_ids"]
    if not isinstance(ids, list):
        raise fail("prompt_token_ids", f"must be a list of token ids, got {ids!r}")
    if not ids:
        raise fail("prompt_token_ids", "is empty; a request needs at least one prompt token")
    for j, tok in enumerate(ids):
        if not _is_int(tok) or not 0 <= tok < 1 << 31:
            raise fail(f"prompt_token_ids[{j}]", f"is {tok!r}; token ids are integers in [0, 2^31)")
    if not _is_int(obj["max_tokens"]) or obj["max_tokens"] < 1:
        raise fail("max_tokens", f"is {obj['max_tokens']!r}; it must be an integer >= 1")
    priority = obj.get("priority")
    if priority is not None and not _is_int(priority):
        raise fail("priority", f"must be an integer, got {priority!r}")
    for name in ("ttft_slo", "tpot_slo"):
        slo = obj.get(name)
        if slo is not None and not (_is_number(slo) and slo > 0):
            raise fail(name, f"must be a number of seconds > 0 or null, got {slo!r}")
    ignore_eos = obj.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise fail("ignore_eos", f"must be true, false or null, got {ignore_eos!r}")
    after = obj.get("after")
    if after is not None and (not isinstance(after, str) or not after):
        raise fail("after", f"must be an earlier request's id or null, got {after!r}")
    return TraceRequest(
        obj["request_id"],
        float(arrival),
        token_array(ids),
        obj["max_tokens"],
        priority or 0,
        obj.get("ttft_slo"),
        obj.get("tpot_slo"),
        ignore_eos is not False,
        after,
    )


def _read_jsonl(path: Path) -> tuple[dict, list[tuple[str, Any]]]:
    metadata: dict = {}
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(
                f"{path} line {n}: invalid JSON ({e.msg}); write one object per line"
            ) from None
        if not records and not metadata and isinstance(obj, dict) and set(obj) == {"metadata"}:
            metadata = obj["metadata"]
        else:
            records.append((f"{path} line {n}", obj))
    return metadata, records


def _read_parquet(path: Path) -> tuple[dict, list[tuple[str, Any]]]:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise TraceError(f"{path}: not a readable parquet file ({e})") from None
    raw = (table.schema.metadata or {}).get(_PARQUET_KEY)
    metadata = json.loads(raw) if raw else {}
    # Row numbers are 0-based, as in pd.read_parquet(path).iloc[row].
    return metadata, [(f"{path} row {i}", obj) for i, obj in enumerate(table.to_pylist())]


def load(path: str | os.PathLike) -> Trace:
    """Read a ``.jsonl`` or ``.parquet`` trace, validating every request.

    The metadata header is optional (a hand-written file has none); ``max_prefix_hit_rate``
    is recomputed from the requests, so it always describes what will be replayed. Requests
    must already be sorted by arrival: a replay must be exactly the file, so an unsorted file
    is an error naming the first out-of-order record rather than being silently reordered
    (which would change who counts as earlier). A follow-up turn (``after``) must come after
    the request it continues; its ``arrival_time`` is a think time, outside that order.
    """
    path = Path(path)
    readers = {".jsonl": _read_jsonl, ".parquet": _read_parquet}
    if path.suffix not in readers:
        raise TraceError(f"{path}: unknown trace format {path.suffix!r}; use .jsonl or .parquet")
    metadata, records = readers[path.suffix](path)
    if not isinstance(metadata, dict):
        raise TraceError(f"{path}: metadata must be an object, got {metadata!r}")
    requests: list[TraceRequest] = []
    opened: list[TraceRequest] = []  # requests that are not follow-ups: sorted by arrival
    first_seen: dict[str, str] = {}
    for where, obj in records:
        req = _parse(obj, where)
        if req.request_id in first_seen:
            raise TraceError(
                f"{where}: field 'request_id' {req.request_id!r} duplicates "
                f"{first_seen[req.request_id]}; request ids must be unique"
            )
        if req.after is not None and req.after not in first_seen:
            raise TraceError(
                f"{where}: field 'after' {req.after!r} names no earlier request; a "
                "follow-up turn comes after the request it continues"
            )
        if req.after is None:
            if opened and req.arrival_time < opened[-1].arrival_time:
                raise TraceError(
                    f"{where}: field 'arrival_time' {req.arrival_time} is earlier than "
                    f"the previous request's {opened[-1].arrival_time}; sort the "
                    "file by arrival_time"
                )
            opened.append(req)
        first_seen[req.request_id] = where
        requests.append(req)
    metadata["max_prefix_hit_rate"] = max_prefix_hit_rate(requests)
    return Trace(tuple(requests), metadata)


def from_file(path: str) -> Trace:
    """Hydra workload that replays a saved trace (relative paths are from the launch dir)."""
    if not Path(path).is_file():
        raise TraceError(
            f"trace.path={path!r} is not a file (relative paths start at {Path.cwd()}): "
            "point it at a .jsonl or .parquet trace"
        )
    trace = load(path)
    trace.metadata["source_file"] = str(path)
    return trace


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write ``path`` through ``write(tmp)`` into a temporary file beside it, then rename it
    into place: readers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save(trace: Trace, path: str | os.PathLike) -> None:
    """Write ``trace`` atomically as ``.jsonl`` (a ``{"metadata": ...}`` header line, then one
    request per line) or ``.parquet`` (metadata as JSON in the schema metadata)."""
    path = Path(path)
    # arrays of ids become JSON/arrow lists
    records = [asdict(r) | {"prompt_token_ids": list(r.prompt_token_ids)} for r in trace.requests]
    if path.suffix == ".jsonl":
        lines = [json.dumps({"metadata": trace.metadata})] + [json.dumps(r) for r in records]
        atomic_write(path, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    elif path.suffix == ".parquet":
        schema = _SCHEMA.with_metadata({_PARQUET_KEY: json.dumps(trace.metadata).encode()})
        table = pa.Table.from_pylist(records, schema=schema)
        atomic_write(path, lambda tmp: pq.write_table(table, tmp))
    else:
        raise TraceError(f"{path}: unknown trace format {path.suffix!r}; use .jsonl or .parquet")
