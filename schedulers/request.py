"""What a scheduling policy reads and sets on a request: a narrow protocol, so policies
depend on no engine module (the engine's ``Sequence`` implements it).

A policy reads a request's identity, rank and token counts, and sets only its scheduling
state: ``status``, ``num_computed_tokens`` (admission, preemption), ``num_cached_tokens``
and ``first_scheduled_time`` (first admission) and ``preemptions``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class RequestParams(Protocol):
    max_tokens: int  # the output budget (shortest-remaining victims, speculation's headroom)

    @property
    def skip_reading_prefix_cache(self) -> bool: ...  # compute every prompt position (vLLM's)


class Request(Protocol):
    """A request as a policy sees it."""

    request_id: str
    token_ids: Sequence[int]  # prompt + output so far (prefix-cache matching reads it)
    params: RequestParams
    priority: int
    arrival_time: float
    status: Status
    num_computed_tokens: int  # tokens whose KV is in the arena
    num_cached_tokens: int | None
    first_scheduled_time: float | None
    preemptions: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def num_uncomputed_tokens(self) -> int: ...
