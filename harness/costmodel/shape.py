"""A model's shape: the sizes a step's cost depends on, read from a config.json without
building the model (no weights, no MLX).

A shape is a dict (a cost profile's ``model``, ``LoadedModel.shape()``'s keys):

    name, model_type     where it came from, and the architecture
    num_layers           decoder layers
    hidden_size          the residual stream's width h
    num_heads            query heads; num_kv_heads: K and V heads (grouped-query attention)
    head_dim             per head (Gemma and Qwen3 set it; else h / num_heads)
    intermediate_size    the gated MLP's width (an expert's, in a mixture of experts)
    vocab_size           the embedding's and LM head's rows
    dtype                the activations' and (unquantized) weights' dtype
    num_params           every parameter, as the unquantized model holds them
    window_layers        the sliding-window layers' indices; window: their size (or None)

and, only where they apply (absent: a dense, untied, unquantized model; so a shape that
has none of them hashes as before they existed, ``profile.fingerprint``):

    weight_bits, weight_group_size   weights quantized as mx.quantize stores them
    num_experts, experts_per_token   a mixture of experts: experts per layer, routed per token
    tie_word_embeddings              true: the LM head is the embedding (counted once)

``load`` reads a config.json file, or a folder holding one (a local mlx_lm or Hugging Face
checkout). Architectures (``ARCHITECTURES``): Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3
(text; a multimodal config's ``text_config``), Mixtral and Qwen3-MoE. Sliding windows follow
Hugging Face's rules: ``layer_types`` where the config lists it; Gemma 2 slides every even
layer, Gemma 3 every layer but each ``sliding_window_pattern``-th; Mistral and Mixtral slide
every layer when ``sliding_window`` is set; Qwen2/3 slide the layers from
``max_window_layers`` on when ``use_sliding_window`` is true.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.platform.formats import BITS, bytes_per_value

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# Per architecture: RMSNorm weights per layer (h each), q/k/v biases, per-head q/k norms,
# the experts' fields, and whether Hugging Face ties the LM head to the embedding by default
# (transformers' <Arch>Config defaults).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(norms=2, tied=False),
    "mistral": dict(norms=2, tied=False),
    "qwen2": dict(norms=2, tied=False, qkv_bias=True),
    "qwen3": dict(norms=2, tied=False, qk_norm=True),
    "gemma2": dict(norms=4, tied=True),
    "gemma3_text": dict(norms=4, tied=True, qk_norm=True),
    "mixtral": dict(norms=2, tied=False, experts=("num_local_experts", "intermediate_size")),
    "qwen3_moe": dict(
        norms=2, tied=False, qk_norm=True, experts=("num_experts", "moe_intermediate_size")
    ),
}
# Tiny and small: the random Llamas of harness/platform/models.py SIZES, by name.
SIZE_NAMES = ("tiny", "small")


class ShapeError(ValueError):
    """A config that cannot be read as a shape; the message names the file, key and fix."""


def load(
    path: str | Path,
    *,
    bits: int | None = None,
    group_size: int = 64,
    dtype: str | None = None,
    option: str = "model.config",
) -> dict[str, Any]:
    """The shape of the config.json at ``path`` (the file, or a folder holding one).

    ``bits`` (16, 8 or 4) prices the weights at that width, mx.quantize's groups of
    ``group_size`` (default: what the config's mlx_lm ``quantization`` says, else 16);
    ``dtype`` overrides the config's ``torch_dtype``; ``option`` is the setting errors name."""
    config, name = read_config(path, option)
    return from_config(config, name, bits=bits, group_size=group_size, dtype=dtype)


def read_config(path: str | Path, option: str = "model.config") -> tuple[dict[str, Any], str]:
    """The parsed config.json at ``path`` (the file, or a folder holding one) and a name for
    it: the folder's for a config.json, else the file's stem; errors name ``option``."""
    where = Path(path).expanduser()
    file = where / "config.json" if where.is_dir() else where
    if not file.is_file():
        raise ShapeError(
            f"{option}={str(path)!r}: no such file or folder with a config.json; point it "
            "at a config.json or a model folder holding one"
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ShapeError(f"{option}={str(path)!r}: not a JSON config ({e})") from None
    if not isinstance(config, dict):
        raise ShapeError(f"{option}={str(path)!r}: not a JSON object")
    return config, file.parent.name if file.name == "config.json" else file.stem


def from_config(
    config: dict[str, Any],
    name: str,
    *,
    bits: int | None = None,
    group_size: int = 64,
    dtype: str | None = None,
) -> dict[str, Any]:
    """The shape of a parsed config.json (``load``'s arguments)."""
    if isinstance(config.get("text_config"), dict):  # a multimodal config: its text model
        config = {**config, **config["text_config"]}
        config["model_type"] = config["text_config"].get("model_type", config["model_type"])
    arch = config.get("model_type")
    if arch == "gemma3":
        arch = "gemma3_text"
    if arch not in ARCHITECTURES:
        raise ShapeError(
            f"{name}: model_type {arch!r} is not a shape kvbench prices: one of "
            f"{', '.join(ARCHITECTURES)}"
        )
    facts = ARCHITECTURES[arch]

    def need(key: str) -> int:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ShapeError(f"{name}: config key {key!r} is {value!r}; a positive int is needed")
        return value

    layers, h, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    dtype = dtype or config.get("torch_dtype") or config.get("dtype")
    if dtype not in DTYPE_BYTES:
        raise ShapeError(
            f"{name}: torch_dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}: set it in "
            "the config, or model.dtype="
        )
    shape: dict[str, Any] = {
        "name": name,
        "model_type": arch,
        "num_layers": layers,
        "hidden_size": h,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": need(
            facts["experts"][1] if "experts" in facts else "intermediate_size"
        ),
        "vocab_size": need("vocab_size"),
        "dtype": dtype,
    }
    window_layers = _window_layers(config, arch, layers)
    shape["window_layers"] = window_layers
    shape["window"] = need("sliding_window") if window_layers else None
    if "experts" in facts:
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            raise ShapeError(
                f"{name}: dense MLP layers among the experts (mlp_only_layers, "
                "decoder_sparse_step) are not priced: every layer must be a mixture"
            )
        shape["num_experts"] = need(facts["experts"][0])
        shape["experts_per_token"] = need("num_experts_per_tok")
    if bits is None:  # as the config's mlx_lm quantization says, else unquantized
        quantized = config.get("quantization") or {}
        bits, group_size = quantized.get("bits", 16), quantized.get("group_size", group_size)
    if bits not in BITS:
        raise ShapeError(f"{name}: weights at {bits!r} bits: model.bits is one of {BITS}")
    if bits != 16:
        if h % group_size or shape["intermediate_size"] % group_size:
            raise ShapeError(
                f"{name}: model.group_size={group_size} does not divide hidden_size {h} and "
                f"intermediate_size {shape['intermediate_size']}: use 32, 64 or 128"
            )
        shape["weight_bits"], shape["weight_group_size"] = bits, group_size
    if config.get("tie_word_embeddings", facts["tied"]):
        shape["tie_word_embeddings"] = True
    shape["num_params"] = num_params(shape)
    return shape


def _window_layers(config: dict[str, Any], arch: str, layers: int) -> list[int]:
    """The sliding-window layers, by Hugging Face's rule for the architecture (module
    docstring)."""
    types = config.get("layer_types")
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not config.get("sliding_window"):
        return []
    if arch == "gemma2":
        return [i for i in range(layers) if i % 2 == 0]
    if arch == "gemma3_text":
        pattern = config.get("sliding_window_pattern", 6)
        return [i for i in range(layers) if (i + 1) % pattern]
    if arch in ("mistral", "mixtral"):
        return list(range(layers))
    if arch in ("qwen2", "qwen3", "qwen3_moe") and config.get("use_sliding_window"):
        return list(range(config.get("max_window_layers", layers), layers))
    return []


def shape_of(size: str, dtype: str = "float32") -> dict[str, Any]:
    """The shape ``random_model("llama", size, dtype=dtype).shape()`` reports, without
    building the model (its name aside, which the fingerprint leaves out)."""
    from harness.platform.models import SIZES

    if size not in SIZES:
        raise ShapeError(f"model size {size!r} is unknown: choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    h, heads = s["hidden_size"], s["num_attention_heads"]
    shape = {
        "name": f"llama-{size}",
        "model_type": "llama",
        "num_layers": s["num_hidden_layers"],
        "hidden_size": h,
        "num_heads": heads,
        "num_kv_heads": s["num_key_value_heads"],
        "head_dim": h // heads,
        "intermediate_size": s["intermediate_size"],
        "vocab_size": s["vocab_size"],
        "dtype": dtype,
        "window_layers": [],
        "window": None,
    }
    return {**shape, "num_params": num_params(shape)}


def sizes(shape: dict[str, Any]) -> tuple[int, ...]:
    """h, layers, heads, KV heads, head_dim, MLP width, vocabulary."""
    keys = (
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
    )
    missing = [k for k in keys if shape.get(k) is None]
    if missing:
        raise ShapeError(f"model shape has no {missing}: pass LoadedModel.shape() or a config")
    return tuple(shape[k] for k in keys)


def attention_params(shape: dict[str, Any]) -> int:
    """One layer's q, k, v and o projections."""
    h, _, heads, kv_heads, d, _, _ = sizes(shape)
    return 2 * h * heads * d + 2 * h * kv_heads * d


def mlp_params(shape: dict[str, Any], active: bool = False) -> int:
    """One layer's gated MLP (gate, up, down), or its experts and router: all of them, or
    (``active``) the ``experts_per_token`` a token is routed to and the router."""
    h, *_, mlp, _ = sizes(shape)
    experts = shape.get("num_experts")
    if experts is None:
        return 3 * h * mlp
    used = shape["experts_per_token"] if active else experts
    return h * experts + used * 3 * h * mlp


def active_params(shape: dict[str, Any]) -> int:
    """Parameters a token passes through in matmuls: every layer's projections and active
    experts, and the LM head (the embedding is a gather, not a matmul)."""
    h, layers, *_, vocab = sizes(shape)
    return layers * (attention_params(shape) + mlp_params(shape, active=True)) + h * vocab


def num_params(shape: dict[str, Any]) -> int:
    """Every parameter of the unquantized model: the layers (projections, MLP or experts and
    router, RMSNorms, q/k/v biases, q/k norms as the architecture has them), the embedding,
    the LM head unless tied, and the final norm."""
    h, layers, heads, kv_heads, d, _, vocab = sizes(shape)
    facts = ARCHITECTURES.get(shape.get("model_type"), ARCHITECTURES["llama"])
    layer = attention_params(shape) + mlp_params(shape) + facts["norms"] * h
    if facts.get("qkv_bias"):
        layer += (heads + 2 * kv_heads) * d
    if facts.get("qk_norm"):
        layer += 2 * d
    head = 0 if shape.get("tie_word_embeddings") else h * vocab
    return layers * layer + h * vocab + head + h


def weight_bytes(shape: dict[str, Any], dtype_bytes: int | None = None) -> float:
    """Bytes a weight takes: the dtype's width, or mx.quantize's bits plus a scale and a bias
    (in the dtype) per group (harness/platform/formats.py)."""
    width = dtype_bytes or DTYPE_BYTES[shape["dtype"]]
    bits = shape.get("weight_bits")
    if bits is None:
        return width
    return bytes_per_value(width, bits, shape["weight_group_size"])
