"""Models the engine runs: seeded random-weight mlx_lm models, or real weights from a path.

Random weights follow vLLM's ``load_format=dummy``: the architecture and the cost are real,
the tokens are meaningless. The harness measures memory and scheduling, which do not
depend on what the weights say.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from harness.platform.formats import BITS, stored_bytes

# Sizes named by configs. "tiny" keeps tests fast on a 2-core CPU; "small" (~32M params)
# makes the forward dominate in benchmarks without taking hours there.
_SIZE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
SIZES: dict[str, dict[str, int]] = {
    name: dict(zip(_SIZE_FIELDS, values, strict=True))
    for name, values in {
        # hidden, layers, MLP, heads, KV heads, vocabulary
        "tiny": (256, 4, 704, 4, 2, 1024),
        "small": (512, 8, 1408, 8, 4, 8192),
    }.items()
}

ARCHITECTURES = ("llama", "qwen2", "gemma3_text", "gpt_oss")

# Fields an architecture needs beyond SIZES, at tiny scale. Windows of 16 tokens make short
# prompts slide (tests); gpt-oss's experts are few and small.
ARCH_FIELDS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    # every third layer full attention, the others a 16-token window (Gemma 3: every sixth)
    "gemma3_text": dict(
        head_dim=64, query_pre_attn_scalar=64, sliding_window=16, sliding_window_pattern=3
    ),
    # alternating window / full layers, as gpt-oss; attention sinks (zero at random init)
    "gpt_oss": dict(head_dim=64, sliding_window=16, num_local_experts=4, num_experts_per_tok=2),
}


@dataclass
class LoadedModel:
    """An mlx_lm model plus the facts the KV arena and the sampler need; or, with ``model``
    None, a shape alone (``spec``: ``model=shape``), which only the model clock runs: it
    prices steps and builds no weights."""

    model: nn.Module | None
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: mx.Dtype
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int | None = None  # None: the config sets no limit
    # Sliding-window layers (mlx_lm's RotatingKVCache): each query attends to the last
    # ``window`` positions, itself included. Empty: every layer is full attention.
    window_layers: tuple[int, ...] = ()
    window: int | None = None
    spec: dict[str, Any] | None = None  # the shape of a model without weights (shape())

    @property
    def num_params(self) -> int:
        if self.model is None:
            return self.spec["num_params"]
        return sum(v.size for _, v in tree_flatten(self.model.parameters()))

    @property
    def hidden_size(self) -> int:
        """The residual stream's width."""
        return self.spec["hidden_size"] if self.model is None else self.model.args.hidden_size

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The full-attention layers (all of them when no layer has a window)."""
        window = set(self.window_layers)
        return tuple(i for i in range(self.num_layers) if i not in window)

    def shape(self) -> dict[str, Any]:
        """What a step's cost depends on (a cost profile's ``model``, harness/costmodel):
        the architecture's sizes and dtype, not the weights' values."""
        if self.model is None:
            return dict(self.spec)
        args = self.model.args
        return {
            "name": self.name,
            "model_type": getattr(args, "model_type", None),
            "num_layers": self.num_layers,
            "hidden_size": args.hidden_size,
            "num_heads": args.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": getattr(args, "intermediate_size", None),
            "vocab_size": self.vocab_size,
            "dtype": str(self.dtype).removeprefix("mlx.core."),
            "num_params": self.num_params,
            "window_layers": list(self.window_layers),
            "window": self.window,
        }

    def layer_bytes_per_token(self, bits: int = 16, group_size: int = 64) -> int:
        """Bytes of K and V that one token occupies in one layer, stored at ``bits``
        (``kv_row_bytes``: 16 is the model's dtype as is)."""
        row = kv_row_bytes(self.head_dim, self.dtype, bits, group_size)
        return 2 * self.num_kv_heads * row

    def kv_bytes_per_token(self, bits: int = 16, group_size: int = 64) -> int:
        """Bytes of K and V that one token occupies across the full-attention layers (all
        layers of a model without windows; a window layer's KV is capped, see
        harness/engine/window.py), stored at ``bits``."""
        return len(self.full_layers) * self.layer_bytes_per_token(bits, group_size)


KV_BITS = BITS  # engine.kv_bits: 16 is the model's dtype, 8 and 4 mx.quantize's


def kv_row_bytes(head_dim: int, dtype: mx.Dtype, bits: int = 16, group_size: int = 64) -> int:
    """Bytes of one head's K (or V) of one token as the KV arena stores it.

    ``bits=16``: ``head_dim`` values in the model's ``dtype`` (4 bytes each for float32: 16
    names "not quantized"). 8 or 4: group-wise affine quantization as ``mx.quantize`` and
    mlx_lm's ``QuantizedKVCache`` do it, along ``head_dim`` in groups of ``group_size``:
    ``head_dim * bits / 8`` bytes of packed values (uint32 words) plus a scale and a bias in
    ``dtype`` per group, all counted (``formats.stored_bytes``)."""
    return stored_bytes(head_dim, dtype.size, bits, group_size)


def random_model(
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    **overrides: Any,
) -> LoadedModel:
    """Build a seeded random-weight mlx_lm model of a named size (``overrides`` change fields)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"model.arch={arch!r} is unknown: choose one of {ARCHITECTURES}")
    if size not in SIZES:
        raise ValueError(f"model.size={size!r} is unknown: choose one of {tuple(SIZES)}")
    config = {
        "model_type": arch,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        **SIZES[size],
        **ARCH_FIELDS[arch],
        **overrides,
    }
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict(config))
    # Normal weights with std 1/sqrt(fan_in) keep activations O(1) through the layers and give
    # logits spread widely enough that greedy ties (which would make token-identity tests
    # depend on rounding) are practically absent.
    keys = iter(mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters()))))

    def init(path: str, w: mx.array) -> mx.array:
        if path.endswith("bias"):
            return mx.zeros_like(w)
        if w.ndim == 1:  # norm scales stay at one
            return w
        return mx.random.normal(w.shape, key=next(keys)) * (w.shape[-1] ** -0.5)

    model.update(tree_map_with_path(init, model.parameters()))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return describe(model, name=f"{arch}-{size}-random-seed{seed}")


def noisy_copy(loaded: LoadedModel, scale: float, seed: int = 0) -> LoadedModel:
    """A copy of ``loaded`` with Gaussian noise of relative ``scale`` added to every weight.

    Each tensor ``w`` becomes ``w + scale * rms(w) * N(0, 1)``: a draft model whose agreement
    with the target falls smoothly as ``scale`` grows (``scale == 0`` is an exact copy, so
    speculative decoding accepts every draft token). It costs what the target costs.
    """
    if scale < 0:
        raise ValueError(f"noisy_copy: scale={scale!r} must be >= 0")
    params = tree_flatten(loaded.model.parameters())
    if any(not mx.issubdtype(w.dtype, mx.floating) for _, w in params):
        raise ValueError(f"noisy_copy: {loaded.name!r} has quantized weights; use a float model")
    keys = iter(mx.random.split(mx.random.key(seed), len(params)))

    def perturb(w: mx.array) -> mx.array:
        rms = mx.sqrt(mx.mean(w.astype(mx.float32) ** 2))
        noise = mx.random.normal(w.shape, key=next(keys)) * (scale * rms)
        return w + noise.astype(w.dtype)

    model = type(loaded.model)(loaded.model.args)
    model.update(tree_map(perturb, loaded.model.parameters()))
    mx.eval(model.parameters())
    return describe(
        model,
        name=f"{loaded.name}-noisy{scale:g}-seed{seed}",
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
    )


def prefix_model(loaded: LoadedModel, num_layers: int) -> LoadedModel:
    """``loaded``'s first ``num_layers`` layers, then its final norm and LM head: a model of
    its own that shares ``loaded``'s weights (no copy; LayerSkip's self-speculative draft).

    The module and its body are shallow copies whose ``layers`` is the prefix list, so
    mlx_lm's forward runs unchanged; ``args`` says ``num_hidden_layers=num_layers``."""
    if not 1 <= num_layers <= loaded.num_layers:
        raise ValueError(
            f"prefix_model: num_layers={num_layers} is outside 1..{loaded.num_layers}, the "
            f"layers of {loaded.name!r}"
        )
    if loaded.window_layers:
        raise ValueError(
            f"prefix_model: {loaded.name!r} has sliding-window layers; a prefix of "
            "full-attention layers only is supported"
        )
    model, body = copy.copy(loaded.model), copy.copy(loaded.model.model)
    body.layers = loaded.model.model.layers[:num_layers]
    for module in (model, body):
        args = getattr(module, "args", None)
        if dataclasses.is_dataclass(args) and hasattr(args, "num_hidden_layers"):
            module.args = dataclasses.replace(args, num_hidden_layers=num_layers)
        if getattr(module, "num_hidden_layers", None) is not None:
            module.num_hidden_layers = num_layers
        if isinstance(getattr(module, "layer_types", None), list):
            module.layer_types = module.layer_types[:num_layers]
    model.model = body
    return describe(
        model,
        name=f"{loaded.name}-first{num_layers}",
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
    )


