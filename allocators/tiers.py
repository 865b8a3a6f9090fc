"""The second KV tier's contract: block moves between the device arena and lower tiers.

A prefix cache with lower tiers (``kv_tier``: host memory, then disk) keeps a block the arena
evicts in the next tier instead of dropping it, and loads it back into an arena block when a
prefix lookup hits it. The allocator decides every move; the engine makes them (real copies,
or their price on the model clock), in the order the allocator emitted them, so a block is
always read before a later move or the step's forward reuses it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Tier = Literal["device", "host", "disk"]
TIERS: tuple[Tier, ...] = ("device", "host", "disk")


class TierMove(NamedTuple):
    """Copy block ``src`` of tier ``src_tier`` into block ``dst`` of tier ``dst_tier``.

    ``dst_tier == "device"``: a load (a lower tier's block brought back for a prefix hit);
    otherwise a write (eviction under write-back, commit under write-through, or a full
    tier handing its block down). The source stays valid until a later move reuses it.
    """

    src_tier: Tier
    src: int
    dst_tier: Tier
    dst: int
