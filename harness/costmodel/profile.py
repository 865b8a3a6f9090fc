"""Step-cost profiles: a step's duration from its work (harness/costmodel/work.py).

A profile file is the contract between the machine that measured (or the device sheet that
derived) the costs and any machine that replays with them (``engine.clock=model
engine.profile=PATH``). It is JSON, schema ``kvbench-profile`` version 1:

    format, version      "kvbench-profile", 1
    kind                 "measured" (kvbench-calibrate) or "roofline"
                         (harness/costmodel/roofline.py)
    model                the model's shape: name, fingerprint (``fingerprint``), num_layers,
                         hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
                         vocab_size, dtype, num_params
    block_size           the KV block size the work was counted at
    machine              where it was measured (harness/platform/machine.py ``info``) or the
                         device it was derived for
    features             the priced counts, in order (work.PRICED: steps-table column
                         names, but block_copies and swap_blocks, which are sums of two;
                         a roofline profile's are the same, work.PRICED)
    kinds                per step kind: {"coefficients": {feature or "step": seconds per
                         unit}, "residuals": {...}} (measured); "step" is the intercept
    moves                seconds per block: {"block_copies": ..., "swap_blocks": ...}
    acceptance_rate      the per-token speculative acceptance rate alpha measured while
                         calibrating (metrics.acceptance_rate: accepted / (accepted +
                         rejected), Leviathan et al.), the Bernoulli(alpha) the model clock
                         draws each draft from up to the first rejection (null: none)
    roofline             (roofline only) peak rates, efficiency, host overhead and each
                         operator's FLOPs and bytes per unit of the counts
                         (harness/costmodel/roofline.py)
    created              ISO time it was written

A measured profile prices a step as ``moves . counts + kinds[kind] . (1, counts)``: linear
per step kind, so piecewise-linear over the step's mix of prefill and decode. A roofline
profile (``RooflineProfile``) prices each operator by the slower of its FLOPs and its bytes at
the stored rates; roofline.py derives the file from a device sheet and imports this module,
never the other way.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from operator import itemgetter, mul
from pathlib import Path
from typing import Any, Protocol

from harness.costmodel.work import KINDS, PRICED, WINDOW, StepWork

FORMAT, VERSION = "kvbench-profile", 1
MOVES = ("block_copies", "swap_blocks")  # priced per block, whatever the step's kind
INTERCEPT = "step"
# A roofline profile's resources (FLOPs, bytes, bytes over the host link) and the counts an
# operator may be priced by: the step's features, the padded batches that run the LM head
# (a batch of prefill chunks that want no logits skips it), a mixture of experts' experts
# whose weights the padded batches read (``RooflineProfile.times``), and the sliding-window
# layers' reads, pairs and ring swaps (work.WINDOW).
RESOURCES = ("compute", "memory", "host_link")
COUNTS = (*PRICED, "logit_groups", "experts_read", *WINDOW)


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file, the field and the fix."""


class ProfileWarning(UserWarning):
    """A profile used where it may price wrongly: at a block size it was not calibrated at."""


class Profile(Protocol):
    """What the model clock needs from a profile."""

    path: str
    kind: str
    data: dict[str, Any]

    def predict(self, work: StepWork) -> float:
        """The step's duration in seconds."""
        ...


