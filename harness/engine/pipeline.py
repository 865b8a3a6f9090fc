"""Pipelined steps, one deep, as mlx_lm's BatchGenerator and vLLM's async scheduling do.

When every row of a step samples on the device (greedy, no penalties, bans or logprobs, no
drafts to verify, no beams), the step launches its forward and its ``argmax`` and returns
without waiting; the next step schedules, builds and launches its own forward, feeding those
tokens straight from the device, and only then reads them on the host, stamps them, and
applies stop conditions::

    step t:    schedule -> launch forward_t + argmax_t -> carry (placeholders)
    step t+1:  schedule -> launch forward_{t+1} (feeds argmax_t) -> resolve argmax_t -> carry

A row computed for a sequence that turns out to have stopped is dropped, never emitted. A
sequence sure to stop on its pending token (its last by ``max_tokens`` or the model length)
gives its blocks back before that token is read (it is "draining").

``Pipelined`` is a part of ``LLMEngine`` (harness/engine/llm_engine.py); it owns the
tokens in flight (``_inflight``, ``_inflight_tokens``) and the draining sequences.
"""

from __future__ import annotations

import time

import mlx.core as mx

from harness.engine.outputs import prompt_positions
from harness.engine.request import RequestOutput
from harness.engine.request import Sequence as Seq
from schedulers.output import SchedulerOutput

INFLIGHT = -1  # the place in token_ids of a sampled token still on the device


class Pipelined:
    """The step's sampled tokens left on the device and read one step later."""

    def _on_device(self, plan: SchedulerOutput) -> bool:
        """Every row that samples this step can sample on the device, from logits alone."""
        for s in plan.scheduled:
            seq, p = s.seq, s.seq.params
            if s.num_draft_tokens:
                return False
            if prompt_positions(seq, s.num_new_tokens):
                return False
            samples = seq.num_computed_tokens + s.num_new_tokens == seq.num_tokens
            if samples and seq.group_id in self._beams:
                return False  # its candidates are chosen on the host
            if samples and not (
                p.greedy
                and not p.penalised
                and not p.min_tokens
                and p.logprobs is None
                and p.n == 1
            ):
                return False
        return True

    def _carry(self, plan: SchedulerOutput, tokens: mx.array | None) -> None:
        """A pipelined step's results: the scheduler counts its KV as written, and each
        sampling row's token (row k of ``tokens``, on the device) gets its place in the
        sequence, a placeholder until the next step reads it. A sequence that stopped on the
        previous step's token drops this step's row."""
        samples = [
            s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens for s in plan.scheduled
        ]
        self.scheduler.update(plan)
        k = 0
        for s, sampled in zip(plan.scheduled, samples, strict=True):
            seq = s.seq
            if sampled and not seq.finished:
                seq.token_ids.append(INFLIGHT)
                self._inflight.append((seq, k))
                if self._last_token(seq):
                    self._release(seq)
                    self._draining.add(seq)
            k += sampled
        self._inflight_tokens = tokens if self._inflight else None

    def _resolve(self, start: float) -> list[RequestOutput]:
        """Read the tokens still on the device (waiting for them), stamp them when they
        exist on the host, and apply stop conditions."""
        if not self._inflight:
            return []
        waited = time.perf_counter()
        tokens = self._inflight_tokens.tolist()
        self._waited += time.perf_counter() - waited
        now = self.clock.after(time.perf_counter() - start)
        outputs = []
        for seq, k in self._inflight:
            if seq.finished:  # aborted while its token computed
                continue
            seq.token_ids[-1] = tokens[k]
            self._emitted(seq, tokens[k], now)
            outputs += self._progressed(seq)
        self._inflight, self._inflight_tokens = [], None
        return outputs

    def _released_early(self, request_id: str) -> Seq | None:
        """The sequence ``request_id`` if it already gave its blocks back to stop on a token
        still on the device; it leaves that set."""
        seq = next((s for s in self._draining if s.request_id == request_id), None)
        self._draining.discard(seq)
        return seq
