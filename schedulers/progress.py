"""A step's results applied to its sequences: the one writer of a sequence's progress, its
tokens and how it finished (vLLM v1's ``Scheduler.update_from_output``), and the record of
the sequences that left for the engine to take.

    advance   each scheduled sequence's KV progress: ``num_computed_tokens``, newly full
              blocks offered to the prefix cache (``commit``, before any stop frees them
              uncached), a verification's rejected drafts' slots trimmed (target and draft)
    append    tokens appended and stamped when they exist on the host, stop checks
              (``Stopping``) after each; what follows a stop is dropped
    close     a sequence's finish: FINISHED, its reasons and time, on the finished list

A sequence whose KV the engine keeps (save_kv) hands its block table over before its
blocks go (``hand_over``), so the engine can save it before the next step writes them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from allocators.base import BlockAllocator
from schedulers.decode_run import DecodeRun
from schedulers.kv_groups import DraftKV
from schedulers.output import INFLIGHT, SchedulerOutput
from schedulers.request import Request, Status
from schedulers.stopping import Stopping, stop_length

Stop = tuple[str, object]  # (finish reason, stop reason)
OWN_TOKENS = "i"  # a running sequence's token_ids: an int32 array (radix keys are its bytes)
LENGTH: Stop = ("length", None)  # a stop by the length limit


class Progress:
    """Sequences' progress, tokens and finishes; the sequences that left since the engine
    last took them."""

    def __init__(
        self,
        allocator: BlockAllocator,
        draft: DraftKV | None,
        stopping: Stopping,
        max_seq_len: int,
    ) -> None:
        self.allocator = allocator
        self.draft = draft
        self.stopping = stopping
        self.max_seq_len = max_seq_len
        self.keep_kv: set[str] = set()  # requests whose KV the engine saves when they stop
        self.finished: list[Request] = []  # since the engine last took them, in order
        self.released: list[tuple[Request, tuple[int, ...] | None]] = []  # kept KV, ditto
        # Per sequence with a token appended and not yet closed, ``Stopping.length_limit``
        # (its params never change): most sequences stop by length alone, one comparison.
        self._length_limits: dict[Request, int] = {}

    def advance(self, plan: SchedulerOutput, tokens: Mapping[Request, Sequence[int]]) -> None:
        """The plan's rows wrote their KV: each scheduled sequence advances by its row's
        tokens; a verification (``num_draft_tokens``) by its last token and the drafts it
        kept, all of ``tokens[seq]`` but the last. A sequence that finished while its row
        computed (pipelined: it stopped on the previous step's token) is skipped."""
        bs, finished = self.allocator.block_size, Status.FINISHED
        for seq, num_new, _, num_draft, _ in plan.scheduled:
            if seq.status is finished:
                continue
            before = seq.num_computed_tokens
            if num_draft:
                kept = tokens[seq][:-1]
                seq.num_computed_tokens += len(kept) + 1
                if seq.num_computed_tokens // bs > before // bs:
                    self._commit(seq, [*seq.token_ids, *kept])
                self.allocator.trim(seq.request_id, seq.num_computed_tokens)
                if self.draft is not None:
                    self.draft.rollback(seq.request_id, seq.num_computed_tokens)
            else:
                seq.num_computed_tokens = after = before + num_new
                if after // bs > before // bs:
                    self._commit(seq, seq.token_ids)

    def _commit(self, seq: Request, token_ids: Sequence[int]) -> None:
        """Tell the allocator about newly full blocks of written KV (prefix caches share
        them); ``token_ids`` hold at least the computed tokens. The allocator reads them
        during the call only, so a decode's whole token list goes without a copy; a
        prefill's are the prompt as sent (a trace's compact array: its keys at C speed)."""
        n = seq.num_computed_tokens
        if n <= len(seq.prompt_token_ids):
            token_ids = seq.prompt_token_ids
        self.allocator.commit(seq.request_id, token_ids if len(token_ids) == n else token_ids[:n])

    @staticmethod
    def admit(seq: Request) -> None:
        """``seq`` runs: a waiting sequence's tokens are its prompt, shared with whoever
        sent it (a tuple, or a trace's compact array: a saturated queue of long prompts
        holds one copy of each, not two), or a fork's list; running, it gets an int32 array
        of its own to grow (``OWN_TOKENS``: copied in C, 4 bytes a token, where a list made
        a Python int of each id past 256 and 8 bytes a pointer to it), kept when it is
        admitted again after a preemption."""
        tokens = seq.token_ids
        if type(tokens) is not array:  # a tuple (or a fork's list) of ints
            seq.token_ids = array(OWN_TOKENS, tokens)
        elif tokens.typecode != OWN_TOKENS or tokens is seq.prompt_token_ids:
            # A compact prompt, its sender's: widened by numpy (7 against 330 us for 16k
            # 2-byte ids made a list, or 900 by array's own per-id conversion)
            own = seq.token_ids = array(OWN_TOKENS)
            own.frombytes(np.asarray(tokens).astype(np.int32).tobytes())

    def append(self, seq: Request, tokens: Sequence[int], now: float) -> Stop | None:
        """Append ``tokens``, each existing on the host at ``now``, up to the first that
        stops ``seq``: that stop, else None."""
        stopped = self.append_all({seq: tokens}, now)
        return stopped[0][1] if stopped else None

    def append_all(
        self, tokens: Mapping[Request, Sequence[int]], now: float
    ) -> list[tuple[Request, Stop]]:
        """``append`` for each sequence's tokens, all on the host at ``now``, in one call a
        step: the sequences that stopped, in order, each with its stop. A token at a time
        through ``append_each`` (verifications, a few rows a step; the sampling rows' many
        take ``append_each`` at once)."""
        stopped = []
        for seq, got in tokens.items():
            for token in got:
                if stop := self.append_each((seq,), (token,), now):
                    stopped += stop
                    break
        return stopped

    def append_each(
        self, seqs: Sequence[Request], tokens: Sequence[int], now: float
    ) -> list[tuple[Request, Stop]]:
        """Append one token to each of ``seqs`` (a step's sampling rows), on the host at
        ``now``, each stamped and stop-checked: the sequences that stopped, in order, each
        with its stop. A sequence only its length can stop is checked by that alone."""
        stopped = []
        check, max_seq_len = self.stopping.check, self.max_seq_len
        limits, length_limit = self._length_limits, self.stopping.length_limit
        for seq, token in zip(seqs, tokens, strict=True):
            token_ids = seq.token_ids
            token_ids.append(token)
            seq.token_times.append(now)
            if seq.first_token_time is None:
                seq.first_token_time = now
            limit = limits.get(seq)
            if limit is None:
                limit = limits[seq] = length_limit(seq, max_seq_len)
            if limit:
                if len(token_ids) >= limit:
                    stopped.append((seq, LENGTH))
                continue
            reason, why = check(seq, token, max_seq_len)
            if reason is not None:
                stopped.append((seq, (reason, why)))
        return stopped

    def decode(
        self, seqs: Sequence[Request], tokens: Sequence[int], now: float, stop_at: Sequence[int]
    ) -> list[tuple[int, Stop]]:
        """``advance`` and ``append_each`` of a step whose rows ``seqs`` each decoded one
        token (the running batch's: ``stop_at`` their length limits, 0 where a token may
        stop one sooner), in one pass: their tokens, existing on the host at ``now``. A
        decoding row is past its first token, so none sets ``first_token_time``. Returns
        the rows that stopped, in order, each with its stop."""
        bs, commit, stopped = self.allocator.block_size, self._commit, []
        check, max_seq_len = self.stopping.check, self.max_seq_len
        row = 0
        for seq, token in zip(seqs, tokens, strict=False):
            computed = seq.num_computed_tokens = seq.num_computed_tokens + 1
            token_ids = seq.token_ids
            if not computed % bs:  # a block filled: offered before the token is appended
                commit(seq, token_ids)
            token_ids.append(token)
            seq.token_times.append(now)
            limit = stop_at[row]
            if limit:
                if len(token_ids) >= limit:
                    stopped.append((row, LENGTH))
            else:
                reason, why = check(seq, token, max_seq_len)
                if reason is not None:
                    stopped.append((row, (reason, why)))
            row += 1  # noqa: SIM113 (enumerate's tuples cost ~15 % of this loop)
        return stopped

    def catch_up(self, run: DecodeRun, rows: Iterable[int], steps: int) -> None:
        """Rows ``rows`` of a decode run (schedulers/decode_run.py): each one's sequence has
        its KV written through the run's steps taken, and takes the tokens of its first
        ``steps`` steps it lacks, stamped with their steps' times."""
        seqs, starts, taken, take = run.seqs, run.starts, run.steps, run.take
        for row in rows:
            seq = seqs[row]
            seq.num_computed_tokens = starts[row] + taken
            tokens, times = take(row, steps)
            seq.token_ids.frombytes(tokens)
            seq.token_times.extend(times)

    def commit_filled(self, run: DecodeRun, rows: list[int]) -> None:
        """Rows ``rows`` of a decode run filled a block in its step just taken: each catches
        up (its tokens before that step's) and offers its full blocks (``commit``), before
        that step's token is appended, as ``decode`` does."""
        self.catch_up(run, rows, run.steps - 1)
        for row in rows:
            seq = run.seqs[row]
            self._commit(seq, seq.token_ids)

    def append_pending(self, seq: Request) -> None:
        """A token still on the device (pipelined steps): a placeholder until ``resolve``."""
        seq.token_ids.append(INFLIGHT)

    def resolve(self, seq: Request, token: int, now: float) -> Stop | None:
        """``seq``'s pending token is ``token``, on the host at ``now``: its stop, if any."""
        seq.token_ids.pop()
        return self.append(seq, (token,), now)

    def drop_pending(self, seq: Request) -> None:
        """``seq`` leaves with a token still on the device: that token is never emitted."""
        if seq.token_ids[-1] == INFLIGHT:
            seq.token_ids.pop()

    def append_chosen(self, seq: Request, token: int) -> None:
        """A beam's next token, chosen by its search (no stop checks: the search ends it)."""
        seq.token_ids.append(token)

    def at_length(self, seq: Request) -> bool:
        """``seq`` stops on its last token whatever it is (max_tokens, the length limit)."""
        return len(seq.token_ids) >= stop_length(seq, self.max_seq_len)

    def keep(self, request_id: str) -> None:
        """The engine saves ``request_id``'s KV when it stops (save_kv)."""
        self.keep_kv.add(request_id)

    def hand_over(self, seq: Request, keep: bool) -> None:
        """``seq``'s blocks are about to go: if its KV is kept and ``keep`` (an abort saves
        none), record its block table (None unless it is on the device: a swapped or
        recomputed sequence's KV is in the engine's host copy, or nowhere)."""
        rid = seq.request_id
        if self.keep_kv and rid in self.keep_kv:
            self.keep_kv.discard(rid)
            if keep:
                on_device = seq.status is Status.RUNNING
                table = tuple(self.allocator.block_table(rid)) if on_device else None
                self.released.append((seq, table))

    def close(
        self,
        seq: Request,
        reason: str | None,
        now: float | None,
        stop_reason: object = None,
        abort_reason: str | None = None,
    ) -> None:
        """``seq`` finished (``reason`` None: it leaves without a finish of its own, a beam
        its search dropped)."""
        self._length_limits.pop(seq, None)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        seq.stop_reason = stop_reason
        seq.abort_reason = abort_reason
        self.finished.append(seq)

    def take_finished(self) -> list[Request]:
        """The sequences that finished since the last call, in the order they did."""
        finished, self.finished = self.finished, []
        return finished

    def take_released(self) -> list[tuple[Request, tuple[int, ...] | None]]:
        """Sequences whose KV is kept that gave their blocks back since the last call, each
        with its block table then (None: not on the device). The blocks are free: the
        engine takes these before anything writes a block again (a fork's copy, the next
        step's moves and forward)."""
        released, self.released = self.released, []
        return released
