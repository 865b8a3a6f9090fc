"""The engine without a model (``engine.clock=model``): a step priced by a cost profile.

The same LLMEngine, allocators, schedulers, recorder and metrics run; only what computes a
step changes. ``shape_model`` (``model=shape model.config=PATH``) is a model without
weights: its config.json's shape, all the model clock needs. ``ModelledRunner`` stands in
for the model behind the ``Runner`` seam: from the step's shape (``StepShape``, lists of ints; no
``Row`` is built) it counts the step's work (``count_work``, the same counts the real
runner reports) and chooses the tokens, and ``ModelClock`` advances by
the profile's price of that work
(harness/costmodel). Nothing is timed, so a replay gives the same tables on any machine,
under any load.

Tokens: each logits row gets a token drawn from a seeded generator (requests run with
``ignore_eos``, so each emits exactly its ``max_tokens``). A verification row (the last
token plus ``k`` drafts) accepts each draft with probability ``acceptance`` (Bernoulli),
up to the first rejection, whose position gets a different token; all accepted gives a
bonus token, as Leviathan et al.'s rule does.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import add, sub

import mlx.core as mx
import numpy as np

from harness.costmodel.profile import Profile
from harness.costmodel.shape import from_config, read_config
from harness.costmodel.tiers import TierCost
from harness.costmodel.work import TIERS, StepWork
from harness.engine.clock import VirtualClock
from harness.engine.model_runner import Forward
from harness.engine.speculative import Proposal, RowFor
from harness.engine.step_shape import StepShape, count_work, decodes_join, decodes_work
from harness.platform.models import LoadedModel
from schedulers.output import Scheduled, SchedulerOutput


def shape_model(
    config: str, bits: int | None = None, group_size: int = 64, dtype: str | None = None
) -> LoadedModel:
    """A model of ``config``'s shape (a config.json, or a folder holding one; ``bits``,
    ``group_size`` and ``dtype`` as harness/costmodel/shape.py ``load``) without weights or
    tokenizer: the model clock prices its steps, nothing runs it (``build_engine`` refuses
    it on another clock). Prompts are token ids below its vocabulary."""
    parsed, name = read_config(config)
    shape = from_config(parsed, name, bits=bits, group_size=group_size, dtype=dtype)
    return LoadedModel(
        model=None,
        name=shape["name"],
        num_layers=shape["num_layers"],
        num_kv_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        vocab_size=shape["vocab_size"],
        dtype=getattr(mx, shape["dtype"]),
        max_position_embeddings=parsed.get("max_position_embeddings"),
        window_layers=tuple(shape["window_layers"]),
        window=shape["window"],
        spec=shape,
    )


def step_work(plan: SchedulerOutput, forward: StepWork, draft_model: bool = True) -> StepWork:
    """The step's work: the ``forward``'s part (``Forward.work``; ``StepWork()`` when no row
    ran) and the plan's block moves (a window model's rings too; its tier moves counted by
    tier: a load by the tier it comes from, a write by the tier it goes to) and draft work
    (none without a ``draft_model``: n-gram lookup)."""
    drafts = [s for s in plan.scheduled if s.num_draft_tokens] if draft_model else []
    swapped = plan.swapped_out or plan.swapped_in  # most steps move nothing: no pass then
    if not (swapped or drafts or plan.copies or plan.draft_copies or plan.tier_moves):
        return forward  # nothing moved nor drafted: the forward's part is all (frozen)
    moved = dict.fromkeys(TIERS, 0) if plan.tier_moves else {}
    for move in plan.tier_moves:
        if move.dst_tier == "device":
            moved[f"{move.src_tier}_blocks_loaded"] += 1
        else:
            moved[f"{move.dst_tier}_blocks_written"] += 1
    return StepWork(
        batch_size=forward.batch_size,
        swap_out_blocks=sum(len(s.blocks) for s in plan.swapped_out),
        swap_in_blocks=sum(len(s.blocks) for s in plan.swapped_in),
        window_swap_blocks=sum([len(s.ring) for s in (*plan.swapped_out, *plan.swapped_in)])
        if swapped
        else 0,
        block_copies=len(plan.copies),
        row_groups=forward.row_groups,
        query_tokens_padded=forward.query_tokens_padded,
        kv_slots_read=forward.kv_slots_read,
        kv_slots_attended=forward.kv_slots_attended,
        attention_pairs=forward.attention_pairs,
        window_kv_slots_read=forward.window_kv_slots_read,
        window_attention_pairs=forward.window_attention_pairs,
        logit_rows=forward.logit_rows,
        single_token_rows=forward.single_token_rows,
        draft_block_copies=len(plan.draft_copies),
        draft_rounds=max((s.num_draft_tokens for s in drafts), default=0),
        draft_tokens=sum(_draft_fed(s) for s in drafts),
        **moved,
    )


def _draft_fed(s: Scheduled) -> int:
    """Tokens the draft model feeds for one verification: it catches up from ``draft_start``
    to the sequence's end, then feeds its own proposals but the last."""
    return s.seq.num_tokens - s.draft_start + s.num_draft_tokens - 1