def fingerprint(shape: dict[str, Any]) -> str:
    """A model's identity for pricing: a hash of its shape (not its weights' values, which
    do not change a step's cost), the first 16 hex digits of a SHA-256."""
    keys = sorted(k for k in shape if k not in ("name", "fingerprint"))
    canonical = json.dumps({k: shape[k] for k in keys}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass
class MeasuredProfile:
    """A fitted profile: linear in the step's counts per step kind (module docstring)."""

    path: str
    data: dict[str, Any]
    kind: str = "measured"

    def __post_init__(self) -> None:
        # Rows of (intercept, coefficients in PRICED order), per kind; moves apart.
        self._moves = [self.data["moves"].get(m, 0.0) for m in MOVES]
        self._moved = itemgetter(*(PRICED.index(m) for m in MOVES))  # of the priced counts
        self._kinds = {}
        for kind, fit in self.data["kinds"].items():
            c = fit["coefficients"]
            self._kinds[kind] = (c.get(INTERCEPT, 0.0), [c.get(f, 0.0) for f in PRICED])

    def predict(self, work: StepWork) -> float:
        kind = work.kind
        if kind == "idle" and kind not in self._kinds:  # no row ran: the moves alone
            self._kinds[kind] = (0.0, [0.0] * len(PRICED))
        if kind not in self._kinds:
            raise ProfileError(
                f"{self.path}: field 'kinds' has no {kind!r} steps; calibrate with a grid "
                f"that runs them ({_HOW[kind]})"
            )
        base, coefficients = self._kinds[kind]
        counts = work.vector()
        # The products summed in order as a generator would, without its frame per term
        # (both lists are PRICED long, MOVES long: built so in __post_init__).
        cost = base + sum(map(mul, coefficients, counts))
        return cost + sum(map(mul, self._moves, self._moved(counts)))


class RooflineProfile:
    """A derived profile: per operator, the slower of its compute and its memory traffic
    (module docstring). It prices from ``data`` alone, so a saved file predicts alike."""

    kind = "roofline"

    def __init__(self, path: str, data: dict[str, Any]):
        self.path = path
        self.data = data
        fix = "re-derive it with python -m harness.costmodel.roofline"
        section = data.get("roofline")
        if not isinstance(section, dict):
            raise ProfileError(f"{path}: field 'roofline' is missing; {fix}")
        try:
            rates = {r: section["peak"][r] * section["efficiency"][r] for r in RESOURCES}
            self._overhead = section["overhead"]["step"], section["overhead"]["rows"]
            experts = section.get("experts")
            self._experts = (experts["num"], experts["active"]) if experts else None
            # name -> resource -> (rate, [(count, amount per unit)])
            self._operators = {
                name: {r: (rates[r], list(per.items())) for r, per in op.items()}
                for name, op in section["operators"].items()
            }
        except (KeyError, TypeError, AttributeError) as e:
            raise ProfileError(f"{path}: field 'roofline' is malformed ({e!r}); {fix}") from None
        for name, op in self._operators.items():
            unknown = {k for _, per in op.values() for k, _ in per} - set(COUNTS)
            if unknown:
                raise ProfileError(
                    f"{path}: roofline.operators.{name} prices {sorted(unknown)}: counts are "
                    f"{list(COUNTS)}"
                )

    def times(self, work: StepWork) -> dict[str, dict[str, float]]:
        """Each operator's seconds on each resource it uses: the roofline's bars.

        A mixture of experts' padded batch of t tokens, each routed to k of E experts, reads
        the weights of the experts at least one token reaches: E (1 - (1 - k/E)^t) of them
        on average if tokens pick experts uniformly and independently (a router balanced by
        its training loss; real routing is skewed, so fewer); with t the step's padded query
        tokens per group."""
        counts = dict(zip(PRICED, work.vector(), strict=True))
        counts["logit_groups"] = min(work.row_groups, work.logit_rows)
        counts["experts_read"] = 0.0
        counts["window_kv_slots_read"] = work.window_kv_slots_read
        counts["window_attention_pairs"] = work.window_attention_pairs
        counts["window_swap_blocks"] = work.window_swap_blocks
        if self._experts is not None and work.row_groups:
            experts, k = self._experts
            tokens = work.query_tokens_padded / work.row_groups
            reached = experts * (1 - (1 - k / experts) ** tokens)
            counts["experts_read"] = work.row_groups * reached
        return {
            name: {r: sum(a * counts[k] for k, a in per) / rate for r, (rate, per) in op.items()}
            for name, op in self._operators.items()
        }

    def predict(self, work: StepWork) -> float:
        """The step's seconds: its host overhead plus, per operator, its slowest resource."""
        if work.draft_rounds and "draft" not in self._operators:
            raise ProfileError(
                f"{self.path}: a verify step runs the draft model, which this profile does "
                "not price; derive it with the draft's shape (derive(draft=...), --draft)"
            )
        step, per_row = self._overhead
        bars = self.times(work).values()
        return step + per_row * work.batch_size + sum(max(t.values()) for t in bars)


_HOW = {
    "decode": "kvbench-calibrate runs decode steps by default",
    "prefill": "kvbench-calibrate runs prefill steps by default",
    "mixed": "kvbench-calibrate runs mixed steps by default",
    "verify": "kvbench-calibrate speculative=draft",
}


def load(path: str | os.PathLike) -> Profile:
    """Read and check a profile file; a bad one raises ProfileError naming file and field."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileError(
            f"engine.profile={where!r}: no such file; write one with kvbench-calibrate "
            "or harness.costmodel.roofline"
        ) from None
    except (OSError, ValueError) as e:
        raise ProfileError(f"{where}: not a JSON profile ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"{where}: field 'format' is not {FORMAT!r}; not a kvbench profile")
    if data.get("version") != VERSION:
        raise ProfileError(
            f"{where}: field 'version' is {data.get('version')!r}; this kvbench reads "
            f"version {VERSION}: re-run kvbench-calibrate"
        )
    for name in ("kind", "model", "block_size"):
        if name not in data:
            raise ProfileError(f"{where}: field {name!r} is missing; re-run kvbench-calibrate")
    if data["kind"] == "roofline":
        return RooflineProfile(where, data)
    if data["kind"] != "measured":
        raise ProfileError(f"{where}: field 'kind' is {data['kind']!r}: measured or roofline")
    for name in ("kinds", "moves"):
        if not isinstance(data.get(name), dict):
            raise ProfileError(f"{where}: field {name!r} is missing; re-run kvbench-calibrate")
    for kind, fit in data["kinds"].items():
        if kind not in KINDS:
            raise ProfileError(f"{where}: field 'kinds' has {kind!r}: kinds are {KINDS}")
        known = {INTERCEPT, *PRICED}
        unknown = set(fit.get("coefficients", {})) - known
        if unknown:
            raise ProfileError(
                f"{where}: kinds.{kind}.coefficients has {sorted(unknown)}: features are "
                f"{sorted(known)}; re-run kvbench-calibrate"
            )
    return MeasuredProfile(where, data)


def save(data: dict[str, Any], path: str | os.PathLike) -> None:
    """Write a profile atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
