"""Output processing (vLLM's OutputProcessor): what the caller gets back.

    sample_row(seq)      the sampler's view of a sequence (EOS and stop ids banned below
                         min_tokens)
    add_logprobs         an output token's logprobs (and the cumulative logprob); prompt
                         logprobs from a prefill's logits
    report(seq)          one RequestOutput per request: its n completions, with text and
                         logprobs, finished when all are (the request table then closes its
                         group); report_progress: final_only requests get only that one

The tokens themselves, their times and the stops are the scheduler's to write
(``Scheduler.update``); ``OutputProcessor`` is the one writer of a sequence's logprobs, and
reads the request table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx
import numpy as np

from harness.engine.beam_search import Hypothesis
from harness.engine.request import CompletionOutput, RequestOutput, Seq
from harness.engine.request_table import RequestTable
from harness.engine.sampling import SampleRow, logprob_dict, logprob_values
from harness.engine.sampling_params import TokenLogprobs
from harness.platform.models import LoadedModel
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


class OutputProcessor:
    """Logprobs in, ``RequestOutput``s out."""

    def __init__(self, model: LoadedModel, requests: RequestTable) -> None:
        self.model = model
        self.requests = requests
        # Per running sequence that streams plainly (``report_alone``), its output tokens
        # streamed so far as ints (vLLM's OutputProcessor keeps its own output_token_ids
        # too): each step makes ints of its new tokens only, then copies pointers, where
        # ``list(seq.token_ids[n:])`` made an int of every output token, every step.
        self._streamed: dict[Seq, list[int]] = {}

    def sample_row(self, seq: Seq, drafts: Sequence[int] = ()) -> SampleRow:
        """The sampler's view of ``seq``, with ``drafts`` appended when verifying them."""
        banned = ()
        if seq.num_output_tokens + len(drafts) < seq.params.min_tokens:
            eos = () if seq.params.ignore_eos else self.model.eos_token_ids
            banned = tuple(eos) + seq.params.stop_token_ids
        tokens = [*seq.token_ids, *drafts] if drafts else seq.token_ids
        return SampleRow(seq.params, tokens, seq.num_prompt_tokens, seq.rng, banned)

    def takes_argmax(self, seq: Seq) -> bool:
        """``seq`` takes its logits' argmax: greedy, no penalties, logprobs or banned tokens
        (``sample_row``'s bans, below ``min_tokens``), so it needs no ``SampleRow``
        (``sampling.sample``'s one-argmax case). Once true, true for the rest of ``seq``: its
        parameters never change and its output only grows past ``min_tokens``."""
        p = seq.params
        return p.argmax and not (p.min_tokens and self.sample_row(seq).banned)

    def report_progress(self, seq: Seq) -> list[RequestOutput]:
        """The output of a request whose ``seq`` got tokens this step: none until all its
        completions finish when its params ask for the final output only."""
        if seq.params.output_kind == "final_only":
            group = self.requests.groups.get(seq.group_id, (seq,)) if seq.finished else ()
            if not (group and all(s.finished for s in group)):
                return []
        return [self.report(seq)]

    def report_alone(self, seqs: Sequence[Seq]) -> list[RequestOutput]:
        """``report_progress`` of each of ``seqs``, every one its request's only sequence
        (n = 1, no beam search). A running sequence without logprobs, most of a step's, gets
        its output built here in one pass (no text, no finish yet, its output tokens copied
        from its ``_streamed`` list, which gains the step's new ones; from its first output
        on, one lookup tells it is such a sequence); any other goes through ``report``.
        Without a live sequence that streams (a replay asks for final outputs only), the
        finished ones alone, in one pass."""
        if not self.requests.streams:
            finished = Status.FINISHED
            return [self.report(seq) for seq in seqs if seq.status is finished]
        outputs = []
        append = outputs.append
        finished, streaming = Status.FINISHED, self._streamed
        for seq in seqs:
            streamed = streaming.get(seq)  # a plain stream's, once it has streamed
            if streamed is None or seq.status is finished:
                params = seq.params
                if params.output_kind != "cumulative" and seq.status is not finished:
                    continue  # a final output only: none before it finishes
                if (
                    seq.status is finished
                    or params.logprobs is not None
                    or params.prompt_logprobs is not None
                ):
                    append(self.report(seq))
                    continue
                streamed = streaming[seq] = []
            streamed += seq.token_ids[seq.num_prompt_tokens + len(streamed) :]
            completion = CompletionOutput(seq.index, "", streamed.copy(), None, None)
            append(RequestOutput(seq.group_id, seq.prompt_token_ids, [completion], False))
        return outputs

    def forget(self, seq: Seq) -> None:
        """``seq`` left the engine: its streamed tokens go."""
        self._streamed.pop(seq, None)

    def report(self, seq: Seq) -> RequestOutput:
        """The request's output: all its completions (n > 1), finished when all are."""
        group = self.requests.groups.get(seq.group_id)
        if group is None:  # one completion (n = 1): the request is ``seq`` alone
            finished = seq.finished
            prompt = seq.params.prompt_logprobs is not None
            return RequestOutput(
                seq.group_id,
                seq.prompt_token_ids,
                [self._completion(seq)],
                finished,
                abort_reason=seq.abort_reason or None,
                prompt_logprobs=list(seq.prompt_logprobs) if prompt else None,
                finished_time=seq.finish_time if finished else None,
            )
        finished = all(s.finished for s in group)
        if finished:
            self.requests.close_group(seq.group_id)
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

    def hypothesis(self, index: int, h: Hypothesis) -> CompletionOutput:
        """A beam search's ``index``-th best hypothesis as a completion."""
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

    def add_logprobs(self, seq: Seq, token: int, logprobs: TokenLogprobs) -> None:
        """An output token's logprobs, and its share of the cumulative logprob (vLLM's)."""
        seq.logprobs.append(self._decoded(logprobs))
        seq.cumulative_logprob += logprobs[token].logprob

    def add_prompt_logprobs(self, seq: Seq, positions: range, logits: mx.array) -> None:
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
