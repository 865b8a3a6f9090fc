"""The engine's host-side KV: host copies of requests' KV (swapped out, or restored from a
file), where a finishing request's KV is saved, and KV files in and out (the file format is
harness/engine/persistence.py). ``HostKV`` is the only writer of the host copies and the
save targets.

    save_kv=PATH        at finish, before its blocks go, the request's KV is saved
    restore_kv=PATH     at intake, the KV of the longest prompt prefix the file holds is read
                        into host memory; admission writes it back (a SwapIn) instead of
                        computing it
    save_prefix_cache   the radix allocator's whole prefix cache, one file per tree path
    restore_prefix_cache  a snapshot back into free blocks, cached and held by nobody

``move_blocks`` applies a step's plan before its forward: swap-outs to host copies, the
prefix cache's moves to and from its lower tiers (``kv_tier``: harness/engine/tier_kv.py; on
the model clock there is no ``TierKV`` and the moves are priced, not made), block copies (the
draft model's too), swap-ins from host copies. The scheduler places every block
(``claim_prefix`` / ``index_prefix`` for a snapshot) and hands over a kept request's block
table when it stops (``take_released``); this part only moves KV between the arena, host
memory and files.
"""

from __future__ import annotations

import time
import warnings
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from allocators.base import blocks_for
from harness.engine import persistence
from harness.engine.kv_cache import HostBlocks, KVFormat
from harness.engine.model_runner import Runner
from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams
from harness.engine.tier_kv import TierKV
from harness.engine.window import WindowTables
from harness.platform.models import LoadedModel
from schedulers.base import Scheduler, SchedulerOutput
from schedulers.prefix_snapshot import claim_prefix, index_prefix


class Moved(NamedTuple):
    """Seconds a step's block moves took: swaps (out and in) and the tier moves."""

    swap_time: float = 0.0
    tier_time: float = 0.0


