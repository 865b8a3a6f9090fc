"""Roofline profiles: a step's duration on a device kvbench never ran on, from its data sheet.

The method is LLM-Viewer's (Yuan et al. 2024, "LLM Inference Unveiled: Survey and Roofline
Model Insights"): each operator of the forward is bound by compute or by memory traffic and
takes ``max(FLOPs / peak FLOP/s, bytes / bandwidth)``; a step takes the sum over its
operators. ``derive`` writes each operator's FLOPs and bytes per unit of the step's counts
(harness/costmodel/work.py, ``PRICED``) into the profile, with the device's peaks
(harness/costmodel/devices.yaml); ``profile.RooflineProfile.predict`` needs nothing but that.

With d = head_dim, b = bytes per value, w = bytes per weight (b, or mx.quantize's bits plus
a scale and a bias per group: shape.weight_bytes), L = layers, and the layers' sizes, per
step:

    linear layers  q, k, v, o, gate, up, down per layer, and the LM head: FLOPs 2 x in x out
                   per query token (per logit row for the head); bytes: the weights (w each)
                   once per padded batch (``groups``; the head once per batch that wants
                   logits, at most ``min(groups, logits)``) plus the activations read and
                   written
    experts        a mixture of experts (Mixtral, Qwen3-MoE) replaces gate, up and down by a
                   router over every expert and each token's ``experts_per_token`` experts:
                   FLOPs per token for the active ones; bytes per expert a padded batch
                   reaches (profile.RooflineProfile.times)
    attention      ``attention`` counts (query, key) position pairs per layer and KV head.
                   Under grouped-query attention each KV head serves num_heads /
                   num_kv_heads query heads, and each query head scores every pair (q . k:
                   2d FLOPs) and adds p v to its output (2d FLOPs), so per layer
                       FLOPs = attention x num_kv_heads x (num_heads / num_kv_heads) x 4d
                             = 4d x num_heads x attention:
                   GQA saves bytes, not FLOPs. Bytes: ``kv_read`` x 2 (K and V) x d x b x
                   num_kv_heads (b x d: a head's row as the arena stores it, quantized or
                   not), plus per query token Q read, the output written and the new K and V
                   written. A fused kernel (FlashAttention, MLX's
                   scaled_dot_product_attention) is assumed: scores never reach memory.
                   These are the full-attention layers'; a sliding-window layer's
                   (``window_attention``) are the same per unit of its own counts,
                   ``window_attention_pairs`` and ``window_kv_slots_read``
                   (harness/costmodel/work.py): over the ring blocks that hold the window
                   before the row's first query and the new keys, never the whole context.
    elementwise    norms, residual adds, the gated activation, RoPE and the embedding
                   gather: bytes per query token; their few FLOPs per byte never bind
    block copies   a block read and written (2 x block bytes) at memory bandwidth
    swaps          a block over the host link (PCIe one way, or a copy in unified memory);
                   a sliding-window ring's blocks alike (``window_swaps``), each holding
                   the window layers' K and V
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
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from harness.costmodel.efficiency import (
    Cell,
    Efficiency,
    cells,
    efficiency_for,
    fit,
    validate_main,
    weight_bits,
)
from harness.costmodel.profile import (
    FORMAT,
    RESOURCES,
    VERSION,
    RooflineProfile,
    fingerprint,
    save,
)
from harness.costmodel.shape import (
    DTYPE_BYTES,
    SIZE_NAMES,
    ShapeError,
    active_params,
    attention_params,
    load,
    shape_of,
    sizes,
    weight_bytes,
)
from harness.costmodel.work import PRICED, StepWork, window_blocks_read
from harness.platform.formats import BITS, stored_bytes

DEVICES_FILE = Path(__file__).with_name("devices.yaml")
SHAPES_DIR = Path(__file__).with_name("shapes")  # config.json files of published models
PEAK_KEY = {4: "fp32", 2: "fp16"}  # devices.yaml's peak_flops key by value width


@cache
def devices() -> dict[str, dict[str, Any]]:
    """The device sheets of devices.yaml, by name (read once; not to be modified)."""
    return yaml.safe_load(DEVICES_FILE.read_text())


def derive(
    shape: dict[str, Any],
    device: str,
    *,
    block_size: int,
    dtype_bytes: int | None = None,
    kv_bits: int = 16,
    kv_group_size: int = 64,
    efficiency: dict[str, float] | None = None,
    draft: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A roofline profile (schema v1, ``kind: "roofline"``) for a model ``shape``
    (harness/costmodel/shape.py: ``LoadedModel.shape()``, ``shape_of`` or ``load``) on
    ``device`` (a devices.yaml name).

    ``dtype_bytes`` prices values of that width instead of the shape's dtype (2: fp16/bf16,
    4: fp32); weights quantized in the shape (``weight_bits``) cost mx.quantize's bytes;
    ``kv_bits`` and ``kv_group_size`` store K and V as the arena does (16: the dtype);
    ``efficiency`` maps compute, memory and host_link to the achieved fraction of peak
    (default 1: the roofline's bound); ``draft`` is a draft model's shape, needed to price
    speculative verify steps. Wrong inputs raise ValueError naming the fix."""
    sheets = devices()
    if device not in sheets:
        raise ValueError(f"device {device!r} is unknown: choose one of {', '.join(sheets)}")
    sheet = sheets[device]
    width = dtype_bytes or _width(shape)
    if width not in PEAK_KEY:
        raise ValueError(f"dtype_bytes={width}: a roofline prices 2 (fp16/bf16) or 4 (fp32)")
    if kv_bits not in BITS:
        raise ValueError(f"kv_bits={kv_bits}: the arena stores K and V at {BITS}")
    efficiency = _efficiency(efficiency)
    _check_priced(shape)
    kv_row = stored_bytes(shape["head_dim"], width, kv_bits, kv_group_size)
    operators = _operators(shape, width, kv_row, block_size)
    if draft is not None:
        if draft["dtype"] != shape["dtype"]:
            raise ValueError(
                f"the draft model is {draft['dtype']}, the model {shape['dtype']}: derive "
                "prices one value width; convert the draft"
            )
        _check_priced(draft)
        operators["draft"] = {
            "compute": {"draft_tokens": 2 * active_params(draft)},
            "memory": {"draft_rounds": active_params(draft) * weight_bytes(draft, width)},
        }
    section = {
        "method": "LLM-Viewer (Yuan et al. 2024): per operator max(FLOPs/peak, bytes/bw)",
        "dtype_bytes": width,
        "kv_format": {"bits": kv_bits, "group_size": kv_group_size},
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
    }
    if shape.get("num_experts"):
        section["experts"] = {"num": shape["num_experts"], "active": shape["experts_per_token"]}
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "roofline",
        "model": {**shape, "fingerprint": fingerprint(shape)},
        "block_size": block_size,
        "machine": {"name": device, **sheet},
        "features": list(PRICED),
        "roofline": section,
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


