"""Beam search as vLLM's ``LLM.beam_search`` defines it, over forked sequences.

Each round every live beam offers the top ``2 * beam_width`` raw log-probabilities of its
next token (``vllm/entrypoints/llm.py``: one step per beam with ``logprobs=2 * beam_width``).
Every (beam, token) candidate gets the beam's cumulative logprob plus the token's; a
candidate ending in EOS (unless ``ignore_eos``) joins the completed hypotheses, the others
are sorted by score and the best ``beam_width`` become the next round's beams. After
``max_tokens`` rounds (or the model length) the live beams join the completed ones, and the
best ``beam_width`` by score are the request's outputs. The score is vLLM's
``get_beam_search_score`` (``vllm/beam_search.py``, after Hugging Face's): the cumulative
logprob divided by ``length ** length_penalty``, the length counting the prompt and not a
final EOS.

The engine keeps each beam as a sequence and turns a selection into KV operations: a beam
chosen once continues as itself, a beam chosen k times forks k - 1 children (the allocator
shares or copies its blocks), a beam not chosen is dropped. This module is the search's
arithmetic; it never touches the KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams, check_fields


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams, ``max_tokens`` rounds at most,
    ``length_penalty`` the exponent of the length in the score. Deterministic: each
    candidate's logprob is the model's raw log-softmax, so there is no temperature."""

    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        checks = [
            ("beam_width", _is_int(self.beam_width) and self.beam_width >= 1, "an int >= 1"),
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
            ("length_penalty", math.isfinite(self.length_penalty), "a finite number"),
        ]
        check_fields(self, checks)

    @property
    def num_candidates(self) -> int:
        """Candidates each beam offers per round (vLLM asks for ``2 * beam_width`` logprobs)."""
        return 2 * self.beam_width

    def beam_params(self) -> SamplingParams:
        """What each beam runs with: greedy rows the sampler never sees, stopping only by
        ``max_tokens`` or the model length (EOS is handled by the search)."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)


def score(num_tokens: int, cumulative_logprob: float, ends_in_eos: bool, length_penalty: float):
    """vLLM's ``get_beam_search_score``: ``cumulative_logprob / length ** length_penalty``,
    ``length`` = prompt + output tokens, less a final EOS."""
    length = max(num_tokens - ends_in_eos, 1)
    return cumulative_logprob / length**length_penalty


def top_candidates(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely next tokens of one row of logits with their raw log-softmax,
    best first (ties: lower token id first)."""
    row = logits.astype(np.float64)
    shifted = row - row.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    k = min(k, row.size)
    kth = np.partition(logprobs, row.size - k)[row.size - k]  # the k-th largest
    above = np.flatnonzero(logprobs > kth)
    top = np.concatenate([above, np.flatnonzero(logprobs == kth)[: k - above.size]])
    top = top[np.lexsort((top, -logprobs[top]))]
    return [(int(t), float(logprobs[t])) for t in top]


@dataclass
class Hypothesis:
    """A finished beam: its output tokens, cumulative logprob and why it ended."""

    output_token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str  # "stop" (it chose EOS), "length" or "abort"
    score: float


@dataclass
class BeamGroup:
    """One beam-search request: its live beams (best first; each a sequence whose
    ``cumulative_logprob`` is the beam's; at first the ``root``, which computes the prompt),
    what they offered this round, and the hypotheses already finished."""

    params: BeamSearchParams
    eos_token_ids: tuple[int, ...]
    root: Seq
    beams: list[Seq] = field(init=False)
    offers: dict[Seq, list[tuple[int, float]]] = field(default_factory=dict)
    completed: list[Hypothesis] = field(default_factory=list)
    round_times: list[float] = field(default_factory=list)  # when each round's tokens existed
    forks: int = 0  # children forked so far (they are named ID/beam1, ID/beam2, ...)
    preemptions: int = 0  # of beams already gone

    def __post_init__(self) -> None:
        self.beams = [self.root]

    def offer(self, beam: Seq, logits: np.ndarray) -> bool:
        """Record ``beam``'s candidates; True once every live beam has offered."""
        self.offers[beam] = top_candidates(logits, self.params.num_candidates)
        return len(self.offers) == len(self.beams)

    def select(self, now: float) -> list[tuple[Seq, int, float]]:
        """End the round, whose tokens exist at ``now``: (parent, token, cumulative logprob)
        of the next beams, best first. Candidates that end in EOS become completed
        hypotheses."""
        self.round_times.append(now)
        survivors = []
        for beam in self.beams:
            for token, logprob in self.offers[beam]:
                total = beam.cumulative_logprob + logprob
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    self._complete(beam, beam.output_token_ids + [token], total, "stop")
                else:
                    length = beam.num_tokens + 1
                    value = self._score(length, total, token)
                    survivors.append((value, beam, token, total))
        self.offers.clear()
        # By score, as vLLM (which shortens an EOS-ending beam even under ignore_eos);
        # sorted() is stable, so ties keep beam-then-rank order (as vLLM's do).
        survivors.sort(key=lambda c: c[0], reverse=True)
        return [(beam, token, total) for _, beam, token, total in survivors[: self.width]]

    @property
    def width(self) -> int:
        return self.params.beam_width

    def name_child(self) -> str:
        """The request id of the next beam forked off a chosen one: ``ID/beam<k>``."""
        self.forks += 1
        return f"{self.root.request_id}/beam{self.forks}"

    def drop(self, beam: Seq) -> None:
        """``beam`` left the search (not chosen, or the search ended): count its
        preemptions, which the request's row reports."""
        self.preemptions += beam.preemptions

    def go_on(self, beams: list[Seq]) -> None:
        """The next round's live beams, best first."""
        self.beams = beams

    def finish(self, reason: str) -> list[Hypothesis]:
        """The live beams join the completed; the best ``beam_width`` by score, best first."""
        for beam in self.beams:
            self._complete(beam, beam.output_token_ids, beam.cumulative_logprob, reason)
        self.beams = []
        ranked = sorted(self.completed, key=lambda h: h.score, reverse=True)
        return ranked[: self.width]

    def _complete(self, beam: Seq, output: list[int], total: float, reason: str) -> None:
        last = output[-1] if output else beam.token_ids[-1]
        value = self._score(beam.num_prompt_tokens + len(output), total, last)
        self.completed.append(Hypothesis(output, total, reason, value))

    def _score(self, num_tokens: int, total: float, last_token: int) -> float:
        """vLLM's score of a beam of ``num_tokens`` tokens ending in ``last_token``."""
        ends_in_eos = last_token in self.eos_token_ids
        return score(num_tokens, total, ends_in_eos, self.params.length_penalty)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
