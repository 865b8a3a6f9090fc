"""What the scheduler side reads and sets on a request: a narrow protocol, so it depends on
no engine module (the engine's ``Seq`` implements it).

The scheduler reads a request's identity, rank, parameters and token counts, and is the one
writer of its state as it moves: ``status``, ``num_computed_tokens`` (admission,
preemption, each step's progress), ``num_cached_tokens`` (and its lower tiers' part:
``num_cached_tokens_host``, ``num_cached_tokens_disk``), ``num_forked_tokens`` and
``first_scheduled_time`` (admission, fork), ``preemptions``, the tokens it appends
(``token_ids``, stamped in ``token_times`` and ``first_token_time``) and how it finished
(``finish_reason``, ``finish_time``, ``stop_reason``, ``abort_reason``).
"""

from __future__ import annotations

import enum
from collections.abc import MutableSequence, Sequence
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
    # Prompt + output so far (prefix-cache matching reads it): the prompt as its sender gave
    # it (a tuple, or a trace's compact array of ids, shared) until first admitted
    # (``Progress.admit``), then an int32 array of its own that grows.
    token_ids: Sequence[int]
    num_prompt_tokens: int
    # The prompt as its sender gave it, kept when ``token_ids`` becomes its own array (a commit
    # within it reads these: a compact array keys a prefix cache's blocks at C speed)
    prompt_token_ids: Sequence[int]
    params: RequestParams
    priority: int
    arrival_time: float
    status: Status
    num_computed_tokens: int  # tokens whose KV is in the arena
    num_cached_tokens: int | None  # prefix-cache hit tokens at the first admission, all tiers
    num_cached_tokens_host: int  # of those, loaded from the host tier (kv_tier)
    num_cached_tokens_disk: int  # of those, loaded from the disk tier
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