def _check_priced(shape: dict[str, Any]) -> None:
    """Refuse a mixture of experts whose shape does not say so (``LoadedModel.shape()`` of
    an mlx_lm MoE has no expert fields): more parameters than a dense transformer of its
    sizes holds, with every norm, bias and an untied embedding counted."""
    h, layers, heads, kv_heads, d, mlp, vocab = sizes(shape)
    if shape.get("num_experts"):
        return
    most = layers * (attention_params(shape) + 3 * h * mlp + 4 * h + (heads + 2 * kv_heads + 2) * d)
    most += 2 * h * vocab + h
    if shape.get("num_params", 0) > most:
        raise ValueError(
            f"model {shape.get('name')!r} has {shape['num_params']} parameters, more than a "
            f"dense transformer of its sizes ({most}): a mixture of experts? Give its shape "
            "from its config.json (model=shape model.config=PATH, --model PATH)"
        )


def _operators(shape: dict[str, Any], b: int, kv_row: int, block_size: int) -> dict[str, dict]:
    """Each operator's FLOPs and bytes per unit of the counts (module docstring), values of
    ``b`` bytes, weights of ``weight_bytes``, a head's K (or V) of a token ``kv_row`` bytes."""
    h, layers, heads, kv_heads, d, mlp, vocab = sizes(shape)
    w = weight_bytes(shape, b)
    projections = {
        "q_proj": (h, heads * d),
        "k_proj": (h, kv_heads * d),
        "v_proj": (h, kv_heads * d),
        "o_proj": (heads * d, h),
    }
    experts = shape.get("num_experts")
    if not experts:
        projections |= {"gate_proj": (h, mlp), "up_proj": (h, mlp), "down_proj": (mlp, h)}
    operators: dict[str, dict] = {
        name: {
            "compute": {"query_tokens_padded": 2 * n_in * n_out * layers},
            "memory": {
                "row_groups": n_in * n_out * w * layers,
                "query_tokens_padded": (n_in + n_out) * b * layers,
            },
        }
        for name, (n_in, n_out) in projections.items()
    }
    active = mlp
    if experts:
        # The router scores every expert; each token runs its experts_per_token experts'
        # gate, up and down; a padded batch reads the weights of the experts its tokens
        # reach (``experts_read``, profile.RooflineProfile.times).
        k = shape["experts_per_token"]
        active = k * mlp
        operators["router"] = {
            "compute": {"query_tokens_padded": 2 * h * experts * layers},
            "memory": {
                "row_groups": h * experts * w * layers,
                "query_tokens_padded": (h + experts) * b * layers,
            },
        }
        operators["experts"] = {
            "compute": {"query_tokens_padded": 2 * 3 * h * mlp * k * layers},
            "memory": {
                "experts_read": 3 * h * mlp * w * layers,
                "query_tokens_padded": 3 * (h + mlp) * k * b * layers,
            },
        }
    operators["lm_head"] = {
        "compute": {"logit_rows": 2 * h * vocab},
        "memory": {"logit_groups": h * vocab * w, "logit_rows": (h + vocab) * b},
    }
    # The full-attention layers over the contexts (attention_pairs, kv_slots_read); the
    # sliding-window layers over their rings and new keys (work.WINDOW), never the context.
    full = layers - len(shape.get("window_layers") or ())
    per_token = 2 * heads * d * b + 2 * kv_heads * kv_row  # Q, output; new K and V written
    operators["attention"] = {
        "compute": {"attention_pairs": 4 * d * heads * full},
        "memory": {
            "kv_slots_read": 2 * kv_heads * kv_row * full,
            "query_tokens_padded": per_token * full,
        },
    }
    if full < layers:
        windowed = layers - full
        operators["window_attention"] = {
            "compute": {"window_attention_pairs": 4 * d * heads * windowed},
            "memory": {
                "window_kv_slots_read": 2 * kv_heads * kv_row * windowed,
                "query_tokens_padded": per_token * windowed,
            },
        }
    # Per layer: two norms (read and write h), two residual adds (read 2h, write h), the
    # gated activation (read 2 x mlp, write mlp, over the active experts' widths), RoPE on
    # q and k (read and write); then the final norm and the embedding gather (read and
    # write h each).
    per_layer = 10 * h + 3 * active + 2 * (heads + kv_heads) * d
    operators["elementwise"] = {"memory": {"query_tokens_padded": (layers * per_layer + 4 * h) * b}}
    block = block_size * 2 * kv_heads * kv_row * full  # K and V of one block, every full layer
    operators["block_copies"] = {"memory": {"block_copies": 2 * block}}
    operators["swaps"] = {"host_link": {"swap_blocks": block}}
    if full < layers:  # a ring block: K and V of every window layer, never quantized
        ring = block_size * 2 * kv_heads * stored_bytes(d, b, 16, 64) * (layers - full)
        operators["window_swaps"] = {"host_link": {"window_swap_blocks": ring}}
    return operators


