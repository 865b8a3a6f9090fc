"""A step's work: counts that no timing changes, the same on any machine for the same plan.

One record, its fields named as the steps table names its columns
(harness/analysis/metrics.py STEP_SCHEMA): the model runner measures the forward's part
(harness/engine/step_shape.py ``forward_work``), the engine adds the plan's block moves and
draft work (harness/engine/modelled.py ``step_work``), the recorder writes each field as the
column of its name, a profile prices it (harness/costmodel/profile.py) and kvbench-calibrate
fits the prices from the columns of measured steps (``StepWork.from_row``). Every count is per
step; KV slots and query-key pairs are per full-attention layer and KV head, the ``window_``
ones per sliding-window layer and KV head:

    batch_size           sequences run, each a row of a padded batch
    swap_out_blocks      blocks moved from the arena to host memory
    swap_in_blocks       blocks moved back into the arena
    window_swap_blocks   sliding-window ring blocks moved to host memory and back: a swapped
                         sequence's ring goes with its blocks, whole (0 without window layers)
    block_copies         blocks copied in the arena (copy-on-write, relocation, forks)
    row_groups           padded batches (harness/engine/step_shape.py ``group_rows``): each
                         is a pass over the weights
    query_tokens_padded  query positions computed, each row padded to its group's longest
    kv_slots_read        KV slots gathered: each row reads as many blocks as its group's
                         longest context needs, padding included
    kv_slots_attended    the rows' contexts without padding: sum of start + tokens
    attention_pairs      query-key pairs scored: a group's rows x its padded queries x its
                         padded keys read, summed over groups
    window_kv_slots_read    a sliding-window layer's KV slots gathered from the rings: each
                         row reads as many blocks as its group's row with the most needs to
                         hold the window before its first query (at least one; 0 for a model
                         without window layers; harness/engine/kv_cache.py ``_ring_layout``)
    window_attention_pairs  query-key pairs a window layer scores: a group's rows x its
                         padded queries x (its ring slots read + its padded queries), the new
                         keys attended beside the ring's (harness/engine/window.py): at most
                         the window plus a block and the chunk, never the whole context
    logit_rows           positions that get logits (the LM head's rows)
    single_token_rows    rows feeding one token (decodes); it picks the kind, no price
    draft_block_copies   blocks copied in the draft model's arena
    draft_rounds         the draft model's sequential forwards (speculative decoding: k)
    draft_tokens         tokens the draft model fed (its catch-up and its proposals)
    host_blocks_loaded   blocks loaded into the arena from the host tier (kv_tier)
    disk_blocks_loaded   blocks loaded into the arena from the disk tier
    host_blocks_written  blocks written down to the host tier
    disk_blocks_written  blocks written down to the disk tier

A profile prices the counts ``PRICED`` names, in that order (``vector``): columns, but for
two sums, since a block costs the same whichever model's arena holds it and whichever way it
moves: ``block_copies`` prices block_copies + draft_block_copies, ``swap_blocks``
swap_out_blocks + swap_in_blocks.

A step's ``kind`` picks the piece of a piecewise-linear profile: ``decode`` (every row feeds
one token), ``prefill`` (no row does), ``mixed`` (both), ``verify`` (drafts are verified)
and ``idle`` (no row ran: block moves only).

The tier moves (the ``*_blocks_loaded`` and ``*_blocks_written`` counts) are not in
``PRICED``: a profile prices the step's own work, and harness/costmodel/tiers.py the moves,
whose loads may overlap the previous step (``TierCost.step_seconds``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

KINDS = ("decode", "prefill", "mixed", "verify", "idle")

# The counts a profile prices, in ``StepWork.vector`` order.
PRICED: tuple[str, ...] = (
    "batch_size",
    "row_groups",
    "query_tokens_padded",
    "attention_pairs",
    "kv_slots_read",
    "logit_rows",
    "block_copies",  # + draft_block_copies
    "swap_blocks",  # swap_out_blocks + swap_in_blocks
    "draft_rounds",
    "draft_tokens",
)


class StepWork(NamedTuple):
    """A step's work (module docstring), a field per steps-table column of the same name.
    A named tuple (immutable): one is built every step, and a frozen dataclass's 21 field
    writes cost several times a tuple's."""

    batch_size: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    window_swap_blocks: int = 0
    block_copies: int = 0
    row_groups: int = 0
    query_tokens_padded: int = 0
    kv_slots_read: int = 0
    kv_slots_attended: int = 0
    attention_pairs: int = 0
    window_kv_slots_read: int = 0
    window_attention_pairs: int = 0
    logit_rows: int = 0
    single_token_rows: int = 0
    draft_block_copies: int = 0
    draft_rounds: int = 0
    draft_tokens: int = 0
    host_blocks_loaded: int = 0
    disk_blocks_loaded: int = 0
    host_blocks_written: int = 0
    disk_blocks_written: int = 0

    @classmethod
    def from_row(cls, row: Mapping[str, int]) -> StepWork:
        """A recorded step's work: a steps-table row (a mapping of its columns). A row
        recorded before the window or the tier columns existed (``ADDED``) holds none: 0,
        as for a model without sliding-window layers and a cache without lower tiers."""
        return cls(**{n: int(row.get(n, 0) if n in ADDED else row[n]) for n in COLUMNS})

    @property
    def kind(self) -> str:
        """The step's kind (module docstring)."""
        if not self.batch_size:
            return "idle"
        if self.draft_rounds:
            return "verify"
        if self.single_token_rows == self.batch_size:
            return "decode"
        return "prefill" if not self.single_token_rows else "mixed"

    def vector(self) -> tuple[int, ...]:
        """The priced counts in ``PRICED`` order (one tuple, no generator: this runs on
        every step a model clock prices)."""
        return (
            self.batch_size,
            self.row_groups,
            self.query_tokens_padded,
            self.attention_pairs,
            self.kv_slots_read,
            self.logit_rows,
            self.block_copies + self.draft_block_copies,
            self.swap_out_blocks + self.swap_in_blocks,
            self.draft_rounds,
            self.draft_tokens,
        )


# The steps-table columns a StepWork holds, in field order.
COLUMNS: tuple[str, ...] = StepWork._fields
# The sliding-window layers' counts: priced by a roofline (its ``window_attention`` and
# ``window_swaps`` operators), not among ``PRICED``: a measured profile's fit has no term
# for them.
WINDOW: tuple[str, ...] = ("window_kv_slots_read", "window_attention_pairs", "window_swap_blocks")
# The lower KV tiers' moves (kv_tier), by tier: not priced by a profile's fit either.
TIERS: tuple[str, ...] = tuple(
    f"{tier}_blocks_{verb}" for verb in ("loaded", "written") for tier in ("host", "disk")
)
# Columns added after steps tables were first written (harness.analysis.metrics'
# ADDED_COLUMNS reads them as 0 alike).
ADDED: tuple[str, ...] = WINDOW + TIERS


def window_blocks_read(start: int, window: int, block_size: int) -> int:
    """Ring blocks a row from position ``start`` reads in a sliding-window layer: the
    logical blocks holding positions ``max(start - window + 1, 0) .. start - 1``, none at 0
    (harness/engine/kv_cache.py lays them out; a padded batch reads at least one)."""
    if start <= 0:
        return 0
    return (start - 1) // block_size - max(start - window + 1, 0) // block_size + 1
