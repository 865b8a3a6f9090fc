"""Roofline profiles: a step's duration on a device kvbench never ran on, from its data sheet.

The method is LLM-Viewer's (Yuan et al. 2024, "LLM Inference Unveiled: Survey and Roofline
Model Insights"): each operator of the forward is bound by compute or by memory traffic and
takes ``max(FLOPs / peak FLOP/s, bytes / bandwidth)``; a step takes the sum over its
operators. ``derive`` writes each operator's FLOPs and bytes per unit of the step's counts
(harness/costmodel/work.py, ``PRICED``) into the profile, with the device's peaks
(harness/costmodel/devices.yaml); ``profile.RooflineProfile.predict`` needs nothing but that.

With d = head_dim, b = bytes per value, L = layers, and the layers' sizes, per step:

    linear layers  q, k, v, o, gate, up, down per layer, and the LM head: FLOPs 2 x in x out
                   per query token (per logit row for the head); bytes: the weights once per
                   padded batch (``groups``; the head once per batch that wants logits,
                   at most ``min(groups, logits)``) plus the activations read and written
    attention      ``attention`` counts (query, key) position pairs per layer and KV head.
                   Under grouped-query attention each KV head serves num_heads /
                   num_kv_heads query heads, and each query head scores every pair (q . k:
                   2d FLOPs) and adds p v to its output (2d FLOPs), so per layer
                       FLOPs = attention x num_kv_heads x (num_heads / num_kv_heads) x 4d
                             = 4d x num_heads x attention:
                   GQA saves bytes, not FLOPs. Bytes: ``kv_read`` x 2 (K and V) x d x b x
                   num_kv_heads, plus per query token Q read, the output written and the
                   new K and V written. A fused kernel (FlashAttention, MLX's
                   scaled_dot_product_attention) is assumed: scores never reach memory.
    elementwise    norms, residual adds, the gated activation, RoPE and the embedding
                   gather: bytes per query token; their few FLOPs per byte never bind
    block copies   a block read and written (2 x block bytes) at memory bandwidth
    swaps          a block over the host link (PCIe one way, or a copy in unified memory)
    draft          with a draft model: its weights once per ``draft_rounds``, 2 x its
                   parameters FLOPs per ``draft_tokens``; its attention is left out
    overhead       the device file's ``step_overhead`` + ``row_overhead`` x rows: 0 unless
                   given, since the roofline knows nothing of the host

A roofline is a lower bound: with the default efficiency of 1 every rate is the data
sheet's peak. ``efficiency`` scales the peaks to what kernels achieve (e.g. compute 0.7,
memory 0.8) and is stored in the profile.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from harness.costmodel.profile import (
    FORMAT,
    RESOURCES,
    VERSION,
    RooflineProfile,
    fingerprint,
    save,
)
from harness.costmodel.work import PRICED, StepWork

DEVICES_FILE = Path(__file__).with_name("devices.yaml")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PEAK_KEY = {4: "fp32", 2: "fp16"}  # devices.yaml's peak_flops key by value width
# a shape's sizes, in the order _sizes returns them
SIZE_KEYS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


def devices() -> dict[str, dict[str, Any]]:
    """The device sheets of devices.yaml, by name."""
    return yaml.safe_load(DEVICES_FILE.read_text())


def derive(
    shape: dict[str, Any],
    device: str,
    *,
    block_size: int,
    dtype_bytes: int | None = None,
    efficiency: dict[str, float] | None = None,
    draft: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A roofline profile (schema v1, ``kind: "roofline"``) for a dense model ``shape``
    (``LoadedModel.shape()`` or ``shape_of``) on ``device`` (a devices.yaml name).

    ``dtype_bytes`` prices values of that width instead of the shape's dtype (2: fp16/bf16,
    4: fp32); ``efficiency`` maps compute, memory and host_link to the achieved fraction of
    peak (default 1: the roofline's bound); ``draft`` is a draft model's shape, needed to
    price speculative verify steps. Wrong inputs raise ValueError naming the fix."""
    sheets = devices()
    if device not in sheets:
        raise ValueError(f"device {device!r} is unknown: choose one of {', '.join(sheets)}")
    sheet = sheets[device]
    width = dtype_bytes or _width(shape)
    if width not in PEAK_KEY:
        raise ValueError(f"dtype_bytes={width}: a roofline prices 2 (fp16/bf16) or 4 (fp32)")
    efficiency = _efficiency(efficiency)
    operators = _operators(shape, width, block_size)
    if draft is not None:
        if draft["dtype"] != shape["dtype"]:
            raise ValueError(
                f"the draft model is {draft['dtype']}, the model {shape['dtype']}: derive "
                "prices one value width; convert the draft"
            )
        _check_dense(draft)
        operators["draft"] = {
            "compute": {"draft_tokens": 2 * _weights(draft)},
            "memory": {"draft_rounds": _weights(draft) * width},
        }
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "roofline",
        "model": {**shape, "fingerprint": fingerprint(shape)},
        "block_size": block_size,
        "machine": {"name": device, **sheet},
        "features": list(PRICED),
        "roofline": {
            "method": "LLM-Viewer (Yuan et al. 2024): per operator max(FLOPs/peak, bytes/bw)",
            "dtype_bytes": width,
            "peak": {
                "compute": sheet["peak_flops"][PEAK_KEY[width]],
                "memory": sheet["memory_bandwidth"],
                "host_link": sheet["host_link_bandwidth"],
            },
            "efficiency": efficiency,
            "overhead": {
                "step": sheet.get("step_overhead", 0.0),
                "rows": sheet.get("row_overhead", 0.0),
            },
            "draft_model": None if draft is None else {**draft, "fingerprint": fingerprint(draft)},
            "operators": operators,
        },
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _efficiency(given: dict[str, float] | None) -> dict[str, float]:
    given = given or {}
    unknown = set(given) - set(RESOURCES)
    if unknown:
        raise ValueError(f"efficiency {sorted(unknown)} unknown: give {', '.join(RESOURCES)}")
    for resource, fraction in given.items():
        if not 0 < fraction <= 1:
            raise ValueError(f"efficiency {resource}={fraction}: a fraction of peak in (0, 1]")
    return {r: float(given.get(r, 1.0)) for r in RESOURCES}


