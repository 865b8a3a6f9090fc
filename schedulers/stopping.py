"""When a sequence stops: vLLM's stop checks, applied on the scheduler side as a token is
appended (vLLM v1's ``check_stop`` inside ``Scheduler.update_from_output``).

    after min_tokens   a stop_token_id ("stop", the id), EOS unless ignore_eos ("stop"), a
                       stop string in the output text ("stop", the string)
    always             max_tokens output tokens or the sequence's length limit ("length")

The model's EOS ids and its detokenizer are the engine's to give (``build_engine`` does);
a scheduler built without them stops by length and stop_token_ids alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from schedulers.request import Request


@dataclass(frozen=True)
class Stopping:
    """The model-dependent part of the stop checks: its EOS token ids, and ``detokenize``
    (output token ids -> text) for stop strings, None for a model without a tokenizer."""

    eos_token_ids: tuple[int, ...] = ()
    detokenize: Callable[[Sequence[int]], str] | None = None

    def length_limit(self, seq: Request, max_seq_len: int) -> int:
        """The token count at which ``seq`` stops with "length", when nothing but its length
        can stop it (no stop token id, EOS ignored or none, no stop string that can be
        read): then ``check`` is that one comparison. 0 when a token may stop it sooner."""
        p = seq.params
        if p.stop_token_ids or (self.eos_token_ids and not p.ignore_eos):
            return 0
        if p.stop and self.detokenize is not None:
            return 0
        return stop_length(seq, max_seq_len)

    def check(self, seq: Request, token: int, max_seq_len: int) -> tuple[str | None, object]:
        """(finish reason, stop reason) of ``seq`` whose last token, just appended, is
        ``token``; (None, None) when it goes on."""
        p = seq.params
        n = len(seq.token_ids)
        if n - seq.num_prompt_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop", token
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if p.stop and self.detokenize is not None:
                text = self.detokenize(seq.token_ids[seq.num_prompt_tokens :])
                for s in p.stop:
                    if s in text:
                        return "stop", s
        if n >= stop_length(seq, max_seq_len):
            return "length", None
        return None, None


def stop_length(seq: Request, max_seq_len: int) -> int:
    """The token count at which ``seq`` stops with "length", whatever its last token: its
    prompt and ``max_tokens`` outputs, or ``max_seq_len``."""
    return min(seq.num_prompt_tokens + seq.params.max_tokens, max_seq_len)
