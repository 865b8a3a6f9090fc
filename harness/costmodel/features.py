"""A step's work as counts that no timing changes: the same on any machine for the same plan.

The model clock prices these (harness/costmodel/profile.py); ``kvbench-calibrate`` fits the
prices from steps the real engine measured. Every count is per step:

    rows           sequences run (each a row of a padded batch)
    groups         padded batches (harness/engine/model_runner.py ``group_rows``): each is
                   a pass over the weights
    query_tokens   query positions computed, each row padded to its group's longest
    attention      query-key pairs scored per layer and KV head: a group's rows x its
                   padded queries x its padded keys read, summed over groups
    kv_read        KV slots gathered per layer and KV head (padding included)
    logits         rows of the LM head (positions that want logits)
    block_copies   blocks copied in the arena (copy-on-write, relocation, forks)
    swap_blocks    blocks moved between the arena and host memory (out + in)
    draft_rounds   the draft model's sequential forwards (speculative decoding: k per step)
    draft_tokens   tokens the draft model fed (its catch-up and its proposals)

A step's ``kind`` picks the piece of a piecewise-linear profile: ``decode`` (every row feeds
one token), ``prefill`` (no row does), ``mixed`` (both), ``verify`` (drafts are verified)
and ``idle`` (no row ran: block moves only).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

KINDS = ("decode", "prefill", "mixed", "verify", "idle")


@dataclass(frozen=True)
class StepFeatures:
    rows: int = 0
    groups: int = 0
    query_tokens: int = 0
    attention: int = 0
    kv_read: int = 0
    logits: int = 0
    block_copies: int = 0
    swap_blocks: int = 0
    draft_rounds: int = 0
    draft_tokens: int = 0
    single_token_rows: int = 0  # rows feeding one token (decodes); picks the kind only

    @property
    def kind(self) -> str:
        if not self.rows:
            return "idle"
        if self.draft_rounds:
            return "verify"
        if self.single_token_rows == self.rows:
            return "decode"
        return "prefill" if not self.single_token_rows else "mixed"

    def vector(self) -> tuple[int, ...]:
        """The priced counts in ``FEATURES`` order (``astuple`` deep-copies: 4 % of a
        model-clock replay)."""
        return tuple(getattr(self, name) for name in FEATURES)


# The counts a profile prices, in order (``single_token_rows`` only picks the kind).
FEATURES: tuple[str, ...] = tuple(f.name for f in fields(StepFeatures))[:-1]


# Where each count is in a steps table (harness/analysis/metrics.py STEP_SCHEMA).
STEP_COLUMNS: dict[str, tuple[str, ...]] = {
    "rows": ("batch_size",),
    "groups": ("row_groups",),
    "query_tokens": ("query_tokens_padded",),
    "attention": ("attention_pairs",),
    "kv_read": ("kv_slots_read",),
    "logits": ("logit_rows",),
    "block_copies": ("block_copies", "draft_block_copies"),
    "swap_blocks": ("swap_out_blocks", "swap_in_blocks"),
    "draft_rounds": ("draft_rounds",),
    "draft_tokens": ("draft_tokens",),
    "single_token_rows": ("single_token_rows",),
}


def from_step(row) -> StepFeatures:
    """A recorded step's counts (a steps-table row, a mapping of its columns)."""
    counts = {name: sum(int(row[c]) for c in columns) for name, columns in STEP_COLUMNS.items()}
    if not counts["groups"]:  # nothing ran: the plan's sequences were not rows
        counts["rows"] = 0
    return StepFeatures(**counts)
