"""The batch constraints a scheduler is built with, checked: a bad value is one
``ValueError`` naming ``scheduler.<field>`` and what it must be."""

from __future__ import annotations

from schedulers.output import Preemption


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1, else a ValueError naming ``scheduler.<name>``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"scheduler.{name}={value!r} is invalid: it must be an int >= 1")
    return value


def check_limits(
    *,
    chunked_prefill: bool,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    max_model_len: int,
    watermark: float,
    min_batch_size: int,
    max_wait: float,
    preemption_mode: str,
    swap_blocks: int | None,
    num_lookahead_slots: int,
    draft: bool,
) -> int:
    """Check a scheduler's constraints (``Scheduler``'s arguments; ``draft``: a draft
    allocator is given); returns the token budget, vLLM's default when None: 2048 when
    prefills are chunked, else max(max_model_len, 2048)."""
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 2048 if chunked_prefill else max(max_model_len, 2048)
    for name, value in [
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_model_len", max_model_len),
        ("min_batch_size", min_batch_size),
    ]:
        positive_int(name, value)
    if not chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"scheduler.max_num_batched_tokens={max_num_batched_tokens} is below "
            f"max_model_len={max_model_len}: a long prompt could never be scheduled; raise "
            "it or use the chunked_prefill scheduler"
        )
    if not 0 <= watermark < 1:
        raise ValueError(f"scheduler.watermark={watermark!r} must be a fraction in [0, 1)")
    if min_batch_size > max_num_seqs:
        raise ValueError(
            f"scheduler.min_batch_size={min_batch_size} exceeds max_num_seqs={max_num_seqs}"
        )
    if not max_wait >= 0:
        raise ValueError(f"scheduler.max_wait={max_wait!r} must be >= 0 seconds")
    modes = [m.value for m in Preemption]
    if preemption_mode not in modes:
        raise ValueError(f"scheduler.preemption_mode={preemption_mode!r}: use one of {modes}")
    if swap_blocks is not None:
        positive_int("swap_blocks", swap_blocks)
    if num_lookahead_slots:
        positive_int("num_lookahead_slots", num_lookahead_slots)
    if draft and not num_lookahead_slots:
        raise ValueError("a draft allocator needs num_lookahead_slots > 0")
    return max_num_batched_tokens
