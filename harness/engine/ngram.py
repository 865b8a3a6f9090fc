"""Prompt-lookup drafting (vLLM's ``ngram`` proposer): drafts copied from the sequence itself.

For a sequence's tokens (prompt and output so far) ``t_0 .. t_{n-1}``::

    suffix   the last m tokens, m from prompt_lookup_max down to prompt_lookup_min
    match    the longest m whose suffix occurs earlier (an occurrence may overlap it);
             of its occurrences, the earliest (vLLM's choice)
    propose  up to k tokens that followed that occurrence (fewer when the sequence ends
             first); nothing when no suffix of at least prompt_lookup_min tokens recurs

No model runs and no KV is kept: the drafts cost a search over the tokens on the host. The
scheduler still reserves k lookahead slots of the target's per verification; a shorter
proposal verifies fewer, and ``Scheduler.update`` trims the target's slots to the accepted
tokens. A draft is a point mass (q = 1 on the proposed token), so a sampling request keeps
it with probability p(x) and otherwise draws from p with x removed (``accept_or_resample``
with a one-hot q: Leviathan et al.'s rule, which keeps every token distributed as p).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from harness.engine.speculative import NGram, Proposal, RowFor
from schedulers.output import Scheduled


def ngram_lookup(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the earliest earlier occurrence of the longest suffix of
    ``tokens`` whose length is in ``[min_n, max_n]``; empty when none recurs."""
    t = np.asarray(tokens)
    n = len(t)
    for m in range(min(max_n, n - 1), min_n - 1, -1):
        # Windows starting at 0 .. n - m - 1: every earlier place the suffix could occur.
        hits = np.flatnonzero((sliding_window_view(t[:-1], m) == t[n - m :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + m
            return t[start : start + k].tolist()
    return []


class NGramProposer:
    """Proposes each verification's drafts by prompt lookup (``ngram_lookup``)."""

    runs_model = False  # no draft forwards, no draft KV: nothing for the cost model to price

    def __init__(self, spec: NGram, vocab_size: int) -> None:
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max
        self.vocab_size = vocab_size

    def propose(self, work: Sequence[Scheduled], row_for: RowFor) -> list[Proposal]:
        """At most ``s.num_draft_tokens`` drafts per verification ``s``; a sampling row's
        draft distribution is the point mass on each draft."""
        proposals = []
        for s in work:
            drafts = ngram_lookup(s.seq.token_ids, self.min_n, self.max_n, s.num_draft_tokens)
            probs = []
            if drafts and not s.seq.params.greedy:
                probs = [self._point_mass(x) for x in drafts]
            proposals.append(Proposal(drafts, probs))
        return proposals

    def _point_mass(self, token: int) -> np.ndarray:
        q = np.zeros(self.vocab_size)
        q[token] = 1.0
        return q
