"""trace=chat: kvbench's prompt set, chat-templated, the model's own EOS, and follow-up turns
whose prompts the replay grows by the model's actual answers (harness/workload/chat.py,
harness/cli/replay.py)."""

from __future__ import annotations

import pytest

from allocators.free_list import FreeListAllocator
from harness.analysis import results
from harness.cli.replay import replay
from harness.cli.run import UsageError, check, run
from harness.engine import build_engine
from harness.workload.chat import chat, load_tokenizer, prompt_set
from harness.workload.distributions import AllAtOnce, Poisson
from harness.workload.traces import Trace, TraceRequest
from schedulers.fcfs import FCFSScheduler


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def test_the_same_seed_gives_the_same_chat_trace_and_each_prompt_once_before_repeats(tok):
    n = len(prompt_set()["prompts"])
    trace = chat(n + 3, Poisson(2.0), seed=5)
    assert trace == chat(n + 3, Poisson(2.0), seed=5)
    assert trace.requests != chat(n + 3, Poisson(2.0), seed=6).requests
    texts = [tok.decode(r.prompt_token_ids) for r in trace.requests]
    assert len(set(texts[:n])) == n  # the first n are the whole set, each once
    for text, req in zip(texts, trace.requests, strict=True):
        assert text.startswith("<|im_start|>system\n")  # SmolLM2's template, its default system
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert req.ignore_eos is False and req.max_tokens == 256 and req.after is None
    lengths = [len(r.prompt_token_ids) for r in trace.requests]
    assert min(lengths) < 40 and max(lengths) > 200  # short questions and quoted passages


def test_a_shared_system_prompt_is_a_long_common_prefix(tok):
    trace = chat(6, AllAtOnce(), seed=0, shared_system_prompt=True)
    prompts = [r.prompt_token_ids for r in trace.requests]
    system = tok.encode(prompt_set()["system_prompt"], add_special_tokens=False)
    common = min(
        next(i for i, (x, y) in enumerate(zip(prompts[0], p, strict=False)) if x != y)
        for p in prompts[1:]
    )
    assert common >= len(system) > 150


def test_a_follow_up_turn_holds_only_what_the_user_adds(tok):
    trace = chat(2, AllAtOnce(), seed=0, turns=3, think_time=1.5)
    ids = [r.request_id for r in trace.requests]
    assert ids == ["chat0", "chat1", "chat0-turn1", "chat0-turn2", "chat1-turn1", "chat1-turn2"]
    turn = trace.requests[3]
    assert turn.after == "chat0-turn1" and turn.arrival_time > 0  # a think time
    text = tok.decode(turn.prompt_token_ids)
    question = text.removeprefix("\n<|im_start|>user\n").removesuffix(
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert question in prompt_set()["follow_ups"]
    assert trace.metadata["max_prefix_hit_rate"] is None  # known only once the answers are


def test_the_replay_grows_a_follow_up_by_the_answer_and_sends_it_after_a_think_time(model):
    first = TraceRequest("a", 0.0, (5, 6, 7), 4)
    turn = TraceRequest("a-1", 0.25, (8, 9), 3, after="a")
    second = TraceRequest("a-2", 0.5, (10,), 2, after="a-1")
    engine = build_engine(model, FreeListAllocator, FCFSScheduler, block_size=4, num_blocks=32)
    sent = replay(engine, Trace((first, turn, second)), progress=False)
    rows = {r["request_id"]: r for r in engine.recorder.requests}
    a, a1, a2 = sent.requests
    assert tuple(a1.prompt_token_ids) == (5, 6, 7) + sent.answers["a"] + (8, 9)
    assert tuple(a2.prompt_token_ids) == (*a1.prompt_token_ids, *sent.answers["a-1"], 10)
    assert len(sent.answers["a"]) == 4 and len(sent.answers["a-1"]) == 3
    assert rows["a-1"]["arrival_time"] == pytest.approx(rows["a"]["finish_time"] + 0.25)
    assert rows["a-2"]["arrival_time"] == pytest.approx(rows["a-1"]["finish_time"] + 0.5)


def test_follow_ups_of_an_aborted_request_are_not_sent(model):
    too_long = TraceRequest("a", 0.0, tuple(range(1, 40)), 4)  # more than the arena holds
    turn = TraceRequest("a-1", 0.1, (8,), 2, after="a")
    turn2 = TraceRequest("a-2", 0.1, (9,), 2, after="a-1")
    other = TraceRequest("b", 0.0, (1, 2), 2)
    engine = build_engine(model, FreeListAllocator, FCFSScheduler, block_size=4, num_blocks=4)
    sent = replay(engine, Trace((too_long, turn, turn2, other)), progress=False)
    assert [r.request_id for r in sent.requests] == ["a", "b"]
    assert {r["request_id"] for r in engine.recorder.requests} == {"a", "b"}


def test_a_chat_trace_is_refused_on_the_model_clock_before_any_work(compose_cfg):
    with pytest.raises(ValueError, match="engine.clock=model runs no model"):
        check(compose_cfg(["trace=chat", "engine.clock=model"]))


def test_a_chat_trace_on_a_model_that_cannot_read_its_tokens_names_model_smollm2(
    compose_cfg, tmp_path
):
    with pytest.raises(UsageError, match="tokenized by 'smollm2'.*run it with model=smollm2"):
        run(compose_cfg(["trace=chat", "trace.num_requests=2"]), tmp_path)  # model=tiny


@pytest.mark.slow
def test_smollm2_chats_end_at_its_own_eos_and_radix_reuses_the_conversation(
    compose_cfg, smollm2_cache, tmp_path, monkeypatch
):
    monkeypatch.setenv("KVBENCH_CACHE", smollm2_cache)  # the session's converted model
    # seed 15 opens with "What is 2+2?" and "What is the capital of France?": short answers
    overrides = ["model=smollm2", "trace=chat_multi_turn", "trace.num_requests=2", "trace.seed=15"]
    overrides += ["trace.max_tokens=64", "allocator=radix", "engine.num_blocks=128"]
    summary = run(compose_cfg(overrides), tmp_path)
    requests, _ = results.load_tables(tmp_path)
    assert summary["completed"] == 6 and summary["num_requests"] == 6
    assert "stop" in set(requests["finish_reason"])  # the model's own EOS ended an answer
    # follow-ups reuse the conversation's KV, within the bound the answers allow
    assert 0.3 < summary["prefix_hit_rate"] <= summary["max_prefix_hit_rate_blocks"]
