"""What one engine step gathers as it goes, for the step's own use: its start, the seconds
the host waited on MLX, the drafts proposed, the verification counts, the tokens left on the
device, the prompt positions a row asked logits for. Made by each step, dropped with it."""

from __future__ import annotations

import mlx.core as mx

from harness.engine.request import Seq
from harness.engine.speculative import Proposal, Verifications


class StepState:
    """What one step gathers as it goes: its start (``perf_counter``), the seconds the host
    waited on MLX, the drafts proposed, the verifications, the tokens left on the device."""

    __slots__ = ("start", "waited", "proposals", "prompt_positions", "verifications", "tokens")

    def __init__(self, start: float) -> None:
        self.start = start
        self.waited = 0.0
        self.proposals: dict[Seq, Proposal] = {}
        # The prompt positions whose logits a row asked for (prompt logprobs), by sequence:
        # decided once, with the rows, and read again when the logits come back.
        self.prompt_positions: dict[Seq, range] = {}
        self.verifications: Verifications | None = None
        self.tokens: mx.array | None = None
