"""Forks: requests that grow several sequences on one prompt's KV.

    parallel sampling (SamplingParams.n > 1)   the prompt computes once; when its last chunk
        is done, completions 1 .. n-1 fork off it (ids ID/1, ID/2, ...), each sampling its
        first token from the same logits with seed ``seed + i`` (vLLM)
    beam search (BeamSearchParams)             every live beam offers its candidates and
        waits (parked) for its siblings; the round's selection drops the beams not chosen,
        forks one chosen k times into k - 1 children (ids ID/beam1, ...) and appends each
        beam's token (harness/engine/beam_search.py has the search itself)

A fork asks the scheduler (``Scheduler.fork``; for completions, ``Scheduler.update`` does it
after the parent's progress), which shares or copies the parent's blocks through the
allocator, or queues the child to recompute when there is no room; ``Forks`` copies the
blocks the allocator says to (and a window model's ring). It makes the children, runs beam
rounds and ends searches; the request table keeps them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from harness.engine.beam_search import BeamGroup
from harness.engine.model_runner import Runner
from harness.engine.outputs import OutputProcessor
from harness.engine.recorder import Recorder
from harness.engine.request import RequestOutput, Seq
from harness.engine.request_table import RequestTable
from harness.engine.sampling_params import make_rng
from harness.engine.window import WindowTables
from schedulers.base import Scheduler
from schedulers.output import Fork


class Forks:
    """Parallel sampling's completions and beam search's rounds."""

    def __init__(
        self,
        requests: RequestTable,
        scheduler: Scheduler,
        runner: Runner,
        window: WindowTables | None,
        outputs: OutputProcessor,
        recorder: Recorder,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.runner = runner
        self.window = window
        self.outputs = outputs
        self.recorder = recorder

    def fork_completions(self, parent: Seq) -> list[Seq]:
        """The other n - 1 completions of ``parent``'s request, made when its prompt is done
        (``Scheduler.update`` forks them onto its KV); completion i samples with seed
        ``seed + i`` (vLLM)."""
        return [
            self._child(parent, f"{parent.request_id}/{i}", i, parent.seed + i)
            for i in range(1, parent.params.n)
        ]

    def copy_forked(self, forked: Sequence[Fork]) -> None:
        """Children that got their parents' KV: copy the blocks their allocations say to
        (copy-on-write) and a window model's ring, which is copied, never shared."""
        for fork in forked:
            self.runner.copy_blocks(fork.copies)
            if self.window is not None:
                self.window.copy_ring(fork.ring_copies)

    def _child(self, parent: Seq, request_id: str, index: int, seed: int) -> Seq:
        """A sequence on ``parent``'s tokens, seeded with ``seed``, in the request table."""
        child = Seq(
            request_id=request_id,
            token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            params=parent.params,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            rng=make_rng(replace(parent.params, seed=seed), 0),
            seed=seed,
            ttft_slo=parent.ttft_slo,
            tpot_slo=parent.tpot_slo,
            first_scheduled_time=parent.first_scheduled_time,
            cumulative_logprob=parent.cumulative_logprob,
            index=index,
            group_id=parent.group_id,
        )
        self.requests.add_child(child)
        return child

    def offer(self, beam: Seq, logits: np.ndarray, now: float) -> list[RequestOutput]:
        """``beam`` offers its candidates (its row's logits); once every live beam of its
        search has, the round runs. Until then it is parked."""
        group = self.requests.beams[beam.group_id]
        if group.offer(beam, logits):
            return self._next_beams(group, now)
        self.scheduler.park(beam)  # until its siblings have offered too
        return []

    def _next_beams(self, group: BeamGroup, now: float) -> list[RequestOutput]:
        """Every beam has offered: the round's selection becomes KV operations. A parent
        not chosen is dropped first (its blocks free), one chosen k times forks k - 1
        children on its KV, then each beam appends its token. The search ends after
        ``max_tokens`` rounds, at the model length, or when no candidate is left."""
        chosen = group.select(now)
        kept = {parent for parent, _, _ in chosen}
        for beam in group.beams:
            if beam not in kept:
                self._drop_beam(group, beam)
        beams, seen = [], set()
        for parent, token, total in chosen:
            beam = self._fork_beam(group, parent) if parent in seen else parent
            seen.add(parent)
            beams.append((beam, token, total))
        for beam, token, total in beams:
            beam.cumulative_logprob = total
            self.scheduler.resume(beam, token)
        group.go_on([beam for beam, _, _ in beams])
        if not group.beams:
            return self.end_beams(group, "stop", now)
        if self.scheduler.progress.at_length(group.beams[0]):  # the beams are all one length
            return self.end_beams(group, "length", now)
        return []

    def _fork_beam(self, group: BeamGroup, parent: Seq) -> Seq:
        child = self._child(parent, group.name_child(), 0, parent.seed)
        fork = self.scheduler.fork(parent, child)
        if fork is not None:  # its KV is the parent's
            self.copy_forked([fork])
        return child

    def _drop_beam(self, group: BeamGroup, beam: Seq) -> None:
        """A beam leaves the search: its blocks go, it records no row of its own."""
        if not beam.finished:  # a rejected beam is already gone
            self.scheduler.finish(beam)
        group.drop(beam)

    def end_beams(
        self, group: BeamGroup, reason: str, now: float, abort_reason: str | None = None
    ) -> list[RequestOutput]:
        """Finish a beam search: its live beams are dropped and join the completed; the
        request records one row (its output tokens and token times are its rounds') and
        returns its best ``beam_width`` hypotheses, best first."""
        for beam in group.beams:
            self._drop_beam(group, beam)
        best = group.finish(reason)
        root = group.root
        self.requests.end_beams(root.request_id)
        times = group.round_times
        self.recorder.request(
            root,
            first_token_time=times[0] if times else float("nan"),
            finish_time=now,
            output_tokens=len(times),
            token_times=array("d", times),
            preemptions=group.preemptions,
            finish_reason=reason,
            abort_reason=abort_reason,
        )
        outputs = [self.outputs.hypothesis(i, h) for i, h in enumerate(best)]
        return [
            RequestOutput(
                root.request_id, root.prompt_token_ids, outputs, True, abort_reason=abort_reason
            )
        ]
