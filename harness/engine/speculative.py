"""Speculative decoding mechanics: the draft proposer and the acceptance rule.

One step of a sequence with ``n`` tokens (``n - 1`` of them with target KV) and ``k`` drafts::

    draft:   catch up on token_ids[d:n] -> x_1, then x_1 -> x_2, ..., x_{k-1} -> x_k
             (k batched draft forwards per engine step, one token each per sequence)
    target:  [t_{n-1}, x_1 .. x_k] at positions n-1 .. n+k-1 in one forward, k + 1 logits
    accept:  x_1 .. x_m (Leviathan et al. 2023), then one token from the target: the
             correction at the first rejection, or a bonus token when all k are accepted

Greedy requests accept a draft token iff it is the target's argmax. Sampling requests accept
``x ~ q`` with probability ``min(1, p(x) / q(x))`` and on rejection draw from
``norm(max(0, p - q))``, which makes every emitted token distributed exactly as the target's
``p``. Both ``p`` and ``q`` go through the sampler's own processing (penalties, min_tokens
bans, temperature, top-k/top-p/min-p), with the context each position actually has.

Three ways of drafting (config group ``speculative/``), each a ``Speculative``:

    Speculation  (draft)      a draft model: another model, or one built from the target
    LayerSkip    (layerskip)  the target's first layers, its norm and head (shared weights)
    NGram        (ngram)      prompt lookup in the sequence's own tokens (harness/engine/
                              ngram.py): no draft model, no draft KV, maybe fewer than k

Speculative decoding is an engine feature: for a draft model the engine builds the draft
model and its allocator like the target's (same allocator policy, same number of blocks, so
it holds every running sequence), counts the draft's KV in the run's budget, and sets the
scheduler's ``num_lookahead_slots``. The scheduler owns the draft's allocator as it owns the
target's (``schedulers/kv_groups.py``): it reserves the draft's slots when it widens a
decode, rolls them back to the accepted tokens and drops them when the sequence leaves the
device (finish, abort, preemption). The proposer only reads the draft's block tables.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from allocators.base import BlockAllocator
from harness.engine.kv_cache import UNQUANTIZED, KVArena, KVFormat
from harness.engine.model_runner import ModelRunner, Row
from harness.engine.request import Seq
from harness.engine.sampling import (
    SampleRow,
    adjust_logits,
    draw_tokens,
    filtered_probs,
    logprob_dict,
    logprob_values,
)
from harness.engine.sampling_params import LogprobsMode, TokenLogprobs
from harness.platform.models import LoadedModel, prefix_model, random_model
from schedulers.output import Scheduled

# The sampler's view of a sequence with some draft tokens appended (the engine's _sample_row).
RowFor = Callable[[Seq, Sequence[int]], SampleRow]


@dataclass(frozen=True)
class Speculative(ABC):
    """What every way of drafting shares: ``num_draft_tokens`` (k) per decode, the
    scheduler's lookahead slots. ``draft_for`` gives the draft model, or None for a
    proposer that runs none (n-gram lookup: no draft KV either)."""

    name: ClassVar[str]  # the speculative/ config option
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative.num_draft_tokens={k!r} is invalid: an int >= 1")

    @abstractmethod
    def draft_for(self, target: LoadedModel) -> LoadedModel | None:
        """The draft model proposing for ``target`` (None: no model, no draft KV)."""


@dataclass(frozen=True)
class Speculation(Speculative):
    """A draft model proposes: ``draft`` is a LoadedModel, a callable building one from the
    target (e.g. ``functools.partial(noisy_copy, scale=0.017)``), or None for
    ``random_draft``."""

    name: ClassVar[str] = "draft"
    draft: LoadedModel | Callable[[LoadedModel], LoadedModel] | None = None

    def draft_for(self, target: LoadedModel) -> LoadedModel:
        """The draft model for ``target``, checked to share its vocabulary."""
        spec = self.draft
        draft = spec if isinstance(spec, LoadedModel) else (spec or random_draft)(target)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model {draft.name!r} has vocabulary {draft.vocab_size}, target "
                f"{target.name!r} has {target.vocab_size}: speculative decoding needs the same"
            )
        return draft


@dataclass(frozen=True)
class LayerSkip(Speculative):
    """Self-speculation (LayerSkip, Elhoushi et al. 2024, without its early-exit training):
    the draft is the target's first ``num_layers`` layers, then its final norm and LM head,
    sharing the target's weights (``prefix_model``). Its KV is its own (one arena layer per
    draft layer), as a draft model's. ``num_layers=None``: half the target's layers."""

    name: ClassVar[str] = "layerskip"
    num_layers: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(
                f"speculative.num_layers={n!r} is invalid: an int >= 1 (the target's first "
                "layers the draft runs), or null for half of them"
            )

    def draft_for(self, target: LoadedModel) -> LoadedModel:
        """The target's first ``num_layers`` layers as a model of their own."""
        layers = target.num_layers
        n = max(1, layers // 2) if self.num_layers is None else self.num_layers
        if not 1 <= n < layers:
            raise ValueError(
                f"speculative.num_layers={n} is invalid for model {target.name!r} of {layers} "
                f"layers: set 1 <= num_layers < {layers} (all of them would be the target)"
            )
        return prefix_model(target, n)


@dataclass(frozen=True)
class NGram(Speculative):
    """Prompt lookup (vLLM's ``method="ngram"``): the longest suffix of the sequence's tokens,
    between ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens long, that occurred
    before proposes the tokens that followed it (harness/engine/ngram.py). No draft model,
    no draft KV. Unset bounds resolve as vLLM's: one missing takes the other's value, both
    missing are 5."""

    name: ClassVar[str] = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for field_, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"speculative.{field_}={value!r} is invalid: an int >= 1, or null")
        hi = hi if hi is not None else (lo if lo is not None else 5)
        lo = lo if lo is not None else hi
        if lo > hi:
            raise ValueError(
                f"speculative.prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}: set min <= max"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def draft_for(self, target: LoadedModel) -> None:
        return None


@dataclass
class Verifications:
    """One step's verification counts: ``proposed`` draft tokens, ``accepted`` of them,
    ``rejected`` verifications that stopped at a rejected draft (at most one each), out of
    ``verifications`` (sequences verified)."""

    proposed: int = 0
    accepted: int = 0
    rejected: int = 0
    verifications: int = 0


@dataclass
class Proposal:
    """A sequence's draft tokens and, for sampling requests, the draft distribution of each."""

    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)  # q_j, normalised; empty if greedy