def _width(shape: dict[str, Any]) -> int:
    if shape["dtype"] not in DTYPE_BYTES:
        raise ValueError(
            f"model dtype {shape['dtype']!r}: a roofline prices {', '.join(DTYPE_BYTES)}; "
            "pass dtype_bytes=2 or 4 to price it at one of their widths"
        )
    return DTYPE_BYTES[shape["dtype"]]


def _sizes(shape: dict[str, Any]) -> tuple[int, ...]:
    """h, layers, heads, KV heads, head_dim, MLP width, vocabulary."""
    missing = [k for k in SIZE_KEYS if shape.get(k) is None]
    if missing:
        raise ValueError(f"model shape has no {missing}: pass LoadedModel.shape() or shape_of")
    return tuple(shape[k] for k in SIZE_KEYS)


def _weights(shape: dict[str, Any]) -> int:
    """Parameters a token passes through: every layer's projections and the LM head (the
    embedding is a gather, not a matmul)."""
    h, layers, heads, kv_heads, d, mlp, vocab = _sizes(shape)
    attention = 2 * h * heads * d + 2 * h * kv_heads * d
    return layers * (attention + 3 * h * mlp) + h * vocab


def _check_dense(shape: dict[str, Any]) -> None:
    """Refuse what the operators below do not describe: sliding-window layers (the features
    count full-attention layers' KV only) and mixtures of experts."""
    if shape.get("window_layers"):
        raise ValueError(
            f"model {shape.get('name')!r} has sliding-window layers; a roofline prices "
            "full-attention models only"
        )
    h, layers, heads, kv_heads, d, _, vocab = _sizes(shape)
    # A dense model: the weights, an untied embedding, norms and q/k/v biases at most.
    dense = _weights(shape) + h * vocab + (2 * layers + 1) * h + layers * (heads + 2 * kv_heads) * d
    if shape.get("num_params", 0) > dense:
        raise ValueError(
            f"model {shape.get('name')!r} has {shape['num_params']} parameters, more than a "
            f"dense transformer of its sizes ({dense}): a mixture of experts? A roofline "
            "prices dense models only"
        )


