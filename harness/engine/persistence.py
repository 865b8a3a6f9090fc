"""KV save and restore: a sequence's KV blocks in a safetensors file, checked before reuse.

A file holds the KV of a sequence's first ``len(token_ids)`` tokens, block by block as the
arena swaps them out (``HostBlocks``), in the model's dtype, or as uint32 words of quantized
rows (harness/engine/kv_cache.py)::

    keys.<layer>, values.<layer>   [num_blocks, ...]   block i holds tokens i*bs .. (i+1)*bs-1
    metadata (all strings)
      format       "kvbench-kv/1"
      token_ids    JSON list of the tokens whose KV the blocks hold
      block_size   tokens per block
      kv_bits      16 (the model's dtype), 8 or 4 (engine.kv_bits); a file without it (written
                   before quantized arenas existed) is 16
      kv_group_size  values per scale and bias when quantized (engine.kv_group_size)
      model        the model's name, for messages
      fingerprint  model_fingerprint(): architecture, KV geometry, dtype, a sample of every
                   weight tensor (hashed)
      checksum     sha256 of the tensors' bytes, in name order

The block layout is ``HostBlocks``'s (the arena's swap format): a change to it is a new
``FORMAT``. A disk tier's block (``kv_tier``, harness/engine/tier_kv.py) is a file of this
format with empty ``token_ids`` (``save_blocks``; its radix node knows the tokens), read back
by ``load_blocks`` with the same checks but the token count.

``load`` refuses a file it cannot trust, raising ``KVFileError`` with one line that names the
file and the reason: unreadable (missing, not safetensors, truncated), not a kvbench KV file,
another block size, another kv_bits or group size, another model or dtype, tensors that do
not match their checksum or their token count. The engine then warns (``KVRestoreWarning``)
and computes the prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from allocators.base import blocks_for
from harness.engine.kv_cache import RAW_BITS, UNQUANTIZED, HostBlocks, KVFormat
from harness.platform.models import LoadedModel

FORMAT = "kvbench-kv/1"
SAMPLES_PER_TENSOR = 1024  # weight elements hashed per tensor for the fingerprint


class KVFileError(ValueError):
    """A KV file cannot be used by this engine; the message names the file and why."""


class KVRestoreWarning(RuntimeWarning):
    """A requested KV restore (or save) did not happen; the prompt is computed instead."""


@dataclass(frozen=True)
class KVSpec:
    """What an engine's KV is: files written for another spec are refused."""

    model: str
    fingerprint: str
    block_size: int
    dtype: mx.Dtype  # the stored rows': the model's, or uint32 when quantized
    kv_format: KVFormat = UNQUANTIZED

    @classmethod
    def of(cls, model: LoadedModel, block_size: int, kv_format: KVFormat = UNQUANTIZED) -> KVSpec:
        dtype = mx.uint32 if kv_format.quantized else model.dtype
        return cls(model.name, model_fingerprint(model), block_size, dtype, kv_format)

    def describe(self) -> str:
        """The format as metadata says it: ``kv_bits=8 (group size 64)``."""
        return _format_name(str(self.kv_format.bits), str(self.kv_format.group_size))


@dataclass(frozen=True)
class SavedKV:
    """A loaded file: the KV of ``token_ids`` in host blocks."""

    token_ids: tuple[int, ...]
    blocks: HostBlocks

    def reusable(self, prompt: Sequence[int]) -> int:
        """Leading tokens of ``prompt`` whose KV this holds: the common prefix, short of the
        prompt's last token (computed for its logits)."""
        limit = min(len(self.token_ids), len(prompt) - 1)
        n = 0
        while n < limit and self.token_ids[n] == prompt[n]:
            n += 1
        return n