class HostKV:
    """Host copies of requests' KV, save targets, and KV files to and from the arena."""

    def __init__(
        self,
        model: LoadedModel,
        scheduler: Scheduler,
        runner: Runner,
        kv_format: KVFormat,
        window: WindowTables | None = None,
        draft_runner: Runner | None = None,
        tiers: TierKV | None = None,
    ) -> None:
        self.model = model
        self.scheduler = scheduler
        self.runner = runner
        self.kv_format = kv_format
        self.window = window  # a model's sliding-window rings move with its blocks
        self.draft_runner = draft_runner  # a draft model's arena (its block copies)
        self.tiers = tiers  # the lower KV tiers' bytes (kv_tier), if any
        self._copies: dict[str, HostBlocks] = {}  # swapped-out and restored requests' KV
        self._save_to: dict[str, Path] = {}  # where a finishing request's KV goes

    @cached_property
    def kv_spec(self) -> persistence.KVSpec:
        """What this engine's KV is (model fingerprint, block size, dtype, kv_bits and group
        size): a KV file saved for another spec is refused."""
        return persistence.KVSpec.of(
            self.model, self.scheduler.allocator.block_size, self.kv_format
        )

    def holds(self, request_id: str) -> bool:
        """A host copy of ``request_id``'s KV is here (swapped out, or restored from a file)."""
        return request_id in self._copies

    @property
    def num_blocks(self) -> int:
        """Blocks (of every layer) held in host copies."""
        return sum(len(host.keys[0]) for host in self._copies.values())

    def keep(self, request_id: str, blocks: HostBlocks) -> None:
        """Hold ``blocks``, a host copy of ``request_id``'s KV, until it is written back."""
        self._copies[request_id] = blocks

    def take(self, request_id: str) -> HostBlocks:
        """The host copy of ``request_id``'s KV, to write back; it leaves host memory."""
        return self._copies.pop(request_id)

    def save_at_finish(self, request_id: str, path: Path) -> None:
        """Save ``request_id``'s KV to ``path`` when it finishes (save_kv)."""
        self._save_to[request_id] = path

    def forget(self, request_id: str) -> None:
        """``request_id`` left: its host copy goes, and an aborted one's KV is not saved."""
        self._copies.pop(request_id, None)
        self._save_to.pop(request_id, None)

    def move_blocks(self, plan: SchedulerOutput) -> Moved:
        """Swap-outs, tier moves, block copies, swap-ins: each block is read before a later op
        (or the forward) reuses it. Returns the seconds the swaps and the tier moves took."""
        swap_time = 0.0
        if plan.swapped_out:
            start = time.perf_counter()
            for s in plan.swapped_out:
                self.keep(s.seq.request_id, self.runner.swap_out(s.blocks))
                if self.window is not None:
                    self.window.swap_out(s.seq.request_id, s.ring)
            swap_time += time.perf_counter() - start
        tier_time = 0.0
        if plan.tier_moves and self.tiers is not None:  # a load's block may be a copy's source
            start = time.perf_counter()
            self.tiers.apply(plan.tier_moves)
            tier_time = time.perf_counter() - start
        self.runner.copy_blocks(plan.copies)  # a source may be a block a swap-in reuses
        if plan.draft_copies:  # only a draft model's KV moves
            self.draft_runner.copy_blocks(plan.draft_copies)
        if plan.swapped_in:
            start = time.perf_counter()
            for s in plan.swapped_in:
                self.runner.swap_in(self.take(s.seq.request_id), s.blocks, s.first)
                if self.window is not None:
                    self.window.swap_in(s.seq.request_id, s.ring)
            swap_time += time.perf_counter() - start
        return Moved(swap_time, tier_time)

    def restorable(
        self, request_id: str, path: str | Path, prompt: list[int], params: SamplingParams
    ) -> tuple[int, HostBlocks] | None:
        """The KV a file holds for a prefix of ``prompt`` (tokens, host blocks); None, with a
        warning, when it cannot be used. A request for prompt logprobs reads no file, as it
        reads no prefix cache: it needs logits at every prompt position."""
        if params.skip_reading_prefix_cache:
            reason = f"KV file {path} is not read: prompt_logprobs needs every prompt position"
        else:
            try:
                saved = persistence.load(path, self.kv_spec)
            except persistence.KVFileError as e:
                reason = str(e)
            else:
                if n := saved.reusable(prompt):
                    return n, saved.blocks
                reason = f"KV file {path} shares no prefix with the prompt"
        warnings.warn(
            f"request {request_id!r}: {reason}; computing the prompt instead",
            persistence.KVRestoreWarning,
            stacklevel=3,
        )
        return None

    def save_prefix_cache(self, folder: str | Path) -> int:
        """Snapshot the radix allocator's whole prefix cache into ``folder`` (created): one
        KV file per root-to-leaf path of the tree, its tokens and blocks (the format of
        ``save_kv``). Returns the number of paths."""
        self._needs_prefix_cache("save_prefix_cache")
        paths = self.scheduler.allocator.cached_paths()
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for i, (tokens, blocks) in enumerate(paths):
            host = self.runner.swap_out(blocks)
            persistence.save(folder / f"path-{i:05d}.safetensors", self.kv_spec, tokens, host)
        return len(paths)

    def restore_prefix_cache(self, folder: str | Path) -> int:
        """Load a ``save_prefix_cache`` snapshot into the prefix cache: each path's blocks
        that the tree lacks are written into free blocks and indexed, cached and held by
        nobody, so later requests hit them. A file that cannot be used warns
        (``KVRestoreWarning``) and is skipped; when the free blocks run out the restore stops
        with a warning rather than evict what it restored. Returns the tokens restored."""
        self._needs_prefix_cache("restore_prefix_cache")
        files = sorted(Path(folder).glob("path-*.safetensors"))
        if not files:
            raise ValueError(f"{folder} holds no prefix-cache snapshot (path-*.safetensors)")
        bs, restored = self.scheduler.allocator.block_size, 0
        for i, path in enumerate(files):
            try:
                saved = persistence.load(path, self.kv_spec)
            except persistence.KVFileError as e:
                warnings.warn(f"{e}; skipped", persistence.KVRestoreWarning, stacklevel=2)
                continue
            tokens = saved.token_ids[: len(saved.token_ids) // bs * bs]
            claimed = claim_prefix(self.scheduler, tokens)
            if claimed is None:
                warnings.warn(
                    f"prefix-cache restore stopped at {path.name} ({i} of {len(files)} "
                    "paths): the arena's free blocks are used up",
                    persistence.KVRestoreWarning,
                    stacklevel=2,
                )
                break
            have, blocks = claimed
            self.runner.swap_in(saved.blocks, blocks, have // bs)
            index_prefix(self.scheduler, tokens)
            restored += len(tokens) - have
        return restored

    def _needs_prefix_cache(self, what: str) -> None:
        allocator = self.scheduler.allocator
        if not allocator.caches_prefixes:
            raise ValueError(
                f"{what} needs a prefix cache: allocator {type(allocator).__name__} "
                "keeps none; use the radix allocator"
            )

    def save(self, seq: Seq, table: tuple[int, ...] | None) -> None:
        """Save the KV of ``seq``'s computed tokens (all but its last, sampled token) to its
        save_kv file: from the arena blocks ``table`` it held when it stopped, or, when it
        was off the device then, its host copy. A failure warns: the request itself has
        finished fine."""
        path = self._save_to.pop(seq.request_id)
        n = seq.num_computed_tokens
        if table is not None:
            bs = self.scheduler.allocator.block_size
            blocks = self.runner.swap_out(table[: blocks_for(n, bs)])
        else:  # preempted after its last token was sampled (pipelined steps)
            blocks = self._copies.get(seq.request_id)
        if blocks is None:
            reason = "it was preempted by recompute and holds no KV"
        else:
            try:
                persistence.save(path, self.kv_spec, seq.token_ids[:n], blocks)
                return
            except (OSError, RuntimeError) as e:
                reason = " ".join(str(e).split())
        warnings.warn(
            f"request {seq.request_id!r}: its KV was not saved to {path} ({reason})",
            persistence.KVRestoreWarning,
            stacklevel=2,
        )
