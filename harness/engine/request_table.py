"""The engine's table of requests: the live sequences by id (and how many of them stream, want
an output every step), the completions of requests with n > 1, the beam searches, the
outputs owed to the caller, and the count of sequences added (which seeds them).
``RequestTable`` is the only writer of all of it.

Ids: a request's own id is its first sequence's; completions 1.. of a request with n > 1
are ``ID/1, ID/2, ...`` and a beam search's beams ``ID/beam1, ...``, so any ``ID/...`` is
reserved while the request runs.
"""

from __future__ import annotations

from harness.engine.beam_search import BeamGroup
from harness.engine.request import RequestOutput, Seq


class RequestTable:
    """Live requests, their completions and beam searches, and outputs owed."""

    def __init__(self) -> None:
        self.live: dict[str, Seq] = {}  # sequences by request id
        self.streams = 0  # live sequences whose output_kind is "cumulative"
        self.groups: dict[str, list[Seq]] = {}  # completions of requests with n > 1
        self.beams: dict[str, BeamGroup] = {}  # beam searches by request id
        self.owed: list[RequestOutput] = []  # aborts and rejections, returned next step
        self.num_added = 0  # sequences added (completion i falls back to seed + i)

    def reserve_seed(self, n: int, engine_seed: int) -> int:
        """The fallback seed of a new request's first sequence, reserving ``n`` in a row."""
        seed = engine_seed * 1_000_003 + self.num_added
        self.num_added += n
        return seed

    def add(self, seq: Seq, beam: BeamGroup | None = None) -> None:
        """A new request's first sequence (and its beam search, if it is one)."""
        self._enter(seq)
        if seq.params.n > 1:
            self.groups[seq.request_id] = [seq]
        if beam is not None:
            self.beams[seq.request_id] = beam

    def add_child(self, child: Seq) -> None:
        """A completion (n > 1) or beam forked off a live sequence of the same request."""
        self._enter(child)
        group = self.groups.get(child.group_id)
        if group is not None and child.index:
            group.append(child)

    def remove(self, seq: Seq) -> None:
        """``seq`` left the engine."""
        gone = self.live.pop(seq.request_id, None)
        if gone is not None and gone.params.output_kind == "cumulative":
            self.streams -= 1

    def _enter(self, seq: Seq) -> None:
        self.live[seq.request_id] = seq
        if seq.params.output_kind == "cumulative":
            self.streams += 1

    def close_group(self, group_id: str) -> None:
        """Every completion of a request with n > 1 finished and was reported."""
        self.groups.pop(group_id, None)

    def end_beams(self, group_id: str) -> None:
        """A beam search finished."""
        del self.beams[group_id]

    def owe(self, output: RequestOutput) -> None:
        """An output to return with the next step (an abort between steps, a rejection)."""
        self.owed.append(output)

    def take_owed(self) -> list[RequestOutput]:
        owed, self.owed = self.owed, []
        return owed

    def ids_taken(self, request_id: str, n: int, beam: bool) -> list[str]:
        """The ids a new request would take that are in use (see the module docstring)."""
        ids = [request_id, *(f"{request_id}/{i}" for i in range(1, n))]
        taken = [i for i in ids if i in self.live or self.is_completion_id(i)]
        if request_id in self.groups or request_id in self.beams:
            taken.append(request_id)  # its first sequence finished, the request runs
        if beam:
            taken += [i for i in self.live if i.startswith(f"{request_id}/")]
        return taken

    def is_completion_id(self, request_id: str) -> bool:
        """``request_id`` is (or will be) a completion of a running request with n > 1, or a
        beam of a running beam search (any ``ID/...``)."""
        parent, _, index = request_id.rpartition("/")
        if parent in self.beams:
            return True
        group = self.groups.get(parent)
        return group is not None and index.isdigit() and 0 < int(index) < group[0].params.n
