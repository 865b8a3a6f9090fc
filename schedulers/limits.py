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
    allocator is given); returns the token budget.

    Args:
        max_num_seqs: running sequences at most.
        max_num_batched_tokens: new tokens per step at most (the token budget); None, as
            vLLM: 2048 when the policy chunks prefills, else max(max_model_len, 2048).
        max_model_len: prompt + output tokens at most; longer prompts are rejected. A
            sequence stops at ``max_seq_len``: this or what one sequence can hold in the arena.
        watermark: fraction of the arena's blocks kept free for running sequences' growth
            when admitting or swapping in (ignored while nothing runs, so it never blocks).
        min_batch_size, max_wait: while nothing runs, do not start a batch of fewer than
            ``min_batch_size`` waiting requests until the oldest has waited ``max_wait``
            seconds (never longer).
        preemption_mode: ``recompute`` or ``swap``.
        swap_blocks: host blocks the swap space holds (None: unbounded); a victim that does
            not fit is preempted by recompute instead.
    """
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
