"""A step's logits into its tokens (vLLM's sampler and rejection sampler, around the batched
sampler of sampling.py): prompt logprobs taken, drafts verified (speculative.py), the other
completions of a request with n > 1 made when its prompt is done (each sampling its first
token from the parent's row), the sampling rows drawn, and the beams' candidate rows read.
The engine hands the result to ``Scheduler.update``; here the completions are only made (in
the request table), the scheduler forks them, and the prompt logprobs and speculative counts
are written (the output processor's and this sampler's).

The logits come one row per position a ``Row`` asked for, in plan order: a row's prompt
positions (prompt logprobs), then its sampling position, or a verification's last token and
drafts. A runner without a model chose the tokens itself (``Forward.tokens``), and so did
the forward's graph when every sampling row takes the argmax (``argmax_only``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from harness.engine.forks import Forks
from harness.engine.model_runner import Forward
from harness.engine.outputs import OutputProcessor
from harness.engine.request import Seq
from harness.engine.request_table import RequestTable
from harness.engine.sampling import argmax_tokens, sample
from harness.engine.sampling_params import LogprobsMode, TokenLogprobs
from harness.engine.speculative import Proposal, Verifications, Verified, verify, verify_tokens
from schedulers.output import SchedulerOutput


@dataclass
class Drawn:
    """What one step's logits gave, in plan order: each verification's outcome, each
    sampling sequence's token (and its logprobs, when asked), the completions forked off a
    parent (which sample too), the beams' candidate rows, and the step's verification counts
    (None without verifications)."""

    verified: list[tuple[Seq, Verified]] = field(default_factory=list)
    sampled: list[Seq] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    forks: list[tuple[Seq, Seq]] = field(default_factory=list)
    offering: list[tuple[Seq, np.ndarray]] = field(default_factory=list)
    verifications: Verifications | None = None


class StepSampler:
    """Draws a step's tokens from its forward (see the module docstring)."""

    def __init__(
        self,
        requests: RequestTable,
        outputs: OutputProcessor,
        forks: Forks,
        logprobs_mode: LogprobsMode,
    ) -> None:
        self.requests = requests
        self.outputs = outputs
        self.forks = forks
        self.logprobs_mode = logprobs_mode
        # The sequences of the last step that sampled, each of which takes the argmax
        # (``OutputProcessor.takes_argmax``, true for good once true): a step of the same
        # ones checks none of them.
        self._argmax: set[Seq] = set()

    def draw(
        self,
        plan: SchedulerOutput,
        forward: Forward,
        proposals: dict[Seq, Proposal],
        prompt_positions: dict[Seq, range],
    ) -> Drawn:
        """The step's tokens; ``proposals``: the drafts each verification fed;
        ``prompt_positions``: the prompt positions each row asked logits for (its rows'
        layout, as the engine built them)."""
        requests = self.requests
        if not (proposals or prompt_positions or requests.beams or requests.groups):
            # Most steps: each row that samples has one row of logits, in plan order, and
            # nothing else does (no drafts, prompt logprobs, beam offers or forks).
            return self.draw_rows([s.seq for s in plan.scheduled if s.samples], forward)
        logits, drawn = forward.logits, Drawn()
        sampling, verifying, offset = [], {}, 0  # rows that sample and verify, by logits row
        for s in plan.scheduled:
            seq = s.seq
            if s.num_draft_tokens:  # the drafts proposed (n-gram lookup may find fewer)
                verifying[seq] = offset
                offset += len(proposals[seq].tokens) + 1
                continue
            if prompt_positions and (positions := prompt_positions.get(seq)):
                self.outputs.add_prompt_logprobs(
                    seq, positions, logits[offset : offset + len(positions)]
                )
                offset += len(positions)
            if s.samples:
                sampling.append((seq, offset))
                offset += 1
        if verifying:
            drawn.verified, drawn.verifications = self._verify(forward, verifying, proposals)
        to_sample, picks = drawn.sampled, []
        offering: list[tuple[Seq, int]] = []  # beams offering candidates, and their row
        if not (requests.beams or requests.groups):  # no beam offers, no completion forks
            to_sample += [seq for seq, _ in sampling]
            picks = [row for _, row in sampling]
            sampling = []
        for seq, row in sampling:
            if seq.group_id in requests.beams:
                offering.append((seq, row))
                continue
            to_sample.append(seq)
            picks.append(row)
            # The prompt is done: n > 1 forks the other completions off it, each sampling
            # its first token from the same logits.
            if seq.params.n > 1 and len(requests.groups[seq.group_id]) == 1:
                for child in self.forks.fork_completions(seq):
                    drawn.forks.append((seq, child))
                    to_sample.append(child)
                    picks.append(row)
        if offering:
            rows = mx.array([i for _, i in offering], dtype=mx.int32)
            candidates = np.array(logits[rows].astype(mx.float32))
            drawn.offering = [(s, row) for (s, _), row in zip(offering, candidates, strict=True)]
        if forward.tokens is not None:
            chosen = forward.tokens.tolist()  # ints at once, not a numpy scalar per row
            drawn.tokens, drawn.logprobs = [chosen[i] for i in picks], [None] * len(picks)
            return drawn
        # Rows of drafts or prompt logprobs beside the sampling ones, or forked completions
        # sampling from one row: one row of logits per token drawn.
        if picks != list(range(offset)):
            logits = logits[mx.array(picks, dtype=mx.int32)] if picks else None
        if to_sample:
            self._sample(drawn, logits)
        return drawn

    def draw_rows(self, sampled: list[Seq], forward: Forward) -> Drawn:
        """``draw`` of a step whose rows that sample are ``sampled``, each with one row of
        logits in order, and whose other rows ask for none (no drafts, prompt logprobs,
        beam offers or forks): a running batch's step, and most steps of any plan."""
        drawn = Drawn(sampled=sampled)
        if forward.tokens is not None:
            drawn.tokens = forward.tokens.tolist()
            drawn.logprobs = [None] * len(drawn.tokens)
        elif sampled:
            self._sample(drawn, forward.logits)
        return drawn

    def argmax_only(
        self,
        plan: SchedulerOutput,
        proposals: dict[Seq, Proposal],
        prompt_positions: dict[Seq, range],
    ) -> bool:
        """``draw``'s first case, with every sampling row taking its logits' argmax: the
        step's tokens are the argmax of its logits, row by row, which the engine may compute
        in the forward's graph (``Forward.tokens``)."""
        requests = self.requests
        if proposals or prompt_positions or requests.beams or requests.groups:
            return False
        return self.argmax_rows([s.seq for s in plan.scheduled if s.samples])

    def _sample(self, drawn: Drawn, logits: mx.array) -> None:
        """Draw a token for each of ``drawn.sampled`` from its row of ``logits``."""
        to_sample = drawn.sampled
        if self.argmax_rows(to_sample):  # no row needs a SampleRow
            drawn.tokens, drawn.logprobs = argmax_tokens(logits), [None] * len(to_sample)
            return
        rows = [self.outputs.sample_row(seq) for seq in to_sample]
        sampled = sample(logits, rows, self.logprobs_mode)
        drawn.tokens, drawn.logprobs = [p.token for p in sampled], [p.logprobs for p in sampled]

    def argmax_rows(self, seqs: list[Seq]) -> bool:
        """Every one of ``seqs`` takes the argmax. ``takes_argmax`` is asked only of those not
        in the last step's set: a step of the same sequences is one set comparison (by
        identity, no attribute of a sequence read)."""
        known = self._argmax
        if len(known) == len(seqs) and known.issuperset(seqs):
            return True
        takes_argmax = self.outputs.takes_argmax
        argmax = [seq for seq in seqs if seq in known or takes_argmax(seq)]
        self._argmax = set(argmax)
        return len(argmax) == len(seqs)

    def _verify(
        self, forward: Forward, at: dict[Seq, int], proposals: dict[Seq, Proposal]
    ) -> tuple[list[tuple[Seq, Verified]], Verifications]:
        """Accept or reject each sequence's drafts (harness/engine/speculative.py): against
        the target's logits, or the tokens a runner without a model chose. The one writer of
        a sequence's speculative counts."""
        chosen = forward.tokens
        table = np.array(forward.logits.astype(mx.float32)) if chosen is None else None
        counts = Verifications()
        verified = []
        for seq, i in at.items():
            proposal = proposals[seq]
            n = len(proposal.tokens)
            if chosen is not None:
                got = verify_tokens(chosen[i : i + n + 1], proposal)
            else:
                got = verify(
                    table[i : i + n + 1],
                    proposal,
                    lambda j, s=seq, d=proposal.tokens: self.outputs.sample_row(s, d[:j]),
                    self.logprobs_mode,
                )
            counts.proposed += n
            counts.accepted += got.accepted
            counts.rejected += got.accepted < n
            counts.verifications += 1
            seq.spec_proposed += n
            seq.spec_accepted += got.accepted
            verified.append((seq, got))
        return verified, counts
