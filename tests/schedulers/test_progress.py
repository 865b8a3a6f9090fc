"""The scheduler side is the one writer of a sequence's progress, tokens and finish: a step's
results go in through ``Scheduler.update`` (vLLM v1's ``update_from_output``), and every way
a sequence leaves is ``Scheduler.finish``. Values are worked out by hand in each test."""

from __future__ import annotations

from array import array

from allocators.free_list import FreeListAllocator
from harness.engine.request import Seq
from harness.engine.sampling_params import SamplingParams
from schedulers.fcfs import FCFSScheduler
from schedulers.output import INFLIGHT, StepResults
from schedulers.progress import Progress
from schedulers.request import Status
from schedulers.stopping import Stopping

EOS = 2


def scheduler(**kwargs) -> FCFSScheduler:
    """Blocks of 4 slots; EOS is token 2."""
    return FCFSScheduler(
        FreeListAllocator(num_blocks=8, block_size=4), stopping=Stopping((EOS,)), **kwargs
    )


def seq(rid: str = "a", prompt=(5, 6, 7, 8), **params) -> Seq:
    return Seq(rid, list(prompt), SamplingParams(temperature=0, **params), arrival_time=0.0)


def test_stop_checks_follow_vllms_order():
    s, stopping = seq(max_tokens=3, min_tokens=1, stop_token_ids=(9,)), Stopping((EOS,))
    s.token_ids.append(EOS)  # 1 output token, min_tokens met: EOS stops
    assert stopping.check(s, EOS, max_seq_len=100) == ("stop", None)
    s.token_ids[-1] = 9
    assert stopping.check(s, 9, max_seq_len=100) == ("stop", 9)  # a stop id names itself
    s.token_ids[-1] = 4
    assert stopping.check(s, 4, max_seq_len=100) == (None, None)
    assert stopping.check(s, 4, max_seq_len=5) == ("length", None)  # 5 tokens: the limit
    s.token_ids += [4, 4]  # 3 output tokens: max_tokens
    assert stopping.check(s, 4, max_seq_len=100) == ("length", None)
    below = seq(min_tokens=2)
    below.token_ids.append(EOS)  # 1 output token < min_tokens: EOS does not stop it
    assert stopping.check(below, EOS, max_seq_len=100) == (None, None)
    ignoring = seq(ignore_eos=True)
    ignoring.token_ids.append(EOS)
    assert stopping.check(ignoring, EOS, max_seq_len=100) == (None, None)


def test_a_sequence_only_its_length_can_stop_is_checked_by_its_length_limit():
    stopping = Stopping((EOS,))
    # 4 prompt tokens + max_tokens 3: 7 tokens, unless the sequence limit is shorter
    assert stopping.length_limit(seq(max_tokens=3, ignore_eos=True), max_seq_len=100) == 7
    assert stopping.length_limit(seq(max_tokens=3, ignore_eos=True), max_seq_len=6) == 6
    assert Stopping().length_limit(seq(max_tokens=3), max_seq_len=100) == 7  # no EOS known
    assert stopping.length_limit(seq(max_tokens=3), max_seq_len=100) == 0  # EOS may stop it
    assert stopping.length_limit(seq(ignore_eos=True, stop_token_ids=(9,)), 100) == 0
    with_text = Stopping((EOS,), detokenize=lambda ids: "".join(map(str, ids)))
    assert with_text.length_limit(seq(ignore_eos=True, stop=("x",)), 100) == 0
    assert stopping.length_limit(seq(ignore_eos=True, stop=("x",)), 100) > 0  # no text: no
    # stop string can be read
    # Appended through update: EOS does not stop the one that ignores it; both stop at 6
    # tokens (max_tokens 2), the other by its length limit alone.
    sched = FCFSScheduler(
        FreeListAllocator(num_blocks=8, block_size=4), stopping=stopping, max_num_seqs=2
    )
    plain, eos = seq("p", max_tokens=2, ignore_eos=True), seq("e", max_tokens=2)
    sched.add(plain)
    sched.add(eos)
    plan = sched.schedule(0.0)
    sched.update(plan, StepResults(sampled=[plain, eos], sampled_tokens=[EOS, 4], now=1.0))
    assert plain.status is eos.status is Status.RUNNING
    plan = sched.schedule(2.0)
    sched.update(plan, StepResults(sampled=[plain, eos], sampled_tokens=[4, 4], now=3.0))
    assert (plain.finish_reason, plain.stop_reason, plain.output_token_ids) == (
        "length",
        None,
        [EOS, 4],
    )
    assert (eos.finish_reason, eos.output_token_ids) == ("length", [4, 4])


def test_update_moves_progress_appends_stamps_and_finishes_at_a_stop():
    sched, a = scheduler(), seq(max_tokens=8)
    sched.add(a)
    plan = sched.schedule(0.0)
    (row,) = plan.scheduled
    assert (row.num_new_tokens, row.samples) == (4, True)  # the whole prompt, then a token
    sched.update(plan, StepResults({a: [11]}, now=1.5))
    assert a.num_computed_tokens == 4 and list(a.token_ids) == [5, 6, 7, 8, 11]
    assert list(a.token_times) == [1.5] and a.first_token_time == 1.5
    assert a.status is Status.RUNNING and sched.allocator.stats().used_blocks == 1
    plan = sched.schedule(2.0)  # a decode: token 11 goes in, a fifth slot, a second block
    sched.update(plan, StepResults({a: [EOS]}, now=2.5))
    assert a.num_computed_tokens == 5 and a.output_token_ids == [11, EOS]
    assert (a.status, a.finish_reason, a.stop_reason, a.finish_time) == (
        Status.FINISHED,
        "stop",
        None,
        2.5,
    )
    assert sched.allocator.stats().used_blocks == 0 and not sched.has_unfinished()
    assert sched.progress.take_finished() == [a]
    assert sched.progress.take_finished() == []  # taken once


