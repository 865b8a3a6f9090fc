"""The lower KV tiers' bytes on the real engine (``kv_tier``): host slots hold host copies of
single arena blocks (the swap path's ``HostBlocks``), disk slots hold KV files (the format of
harness/engine/persistence.py, one block a file) in a folder the run owns. The radix
allocator decides every move (``allocators.tiers.TierMove``); ``TierKV.apply`` makes them in
order, each a real copy (a quantized arena's stored words too)::

    device -> host   runner.swap_out([block])            host -> device   runner.swap_in
    host   -> disk   persistence.save_blocks(slot file)  disk -> device   load_blocks, swap_in

The folder is made inside ``kv_tier.dir`` (a run sets it to its output folder when the config
leaves it null; else the system's temporary folder) and removed by ``close``, or when the
engine is collected or the process exits, unless ``kv_tier.keep``. On the model clock there
are no bytes: the engine gets no ``TierKV`` and the moves are priced instead.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

from allocators.tiers import KVTier, Tier, TierMove
from harness.engine import persistence
from harness.engine.kv_cache import HostBlocks
from harness.engine.model_runner import Runner


class TierKV:
    """The host and disk tiers' blocks: host copies in memory, disk blocks in files."""

    def __init__(
        self,
        kv_tier: KVTier,
        runner: Runner,
        spec: Callable[[], persistence.KVSpec],
    ) -> None:
        self.kv_tier = kv_tier
        self.runner = runner
        self._spec = spec  # the engine's KV spec, read when the first file is written
        self._host: dict[int, HostBlocks] = {}
        self.folder: Path | None = None
        if kv_tier.disk_blocks:
            if kv_tier.dir is not None:
                Path(kv_tier.dir).mkdir(parents=True, exist_ok=True)
            self.folder = Path(tempfile.mkdtemp(prefix="kv-tier-", dir=kv_tier.dir))
        self._finalizer = weakref.finalize(
            self, shutil.rmtree, str(self.folder), ignore_errors=True
        )
        if self.folder is None or kv_tier.keep:
            self._finalizer.detach()

    def apply(self, moves: Iterable[TierMove]) -> None:
        """Make ``moves`` in order: each reads its source before a later move reuses it."""
        for move in moves:
            self._write(move.dst_tier, move.dst, self._read(move.src_tier, move.src))

    def close(self, discard: bool = False) -> None:
        """Remove the disk tier's folder now, unless ``keep`` (``discard``: even then)."""
        if self._finalizer.alive:
            self._finalizer()
        elif discard and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _read(self, tier: Tier, slot: int) -> HostBlocks:
        if tier == "device":
            return self.runner.swap_out([slot])
        if tier == "host":
            return self._host[slot]
        return persistence.load_blocks(self._file(slot), self._spec(), 1)

    def _write(self, tier: Tier, slot: int, blocks: HostBlocks) -> None:
        if tier == "device":
            self.runner.swap_in(blocks, [slot])
        elif tier == "host":
            self._host[slot] = blocks
        else:
            persistence.save_blocks(self._file(slot), self._spec(), blocks)

    def _file(self, slot: int) -> Path:
        return self.folder / f"block-{slot:06d}.safetensors"
