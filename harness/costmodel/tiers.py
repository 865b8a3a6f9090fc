"""The price of KV blocks moved between the arena and the lower tiers (``kv_tier``), and
whether loading a prefix hit beats recomputing it: pure arithmetic over a profile.

A block is ``block_bytes`` (K and V of its slots over every full-attention layer, at the
arena's format: what a swap moves). Two links carry it, each at a rate:

    host link   device <-> host memory: the roofline's ``peak.host_link`` x its efficiency
                (PCIe one way; a copy within unified memory on Apple silicon), so
                ``block_bytes / rate`` a block; a measured profile's ``moves.swap_blocks``
                (the seconds kvbench-calibrate measured to swap a block, the same copy)
    disk        host memory <-> the SSD: the device sheet's ``disk_bandwidth`` (devices.yaml,
                copied into a roofline profile's ``machine``), at its peak: a sequential read
                rate, used for writes too (slower on real drives, so writes are a lower
                bound). A measured profile has none (kvbench-calibrate times no disk), and a
                roofline derived before the sheets had one neither: a disk tier is refused
                with them (``TierCost.of``), no default is guessed

Moves follow SGLang HiCache's path through the tiers (device, host, disk): a load from the
host tier crosses the host link, a load from disk crosses the disk and then the host link; a
write to the host tier (an arena block written down) crosses the host link, a write to the
disk tier (a host block handed down) the disk. Per step (``step_seconds``):

    writes      their full time, before the step's forward: under write-back the evicted
                block's arena slot is reused by this very step, so it is read out first;
                under write-through a committed block's copy could run beside the
                computation, so there this is an upper bound
    loads       their full time before the forward that needs them; with ``prefetch``
                (HiCache's prefetch of a waiting request's hits) issued a step ahead, so only
                what the previous step's computation does not hide:
                max(0, loads - previous step's price)

Load or recompute (``worth_loading``): n blocks holding t prompt tokens after s computed ones
are loaded only if recomputing those tokens costs at least ``min_load_ratio`` x their load.
Recomputing them costs what they add to a prefill step: the profile's price of a chunk of the
t tokens after the s before them (roofline.py ``prefill_step``: their queries attend to all
s + t keys) less that of a step without them (its fixed part: the weights read once, the
intercept, the LM head's row), which the request's own prefill pays anyway. SGLang's
``HiRadixCache`` refuses a load back shorter than a fixed ``load_back_threshold`` (10 tokens)
instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from allocators.tiers import Tier
from harness.costmodel.profile import Profile, ProfileError
from harness.costmodel.roofline import prefill_step
from harness.costmodel.work import StepWork


@dataclass(frozen=True)
class TierCost:
    """Seconds per block over each link (``host``, ``disk``; None: unpriced), the step's
    load-and-write time, and the load-or-recompute rule (module docstring), for an arena of
    ``block_size`` slots a block."""

    profile: Profile
    block_size: int
    host: float
    disk: float | None
    prefetch: bool = True
    min_load_ratio: float = 1.0

    @classmethod
    def of(
        cls,
        profile: Profile,
        block_bytes: int,
        block_size: int,
        *,
        disk: bool = False,
        prefetch: bool = True,
        min_load_ratio: float = 1.0,
    ) -> TierCost:
        """The prices ``profile`` gives a block of ``block_bytes`` (``block_size`` slots);
        ``disk``: a disk tier is used, so the profile must price the disk (else ProfileError
        naming the fix)."""
        data = profile.data
        section = data.get("roofline")
        if section is not None:
            rate = section["peak"]["host_link"] * section["efficiency"]["host_link"]
            host = block_bytes / rate
            sheet = data.get("machine", {}).get("disk_bandwidth")
            on_disk = block_bytes / sheet if sheet else None
        else:
            host, on_disk = data["moves"].get("swap_blocks", 0.0), None
        if disk and on_disk is None:
            raise ProfileError(
                f"engine.profile={profile.path!r} has no disk bandwidth (a {profile.kind} "
                "profile without machine.disk_bandwidth): kv_tier.disk_blocks needs a roofline "
                "profile derived from devices.yaml (python -m harness.costmodel.roofline), or "
                "set kv_tier=host"
            )
        if min_load_ratio < 0:
            raise ValueError(f"kv_tier.min_load_ratio={min_load_ratio}: a ratio >= 0")
        return cls(profile, block_size, host, on_disk, prefetch, min_load_ratio)

    def load_seconds(self, tier: Tier, num_blocks: int) -> float:
        """Seconds to bring ``num_blocks`` of ``tier`` into the arena."""
        if tier == "host":
            return num_blocks * self.host
        if tier == "disk":
            return num_blocks * (self._disk() + self.host)
        raise ValueError(f"tier {tier!r}: loads come from host or disk")

    def write_seconds(self, tier: Tier, num_blocks: int) -> float:
        """Seconds to write ``num_blocks`` down to ``tier``."""
        if tier == "host":
            return num_blocks * self.host
        if tier == "disk":
            return num_blocks * self._disk()
        raise ValueError(f"tier {tier!r}: writes go to host or disk")

    def step_seconds(self, work: StepWork, previous: float) -> float:
        """The time ``work``'s tier moves add to its step, after a step priced ``previous``
        seconds: writes in full, loads in full or (``prefetch``) what ``previous`` hides not."""
        if not (
            work.host_blocks_written
            or work.host_blocks_loaded
            or work.disk_blocks_written
            or work.disk_blocks_loaded
        ):
            return 0.0  # most steps move nothing
        writes = self.write_seconds("host", work.host_blocks_written)
        if work.disk_blocks_written:
            writes += self.write_seconds("disk", work.disk_blocks_written)
        loads = self.load_seconds("host", work.host_blocks_loaded)
        if work.disk_blocks_loaded:
            loads += self.load_seconds("disk", work.disk_blocks_loaded)
        if self.prefetch:
            loads = max(0.0, loads - previous)
        return writes + loads

    def recompute_seconds(self, num_tokens: int, start: int = 0) -> float:
        """What ``num_tokens`` prompt tokens after ``start`` computed ones add to a prefill
        step: their queries attend to the ``start`` tokens before them too."""
        price, block_size = self.profile.predict, self.block_size
        full = prefill_step(num_tokens, block_size, start=start)
        return max(0.0, price(full) - price(prefill_step(0, block_size)))

    def worth_loading(self, tier: Tier, num_blocks: int, num_tokens: int, start: int = 0) -> bool:
        """Load ``num_blocks`` of ``tier`` holding ``num_tokens`` tokens, after ``start``
        tokens of the prompt, rather than compute them: recomputing costs at least
        ``min_load_ratio`` x loading."""
        recompute = self.recompute_seconds(num_tokens, start)
        return recompute >= self.min_load_ratio * self.load_seconds(tier, num_blocks)

    def _disk(self) -> float:
        if self.disk is None:
            raise ProfileError(
                f"engine.profile={self.profile.path!r} prices no disk: a disk move cannot be "
                "priced (TierCost.of(..., disk=True) says why)"
            )
        return self.disk