def load_pretrained(path: str) -> LoadedModel:
    """Load real weights and tokenizer from a local mlx_lm checkpoint folder, as ``mlx_lm.load``.

    The folder holds what ``mlx_lm.convert`` writes: config.json, model*.safetensors and the
    tokenizer's files. Nothing is downloaded. A folder mlx_lm cannot load raises ``ValueError``
    naming ``model.path`` and what is wrong with it.
    """
    from mlx_lm.utils import load_model, load_tokenizer

    folder = Path(path).expanduser()
    checkpoint = "a local mlx_lm checkpoint (config.json, model*.safetensors, tokenizer files)"
    if not folder.exists():
        raise ValueError(
            f"model.path={path!r} does not exist: point it at the folder of {checkpoint}; "
            "kvbench does not download models"
        )
    if not folder.is_dir():
        raise ValueError(f"model.path={path!r} is a file: point it at the folder of {checkpoint}")
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"model.path={path!r} has no config.json: point it at the folder of {checkpoint}"
        )
    if not any(folder.glob("model*.safetensors")):
        raise ValueError(
            f"model.path={path!r} has no weights (model*.safetensors): point it at the folder "
            f"of {checkpoint}, e.g. one written by mlx_lm.convert"
        )
    try:
        model, config = load_model(folder)
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise ValueError(
            f"model.path={path!r}: mlx_lm cannot build a model from its config.json and weights "
            f"({_one_line(e)}); fix config.json or re-convert the model with mlx_lm.convert"
        ) from e
    try:
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise ValueError(
            f"model.path={path!r}: its tokenizer does not load ({_one_line(e)}); the folder "
            "needs the tokenizer's files (tokenizer.json, tokenizer_config.json)"
        ) from e
    eos = tuple(sorted(tokenizer.eos_token_ids))
    return describe(model, name=path, tokenizer=tokenizer, eos_token_ids=eos)