class ModelClock(VirtualClock):
    """A virtual clock that advances by the profile's price of each step's work, never by a
    measurement: ``charge`` the step's work, then ``advance``. ``tiers``: the price of the
    step's tier moves (kv_tier), added to it; a load prefetched a step ahead pays only what
    the previous step's price does not hide (harness/costmodel/tiers.py), none after an idle
    wait."""

    name = "model"
    measures = False

    def __init__(self, profile: Profile, start: float = 0.0, tiers: TierCost | None = None):
        super().__init__(start)
        self.profile = profile
        self.tiers = tiers
        self._step = 0.0
        self._previous = 0.0  # the previous step's price without its tier moves
        self._price = profile.predict

    def charge(self, work: StepWork) -> None:
        price = self._price(work)
        if self.tiers is None:
            self._step = price
            return
        self._step = price + self.tiers.step_seconds(work, self._previous)
        self._previous = price

    def wait_until(self, t: float) -> None:
        """Idle until ``t``: a step after the wait had no step computing just before it, so
        no prefetch hid its loads (a request that arrived then was not there to prefetch)."""
        if t > self._now:
            self._previous = 0.0
        super().wait_until(t)

    def after(self, elapsed: float) -> float:
        return self._now + self._step

    def advance(self, duration: float) -> float:
        step, self._step = self._step, 0.0
        self._now += step
        return step


_DRAW_AHEAD = 4096  # tokens a draw makes when none verifies


