"""The recorder's settling of ``slots_future`` at an allocation's end, fed by hand.

A fork's two sequences share a partial block: each one's held slots count it, the arena
holds it once. When both end in the same step, the first to have started takes the block's
unfilled slot as future and the second finds none left (the cap by the step's unfilled
slots), whatever the order of their entries. Block size 4; every figure is counted below.
"""

from __future__ import annotations

import pytest

from allocators.base import Holdings
from allocators.stats import AllocatorStats
from harness.analysis.metrics import STEP_SCHEMA
from harness.costmodel.work import StepWork
from harness.engine.recorder import Recorder
from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams
from schedulers.output import KVStats, Scheduled, SchedulerOutput


def _seq(name: str, tokens: int, computed: int) -> Seq:
    seq = Seq(request_id=name, token_ids=list(range(3)), params=SamplingParams(), arrival_time=0)
    seq.token_ids = list(range(tokens))
    seq.num_computed_tokens = computed
    return seq


def _blocks(used_blocks: int, used_slots: int, tables: list[list[int]]) -> AllocatorStats:
    """An arena of 8 blocks of 4 whose sequences hold ``tables``."""
    return AllocatorStats(
        num_blocks=8, block_size=4, used_blocks=used_blocks, free_blocks=8 - used_blocks,
        cached_blocks=0, reserved_slots=4 * used_blocks, used_slots=used_slots,
        prefix_queries=0, prefix_query_tokens=0, prefix_hit_tokens=0, evictions=0,
        cow_copies=0, relocations=0, relocated_blocks=0, fork_copies=0, num_seqs=len(tables),
        table_refs=sum(map(len, tables)), table_blocks=len(set().union(*tables)),
    )  # fmt: skip


def _stats(running, holdings: Holdings, blocks: AllocatorStats) -> KVStats:
    return KVStats(
        blocks=blocks, running=tuple(running), holdings=holdings, num_waiting=0,
        num_swapped=0, unusable_free_blocks=0, draft_blocks_used=0, window_blocks_used=0,
    )  # fmt: skip


def _step(recorder: Recorder, running, holdings: Holdings, blocks, scheduled) -> None:
    plan = SchedulerOutput(scheduled=scheduled)
    row = recorder.snapshot(_stats(running, holdings, blocks), plan, {})
    recorder.step(plan, row, 0.0, 1.0, 0.0, 0.0, work=StepWork())


def _prefill_then_decode(recorder: Recorder) -> Seq:
    """A 3-token prompt in 1 block of 4 (step 0: tokens 3, internal 1), then one decode
    (step 1: 4 written); the sequence, still running."""
    a = _seq("a", 3, 0)
    _step(recorder, [a], Holdings([3], [4]), _blocks(1, 3, [[0]]), [Scheduled(a, 3, True)])
    a.token_ids, a.num_computed_tokens = list(range(4)), 3
    _step(recorder, [a], Holdings([4], [4]), _blocks(1, 4, [[0]]), [Scheduled(a, 1, True)])
    return a


def test_forks_sharing_a_partial_block_settle_it_once_in_the_order_they_started():
    recorder = Recorder(measured=False)
    # step 0: a and b (3-token prompts, forked) share block 0 holding 3 slots; each holds 4
    # slots and has written 3. Arena: 1 block, 4 slots, 3 used: tokens 3, internal 1.
    a, b = _seq("a", 3, 3), _seq("b", 3, 3)
    _step(recorder, [a, b], Holdings([3, 3], [4, 4]), _blocks(1, 3, [[0], [0]]), [])
    # step 1: each decodes its 4th token into a block of its own (b copied on write):
    # a's table [0], b's [1]; 2 blocks, 8 slots, 8 used after the writes: internal 0.
    a.token_ids, b.token_ids = list(range(4)), list(range(4))
    rows = [Scheduled(a, 1, True), Scheduled(b, 1, True)]
    _step(recorder, [b, a], Holdings([4, 4], [4, 4]), _blocks(2, 8, [[1], [0]]), rows[::-1])
    # step 2: both have ended. Each went on to fill 4 slots: at step 0 each had 1 more to
    # fill, but the step had 1 unfilled slot: a (started first) takes it, b finds none.
    _step(recorder, [], Holdings([], []), _blocks(0, 0, []), [])
    columns = recorder.step_columns()
    assert columns["slots_tokens"].tolist() == [3, 8, 0]
    assert columns["slots_future"].tolist() == [1, 0, 0]
    assert columns["slots_internal"].tolist() == [0, 0, 0]
    assert columns["decode_tokens"].tolist() == [0, 2, 0]
    assert columns["block_refs"].tolist() == [2, 2, 0]
    assert columns["blocks_shared"].tolist() == [1, 0, 0]  # block 0 in both tables at step 0


def test_an_allocation_still_live_counts_what_it_has_written_so_far():
    # a 3-token prompt in 1 block of 4 (step 0: tokens 3, internal 1), then one decode
    # (step 1: 4 written). Still running: step 0's unfilled slot is future (filled at step
    # 1), step 1 has none left.
    recorder = Recorder(measured=False)
    _prefill_then_decode(recorder)
    columns = recorder.step_columns()
    assert columns["prefill_tokens"].tolist() == [3, 0]
    assert columns["decode_tokens"].tolist() == [0, 1]
    assert columns["slots_future"].tolist() == [1, 0]
    assert columns["slots_internal"].tolist() == [0, 0]


