"""The engine's KV save and restore hooks (the file format is harness/engine/persistence.py).

    save_kv=PATH        at finish, before its blocks go, the request's KV is saved
    restore_kv=PATH     at intake, the KV of the longest prompt prefix the file holds is read
                        into host memory; admission writes it back (a SwapIn) instead of
                        computing it
    save_prefix_cache   the radix allocator's whole prefix cache, one file per tree path
    restore_prefix_cache  a snapshot back into free blocks, cached and held by nobody

The scheduler places every block (``claim_prefix`` / ``index_prefix`` for a snapshot);
these hooks only move KV between the arena, host memory and files.

``KVFiles`` is a part of ``LLMEngine`` (harness/engine/llm_engine.py); it owns ``_host``
(host copies of swapped-out and restored requests) and ``_save_to`` (where a finishing
request's KV goes).
"""

from __future__ import annotations

import warnings
from functools import cached_property
from pathlib import Path

from allocators.base import blocks_for
from harness.engine import persistence
from harness.engine.kv_cache import HostBlocks
from harness.engine.request import Sequence as Seq
from harness.engine.sampling_params import SamplingParams
from schedulers.request import Status


class KVFiles:
    """KV to and from files, and host copies of requests' KV."""

    @cached_property
    def kv_spec(self) -> persistence.KVSpec:
        """What this engine's KV is (model fingerprint, block size, dtype, kv_bits and group
        size): a KV file saved for another spec is refused."""
        return persistence.KVSpec.of(self.model, self.allocator.block_size, self.kv_format)

    def _restorable(
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
        ``save_kv``). Returns the number of paths. Between steps, like every engine call."""
        with self._lock:
            self._needs_prefix_cache("save_prefix_cache")
            paths = self.allocator.cached_paths()
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
        with self._lock:
            self._needs_prefix_cache("restore_prefix_cache")
            files = sorted(Path(folder).glob("path-*.safetensors"))
            if not files:
                raise ValueError(f"{folder} holds no prefix-cache snapshot (path-*.safetensors)")
            bs, restored = self.allocator.block_size, 0
            for i, path in enumerate(files):
                try:
                    saved = persistence.load(path, self.kv_spec)
                except persistence.KVFileError as e:
                    warnings.warn(f"{e}; skipped", persistence.KVRestoreWarning, stacklevel=2)
                    continue
                tokens = saved.token_ids[: len(saved.token_ids) // bs * bs]
                claimed = self.scheduler.claim_prefix(tokens)
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
                self.scheduler.index_prefix(tokens)
                restored += len(tokens) - have
            return restored

    def _needs_prefix_cache(self, what: str) -> None:
        if not self.allocator.caches_prefixes:
            raise ValueError(
                f"{what} needs a prefix cache: allocator {type(self.allocator).__name__} "
                "keeps none; use the radix allocator"
            )

    def _release(self, seq: Seq) -> None:
        """Give a finishing sequence's blocks back, saving its KV first if asked (save_kv)."""
        path = self._save_to.pop(seq.request_id, None)
        if path is not None:
            self._save_kv(seq, path)
        self.scheduler.finish(seq)

    def _save_kv(self, seq: Seq, path: Path) -> None:
        """Save the KV of ``seq``'s computed tokens (all but its last, sampled token). A
        failure warns: the request itself has finished fine."""
        n = seq.num_computed_tokens
        if seq.status is Status.RUNNING:
            table = self.allocator.block_table(seq.request_id)
            blocks = self.runner.swap_out(table[: blocks_for(n, self.allocator.block_size)])
        else:  # preempted after its last token was sampled (pipelined steps)
            blocks = self._host.get(seq.request_id)
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
