"""The reference every engine test compares with: mlx_lm's own generation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from harness.platform.models import LoadedModel


def mlx_lm_tokens(model: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of mlx_lm's single-sequence ``generate_step`` over its ``KVCache``."""
    steps = generate_step(mx.array(prompt), model.model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


def mlx_lm_quantized_tokens(
    model: LoadedModel, prompt: list[int], max_tokens: int, bits: int, group_size: int = 64
) -> list[int]:
    """Greedy tokens of mlx_lm's model over its own ``QuantizedKVCache`` from the first token
    on: K and V quantized before they are attended to, prompt included. (``generate_step``'s
    ``kv_bits`` quantizes only after its prefill, so its prompt attends unquantized.)"""
    cache = [QuantizedKVCache(group_size, bits) for _ in range(model.num_layers)]
    logits = model.model(mx.array(prompt)[None], cache=cache)
    tokens = []
    for _ in range(max_tokens):
        tokens.append(int(mx.argmax(logits[0, -1])))
        logits = model.model(mx.array([tokens[-1:]]), cache=cache)
    return tokens


def mlx_lm_logprobs(model: LoadedModel, tokens: list[int], kv_bits: int = 16) -> np.ndarray:
    """Log-softmax of mlx_lm's own full forward over ``tokens``, float32 [len(tokens), vocab]:
    row p scores the token at p + 1. No cache, or with ``kv_bits`` < 16 a fresh
    ``QuantizedKVCache`` (group size 64) per layer, so every query attends to quantized K/V."""
    cache = None
    if kv_bits != 16:
        cache = [QuantizedKVCache(64, kv_bits) for _ in range(model.num_layers)]
    logits = model.model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def beam_search_reference(
    model: LoadedModel,
    prompt: list[int],
    beam_width: int,
    max_tokens: int,
    eos: tuple[int, ...] = (),
    length_penalty: float = 1.0,
    ignore_eos: bool = False,
    kv_bits: int = 16,
) -> list[tuple[list[int], float]]:
    """Brute force of vLLM's ``LLM.beam_search``: each round every beam is re-run through
    mlx_lm's full forward (no cache), offers its top 2 * width raw logprobs, EOS candidates
    complete (unless ``ignore_eos``), the best ``beam_width`` by score go on; at the end the
    best ``beam_width`` of all by score, ``cum / len(prompt + output, less a final EOS) **
    length_penalty`` (vLLM shortens an EOS-ending beam even under ``ignore_eos``).
    ``kv_bits`` < 16: each forward over mlx_lm's ``QuantizedKVCache`` (``mlx_lm_logprobs``).
    Returns (output tokens, cumulative logprob), best first."""

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] in eos)) ** length_penalty

    beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        new = []
        for tokens, cum in beams:
            row = mlx_lm_logprobs(model, tokens, kv_bits)[-1].astype(np.float64)
            for token in sorted(range(row.size), key=lambda t: (-row[t], t))[: 2 * beam_width]:
                grown = (tokens + [token], cum + float(row[token]))
                (done if token in eos and not ignore_eos else new).append(grown)
        beams = sorted(new, key=score, reverse=True)[:beam_width]

    best = sorted(done + beams, key=score, reverse=True)[:beam_width]
    return [(tokens[len(prompt) :], cum) for tokens, cum in best]