def _one_line(error: Exception) -> str:
    """An error's message on one line; a KeyError's is the missing key."""
    if isinstance(error, KeyError):
        return f"no key {error.args[0]!r}"
    return " ".join(str(error).split())


def describe(model: nn.Module, name: str, **extra: Any) -> LoadedModel:
    """Read the KV geometry of an mlx_lm model; fail clearly if the paged cache cannot run it.

    Layers whose mlx_lm cache is a ``RotatingKVCache`` (sliding window, ``keep=0``) become
    window layers; every window must be the same size (one window group)."""
    window_layers, windows = [], set()
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
        kinds = {type(c).__name__ for c in caches}
        if not kinds <= {"KVCache", "RotatingKVCache"}:
            raise ValueError(
                f"model {name!r} needs cache types {sorted(kinds)}; kvbench's paged cache "
                "implements full attention (KVCache) and sliding windows (RotatingKVCache) "
                "only, not recurrent or quantized layers"
            )
        for i, c in enumerate(caches):
            if type(c).__name__ == "RotatingKVCache":
                if c.keep:
                    raise ValueError(
                        f"model {name!r}: layer {i} keeps {c.keep} leading tokens in its "
                        "window (RotatingKVCache keep); kvbench's window group keeps none"
                    )
                window_layers.append(i)
                windows.add(c.max_size)
        if len(windows) > 1:
            raise ValueError(
                f"model {name!r} has windows of sizes {sorted(windows)}; kvbench runs one "
                "window size per model"
            )
    args = model.args
    heads = args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    attn = model.layers[0].self_attn
    return LoadedModel(
        model=model,
        name=name,
        num_layers=len(model.layers),
        num_kv_heads=getattr(args, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=args.vocab_size,
        # a quantized projection's outputs (the KV) come in its scales' dtype
        dtype=getattr(attn.k_proj, "scales", attn.k_proj.weight).dtype,
        max_position_embeddings=getattr(args, "max_position_embeddings", None),
        window_layers=tuple(window_layers),
        window=windows.pop() if windows else None,
        **extra,
    )