def decode_step(batch: int, context: int, block_size: int, window: int | None = None) -> StepWork:
    """``batch`` decodes at ``context`` tokens each, as one padded batch; with ``window``,
    a sliding-window layer reads the ring blocks that hold the window before the new token
    (work.window_blocks_read) and attends over them and it."""
    keys = -(-context // block_size) * block_size
    ring = _ring_slots(context - 1, window, block_size)
    return StepWork(
        batch_size=batch,
        row_groups=1,
        query_tokens_padded=batch,
        attention_pairs=batch * keys,
        kv_slots_read=batch * keys,
        kv_slots_attended=batch * context,
        window_kv_slots_read=batch * ring,
        window_attention_pairs=batch * (ring + 1) if window else 0,
        logit_rows=batch,
        single_token_rows=batch,
    )


def prefill_step(
    tokens: int, block_size: int, window: int | None = None, start: int = 0
) -> StepWork:
    """One prompt of ``tokens`` from position ``start`` (a chunk after ``start`` computed
    tokens; 0: a whole prompt), logits for its last position; with ``window``, a
    sliding-window layer reads one (empty) ring block and scores the prompt's queries against
    it and the prompt's keys, as the engine's forward does (``start`` 0 only)."""
    keys = -(-(start + tokens) // block_size) * block_size
    ring = _ring_slots(0, window, block_size)
    return StepWork(
        batch_size=1,
        row_groups=1,
        query_tokens_padded=tokens,
        attention_pairs=tokens * keys,
        kv_slots_read=keys,
        kv_slots_attended=start + tokens,
        window_kv_slots_read=ring,
        window_attention_pairs=tokens * (ring + tokens) if window else 0,
        logit_rows=1,
    )


def _ring_slots(start: int, window: int | None, block_size: int) -> int:
    """Ring slots a row from ``start`` reads in a window layer (0 without one)."""
    if not window:
        return 0
    return max(1, window_blocks_read(start, window, block_size)) * block_size


def price_cell(cell: Cell, efficiency: Efficiency) -> tuple[float, float]:
    """A published measurement's predicted decode and prefill tokens/s (efficiency.py): the
    cell's model shape (shapes/<model>.json) with its weights at the format's bits and
    float16 activations, on its device at ``efficiency``, KV blocks of 16. Decode: a token at
    the mean context of ``decode_tokens`` generated from an empty one; prefill: the prompt
    from position 0."""
    shape = _cell_shape(cell.model, cell.weights)
    data = derive(shape, cell.device, block_size=16, efficiency=efficiency)
    profile = RooflineProfile(cell.model, data)
    window = shape["window"]
    decode = 1 / profile.predict(decode_step(1, max(1, cell.decode_tokens // 2), 16, window))
    prefill = cell.prompt / profile.predict(prefill_step(cell.prompt, 16, window))
    return decode, prefill


@cache
def _cell_shape(model: str, weights: str) -> dict[str, Any]:
    return load(SHAPES_DIR / f"{model}.json", bits=weight_bits(weights), dtype="float16")


def fitted_efficiency(device: str, bits: int) -> Efficiency:
    """The memory and compute efficiencies fitted to every published cell (efficiency.py)
    of ``device``'s class and weights of ``bits``: the format with the most cells of that
    class at those bits (Apple 4 bits: llama.cpp's q4_0 over mlx_4bit's one cell), else the
    class's pooled fit."""
    if device not in devices():
        raise ValueError(f"device {device!r} is unknown: choose one of {', '.join(devices())}")
    kind = device_class(device)
    table = cells()
    fitted = fit(table, price_cell, lambda c: (device_class(c.device), c.weights))
    same = [c.weights for c in table if device_class(c.device) == kind]
    formats = sorted({w for w in same if weight_bits(w) == bits}, key=lambda w: (-same.count(w), w))
    found = efficiency_for(fitted, kind, formats[0] if formats else "*")
    if found is None:
        raise ValueError(f"no published cell of {kind} devices to fit")
    return found


def device_class(device: str) -> str:
    """A device's class (devices.yaml ``class``: apple, apple-ultra, nvidia), which the fit
    groups by."""
    return devices()[device]["class"]


def model_shape(
    model: str, dtype: str | None = None, bits: int | None = None, group_size: int = 64
) -> dict[str, Any]:
    """``--model``'s shape: a random Llama size (tiny, small; float32 unless ``dtype``), or
    a config.json or model folder (shape.load: its dtype and quantization unless given)."""
    if model in SIZE_NAMES:
        if bits not in (None, 16):
            raise ShapeError(f"--bits={bits}: the random sizes are unquantized; give a config")
        return shape_of(model, dtype or "float32")
    return load(model, bits=bits, group_size=group_size, dtype=dtype, option="--model")


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.costmodel.roofline``: derive, save and sample a profile;
    ``... roofline validate``: the efficiency fit's held-out table (efficiency.py)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validate"]:
        return validate_main(argv[1:], price_cell, device_class)
    parser = argparse.ArgumentParser(
        prog="python -m harness.costmodel.roofline",
        description="Derive a roofline step-cost profile for a device kvbench does not have.",
    )
    parser.add_argument("--device", required=True, help="a devices.yaml name, e.g. h100")
    parser.add_argument(
        "--model", required=True, help="a random Llama size (tiny, small) or a config.json path"
    )
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="default: the model's")
    parser.add_argument("--bits", type=int, choices=BITS, help="weights' bits (default: model's)")
    parser.add_argument("--group-size", type=int, default=64, help="quantized weights' group")
    parser.add_argument("--kv-bits", type=int, choices=BITS, default=16)
    parser.add_argument("--draft", help="the draft model (as --model), to price verify steps")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--efficiency",
        nargs="*",
        default=[],
        metavar="RESOURCE=FRACTION",
        help=f"achieved fraction of peak for {', '.join(RESOURCES)} (default 1), or 'fitted': "
        "the device class's and weight format's fit to every published cell (validate)",
    )
    parser.add_argument("--out", required=True, help="the profile file to write")
    args = parser.parse_args(argv)
    try:
        shape = model_shape(args.model, args.dtype, args.bits, args.group_size)
        if args.efficiency == ["fitted"]:
            efficiency = fitted_efficiency(args.device, shape.get("weight_bits", 16))
        else:
            pairs = (e.partition("=") for e in args.efficiency)
            efficiency = {k: float(v) for k, _, v in pairs}
        draft = model_shape(args.draft, shape["dtype"]) if args.draft else None
        data = derive(
            shape,
            args.device,
            block_size=args.block_size,
            kv_bits=args.kv_bits,
            efficiency=efficiency,
            draft=draft,
        )
    except ValueError as e:
        print(f"roofline: {e}", file=sys.stderr)
        return 2
    save(data, args.out)
    profile = RooflineProfile(args.out, data)
    print(args.out)
    bits = shape.get("weight_bits", 16)
    print(
        f"{args.device}, {shape['name']} {shape['dtype']}, weights at {bits} bits, KV at "
        f"{args.kv_bits}, block size {args.block_size}:"
    )
    window = shape["window"]
    steps = [
        (f"decode, batch {n:2}, 512-token contexts", decode_step(n, 512, args.block_size, window))
        for n in (1, 8, 32)
    ]
    steps.append(("prefill, 512 tokens", prefill_step(512, args.block_size, window)))
    for label, work in steps:
        seconds = profile.predict(work)
        compute = sum(t.get("compute", 0.0) for t in profile.times(work).values())
        print(f"  {label:38} {seconds * 1e6:10.1f} us  compute busy {compute / seconds:4.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