def test_a_sequence_preempted_and_readmitted_between_two_steps_starts_a_new_allocation():
    # step 0: a's 3-token prompt in block 0 of 4 slots (tokens 3, internal 1). Before step 1
    # it is preempted (recompute) and admitted again: the running set holds the same
    # sequence, its preemption count 1. Its first allocation ended having written 3 slots,
    # so step 0's unfilled slot stays internal (a region freed before it is filled), not
    # future; the new one recomputes its 3 prompt tokens and its 1 output token into block 1.
    recorder = Recorder(measured=False)
    a = _seq("a", 3, 0)
    _step(recorder, [a], Holdings([3], [4]), _blocks(1, 3, [[0]]), [Scheduled(a, 3, True)])
    a.token_ids, a.num_computed_tokens, a.preemptions = list(range(4)), 0, 1
    _step(recorder, [a], Holdings([4], [4]), _blocks(1, 4, [[1]]), [Scheduled(a, 4, True)])
    columns = recorder.step_columns()
    assert columns["prefill_tokens"].tolist() == [3, 4]
    assert columns["slots_tokens"].tolist() == [3, 4]
    assert columns["slots_future"].tolist() == [0, 0]
    assert columns["slots_internal"].tolist() == [1, 0]
    assert columns["block_refs"].tolist() == [1, 1]
    assert columns["blocks_shared"].tolist() == [0, 0]


def test_a_runs_end_takes_the_step_columns_uncopied_and_no_step_is_recorded_after():
    # As the test above: step 0's unfilled slot is future once a has written 4 slots. The
    # run's end takes the same columns as step_columns, settled alike, but the recorder's
    # own memory: two takes would share it, so a second is refused, as is a further step.
    recorder = Recorder(measured=False)
    a = _prefill_then_decode(recorder)
    copied = recorder.step_columns()
    taken = recorder.take_step_columns()
    assert taken.keys() == copied.keys()
    assert all(taken[c].tolist() == copied[c].tolist() for c in copied)
    assert taken["slots_future"].tolist() == [1, 0]
    assert not taken["slots_future"].flags.owndata  # a view of the recorder's array
    with pytest.raises(RuntimeError, match="taken"):
        recorder.step_columns()
    with pytest.raises(RuntimeError, match="taken"):
        _step(recorder, [a], Holdings([4], [4]), _blocks(1, 4, [[0]]), [])
    with pytest.raises(RuntimeError, match="taken"):  # nor a row without a snapshot
        recorder.step(SchedulerOutput(), None, 0.0, 1.0, 0.0, 0.0, work=StepWork())


def test_a_column_is_kept_as_one_value_until_its_first_other_value():
    # 3,000 steps of one decoding sequence (over three batches of rows): block_copies is 0 up
    # to step 1,999, then its step's index; duration 1.0 throughout. Each column reads as
    # recorded, and one that held a single value takes no memory a step.
    recorder = Recorder(measured=False)
    a = _seq("a", 3, 3)
    stats = _stats([a], Holdings([3], [4]), _blocks(1, 3, [[0]]))
    plan = SchedulerOutput(scheduled=[])
    for i in range(3000):
        row = recorder.snapshot(stats, plan, {})
        work = StepWork(block_copies=i if i >= 2000 else 0)
        recorder.step(plan, row, float(i), 1.0, 0.0, 0.0, work=work)
    columns = recorder.take_step_columns()
    assert columns["block_copies"].tolist() == [0] * 2000 + list(range(2000, 3000))
    assert columns["start_time"].tolist() == [float(i) for i in range(3000)]
    assert columns["duration"].tolist() == [1.0] * 3000
    assert columns["duration"].strides == (0,)  # one value, repeated without memory
    assert columns["step"].tolist() == list(range(3000))
    assert list(columns) == list(STEP_SCHEMA)


def test_a_snapshot_whose_allocator_holds_other_sequences_than_the_running_raises():
    # The running tables' sharing is the allocator's count only while its sequences are the
    # running ones: one it still holds after its sequence stopped running is a scheduler bug.
    recorder = Recorder(measured=False)
    a = _seq("a", 3, 3)
    stats = _stats([a], Holdings([3], [4]), _blocks(2, 6, [[0], [1]]))
    with pytest.raises(RuntimeError, match="holds 2 sequences and 1 run"):
        recorder.snapshot(stats, SchedulerOutput(scheduled=[]), {})


def test_a_float_in_an_integer_column_raises_even_while_the_column_is_constant():
    """A column keeps one value until it changes (no array); that value is checked as its
    array would check it: a float work count is an error, not a truncated integer."""
    recorder = Recorder(measured=False)
    plan = SchedulerOutput()
    row = recorder.snapshot(_stats([], Holdings([], []), _blocks(0, 0, [])), plan, {})
    for _ in range(3):  # the same float every step: the column never changes
        recorder.step(plan, row, 0.0, 1.0, 0.0, 0.0, work=StepWork(batch_size=2.5))
    with pytest.raises(TypeError):
        recorder.step_columns()
