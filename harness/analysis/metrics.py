"""Per-request and per-step result tables, and the run summary computed from them alone.

Latency definitions follow vLLM's ``bench serve``; the KV-memory breakdown follows the vLLM
paper (Kwon et al., SOSP 2023, Fig. 2): token states, reserved for future tokens, internal
and external fragmentation. All times are seconds on the run's clock (``virtual`` or
``wall``), which the summary records.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd


class MetricsError(ValueError):
    """A result table that does not match its schema; the message names row and column."""


# Column name -> kind. "float" columns hold NaN for "not applicable" (e.g. no SLO, or an
# aborted request that never got a first token).
REQUEST_SCHEMA: dict[str, str] = {
    "request_id": "str",
    "priority": "int",
    "arrival_time": "float",
    "first_scheduled_time": "float",
    "first_token_time": "float",
    "finish_time": "float",
    "prompt_tokens": "int",
    "output_tokens": "int",
    "cached_tokens": "int",  # prefix-cache hit tokens at the first admission
    "forked_tokens": "int",  # prompt tokens whose KV a fork gave it (n > 1), not looked up
    "preemptions": "int",
    "finish_reason": "str",  # one of FINISH_REASONS
    "abort_reason": "str|None",
    "ttft_slo": "float",
    "tpot_slo": "float",
    "token_times": "list[float]",  # when each output token was produced (for ITL)
    "spec_proposed": "int",
    "spec_accepted": "int",
    # cached_tokens by the tier each hit came from (kv_tier; SGLang HiCache's device, host
    # and storage hits): device = cached_tokens - host - disk
    "cached_tokens_device": "int",
    "cached_tokens_host": "int",
    "cached_tokens_disk": "int",
}
STEP_SCHEMA: dict[str, str] = {
    "step": "int",
    "start_time": "float",
    "duration": "float",  # the whole step, scheduling included
    "forward_time": "float",  # the forward's graph building + the host blocked on MLX
    "build_time": "float",  # host work building the forward's inputs (before forward_time)
    "batch_size": "int",
    "prefill_tokens": "int",
    "decode_tokens": "int",
    "preempted": "int",
    "swap_out_blocks": "int",
    "swap_in_blocks": "int",
    "window_swap_blocks": "int",  # sliding-window ring blocks swapped out and in, else 0
    "swap_time": "float",  # host copies of swapped KV, synchronised
    "block_copies": "int",  # (src, dst) block copies of the step's plan
    "row_groups": "int",  # padded batches of the forward (costmodel.work.StepWork)
    "query_tokens_padded": "int",  # query positions computed, padding included
    "kv_slots_read": "int",  # KV slots gathered per layer and KV head, padding included
    "kv_slots_attended": "int",  # the rows' contexts, no padding
    "attention_pairs": "int",  # query-key pairs scored per layer and KV head, padding included
    "window_kv_slots_read": "int",  # the same per sliding-window layer: ring slots gathered
    "window_attention_pairs": "int",  # and pairs scored over them and the new keys (else 0)
    "logit_rows": "int",  # positions the LM head ran on
    "single_token_rows": "int",  # rows feeding one token (decodes)
    "draft_block_copies": "int",  # block copies in the draft model's arena
    "draft_rounds": "int",  # the draft model's sequential forwards (speculative decoding)
    "draft_tokens": "int",  # tokens the draft model fed
    "num_waiting": "int",
    "num_running": "int",
    "num_swapped": "int",
    "blocks_used": "int",
    "blocks_free": "int",
    "blocks_cached": "int",
    "block_refs": "int",  # block-table entries of running sequences
    "blocks_shared": "int",  # of those, entries served by a block another entry also holds
    "slots_tokens": "int",  # KV slots holding token states once the step's writes are done
    "slots_future": "int",  # allocated slots their holder fills later
    "slots_internal": "int",  # allocated slots never filled (block/region slack)
    "slots_external": "int",  # free slots in runs/regions too small for the next request in line
    "slots_total": "int",  # arena slots
    "external_fragmentation": "float",  # slots_external over free slots (vLLM paper's sense)
    "draft_blocks_used": "int",  # the draft model's blocks (speculative decoding), else 0
    "window_blocks_used": "int",  # sliding-window layers' ring blocks, else 0
    "mlx_active_bytes": "int",
    "mlx_peak_bytes": "int",
    "spec_proposed": "int",
    "spec_accepted": "int",
    "spec_rejected": "int",
    "spec_verifications": "int",
    # KV blocks moved between the arena and the lower tiers (kv_tier), and their bytes: a load
    # by the tier it came from, a write by the tier it went to (costmodel.work.StepWork)
    "host_blocks_loaded": "int",
    "disk_blocks_loaded": "int",
    "host_blocks_written": "int",
    "disk_blocks_written": "int",
    "host_bytes_loaded": "int",
    "disk_bytes_loaded": "int",
    "host_bytes_written": "int",
    "disk_bytes_written": "int",
    "tier_time": "float",  # the tier moves' copies, synchronised (measuring clocks; else 0)
}
# Columns added after tables were first written, and what a table without them recorded: no
# lower KV tier (every hit in the arena, nothing moved). A table from before reads as that.
_TIER_STEP_COLUMNS = tuple(
    f"{tier}_{unit}_{verb}"
    for unit in ("blocks", "bytes")
    for verb in ("loaded", "written")
    for tier in ("host", "disk")
)
# a model without sliding-window layers counts 0 (costmodel.work.WINDOW)
_WINDOW_STEP_COLUMNS = ("window_kv_slots_read", "window_attention_pairs", "window_swap_blocks")
ADDED_COLUMNS: dict[str, dict[str, str | int | float]] = {
    "requests": {"cached_tokens_device": "cached_tokens", "cached_tokens_host": 0,
                 "cached_tokens_disk": 0},
    "steps": {**dict.fromkeys(_TIER_STEP_COLUMNS, 0), "tier_time": 0.0,
              **dict.fromkeys(_WINDOW_STEP_COLUMNS, 0)},
}  # fmt: skip
REQUEST_COLUMNS: tuple[str, ...] = tuple(REQUEST_SCHEMA)
STEP_COLUMNS: tuple[str, ...] = tuple(STEP_SCHEMA)
FINISH_REASONS = ("stop", "length", "abort")
# The names engine.clock takes: measured (virtual, wall; harness/engine/clock.py) or modelled
# (model: a cost profile's prices, harness/engine/modelled.py). Kept here too so reading
# results never imports the engine, and MLX; tests/analysis/test_metrics.py checks both.
CLOCKS = ("virtual", "wall", "model")

LATENCIES = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p99")
KV_PARTS = ("tokens", "future", "internal", "external", "free")
# Where a prefix hit's KV was (kv_tier): the arena, then the lower tiers (allocators/tiers.py)
HIT_TIERS = ("device", "host", "disk")
SUMMARY_KEYS: tuple[str, ...] = (
    *(f"{m}_{s}" for m in LATENCIES for s in STATS),
    "duration",
    "completed",
    "completed_requests",
    "aborted",
    "output_throughput",
    "total_token_throughput",
    "request_throughput",
    "goodput",
    *(f"kv_{p}_frac_{agg}" for agg in ("mean", "peak") for p in KV_PARTS),
    "kv_utilisation",
    "blocks_used_peak",
    "blocks_used_mean",
    "window_blocks_used_peak",
    "batch_size_mean",
    "external_fragmentation_mean",
    "kv_sharing_saving",
    "prefix_hit_rate",
    *(f"prefix_hit_rate_{t}" for t in HIT_TIERS),
    "tier_bytes_loaded",
    "tier_bytes_written",
    "preemptions",
    "spec_acceptance_rate",
    "spec_draft_acceptance_rate",
    "spec_tokens_per_verification",
    "mlx_peak_bytes",
    "num_steps",
    "clock",
)


def _is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


# Validators and normalisers of the non-numeric kinds, applied value by value. pandas may
# store a missing string as NaN and parquet returns lists as numpy arrays; the tables' own
# conventions are None and list[float].
def _floats(values) -> np.ndarray:
    """``values`` as a float64 array, without a copy when they already are one."""
    if isinstance(values, array) and values.typecode == "d":
        return np.frombuffer(values, dtype=np.float64)
    return np.asarray(values, dtype=np.float64)


_OBJECT_KINDS = {
    "str": (lambda v: isinstance(v, str), lambda v: v),
    "str|None": (lambda v: _is_missing(v) or isinstance(v, str), lambda v: v),
    "list[float]": (
        lambda v: isinstance(v, (list, tuple, np.ndarray, array)),
        # kept without a copy where it can be (the recorder's rows hold float arrays, 8
        # bytes a value): copying every request's times would double the largest column
        lambda v: v if type(v) is list else _floats(v),
    ),
}


# A column already of its kind's dtype holds nothing to check or convert: kept as it is (a
# frame read back, or validated once already, is not copied again).
_DTYPES = {"int": np.dtype(np.int64), "float": np.dtype(np.float64)}


def _coerce(col: pd.Series, kind: str, where: str) -> pd.Series:
    if kind in _DTYPES and col.dtype == _DTYPES[kind]:
        return col
    if kind in ("int", "float"):
        num = pd.to_numeric(col, errors="coerce")
        bad = num.isna() & col.notna() if kind == "float" else num.isna() | (num % 1 != 0)
        if not bad.any():
            return num.astype("int64" if kind == "int" else "float64")
    else:
        valid, normalise = _OBJECT_KINDS[kind]
        bad = pd.Series([not valid(v) for v in col], index=col.index, dtype=bool)
        if not bad.any():
            values = [None if _is_missing(v) else normalise(v) for v in col]
            return pd.Series(values, index=col.index, name=col.name, dtype=object)
    row = int(np.flatnonzero(bad.to_numpy())[0])
    raise MetricsError(
        f"{where} row {row}: column '{col.name}' must be {kind}, got {col.iloc[row]!r}"
    )


def _frame(
    rows: Iterable[Mapping[str, Any]] | pd.DataFrame, schema: dict[str, str], table: str
) -> pd.DataFrame:
    if isinstance(rows, pd.DataFrame):
        df = rows.reset_index(drop=True)
    else:
        rows = list(rows)
        df = pd.DataFrame(rows) if rows else pd.DataFrame({c: [] for c in schema})
    # a table written before these columns: their values then (ADDED_COLUMNS); a string
    # names the column a value is copied from
    absent = {c: v for c, v in ADDED_COLUMNS[table].items() if c not in df.columns}
    absent = {
        c: df[v] if isinstance(v, str) else v
        for c, v in absent.items()
        if not isinstance(v, str) or v in df
    }
    if absent:
        df = df.assign(**absent)
    missing = [c for c in schema if c not in df.columns and c not in ADDED_COLUMNS[table]]
    if missing:
        raise MetricsError(f"{table} table: missing column(s) {missing}; record every column")
    # copy=False: each column stays its own array, not copied into one block per dtype
    columns = {c: _coerce(df[c], kind, f"{table} table") for c, kind in schema.items()}
    extra = [c for c in df.columns if c not in schema]  # kept: recorders may add diagnostics
    columns.update((c, df[c]) for c in extra)
    return pd.DataFrame(columns, copy=False)


def requests_frame(rows: Iterable[Mapping[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """Validate request rows (dicts, or a frame read back from parquet) into a typed frame.

    Raises ``MetricsError`` naming a missing column, or the row and column of a bad value.
    Columns not in ``REQUEST_COLUMNS`` are kept after them.
    """
    df = _frame(rows, REQUEST_SCHEMA, "requests")
    reason_ok = df["finish_reason"].isin(FINISH_REASONS)
    times_ok = df["token_times"].map(len) == df["output_tokens"]
    checks = [
        (~reason_ok, f"finish_reason must be one of {FINISH_REASONS}"),
        (~times_ok, "token_times needs one time per output token"),
    ]
    for bad, rule in checks:
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            got = {c: df.at[row, c] for c in ("finish_reason", "output_tokens", "token_times")}
            raise MetricsError(f"requests table row {row}: {rule}; got {got}")
    return df


def steps_frame(rows: Iterable[Mapping[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """Validate step rows into a typed frame (errors as in ``requests_frame``)."""
    return _frame(rows, STEP_SCHEMA, "steps")


def _stats(name: str, values: Iterable[float], *, scratch: bool = False) -> dict[str, float]:
    """Mean and percentiles of ``values``; ``scratch``: an array of the caller's own that the
    percentiles may reorder in place rather than copy."""
    # an array or column as it is: a list of a run's ITL gaps is 4x the array's bytes
    columnar = isinstance(values, (np.ndarray, pd.Series))
    arr = np.asarray(values if columnar else list(values), dtype=np.float64)
    if arr.size == 0:
        return {f"{name}_{s}": math.nan for s in STATS}
    mean = float(arr.mean())  # before the percentiles reorder a scratch array
    # linear interpolation, as vLLM
    p50, p90, p99 = np.percentile(arr, [50, 90, 99], overwrite_input=scratch)
    return {
        f"{name}_mean": mean,
        f"{name}_p50": float(p50),
        f"{name}_p90": float(p90),
        f"{name}_p99": float(p99),
    }


def acceptance_rate(steps: pd.DataFrame) -> float:
    """Leviathan et al.'s (ICML 2023) per-token acceptance rate alpha of a steps table =
    accepted / (accepted + rejected) drafts, each verification stopping at its first
    rejection: the estimate of the Bernoulli(alpha) the model clock draws each draft from
    (NaN without a verified draft). Not vLLM's draft acceptance rate (accepted / proposed),
    which counts the drafts after a rejection as unaccepted too."""
    accepted = steps["spec_accepted"].sum()
    return _ratio(accepted, accepted + steps["spec_rejected"].sum())


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den > 0 else math.nan


def itl_gaps(requests: pd.DataFrame) -> np.ndarray:
    """The inter-token gaps of ``itl_*`` (s): between consecutive distinct ``token_times`` of
    each completed request, pooled in row order (tokens one step produced together are one
    chunk, as one streamed message in vLLM's ``bench serve``)."""
    done = requests["token_times"][requests["finish_reason"] != "abort"]
    times = [_floats(t) for t in done]
    # vector passes over a few thousand requests at a time, into one array sized by the
    # tokens: never the run's times twice over (a 100k-request run has ~17M of them)
    out = np.empty(sum(map(len, times)), dtype=np.float64)
    size = 0
    for start in range(0, len(times), _GAPS_CHUNK):
        gaps = _gaps(times[start : start + _GAPS_CHUNK])
        out[size : size + len(gaps)] = gaps
        size += len(gaps)
    return out[:size]


_GAPS_CHUNK = 4096  # requests a vector pass of itl_gaps covers


def _gaps(times: list[np.ndarray]) -> np.ndarray:
    """``itl_gaps`` of these requests' times, in one pass: a gap within a request that is > 0
    is one between consecutive distinct times, when each request's times are in order (as a
    run records them); requests whose are not are sorted first, as np.unique would."""
    lengths = np.fromiter(map(len, times), dtype=np.int64, count=len(times))
    gaps = np.diff(np.concatenate(times))
    within = np.ones(len(gaps), dtype=bool)
    ends = np.cumsum(lengths)[:-1]  # where each request but the last ends in the times
    within[ends[(ends > 0) & (ends <= len(gaps))] - 1] = False  # a gap across two requests
    if (gaps[within] < 0).any():
        return np.concatenate([np.diff(np.unique(t)) for t in times])
    return gaps[within & (gaps > 0)]


def decode_step_time(steps: pd.DataFrame) -> float:
    """Median ``duration`` (s) of the steps that ran decodes and no prefill token
    (``decode_tokens > 0``, ``prefill_tokens == 0``): what one token costs a decoding request
    when no prompt shares its step. NaN without such a step."""
    decode_only = steps[(steps["decode_tokens"] > 0) & (steps["prefill_tokens"] == 0)]
    return float(decode_only["duration"].median()) if len(decode_only) else math.nan


def decode_stalls(requests: pd.DataFrame, threshold: float) -> int:
    """Decode stalls: the gaps of ``itl_gaps`` longer than ``threshold`` seconds.

    Sarathi-Serve (Agrawal et al., OSDI'24, Fig. 1a) calls a *generation stall* the time
    on-going decodes wait while a prefill runs; here a stall is a request's gap between two
    tokens that exceeds ``threshold``, which the caller sets from a decode-only step
    (``decode_step_time``), e.g. 5x, so that a gap counts when a prompt's computation, not
    decoding, made it long. docs/results.md, "Derived figures".
    """
    return int((itl_gaps(requests) > threshold).sum())


def request_of(requests: pd.DataFrame) -> pd.Series:
    """Each row's trace request: ``ID`` for completions ``ID/1``, ``ID/2``, ... of a request with
    ``SamplingParams.n`` > 1 (docs/results.md, request_id), else the row's own id."""
    ids = requests["request_id"]
    parent = ids.str.replace(r"(?<=.)/\d+$", "", regex=True)
    return parent.where(parent.isin(set(ids)), ids)


def summarize(requests: pd.DataFrame, steps: pd.DataFrame, *, clock: str) -> dict[str, Any]:
    """The run's figures (keys ``SUMMARY_KEYS``), computed only from the two tables;
    docs/results.md defines each and names the tool or paper it follows.

    Latencies (s) over completed requests (finish_reason != 'abort'), as vLLM's ``bench
    serve``: TTFT = first token - arrival; TPOT = (E2E - TTFT) / (output_tokens - 1), only
    requests with > 1 output token; ITL = the gap between consecutive *chunks* (tokens a
    step produced together, e.g. accepted drafts, are one chunk, as one streamed message),
    pooled; E2E = finish - arrival. Each as mean/p50/p90/p99, NaN when empty. duration =
    last finish - first arrival (all requests); throughputs and goodput count completed
    requests per second of it; goodput counts those meeting every SLO they have (TPOT of a
    1-token request is 0, as in vLLM).

    Memory (the vLLM paper's breakdown, fractions of ``slots_total``): ``_mean`` weights
    each step by its duration (a time average over the engine's busy time), ``_peak`` is
    the step with the most allocated slots (tokens+future+internal); kv_utilisation =
    time-weighted tokens / time-weighted allocated; blocks_used_mean, batch_size_mean (the
    paper's average number of batched requests, its Fig. 13) and
    external_fragmentation_mean are time-weighted too. kv_sharing_saving (the vLLM paper's
    memory saving of parallel sampling and beam search, its section 6.3) = time-weighted
    blocks_shared / time-weighted block_refs: the share of block-table entries that sharing
    (fork, prefix cache) serves without a block of their own. completed_requests counts the
    trace's requests all of whose completions completed (``completed`` counts completions).
    prefix_hit_rate counts prefix-cache hits only: completions 1.. of a request with n > 1 that
    got their prompt's KV by a fork (``forked_tokens`` > 0) looked nothing up, so they are left
    out of both sums.
    prefix_hit_rate_device, _host and _disk split it by where the hit's KV was (kv_tier:
    the arena, or loaded from a lower tier), over the same rows, so they sum to it;
    tier_bytes_loaded and tier_bytes_written sum the steps' bytes moved between the arena and
    the lower tiers (SGLang HiCache's and LMCache's transfer volumes).
    preemptions use all requests. Speculative decoding as Leviathan et al. (ICML 2023) define it:
    acceptance rate alpha = accepted / (accepted + rejected), each verification stopping at
    its first rejected draft; tokens per verification = 1 + accepted per sequence
    verification; vLLM's draft acceptance rate = accepted / proposed.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    req, st = requests_frame(requests), steps_frame(steps)
    done = req[req["finish_reason"] != "abort"]
    ttft = done["first_token_time"] - done["arrival_time"]
    multi = done["output_tokens"] > 1
    tpot = (done["finish_time"] - done["first_token_time"]) / (done["output_tokens"] - 1)
    out: dict[str, Any] = {}
    out.update(_stats("ttft", ttft.dropna()))
    out.update(_stats("tpot", tpot[multi].dropna()))
    out.update(_stats("itl", itl_gaps(req), scratch=True))
    out.update(_stats("e2e", (done["finish_time"] - done["arrival_time"]).dropna()))

    duration = req["finish_time"].max() - req["arrival_time"].min() if len(req) else math.nan
    per_s = 1.0 / duration if duration > 0 else math.nan
    ttft_ok = done["ttft_slo"].isna() | (ttft <= done["ttft_slo"])
    tpot_ok = done["tpot_slo"].isna() | (tpot.where(multi, 0.0) <= done["tpot_slo"])
    request = request_of(req)
    looked_up = req["forked_tokens"] == 0  # rows that queried the prefix cache
    out.update(
        duration=float(duration),
        completed=len(done),
        completed_requests=int((req["finish_reason"] != "abort").groupby(request).all().sum()),
        aborted=len(req) - len(done),
        output_throughput=done["output_tokens"].sum() * per_s,
        total_token_throughput=(done["prompt_tokens"].sum() + done["output_tokens"].sum()) * per_s,
        request_throughput=len(done) * per_s,
        goodput=int((ttft_ok & tpot_ok).sum()) * per_s,
    )

    total = st["slots_total"].where(st["slots_total"] > 0).astype(np.float64)
    parts = {p: st[f"slots_{p}"] for p in KV_PARTS[:-1]}
    parts["free"] = st["slots_total"] - sum(parts.values())
    allocated = parts["tokens"] + parts["future"] + parts["internal"]
    peak = int(np.argmax(allocated.to_numpy())) if len(st) else None
    weight = st["duration"].to_numpy(np.float64)

    def over_time(values: pd.Series) -> float:
        """Mean weighted by step duration (NaN without time to weigh by)."""
        return float(np.average(values, weights=weight)) if weight.sum() > 0 else math.nan

    for p, slots in parts.items():
        out[f"kv_{p}_frac_mean"] = over_time(slots / total)
        out[f"kv_{p}_frac_peak"] = (
            math.nan if peak is None else float(slots.iloc[peak] / total.iloc[peak])
        )
    accepted, verifications = st["spec_accepted"].sum(), st["spec_verifications"].sum()
    out.update(
        kv_utilisation=_ratio(over_time(parts["tokens"]), over_time(allocated)),
        blocks_used_peak=float(st["blocks_used"].max()) if len(st) else math.nan,
        blocks_used_mean=over_time(st["blocks_used"]),
        window_blocks_used_peak=float(st["window_blocks_used"].max()) if len(st) else math.nan,
        batch_size_mean=over_time(st["batch_size"]),
        external_fragmentation_mean=over_time(st["external_fragmentation"]),
        kv_sharing_saving=_ratio(over_time(st["blocks_shared"]), over_time(st["block_refs"])),
        prefix_hit_rate=_ratio(
            req["cached_tokens"][looked_up].sum(), req["prompt_tokens"][looked_up].sum()
        ),
        **{
            f"prefix_hit_rate_{t}": _ratio(
                req[f"cached_tokens_{t}"][looked_up].sum(), req["prompt_tokens"][looked_up].sum()
            )
            for t in HIT_TIERS
        },
        tier_bytes_loaded=int(st["host_bytes_loaded"].sum() + st["disk_bytes_loaded"].sum()),
        tier_bytes_written=int(st["host_bytes_written"].sum() + st["disk_bytes_written"].sum()),
        preemptions=int(req["preemptions"].sum()),
        spec_acceptance_rate=acceptance_rate(st),
        spec_draft_acceptance_rate=_ratio(accepted, st["spec_proposed"].sum()),
        spec_tokens_per_verification=_ratio(accepted + verifications, verifications),
        mlx_peak_bytes=float(st["mlx_peak_bytes"].max()) if len(st) else math.nan,
        num_steps=len(st),
        clock=clock,
    )
    # Plain Python scalars, in SUMMARY_KEYS order, so summary.json is stable and diffable.
    return {k: out[k].item() if isinstance(out[k], np.generic) else out[k] for k in SUMMARY_KEYS}


def reachable_hits_recovered(summary: Mapping[str, Any]) -> float:
    """The share of the prefix hits a device-only cache left on the table that the lower
    tiers served: (prefix_hit_rate_host + prefix_hit_rate_disk) / (max_prefix_hit_rate_blocks
    - prefix_hit_rate_device), the bound being an unbounded cache's hit rate on the trace as
    sent (``harness.workload.traces.max_prefix_hit_rate`` at whole blocks). 0 without a lower
    tier; NaN when the arena already reached the bound. The question SGLang HiCache and
    LMCache answer by a second tier, measured as the issue's eviction table does (Belady and
    LRU against the bound)."""
    lower = summary["prefix_hit_rate_host"] + summary["prefix_hit_rate_disk"]
    return _ratio(lower, summary["max_prefix_hit_rate_blocks"] - summary["prefix_hit_rate_device"])


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def abort_reasons(requests: pd.DataFrame) -> list[tuple[int, str]]:
    """(count, reason) of the aborted requests, most frequent first. Reasons that differ only
    in their numbers are one group, each number shown as the range it spans ("prompt of 24-40
    tokens exceeds max_model_len=8"): a request's own length must not split the count."""
    groups: dict[str, list[list[float]]] = {}
    for reason in requests_frame(requests).query("finish_reason == 'abort'")["abort_reason"]:
        text = "no reason recorded" if _is_missing(reason) else reason
        numbers = [float(n) for n in _NUMBER.findall(text)]
        groups.setdefault(_NUMBER.sub("{}", text), []).append(numbers)
    out = []
    for template, rows in groups.items():
        spans = [
            f"{min(col):g}" if min(col) == max(col) else f"{min(col):g}-{max(col):g}"
            for col in zip(*rows, strict=True)
        ]
        out.append((len(rows), template.format(*spans)))
    return sorted(out, key=lambda item: -item[0])


def format_outcome(requests: pd.DataFrame) -> str:
    """One line: how many requests completed and, if any aborted, how many for which reason
    ("0 of 6 requests completed: 6 aborted (prompt of 24-40 tokens exceeds max_model_len=8)")."""
    reasons = abort_reasons(requests)
    aborted = sum(count for count, _ in reasons)
    line = f"{len(requests) - aborted} of {len(requests)} requests completed"
    if not reasons:
        return line
    if len(reasons) == 1:
        return f"{line}: {aborted} aborted ({reasons[0][1]})"
    return f"{line}: {aborted} aborted ({'; '.join(f'{n}: {r}' for n, r in reasons)})"


def _num(value: float, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """A figure with its unit, or "n/a" (no unit) when there is nothing to report."""
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value * scale:,.{digits}f}{unit}"


def format_summary(summary: Mapping[str, Any]) -> str:
    """A compact two-column table (metric, value with unit) for the end of a run."""
    s = summary
    rows = [
        (
            f"{m.upper()} ({s['clock']} clock)",
            " / ".join(_num(s[f"{m}_{q}"], 1e3) for q in STATS) + " ms  (mean/p50/p90/p99)",
        )
        for m in LATENCIES
    ]
    rows += [
        ("Duration", _num(s["duration"], unit=" s")),
        ("Requests completed / aborted", f"{s['completed']} / {s['aborted']}"),
        ("Output throughput", _num(s["output_throughput"], unit=" tok/s")),
        ("Total token throughput", _num(s["total_token_throughput"], unit=" tok/s")),
        ("Request throughput", _num(s["request_throughput"], digits=3, unit=" req/s")),
        ("Goodput (SLOs met)", _num(s["goodput"], digits=3, unit=" req/s")),
    ]
    for agg in ("mean", "peak"):  # mean: weighted by step duration
        parts = " ".join(f"{p} {_num(s[f'kv_{p}_frac_{agg}'], 100, 1, unit='%')}" for p in KV_PARTS)
        rows.append((f"KV slots ({'time mean' if agg == 'mean' else agg})", parts))
    rows += [
        ("KV utilisation (tokens/allocated)", _num(s["kv_utilisation"], 100, 1, unit=" %")),
        (
            "Blocks used peak / mean",
            f"{_num(s['blocks_used_peak'], digits=0)} / {_num(s['blocks_used_mean'], digits=1)}",
        ),
        *(
            [("Window ring blocks peak", _num(rings, digits=0))]
            if (rings := s.get("window_blocks_used_peak", 0)) > 0  # a sliding-window model
            else []
        ),
        (
            "External fragmentation (mean)",
            _num(s["external_fragmentation_mean"], 100, 1, unit=" %"),
        ),
        ("KV saved by sharing (fork)", _num(s["kv_sharing_saving"], 100, 1, unit=" %")),
        ("Prefix hit rate", _num(s["prefix_hit_rate"], 100, 1, unit=" %")),
        *_tier_rows(s),
        ("Preemptions", str(s["preemptions"])),
        (
            "Spec acceptance rate alpha / draft",
            f"{_num(s['spec_acceptance_rate'], 100, 1, unit=' %')} / "
            f"{_num(s['spec_draft_acceptance_rate'], 100, 1, unit=' %')}",
        ),
        ("Spec tokens / verification", _num(s["spec_tokens_per_verification"])),
        ("MLX peak memory", _num(s["mlx_peak_bytes"], 2.0**-20, 1, unit=" MiB")),
        ("Engine steps", str(s["num_steps"])),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def has_tiers(summary: Mapping[str, Any]) -> bool:
    """The run moved KV to or from a lower tier, or hit one (kv_tier): its tier figures say
    something (a run without tiers, or whose tiers never filled, shows none of them)."""
    keys = (
        "tier_bytes_loaded",
        "tier_bytes_written",
        "prefix_hit_rate_host",
        "prefix_hit_rate_disk",
    )
    return any(summary.get(k, 0) > 0 for k in keys)


def _tier_rows(s: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The console rows of the lower tiers' figures, when the run has any (``has_tiers``)."""
    if not has_tiers(s):
        return []
    hits = " / ".join(_num(s[f"prefix_hit_rate_{t}"], 100, 1, unit=" %") for t in HIT_TIERS)
    moved = " / ".join(_num(s[k], 2.0**-20, 1) for k in ("tier_bytes_loaded", "tier_bytes_written"))
    return [
        ("Prefix hits device / host / disk", hits),
        (
            "Reachable hits recovered",
            _num(s.get("reachable_hits_recovered", math.nan), 100, 1, unit=" %"),
        ),
        ("Tier loaded / written", f"{moved} MiB"),
    ]
