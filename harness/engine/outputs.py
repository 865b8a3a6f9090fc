"""Output processing: a sampled token becomes part of its sequence, stop conditions end it,
and the caller gets incremental ``RequestOutput``s with text and logprobs (vLLM's
OutputProcessor and stop checks).

    append(seq, token, now)  stamp the token at ``now`` (when it exists on the host)
      stop?                  stop_token_ids, EOS (unless ignore_eos), a stop string, after
                             min_tokens; else max_tokens or the model length ("length")
      finish                 the scheduler frees its blocks (KV saved first if asked); the
                             request's row goes to the recorder
    output(seq)              one RequestOutput per request: its n completions, finished
                             when all are

``Outputs`` is a part of ``LLMEngine`` (harness/engine/llm_engine.py): it reads the engine's
model, scheduler, recorder and request tables, and owns none of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx
import numpy as np

from harness.engine.request import CompletionOutput, RequestOutput
from harness.engine.request import Sequence as Seq
from harness.engine.sampling import SampleRow, logprob_dict, logprob_values
from harness.engine.sampling_params import TokenLogprobs
from harness.engine.speculative import Verified
from schedulers.request import Status


def prompt_positions(seq: Seq, num_new_tokens: int) -> range:
    """The positions of a step's chunk whose logits give prompt logprobs not yet taken
    (position p's logits score prompt token p + 1): none after the prompt's last but one, and
    none twice, so a recompute after preemption takes none; none for completions 1.. of a
    request with n > 1 (completion 0 reports them)."""
    if seq.params.prompt_logprobs is None or seq.index:
        return range(0)
    first = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
    end = min(seq.num_computed_tokens + num_new_tokens, seq.num_prompt_tokens - 1)
    return range(first, end)


class Outputs:
    """Tokens in, stop conditions, finished requests and the outputs callers read."""

    def _sample_row(self, seq: Seq, drafts: Sequence[int] = ()) -> SampleRow:
        """The sampler's view of ``seq``, with ``drafts`` appended when verifying them."""
        banned = ()
        if seq.num_output_tokens + len(drafts) < seq.params.min_tokens:
            eos = () if seq.params.ignore_eos else self.model.eos_token_ids
            banned = tuple(eos) + seq.params.stop_token_ids
        tokens = seq.token_ids + list(drafts) if drafts else seq.token_ids
        return SampleRow(seq.params, tokens, seq.num_prompt_tokens, seq.rng, banned)

    def _append(self, seq: Seq, token: int, now: float) -> bool:
        """Append a generated token; finish the sequence if it stops here (True)."""
        seq.token_ids.append(token)
        return self._emitted(seq, token, now)

    def _emitted(self, seq: Seq, token: int, now: float) -> bool:
        """``token``, the sequence's last, exists on the host at ``now``: stamp it and
        finish the sequence if it stops here (True)."""
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        reason, stop_reason = self._stop(seq, token)
        if reason:
            if seq in self._draining:
                self._draining.discard(seq)
            else:
                self._release(seq)
            self._finish(seq, reason, now, stop_reason=stop_reason)
        return reason is not None

    def _accept(self, seq: Seq, got: Verified, now: float) -> list[RequestOutput]:
        """Append a verification's tokens (its KV the scheduler already counted in
        ``update``); stop conditions drop what follows a stop. Returns ``_progressed``."""
        for j, token in enumerate(got.tokens):
            if got.logprobs is not None:
                self._add_logprobs(seq, token, got.logprobs[j])
            if self._append(seq, token, now):
                break
        return self._progressed(seq)

    def _last_token(self, seq: Seq) -> bool:
        """The sequence stops on its last token whatever it is (max_tokens, model length)."""
        n = len(seq.token_ids)
        return n - seq.num_prompt_tokens >= seq.params.max_tokens or n >= self.scheduler.max_seq_len

    def _stop(self, seq: Seq, token: int) -> tuple[str | None, str | int | None]:
        p = seq.params
        if len(seq.token_ids) - seq.num_prompt_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop", token
            if not p.ignore_eos and token in self.model.eos_token_ids:
                return "stop", None
            if p.stop:
                text = self._text(seq)
                for s in p.stop:
                    if s in text:
                        return "stop", s
        if self._last_token(seq):
            return "length", None
        return None, None

    def _finish(self, seq: Seq, reason: str, now: float, **why) -> None:
        seq.status = Status.FINISHED
        self._host.pop(seq.request_id, None)  # a swapped request's host copy goes too
        if self.window is not None:
            self.window.drop(seq.request_id)
        self._save_to.pop(seq.request_id, None)  # an aborted request's KV is not saved
        seq.finish_reason = reason
        seq.finish_time = now
        seq.abort_reason = why.get("abort_reason")
        seq.stop_reason = why.get("stop_reason")
        self._requests.pop(seq.request_id, None)
        self.recorder.request(seq)

    def _progressed(self, seq: Seq) -> list[RequestOutput]:
        """The output of a request whose ``seq`` got tokens this step: none until all its
        completions finish when its params ask for the final output only."""
        if seq.params.output_kind == "final_only":
            group = self._groups.get(seq.group_id, (seq,)) if seq.finished else ()
            if not (group and all(s.finished for s in group)):
                return []
        return [self._output(seq)]

    def _output(self, seq: Seq) -> RequestOutput:
        """The request's output: all its completions (n > 1), finished when all are."""
        group = self._groups.get(seq.group_id, [seq])
        finished = all(s.finished for s in group)
        if finished:
            self._groups.pop(seq.group_id, None)
        first = group[0]  # computed the prompt, and so its logprobs
        prompt = first.params.prompt_logprobs is not None
        return RequestOutput(
            seq.group_id,
            seq.prompt_token_ids,
            [self._completion(s) for s in group],
            finished,
            abort_reason=next((s.abort_reason for s in group if s.abort_reason), None),
            prompt_logprobs=list(first.prompt_logprobs) if prompt else None,
            finished_time=max(s.finish_time for s in group) if finished else None,
        )

    def _completion(self, seq: Seq) -> CompletionOutput:
        text = self._text(seq) if seq.finished else ""
        stop = seq.stop_reason
        if isinstance(stop, str):
            text = text[: text.index(stop)]
        logprobs = cumulative = None
        if seq.params.logprobs is not None:
            # Copies: an output the caller holds must not grow with the sequence.
            logprobs = list(seq.logprobs)
            cumulative = seq.cumulative_logprob
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=seq.output_token_ids,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=stop,
            cumulative_logprob=cumulative,
        )

    def _add_logprobs(self, seq: Seq, token: int, logprobs: TokenLogprobs) -> None:
        """An output token's logprobs, and its share of the cumulative logprob (vLLM's)."""
        seq.logprobs.append(self._decoded(logprobs))
        seq.cumulative_logprob += logprobs[token].logprob

    def _prompt_logprobs(self, seq: Seq, positions: range, logits: mx.array) -> None:
        """Append the prompt logprobs ``logits`` [len(positions), vocab] give: position p's
        raw log-probabilities of prompt token p + 1 and the top-n (vLLM: raw, whatever the
        ``logprobs_mode``)."""
        table = np.array(logits.astype(mx.float32))
        n = seq.params.prompt_logprobs
        for row, p in zip(table, positions, strict=True):
            values = logprob_values(row, row, None, seq.params, "raw_logprobs")
            seq.prompt_logprobs.append(self._decoded(logprob_dict(values, seq.token_ids[p + 1], n)))

    def _decoded(self, logprobs: TokenLogprobs) -> TokenLogprobs:
        """``logprobs`` with each token's text (vLLM's ``decoded_token``), if a tokenizer."""
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            return logprobs
        return {t: replace(lp, decoded_token=tokenizer.decode([t])) for t, lp in logprobs.items()}

    def _text(self, seq: Seq) -> str:
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            return ""
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str):
            ids = ids[:-1]  # as vLLM, the EOS or stop token id that ended it is not text
        return tokenizer.decode(ids)
