"""How many bytes a run of values takes as MLX stores it: as is, or group-wise affine
quantized as ``mx.quantize`` stores it (the KV arena's quantized K and V, mlx_lm's quantized
weights). No MLX here: the cost model counts the same bytes without building anything.

``mx.quantize(w, group_size, bits)`` packs ``bits``-bit values into uint32 words and keeps,
per ``group_size`` consecutive values, a scale and a bias in ``w``'s dtype (MLX docs,
mlx.core.quantize: "scales and biases ... of the same type as w"). So a float16 matrix at 4
bits and group 64 costs 0.5 + 2 x 2 / 64 = 0.5625 bytes a value, at 8 bits 1.0625.
"""

from __future__ import annotations

BITS = (16, 8, 4)  # 16: not quantized (the dtype as is); 8 and 4: mx.quantize's


def stored_bytes(values: int, dtype_bytes: int, bits: int = 16, group_size: int = 64) -> int:
    """Bytes of ``values`` values of ``dtype_bytes`` each, stored at ``bits``: as is (16,
    whatever the dtype's width), or quantized in groups of ``group_size`` that divide
    ``values``: the packed values plus a scale and a bias per group."""
    if bits == 16:
        return values * dtype_bytes
    return values * bits // 8 + 2 * (values // group_size) * dtype_bytes


def bytes_per_value(dtype_bytes: int, bits: int = 16, group_size: int = 64) -> float:
    """``stored_bytes`` of one value, averaged over a group (a weight matrix's rate)."""
    return stored_bytes(group_size, dtype_bytes, bits, group_size) / group_size
