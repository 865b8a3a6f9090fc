"""What the scheduler side reads and sets on a request: a narrow protocol, so it depends on
no engine module (the engine's ``Seq`` implements it).

The scheduler reads a request's identity, rank, parameters and token counts, and is the one
writer of its state as it moves: ``status``, ``num_computed_tokens`` (admission,
preemption, each step's progress), ``num_cached_tokens`` (and its lower tiers' shares),
``num_forked_tokens`` and ``first_scheduled_time`` (admission, fork), ``preemptions``, the
tokens it appends (``token_ids``, stamped in ``token_times`` and ``first_token_time``) and
how it finished (``finish_reason``, ``finish_time``, ``stop_reason``, ``abort_reason``).
"""

from __future__ import annotations

import enum
from collections.abc import MutableSequence
from typing import Protocol


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class RequestParams(Protocol):
    max_tokens: int  # the output budget (shortest-remaining victims, speculation's headroom)
    min_tokens: int  # output tokens before a stop token, EOS or stop string counts
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stop: tuple[str, ...]  # stop strings

    @property
    def skip_reading_prefix_cache(self) -> bool: ...  # compute every prompt position (vLLM's)


class Request(Protocol):
    """A request as a policy sees it."""

    request_id: str
    # Prompt + output so far (prefix-cache matching reads it): a tuple (the prompt, shared
    # with its sender) until first admitted (``Progress.admit``), then a list that grows.
    token_ids: list[int] | tuple[int, ...]
    num_prompt_tokens: int
    params: RequestParams
    priority: int
    arrival_time: float
    status: Status
    num_computed_tokens: int  # tokens whose KV is in the arena
    num_cached_tokens: int | None  # every tier's hit; the device's is the rest of these two:
    num_cached_tokens_host: int  # loaded from the host tier (kv_tier)
    num_cached_tokens_disk: int  # loaded from the disk tier
    num_forked_tokens: int
    first_scheduled_time: float | None
    preemptions: int
    token_times: MutableSequence[float]  # an array('d') in the engine's Seq
    first_token_time: float | None
    finish_reason: str | None
    finish_time: float | None
    stop_reason: str | int | None
    abort_reason: str | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def num_uncomputed_tokens(self) -> int: ...
