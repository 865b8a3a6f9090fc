"""The host memory swapped-out sequences' KV takes (preemption by swap), counted in blocks
within an optional limit (``scheduler.swap_blocks``): a victim that does not fit is
preempted by recompute instead. The copies themselves are the engine's (host_kv.py)."""

from __future__ import annotations


class SwapSpace:
    """Host blocks held by swapped-out sequences, by request id."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # host blocks at most (None: unbounded)
        self._blocks: dict[str, int] = {}

    @property
    def used(self) -> int:
        """Host blocks held."""
        return sum(self._blocks.values())

    def fits(self, num_blocks: int) -> bool:
        """``num_blocks`` more fit within the limit."""
        return self.limit is None or self.used + num_blocks <= self.limit

    def hold(self, request_id: str, num_blocks: int) -> None:
        """``request_id`` was swapped out: its host copy takes ``num_blocks``."""
        self._blocks[request_id] = num_blocks

    def release(self, request_id: str) -> int:
        """``request_id``'s host copy goes (swapped in, or it left): the blocks it held."""
        return self._blocks.pop(request_id, 0)