class ModelledRunner:
    """A ``Runner`` without a model: counts each forward's work and draws its tokens.

    It is handed each step's shape as lists (``StepShape``), never ``Row``s, and groups and
    counts them with the real runner's own functions (harness/engine/step_shape.py):
    ``key_cost`` groups rows into padded batches as the real runner would for this model
    (``ModelRunner.key_cost``), so the counts are the ones a real step would have; a model
    with sliding-window layers of ``window`` tokens has its window layers' reads counted
    too, from its rows' starts (``count_work``).

    ``verifies``: its steps may verify drafts (a speculative engine), whose acceptance draws
    come from the same generator between the steps' token draws. Without, the tokens are
    drawn ahead ``_DRAW_AHEAD`` at a time: the same tokens (a generator's ``integers`` draws
    concatenate to one draw of their total size), without a draw's fixed cost a step."""

    arena = None  # no KV arena: nothing is computed
    computes_logits = False

    def __init__(
        self,
        *,
        block_size: int,
        key_cost: float,
        vocab_size: int,
        acceptance: float,
        seed: int,
        window: int | None = None,
        verifies: bool = True,
    ) -> None:
        self.block_size = block_size
        self.window = window
        self.key_cost = key_cost
        self.vocab_size = vocab_size
        self.acceptance = acceptance
        self._rng = np.random.default_rng([seed, 0x5EED])
        self.verifies = verifies
        self._ahead = np.empty(0, dtype=np.int64)  # tokens drawn, not yet handed out
        # The contexts of the last step whose rows, a token each, all joined one group: the
        # next step's join too if each is one further (``decodes_join`` reads only the sorted
        # contexts' gaps, which are the same), found without sorting them.
        self._joined: list[int] | None = None

    def forward(self, shape: StepShape, carried=None) -> Forward:
        """The step's work and tokens from its shape alone (the engine builds no ``Row``)."""
        queries = shape.queries
        contexts = list(map(add, shape.starts, queries))
        logit_rows = sum(shape.num_logits)
        key_cost, window = self.key_cost, self.window
        last, joined = self._joined, None
        if last is not None and len(last) == len(contexts) and queries.count(1) == len(queries):
            joined = list(map(sub, contexts, last)) == queries or None
        if joined is None:
            joined = decodes_join(queries, contexts, key_cost)
        self._joined = contexts if joined and queries[0] == 1 else None
        work = count_work(queries, contexts, logit_rows, key_cost, self.block_size, window, joined)
        return Forward(None, 0.0, 0.0, work, tokens=self._tokens(shape, logit_rows))

    def decode_run(self, starts: list[int]) -> RunForwards:
        """The forwards of a run of decode steps whose rows start at ``starts``
        (schedulers/decode_run.py): ``RunForwards``."""
        return RunForwards(self, starts)

    def draw(self, count: int) -> np.ndarray:
        """``count`` tokens of a step that verifies nothing, from those drawn ahead."""
        if len(self._ahead) < count:
            more = self._rng.integers(0, self.vocab_size, max(count, _DRAW_AHEAD))
            self._ahead = np.concatenate([self._ahead, more])
        drawn, self._ahead = self._ahead[:count], self._ahead[count:]
        return drawn

    def _tokens(self, shape: StepShape, logit_rows: int) -> np.ndarray:
        """One token per logits row (``logit_rows`` in all), in row order; a verification's
        rows first take its drafts while the Bernoulli draws accept them (a draw of ``k`` for
        a verification of ``k`` drafts, in row order, after the step's tokens)."""
        if not self.verifies:
            if shape.drafts:
                raise RuntimeError("a step verifies drafts on a runner built with verifies=False")
            return self.draw(logit_rows)
        drawn = self._rng.integers(0, self.vocab_size, logit_rows)
        if not shape.drafts:  # no verification: nothing to accept
            return drawn
        logits = shape.num_logits
        offsets = (np.cumsum(logits) - logits).tolist()  # each row's first logits row
        for row, drafts in shape.drafts.items():
            at, k = offsets[row], len(drafts)
            accepted = self._rng.random(k) < self.acceptance
            m = k if accepted.all() else int(np.argmin(accepted))
            drawn[at : at + m] = drafts[:m]
            if m < k and drawn[at + m] == drafts[m]:  # a rejection differs from its draft
                drawn[at + m] = (drafts[m] + 1) % self.vocab_size
        return drawn

    def launch(self, outputs) -> None:
        pass

    def wait(self, outputs) -> None:
        pass

    def copy_blocks(self, copies) -> None:
        pass

    def swap_out(self, blocks: Sequence[int]) -> None:
        return None

    def swap_in(self, host, blocks: Sequence[int], first: int = 0) -> None:
        pass


class RunForwards:
    """The forwards of a run of decode steps (schedulers/decode_run.py): every step, each
    row one token further. When the rows join one group at the first step (``decodes_join``;
    then at every step: their contexts' gaps stay the same) on a model without window
    layers, a step's work is that group's counts (``decodes_work``) from the longest context
    and the contexts' sum, one further a row each step; otherwise each step is ``forward`` of
    its shape."""

    def __init__(self, runner: ModelledRunner, starts: list[int]) -> None:
        self.runner = runner
        self.starts = starts
        n = len(starts)
        self._ones = [1] * n
        contexts = [start + 1 for start in starts]
        self.joined = runner.window is None and decodes_join(self._ones, contexts, runner.key_cost)
        self._longest, self._total = max(contexts), sum(contexts)

    def forward(self, step: int) -> Forward:
        """Step ``step``'s (from 0): its work and its tokens, one a row."""
        runner, n = self.runner, len(self._ones)
        if not self.joined:
            starts = [start + step for start in self.starts]
            return runner.forward(StepShape(self._ones, starts, self._ones, {}))
        work = decodes_work(n, self._longest + step, self._total + n * step, runner.block_size)
        return Forward(None, 0.0, 0.0, work, tokens=runner.draw(n))


class ModelledProposer:
    """The draft model's stand-in: proposes seeded tokens (which the runner accepts with
    the set probability); the draft's work is priced with the step's (``step_work``)."""

    runs_model = True

    def __init__(self, runner: ModelledRunner, seed: int) -> None:
        self.runner = runner  # the draft's copies go nowhere, as the target's
        self._rng = np.random.default_rng([seed, 0xD2AF])

    def propose(self, work: Sequence[Scheduled], row_for: RowFor) -> list[Proposal]:
        vocab = self.runner.vocab_size
        return [
            Proposal(tokens=self._rng.integers(0, vocab, s.num_draft_tokens).tolist()) for s in work
        ]
