"""A step's priced counts by the names roofline.py (harness/costmodel/roofline.py) prices
them: ``StepWork.vector()`` (harness/costmodel/work.py), in ``FEATURES`` order.

Kept only for roofline.py, which is being changed on another branch and so is not ported to
``StepWork`` here, and for the roofline profile it wrote
(results/reproductions/chunked_prefill/profile-a100-small-bf16.json), whose operators name
their counts by these names. This module goes once roofline.py prices ``StepWork``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from harness.costmodel.work import StepWork


@dataclass(frozen=True)
class StepFeatures:
    """``StepWork``'s priced counts, named as roofline.py names them (``FEATURES``)."""

    rows: int = 0  # batch_size
    groups: int = 0  # row_groups
    query_tokens: int = 0  # query_tokens_padded
    attention: int = 0  # attention_pairs
    kv_read: int = 0  # kv_slots_read
    logits: int = 0  # logit_rows
    block_copies: int = 0  # block_copies + draft_block_copies
    swap_blocks: int = 0  # swap_out_blocks + swap_in_blocks
    draft_rounds: int = 0
    draft_tokens: int = 0
    single_token_rows: int = 0  # priced by nothing (roofline.py's decode_step sets it)

    @classmethod
    def of(cls, work: StepWork) -> StepFeatures:
        """``work``'s counts (``PRICED`` and ``FEATURES`` are in the same order)."""
        return cls(*work.vector(), work.single_token_rows)

    def vector(self) -> tuple[int, ...]:
        """The priced counts in ``FEATURES`` order."""
        return tuple(getattr(self, name) for name in FEATURES)


# The counts roofline.py prices, in order (all but ``single_token_rows``).
FEATURES: tuple[str, ...] = tuple(f.name for f in fields(StepFeatures))[:-1]