@dataclass
class Verified:
    """What the target's verification decided for one sequence."""

    tokens: list[int]  # accepted drafts, then the correction or bonus token
    accepted: int  # drafts accepted
    logprobs: list[TokenLogprobs] | None = None  # per token, when params.logprobs


def random_draft(
    target: LoadedModel, arch: str = "llama", size: str = "tiny", seed: int = 1, **overrides: Any
) -> LoadedModel:
    """The default draft: a seeded random model of a small size with the target's vocabulary."""
    return random_model(arch, size, seed, vocab_size=target.vocab_size, **overrides)


class Proposer(Protocol):
    """What the engine asks of a source of drafts: ``propose`` at most ``num_draft_tokens``
    per verification of the plan. ``runs_model``: a draft model computes them (its forwards
    are a step's ``draft_rounds`` and ``draft_tokens``, and it has a ``runner`` whose KV
    blocks the plan's ``draft_copies`` move)."""

    runs_model: bool

    def propose(self, work: Sequence[Scheduled], row_for: RowFor) -> list[Proposal]: ...


class DraftProposer:
    """Runs the draft model over its own paged KV arena and proposes tokens per sequence.

    ``allocator``: the draft's, owned by the scheduler; the proposer reads its tables.
    ``kv_format``: how its arena stores K and V (the target's: engine.kv_bits applies to
    both, and the byte budget pays for both at it)."""

    runs_model = True

    def __init__(
        self, draft: LoadedModel, allocator: BlockAllocator, kv_format: KVFormat = UNQUANTIZED
    ) -> None:
        self.model = draft
        self.allocator = allocator
        self.arena = KVArena.for_model(draft, allocator.num_blocks, allocator.block_size, kv_format)
        self.runner = ModelRunner(draft, self.arena)

    def propose(self, work: Sequence[Scheduled], row_for: RowFor) -> list[Proposal]:
        """``s.num_draft_tokens`` draft tokens for each verification ``s`` of the plan; the
        scheduler gave the draft slots for them (``Scheduled.draft_start`` on)."""
        proposals = [Proposal() for _ in work]
        for j in range(max((s.num_draft_tokens for s in work), default=0)):
            batch = [i for i, s in enumerate(work) if s.num_draft_tokens > j]
            rows = [self._row(work[i], proposals[i], j) for i in batch]
            table = np.array(self.runner.run(rows))
            for b, i in enumerate(batch):
                seq, proposal = work[i].seq, proposals[i]
                row = row_for(seq, proposal.tokens)
                logits = adjust_logits(table[b], row)
                if row.params.greedy:
                    proposal.tokens.append(int(np.argmax(logits)))
                else:
                    q = _normalised(filtered_probs(logits, row.params))
                    proposal.tokens.append(_draw(q, row.rng))
                    proposal.probs.append(q)
        return proposals

    def _row(self, s: Scheduled, proposal: Proposal, j: int) -> Row:
        seq = s.seq
        table = self.allocator.block_table(seq.request_id)
        if j == 0:  # catch up with the sequence: its new tokens (the whole prompt at first)
            return Row(seq.token_ids[s.draft_start :].tolist(), s.draft_start, table)
        return Row([proposal.tokens[-1]], seq.num_tokens + j - 1, table)


