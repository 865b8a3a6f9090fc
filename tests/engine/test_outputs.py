"""The output processor's one-pass outputs and the sampler's argmax check, by hand.

``OutputProcessor.report_alone`` builds a running n=1 request's output in one pass; it must
give what ``report`` gives, field for field. ``takes_argmax`` turns true once a sequence is
past its ``min_tokens`` bans and stays true; the step sampler asks it only of sequences new
since the last step, so a newcomer in a batch of the same size is still asked.
"""

from __future__ import annotations

from functools import partial

from support import build_with_policy

from allocators.free_list import FreeListAllocator
from harness.engine.outputs import OutputProcessor
from harness.engine.request import CompletionOutput, RequestOutput, Seq
from harness.engine.request_table import RequestTable
from harness.engine.sampling_params import SamplingParams
from schedulers.request import Status

PROMPT_LENS = [5, 9]
PROMPT_SEED = 3
MAX_TOKENS = 6


def running(request_id: str, tokens: list[int], prompt: int, **params) -> Seq:
    """A running sequence of ``tokens``, the first ``prompt`` of them its prompt."""
    seq = Seq(request_id, tuple(tokens[:prompt]), SamplingParams(**params), 0.0)
    seq.token_ids = list(tokens)
    seq.status = Status.RUNNING
    return seq


def test_a_running_requests_output_is_built_in_one_pass_as_report_builds_it(model):
    table = RequestTable()
    outputs = OutputProcessor(model, table)
    plain = running("a", [7, 8, 9, 4, 5], prompt=3, max_tokens=9)
    final = running("b", [1, 2, 3], prompt=2, max_tokens=9, output_kind="final_only")
    logprobs = running("c", [6, 6], prompt=1, max_tokens=9, logprobs=0)
    done = running("d", [2, 3, 4], prompt=2, max_tokens=9, output_kind="final_only")
    done.status, done.finish_reason, done.finish_time = Status.FINISHED, "length", 2.5
    for seq in (plain, final, logprobs, done):
        table.add(seq)
    assert table.streams == 2  # "a" and "c" want an output every step

    got = outputs.report_alone([plain, final, logprobs, done])

    # By hand: "a" running, its output tokens 4, 5 and no text yet; "b" asks for its final
    # output only (none while it runs); "c" and "d" as report gives them.
    expected_a = RequestOutput("a", (7, 8, 9), [CompletionOutput(0, "", [4, 5], None, None)], False)
    assert got == [expected_a, outputs.report(logprobs), outputs.report(done)]
    assert got[0] == outputs.report(plain)
    assert got[1].outputs[0].logprobs == [] and got[2].finished_time == 2.5
    plain.token_ids.append(6)  # an output already returned never changes
    assert got[0].outputs[0].token_ids == [4, 5]
    # The next step's output holds every output token (the tokens streamed before and the
    # new one), as report gives it, in a list of its own.
    again = outputs.report_alone([plain])
    assert again == [outputs.report(plain)] and again[0].outputs[0].token_ids == [4, 5, 6]
    plain.token_ids.append(1)
    assert again[0].outputs[0].token_ids == [4, 5, 6] and got[0].outputs[0].token_ids == [4, 5]
    outputs.forget(plain)  # it left: its next output (were it reported) starts afresh
    assert outputs.report_alone([plain])[0].outputs[0].token_ids == [4, 5, 6, 1]


def test_without_a_streaming_request_only_the_finished_are_reported(model):
    # "a" streams (cumulative); once it has left, the table holds final-only requests alone
    # and a step's report is the finished ones', in order, as report gives them.
    table = RequestTable()
    outputs = OutputProcessor(model, table)
    a = running("a", [7, 8, 9], prompt=2, max_tokens=9)
    b = running("b", [1, 2, 3], prompt=2, max_tokens=9, output_kind="final_only")
    c = running("c", [4, 5], prompt=1, max_tokens=9, output_kind="final_only")
    for seq in (a, b, c):
        table.add(seq)
    assert len(outputs.report_alone([a, b, c])) == 1  # "a"'s, while it streams
    a.status = c.status = Status.FINISHED
    table.remove(a)
    table.remove(a)  # removed twice: counted once
    assert table.streams == 0
    assert outputs.report_alone([b, c]) == [outputs.report(c)]
    table.remove(c)
    assert table.streams == 0 and outputs.report_alone([b]) == []


def test_takes_argmax_turns_true_past_min_tokens_bans_and_stays(model):
    outputs = OutputProcessor(model, RequestTable())
    eos = model.eos_token_ids[0] if model.eos_token_ids else 0
    seq = running("a", [5, 6], prompt=2, temperature=0, max_tokens=9, min_tokens=2,
                  stop_token_ids=(eos,))  # fmt: skip
    sampled = running("b", [5, 6], prompt=2, temperature=1.0, max_tokens=9)
    assert not outputs.takes_argmax(seq)  # 0 output tokens < 2: EOS and stop ids banned
    seq.token_ids.append(9)
    assert not outputs.takes_argmax(seq)  # 1 < 2
    seq.token_ids.append(9)
    assert outputs.takes_argmax(seq)  # 2: no bans
    seq.token_ids.append(9)
    assert outputs.takes_argmax(seq)
    assert not outputs.takes_argmax(sampled)  # temperature 1: drawn, not the argmax


def test_a_newcomer_in_a_batch_of_the_same_size_is_asked_for_its_bans(model, prompts, reference):
    """Two greedy requests run (the sampler then knows both take the argmax); one finishes
    the step a third joins, so the batch keeps its size with a sequence the sampler has not
    seen: whose argmax at its second token is a stop id it may not take yet
    (``min_tokens``). Its second token must differ from mlx_lm's."""
    reference = reference[0]
    engine = build_with_policy(
        model, partial(FreeListAllocator), block_size=16, num_blocks=64, max_num_seqs=2
    )
    greedy = partial(SamplingParams, temperature=0, ignore_eos=True)
    engine.add_request("short", prompts[1], greedy(max_tokens=2))
    engine.add_request("long", prompts[1], greedy(max_tokens=MAX_TOKENS + 4))
    engine.step()  # both prompts, both sample
    banned = greedy(max_tokens=MAX_TOKENS, min_tokens=4, stop_token_ids=(reference[1],))
    engine.add_request("new", prompts[0], banned)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    tokens = outputs["new"].outputs[0].token_ids
    assert tokens[0] == reference[0] and tokens[1] != reference[1]