def _operators(shape: dict[str, Any], b: int, block_size: int) -> dict[str, dict]:
    """Each operator's FLOPs and bytes per unit of the counts (module docstring)."""
    _check_dense(shape)
    h, layers, heads, kv_heads, d, mlp, vocab = _sizes(shape)
    projections = {
        "q_proj": (h, heads * d),
        "k_proj": (h, kv_heads * d),
        "v_proj": (h, kv_heads * d),
        "o_proj": (heads * d, h),
        "gate_proj": (h, mlp),
        "up_proj": (h, mlp),
        "down_proj": (mlp, h),
    }
    operators: dict[str, dict] = {
        name: {
            "compute": {"query_tokens_padded": 2 * n_in * n_out * layers},
            "memory": {
                "row_groups": n_in * n_out * b * layers,
                "query_tokens_padded": (n_in + n_out) * b * layers,
            },
        }
        for name, (n_in, n_out) in projections.items()
    }
    operators["lm_head"] = {
        "compute": {"logit_rows": 2 * h * vocab},
        "memory": {"logit_groups": h * vocab * b, "logit_rows": (h + vocab) * b},
    }
    operators["attention"] = {
        "compute": {"attention_pairs": 4 * d * heads * layers},
        "memory": {
            "kv_slots_read": 2 * kv_heads * d * b * layers,
            # Q read, the output written, the new K and V written to the cache
            "query_tokens_padded": 2 * (heads + kv_heads) * d * b * layers,
        },
    }
    # Per layer: two norms (read and write h), two residual adds (read 2h, write h), the
    # gated activation (read 2 x mlp, write mlp), RoPE on q and k (read and write); then the
    # final norm and the embedding gather (read and write h each).
    per_layer = 10 * h + 3 * mlp + 2 * (heads + kv_heads) * d
    operators["elementwise"] = {"memory": {"query_tokens_padded": (layers * per_layer + 4 * h) * b}}
    block = block_size * 2 * kv_heads * d * b * layers  # K and V of one block, every layer
    operators["block_copies"] = {"memory": {"block_copies": 2 * block}}
    operators["swaps"] = {"host_link": {"swap_blocks": block}}
    return operators


def decode_step(batch: int, context: int, block_size: int) -> StepWork:
    """``batch`` decodes at ``context`` tokens each, as one padded batch."""
    keys = -(-context // block_size) * block_size
    return StepWork(
        batch_size=batch,
        row_groups=1,
        query_tokens_padded=batch,
        attention_pairs=batch * keys,
        kv_slots_read=batch * keys,
        kv_slots_attended=batch * context,
        logit_rows=batch,
        single_token_rows=batch,
    )


def prefill_step(tokens: int, block_size: int) -> StepWork:
    """One prompt of ``tokens`` from position 0, logits for its last position."""
    keys = -(-tokens // block_size) * block_size
    return StepWork(
        batch_size=1,
        row_groups=1,
        query_tokens_padded=tokens,
        attention_pairs=tokens * keys,
        kv_slots_read=keys,
        kv_slots_attended=tokens,
        logit_rows=1,
    )


def shape_of(size: str, dtype: str = "float32") -> dict[str, Any]:
    """The shape ``random_model("llama", size, dtype=dtype).shape()`` reports, without
    building the model (its name aside, which the fingerprint leaves out)."""
    from harness.platform.models import SIZES

    if size not in SIZES:
        raise ValueError(f"model size {size!r} is unknown: choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    h, layers, heads = s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"]
    shape = {
        "name": f"llama-{size}",
        "model_type": "llama",
        "num_layers": layers,
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
    # the layers' weights and LM head, the untied embedding, two norms a layer, the last norm
    num_params = _weights(shape) + h * s["vocab_size"] + (2 * layers + 1) * h
    return {**shape, "num_params": num_params}


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.costmodel.roofline``: derive, save and sample a profile."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.costmodel.roofline",
        description="Derive a roofline step-cost profile for a device kvbench does not have.",
    )
    parser.add_argument("--device", required=True, help="a devices.yaml name, e.g. h100")
    parser.add_argument("--model", required=True, help="a random Llama size: tiny, small")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPE_BYTES))
    parser.add_argument("--draft", help="the draft model's size, to price verify steps")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--efficiency",
        nargs="*",
        default=[],
        metavar="RESOURCE=FRACTION",
        help=f"achieved fraction of peak for {', '.join(RESOURCES)} (default 1)",
    )
    parser.add_argument("--out", required=True, help="the profile file to write")
    args = parser.parse_args(argv)
    try:
        efficiency = {k: float(v) for k, _, v in (e.partition("=") for e in args.efficiency)}
        shape = shape_of(args.model, args.dtype)
        draft = shape_of(args.draft, args.dtype) if args.draft else None
        data = derive(
            shape, args.device, block_size=args.block_size, efficiency=efficiency, draft=draft
        )
    except ValueError as e:
        print(f"roofline: {e}", file=sys.stderr)
        return 2
    save(data, args.out)
    profile = RooflineProfile(args.out, data)
    print(args.out)
    print(f"{args.device}, {shape['name']} {args.dtype}, block size {args.block_size}:")
    steps = [
        (f"decode, batch {n:2}, 512-token contexts", decode_step(n, 512, args.block_size))
        for n in (1, 8, 32)
    ]
    steps.append(("prefill, 512 tokens", prefill_step(512, args.block_size)))
    for label, work in steps:
        seconds = profile.predict(work)
        compute = sum(t.get("compute", 0.0) for t in profile.times(work).values())
        print(f"  {label:38} {seconds * 1e6:10.1f} us  compute busy {compute / seconds:4.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