def verify(
    logits: np.ndarray,
    proposal: Proposal,
    rows: Callable[[int], SampleRow],
    logprobs_mode: LogprobsMode = "raw_logprobs",
) -> Verified:
    """Leviathan acceptance of ``proposal`` against target ``logits`` [len(drafts) + 1, vocab].

    ``rows(j)`` is the sampler's view of the sequence with the first ``j`` drafts appended.
    Target distributions are computed only up to the first rejection. Each emitted token's
    logprobs are the target's at its position, as plain decoding would give them.
    """
    tokens: list[int] = []
    logprobs: list[TokenLogprobs] = []
    for j in range(len(proposal.tokens) + 1):
        row = rows(j)
        adjusted = adjust_logits(logits[j], row)
        draft = proposal.tokens[j] if j < len(proposal.tokens) else None
        p = None
        if row.params.greedy:
            token = int(np.argmax(adjusted))
        else:
            p = _normalised(filtered_probs(adjusted, row.params))
            q = proposal.probs[j] if draft is not None else None
            token = accept_or_resample(p, q, draft, row.rng)
        tokens.append(token)
        if row.params.logprobs is not None:
            kept = None if p is None else p > 0
            values = logprob_values(logits[j], adjusted, kept, row.params, logprobs_mode)
            logprobs.append(logprob_dict(values, token, row.params.logprobs))
        if token != draft:
            break
    accepted = len(tokens) - 1
    return Verified(tokens, accepted, logprobs if rows(0).params.logprobs is not None else None)


def verify_tokens(targets: Sequence[int], proposal: Proposal) -> Verified:
    """Greedy acceptance against the target's chosen tokens [len(drafts) + 1] rather than
    its logits (a runner without a model, harness/engine/modelled.py): drafts are accepted
    while they equal the target's token, then the target's token at the first difference
    (or the bonus token) is emitted."""
    tokens = []
    for j, token in enumerate(targets):
        tokens.append(int(token))
        if j == len(proposal.tokens) or token != proposal.tokens[j]:
            break
    return Verified(tokens, len(tokens) - 1)


def accept_or_resample(
    p: np.ndarray, q: np.ndarray | None, draft: int | None, rng: np.random.Generator
) -> int:
    """One position of speculative sampling: ``draft`` (drawn from ``q``) if accepted, else a
    token from the residual ``norm(max(0, p - q))``; with no draft, a bonus token from ``p``.

    The returned token is distributed as ``p`` whatever ``q`` is (Leviathan et al., thm. 1).
    """
    if draft is None:
        return _draw(p, rng)
    if rng.random() * q[draft] < p[draft]:  # probability min(1, p/q), without dividing by 0
        return draft
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    # p == q up to rounding leaves no residual mass; p itself is then the right law.
    return _draw(residual / total if total > 0 else p, rng)


def _normalised(probs: np.ndarray) -> np.ndarray:
    return probs / probs.sum()


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    return int(draw_tokens(probs[None], np.array([rng.random()]))[0])
