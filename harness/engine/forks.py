"""Forks: requests that grow several sequences on one prompt's KV.

    parallel sampling (SamplingParams.n > 1)   the prompt computes once; when its last chunk
        is done, completions 1 .. n-1 fork off it (ids ID/1, ID/2, ...), each sampling its
        first token from the same logits with seed ``seed + i`` (vLLM)
    beam search (BeamSearchParams)             every live beam offers its candidates and
        waits (parked) for its siblings; the round's selection drops the beams not chosen,
        forks one chosen k times into k - 1 children (ids ID/beam1, ...) and appends each
        beam's token (harness/engine/beam_search.py has the search itself)

A fork asks the scheduler (``Scheduler.fork``), which shares or copies the parent's blocks
through the allocator, or queues the child to recompute when there is no room; the engine
copies the blocks the allocator says to (and a window model's ring).

``Forks`` is a part of ``LLMEngine`` (harness/engine/llm_engine.py); it owns ``_groups``
(the completions of requests with n > 1) and ``_beams`` (beam searches, by request id).
"""

from __future__ import annotations

from dataclasses import replace

from harness.engine.beam_search import BeamGroup, Hypothesis
from harness.engine.request import CompletionOutput, RequestOutput
from harness.engine.request import Sequence as Seq
from harness.engine.sampling_params import make_rng
from schedulers.request import Status


class Forks:
    """Parallel sampling's completions and beam search's rounds."""

    def _ids_taken(self, request_id: str, n: int, beam: bool) -> list[str]:
        """The ids a new request would take that are in use: completions 1.. of a request
        with n > 1 take ``ID/1, ID/2, ...``, a beam search's beams ``ID/beam1, ...``, and any
        ``ID/...`` may be taken later."""
        ids = [request_id, *(f"{request_id}/{i}" for i in range(1, n))]
        taken = [i for i in ids if i in self._requests or self._completion_id(i)]
        if request_id in self._groups or request_id in self._beams:
            taken.append(request_id)  # its first sequence finished, the request runs
        if beam:
            taken += [i for i in self._requests if i.startswith(f"{request_id}/")]
        return taken

    def _completion_id(self, request_id: str) -> bool:
        """``request_id`` is (or will be) a completion of a running request with n > 1, or a
        beam of a running beam search (any ``ID/...``)."""
        parent, _, index = request_id.rpartition("/")
        if parent in self._beams:
            return True
        group = self._groups.get(parent)
        return group is not None and index.isdigit() and 0 < int(index) < group[0].params.n

    def _fork(self, parent: Seq) -> list[Seq]:
        """The other n - 1 completions of ``parent``'s request, on its prompt's KV (shared
        or copied by the allocator); completion i samples with seed ``seed + i`` (vLLM)."""
        group = self._groups[parent.group_id]
        for i in range(1, parent.params.n):
            group.append(self._child(parent, f"{parent.request_id}/{i}", i, parent.seed + i))
        return group[1:]

    def _child(self, parent: Seq, request_id: str, index: int, seed: int) -> Seq:
        """A sequence forked off ``parent``'s tokens and KV (shared or copied by the
        allocator; without room it waits and recomputes them), seeded with ``seed``."""
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
            cumulative_logprob=parent.cumulative_logprob,
            index=index,
            group_id=parent.group_id,
        )
        child.first_scheduled_time = parent.first_scheduled_time
        self._requests[child.request_id] = child
        allocation = self.scheduler.fork(parent, child)
        if allocation is not None:  # its KV is the parent's
            child.num_forked_tokens = parent.num_computed_tokens
            self.runner.copy_blocks(allocation.copies)
            if self.window is not None:  # a ring is copied, never shared
                self.window.fork(parent.request_id, child.request_id)
        return child

    def _next_beams(self, group: BeamGroup, now: float) -> list[RequestOutput]:
        """Every beam has offered: the round's selection becomes KV operations. A parent
        not chosen is dropped first (its blocks free), one chosen k times forks k - 1
        children on its KV, then each beam appends its token. The search ends after
        ``max_tokens`` rounds, at the model length, or when no candidate is left."""
        chosen = group.select()
        group.round_times.append(now)
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
            beam.token_ids.append(token)
            beam.cumulative_logprob = total
            self.scheduler.unpark(beam)
        group.beams = [beam for beam, _, _ in beams]
        if not group.beams:
            return self._end_beams(group, "stop", now)
        if self._last_token(group.beams[0]):  # the beams are all one length
            return self._end_beams(group, "length", now)
        return []

    def _fork_beam(self, group: BeamGroup, parent: Seq) -> Seq:
        group.forks += 1
        return self._child(parent, f"{group.root.request_id}/beam{group.forks}", 0, parent.seed)

    def _drop_beam(self, group: BeamGroup, beam: Seq) -> None:
        """A beam leaves the search: its blocks (and any host copy) go, it records no row."""
        self.scheduler.finish(beam)
        self._host.pop(beam.request_id, None)
        if self.window is not None:
            self.window.drop(beam.request_id)
        beam.status = Status.FINISHED
        self._requests.pop(beam.request_id, None)
        group.preemptions += beam.preemptions

    def _end_beams(
        self, group: BeamGroup, reason: str, now: float, abort_reason: str | None = None
    ) -> list[RequestOutput]:
        """Finish a beam search: its live beams are dropped and join the completed; the
        request records one row (its output tokens and token times are its rounds') and
        returns its best ``beam_width`` hypotheses, best first."""
        for beam in group.beams:
            self._drop_beam(group, beam)
        best = group.finish(reason)
        root = group.root
        del self._beams[root.request_id]
        times = group.round_times
        self.recorder.request(
            root,
            first_token_time=times[0] if times else float("nan"),
            finish_time=now,
            output_tokens=len(times),
            token_times=list(times),
            preemptions=group.preemptions,
            finish_reason=reason,
            abort_reason=abort_reason,
        )
        outputs = [self._hypothesis(i, h) for i, h in enumerate(best)]
        return [
            RequestOutput(
                root.request_id, root.prompt_token_ids, outputs, True, abort_reason=abort_reason
            )
        ]

    def _hypothesis(self, index: int, h: Hypothesis) -> CompletionOutput:
        tokenizer = self.model.tokenizer
        ids = h.output_token_ids[:-1] if h.finish_reason == "stop" else h.output_token_ids
        return CompletionOutput(
            index=index,
            text=tokenizer.decode(ids) if tokenizer is not None else "",
            token_ids=list(h.output_token_ids),
            logprobs=None,
            finish_reason=h.finish_reason,
            cumulative_logprob=h.cumulative_logprob,
        )