def model_fingerprint(model: LoadedModel) -> str:
    """Architecture, KV geometry and dtype, and a hash of up to ``SAMPLES_PER_TENSOR`` evenly
    spaced elements of every weight tensor (with names and shapes): other weights, seeds,
    fine-tunes and dtypes differ in it, and it costs milliseconds even for large models."""
    arch = getattr(model.model.args, "model_type", type(model.model).__name__)
    params = tree_flatten(model.model.parameters())
    n = SAMPLES_PER_TENSOR
    samples = [w.reshape(-1)[:: max(1, w.size // n)][:n] for _, w in params]
    mx.eval(samples)
    digest = hashlib.sha256()
    for (name, w), sample in zip(params, samples, strict=True):
        digest.update(f"{name}{w.shape}{w.dtype}".encode())
        digest.update(memoryview(np.array(sample.view(RAW_BITS[sample.dtype.size]))))
    return (
        f"{arch} layers={model.num_layers} kv_heads={model.num_kv_heads} "
        f"head_dim={model.head_dim} dtype={_dtype_name(model.dtype)} "
        f"weights={digest.hexdigest()[:16]}"
    )


def save(path: str | Path, spec: KVSpec, token_ids: Sequence[int], blocks: HostBlocks) -> None:
    """Write the KV of ``token_ids`` (``blocks``, as ``KVArena.swap_out`` returns them).
    Written to a temporary name, then renamed: a reader never sees half a file."""
    path = Path(path)
    raw = _named(blocks)
    metadata = {
        "format": FORMAT,
        "token_ids": json.dumps(list(token_ids)),
        "block_size": str(spec.block_size),
        "kv_bits": str(spec.kv_format.bits),
        "kv_group_size": str(spec.kv_format.group_size),
        "model": spec.model,
        "fingerprint": spec.fingerprint,
        "checksum": _checksum(raw),
    }
    arrays = {name: mx.array(a).view(spec.dtype) for name, a in raw.items()}
    partial = path.with_name(f".{path.name}.partial.safetensors")
    mx.save_safetensors(str(partial), arrays, metadata=metadata)
    os.replace(partial, path)


def load(path: str | Path, spec: KVSpec) -> SavedKV:
    """Read and check a file written by ``save`` for ``spec``; ``KVFileError`` if it cannot
    be trusted (see the module docstring)."""
    meta, arrays = _read(path, spec)
    try:
        token_ids = tuple(int(t) for t in json.loads(meta["token_ids"]))
    except (KeyError, TypeError, ValueError) as e:
        raise KVFileError(f"KV file {path} has no valid token_ids in its header") from e
    if not token_ids:
        raise KVFileError(f"KV file {path} holds no tokens")
    blocks = blocks_for(len(token_ids), spec.block_size)
    what = f" for its {len(token_ids)} tokens"
    return SavedKV(token_ids, _blocks(path, spec, meta, arrays, blocks, what))


def save_blocks(path: str | Path, spec: KVSpec, blocks: HostBlocks) -> None:
    """Write KV blocks whose tokens the file does not name (a disk tier's block: its radix
    node knows them), in ``save``'s format with an empty ``token_ids``."""
    save(path, spec, (), blocks)


def load_blocks(path: str | Path, spec: KVSpec, num_blocks: int) -> HostBlocks:
    """Read and check ``num_blocks`` blocks written by ``save_blocks`` for ``spec``
    (``KVFileError`` as ``load``)."""
    return _blocks(path, spec, *_read(path, spec), num_blocks)


def _read(path: str | Path, spec: KVSpec) -> tuple[dict[str, str], dict[str, mx.array]]:
    """A KV file's header and tensors, its format, block size, KV format and model checked."""
    try:
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise KVFileError(f"KV file {path} cannot be read ({' '.join(str(e).split())})") from e
    if meta.get("format") != FORMAT:
        raise KVFileError(f"KV file {path} is not a kvbench KV file (no format {FORMAT!r})")
    if meta.get("block_size") != str(spec.block_size):
        raise KVFileError(
            f"KV file {path} was saved with block_size={meta.get('block_size')}, this engine "
            f"uses {spec.block_size}: restore it with the same engine.block_size"
        )
    saved = _format_name(meta.get("kv_bits", "16"), meta.get("kv_group_size", ""))
    if saved != spec.describe():
        raise KVFileError(
            f"KV file {path} was saved with {saved}, this engine stores {spec.describe()}: "
            "restore it with the same engine.kv_bits and engine.kv_group_size"
        )
    if meta.get("fingerprint") != spec.fingerprint:
        raise KVFileError(
            f"KV file {path} was saved from another model ({meta.get('model')!r}: "
            f"{meta.get('fingerprint')}); this engine runs {spec.model!r}: {spec.fingerprint}"
        )
    return meta, arrays


def _blocks(
    path: str | Path,
    spec: KVSpec,
    meta: dict[str, str],
    arrays: dict[str, mx.array],
    num_blocks: int,
    what: str = "",
) -> HostBlocks:
    """A file's tensors as host blocks, if they are ``num_blocks`` blocks of every layer in
    the engine's dtype and match their checksum (``what`` says why that many)."""
    layers = len(arrays) // 2
    names = [f"{kind}.{layer}" for kind in ("keys", "values") for layer in range(layers)]
    if sorted(names) != sorted(arrays) or any(
        a.shape[0] != num_blocks or a.dtype != spec.dtype for a in arrays.values()
    ):
        raise KVFileError(
            f"KV file {path} does not hold {num_blocks} {_dtype_name(spec.dtype)} blocks per "
            f"layer{what}"
        )
    bits = RAW_BITS[spec.dtype.size]
    raw = {name: np.array(a.view(bits)) for name, a in arrays.items()}
    if meta.get("checksum") != _checksum(raw):
        raise KVFileError(f"KV file {path} is corrupted: its tensors do not match its checksum")
    return HostBlocks(
        [raw[f"keys.{layer}"] for layer in range(layers)],
        [raw[f"values.{layer}"] for layer in range(layers)],
    )


def _named(blocks: HostBlocks) -> dict[str, np.ndarray]:
    """Host blocks by tensor name: ``keys.<layer>``, ``values.<layer>``."""
    return {
        f"{kind}.{layer}": a
        for kind, layers in (("keys", blocks.keys), ("values", blocks.values))
        for layer, a in enumerate(layers)
    }


def _checksum(raw: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(raw):
        digest.update(memoryview(np.ascontiguousarray(raw[name])))
    return digest.hexdigest()


def _format_name(bits: str, group_size: str) -> str:
    """``kv_bits=16``, or ``kv_bits=8 (group size 64)``: the group size matters only then."""
    return f"kv_bits={bits}" if bits == "16" else f"kv_bits={bits} (group size {group_size})"


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")