def test_a_verification_keeps_its_accepted_drafts_and_drops_what_follows_a_stop():
    """A 4-token prompt decoding token 11: the row verifies 3 drafts, all of whose slots
    were reserved. The target accepts 2 (12, 13) and corrects the third to 9, a stop id:
    KV progresses by the last token and the 2 kept drafts (4 -> 7), and the output stops at
    9 with the tokens before it."""
    sched, a = scheduler(num_lookahead_slots=3), seq(max_tokens=8, stop_token_ids=(9,))
    sched.add(a)
    sched.update(sched.schedule(0.0), StepResults({a: [11]}, now=1.0))
    plan = sched.schedule(1.0)
    (row,) = plan.scheduled
    assert (row.num_new_tokens, row.num_draft_tokens, row.samples) == (4, 3, True)
    assert sched.allocator.num_tokens("a") == 8  # 5 tokens and 3 draft slots
    sched.update(plan, StepResults({a: [12, 13, 9]}, now=2.0))
    assert a.num_computed_tokens == 7 and a.output_token_ids == [11, 12, 13, 9]
    assert list(a.token_times) == [1.0, 2.0, 2.0, 2.0]
    assert (a.finish_reason, a.stop_reason) == ("stop", 9)
    assert sched.allocator.stats().used_blocks == 0


def test_a_pending_token_sure_to_be_the_last_gives_the_blocks_back_before_it_is_read():
    sched, a = scheduler(), seq(max_tokens=1)
    sched.add(a)
    plan = sched.schedule(0.0)
    sched.update(plan, StepResults({a: ()}, pending=True))
    assert a.token_ids[-1] == INFLIGHT and sched.draining == {"a": a}
    assert sched.allocator.stats().used_blocks == 0 and a.status is Status.RUNNING
    assert sched.has_unfinished()  # until its token is read
    sched.resolve(a, 11, now=3.0)
    assert a.output_token_ids == [11] and a.finish_reason == "length"
    assert list(a.token_times) == [3.0] and not sched.draining and not sched.has_unfinished()


def test_every_exit_is_finish_and_an_abort_saves_no_kv():
    """A request whose KV is kept hands its table over when it stops, not when aborted; a
    rejected prompt leaves through the same exit, at schedule time."""
    sched = scheduler(max_model_len=16)
    kept, aborted, too_long = seq("kept", max_tokens=1), seq("aborted"), seq("long", [1] * 17)
    sched.add(kept, keep_kv=True)
    sched.add(aborted, keep_kv=True)
    sched.add(too_long)
    plan = sched.schedule(0.0)
    assert plan.rejected == [(too_long, "prompt of 17 tokens exceeds max_model_len=16")]
    assert (too_long.status, too_long.finish_reason) == (Status.FINISHED, "abort")
    assert too_long.finish_time == 0.0
    blocks = tuple(sched.allocator.block_table("kept"))
    sched.update(plan, StepResults({kept: [11], aborted: [12]}, now=1.0))  # kept: max_tokens
    assert sched.abort("aborted", now=2.0, reason="by the user") is aborted
    assert (aborted.finish_reason, aborted.abort_reason) == ("abort", "by the user")
    assert sched.progress.take_released() == [(kept, blocks)]
    assert sched.progress.take_finished() == [too_long, kept, aborted]
    assert sched.allocator.stats().used_blocks == 0


def test_a_running_sequence_grows_an_int32_array_of_its_own_and_outputs_lists():
    # A trace's compact prompt (int32) and a tuple, each shared with its sender until admitted
    sent = array("i", (5, 6, 7, 8))
    greedy = SamplingParams(temperature=0)
    a, b = Seq("a", sent, greedy, arrival_time=0.0), Seq("b", (5, 6, 7), greedy, arrival_time=0.0)
    assert a.token_ids is a.prompt_token_ids is sent
    sched = scheduler(preemption_mode="recompute")
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(now=0.0)
    assert [s.seq for s in plan.scheduled] == [a, b]
    for s in (a, b):
        assert type(s.token_ids) is array and s.token_ids.typecode == "i"
    assert a.token_ids is not sent and a.prompt_token_ids is sent
    narrow = Seq("c", array("H", (5, 6)), greedy, arrival_time=0.0)  # 2-byte ids, widened
    Progress.admit(narrow)
    assert narrow.token_ids == array("i", (5, 6)) and narrow.prompt_token_ids == array("H", (5, 6))
    sched.update(plan, StepResults({}, [a, b], [1000, 300], (), 1.0))
    assert sent == array("i", (5, 6, 7, 8))  # the sender's prompt is never written
    assert list(a.token_ids) == [5, 6, 7, 8, 1000] and list(b.token_ids) == [5, 6, 7, 300]
    assert a.output_token_ids == [1000] and type(b.output_token_ids) is list
    # Admitted again (after a preemption by recompute), it keeps its own array: no copy
    own = a.token_ids
    Progress.admit(a)
    assert a.token_ids is own
