"""The second KV tier's contract: block moves between the device arena and lower tiers.

A prefix cache with lower tiers (``kv_tier``: host memory, then disk) keeps a block the arena
evicts in the next tier instead of dropping it, and loads it back into an arena block when a
prefix lookup hits it. The allocator decides every move; the engine makes them (real copies,
or their price on the model clock), in the order the allocator emitted them, so a block is
always read before a later move or the step's forward reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
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


WritePolicy = Literal["write_back", "write_through"]


@dataclass(frozen=True)
class KVTier:
    """The ``kv_tier`` config group: the lower tiers under the prefix cache.

    ``host_blocks`` blocks in host memory (0: no tier below the arena), then ``disk_blocks``
    on disk in ``dir`` (a folder the run owns, removed at its end unless ``keep``).
    ``write_policy``: ``write_back`` writes a block down when the arena evicts it;
    ``write_through`` when it is committed, so eviction is free. Each tier evicts by
    ``eviction`` (the radix allocator's policies). ``prefetch``: a load the scheduler issues
    a step ahead overlaps the previous step's compute (the model clock's assumption, as
    SGLang HiCache's prefetch). ``min_load_ratio``: load lower-tier blocks only when
    recomputing their tokens costs at least this many times the load; otherwise recompute.
    """

    host_blocks: int = 0
    disk_blocks: int = 0
    dir: str | None = None
    keep: bool = False
    write_policy: WritePolicy = "write_back"
    eviction: str = "lru"
    prefetch: bool = True
    min_load_ratio: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0 or self.disk_blocks > 0
