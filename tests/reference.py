"""The reference every engine test compares with: mlx_lm's own generation."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step

from harness.models import LoadedModel


def mlx_lm_tokens(model: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of mlx_lm's single-sequence ``generate_step`` over its ``KVCache``."""
    steps = generate_step(mx.array(prompt), model.model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]
