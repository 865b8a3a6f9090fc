"""The reference every engine test compares with: mlx_lm's own generation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from harness.models import LoadedModel


def mlx_lm_tokens(model: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of mlx_lm's single-sequence ``generate_step`` over its ``KVCache``."""
    steps = generate_step(mx.array(prompt), model.model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


def mlx_lm_logprobs(model: LoadedModel, tokens: list[int]) -> np.ndarray:
    """Log-softmax of mlx_lm's own full forward over ``tokens`` (no cache), float32
    [len(tokens), vocab]: row p scores the token at p + 1."""
    logits = model.model(mx.array(tokens)[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
