"""Public trace formats (Azure 2023/2024, BurstGPT, Mooncake) from small files written here in
each format, and the Mooncake-like generator: arrivals, lengths, filters, the window, clipping,
equal hash ids as equal tokens, and one line naming file, line and column for a bad file."""

from __future__ import annotations

import json

import pytest

from harness.workload.distributions import LogNormal, Poisson, Uniform
from harness.workload.generators import mooncake_like
from harness.workload.public import azure, burstgpt, clip, mooncake, write_mooncake
from harness.workload.traces import Trace, TraceError, TraceRequest

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:47.1805900,396,109
2023-11-16 18:15:49.6805900,1500,900
2023-11-16 18:15:50.0000000,10,5
"""
BURST = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
130,ChatGPT,260,30,290,API log
"""
SIZES = {"max_len": 2048, "vocab_size": 1024}


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def mooncake_file(tmp_path, rows: list[dict]) -> str:
    return write(tmp_path, "mooncake.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def test_an_azure_record_with_nothing_generated_is_skipped_and_counted(tmp_path):
    trace = azure(write(tmp_path, "a.csv", AZURE.replace(",109\n", ",0\n")), **SIZES)
    assert len(trace) == 3 and trace.metadata["skipped_empty"] == 1


def test_azure_arrivals_are_seconds_from_the_first_record_and_lengths_are_the_files(tmp_path):
    trace = azure(write(tmp_path, "a.csv", AZURE), **SIZES)
    assert [r.arrival_time for r in trace] == pytest.approx([0.0, 0.5, 3.0, 3.31941])
    assert [len(r.prompt_token_ids) for r in trace] == [374, 396, 1500, 10]
    assert [r.max_tokens for r in trace] == [44, 109, 548, 5]  # 1500 + 900 > 2048: output clipped
    assert trace.metadata["clipped_requests"] == 1
    # means of the file's lengths, then of the trace's: the 900-token output became 548
    assert trace.metadata["clipped_means"] == {
        "prompt": [570.0, 570.0],
        "output": [264.5, 176.5],
    }
    assert trace.metadata["generator"] == "azure"


def test_no_max_len_keeps_every_request_whole(tmp_path):
    trace = azure(write(tmp_path, "a.csv", AZURE), max_len=None, vocab_size=1024)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in trace] == [
        (374, 44),
        (396, 109),
        (1500, 900),
        (10, 5),
    ]
    assert trace.metadata["clipped_requests"] == 0


@pytest.mark.parametrize(
    ("make", "text", "columns"),
    [
        (azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,4\n"
         "2023-11-16 18:15:47,12,0\n", "0 ContextTokens or GeneratedTokens"),
        (burstgpt, BURST.splitlines()[0] + "\n5,ChatGPT,472,0,472,API log\n",
         "0 Request tokens or Response tokens"),
    ],
)  # fmt: skip
def test_a_file_whose_rows_all_have_0_tokens_says_they_were_skipped_and_why(
    tmp_path, make, text, columns
):
    path = write(tmp_path, "zero.csv", text)
    rows = text.count("\n") - 1
    with pytest.raises(TraceError, match=f"all {rows} rows have {columns} .* were skipped"):
        make(path, **SIZES)


def test_the_window_keeps_start_to_start_plus_duration_scaled_and_counted(tmp_path):
    """start 0.4 s and duration 2.7 s keep the records at 0.5 and 3.0 s (not 3.32); time_scale
    2 halves their offsets from start: 0.05 and 1.3 s; max_requests 1 keeps the first."""
    path = write(tmp_path, "a.csv", AZURE)
    trace = azure(path, start=0.4, duration=2.7, time_scale=2.0, **SIZES)
    assert [r.arrival_time for r in trace] == pytest.approx([0.05, 1.3])
    assert len(azure(path, start=0.4, max_requests=1, **SIZES)) == 1


def test_burstgpt_filters_by_model_and_log_type_and_drops_failed_requests(tmp_path):
    path = write(tmp_path, "b.csv", BURST)
    every = burstgpt(path, **SIZES)
    assert [r.arrival_time for r in every] == [0.0, 113.0, 125.0]
    assert every.metadata["skipped_empty"] == 1
    chat = burstgpt(path, model="ChatGPT", log_type="Conversation log", **SIZES)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in chat] == [(472, 18)]
    with pytest.raises(TraceError, match="trace.model='Claude' matches no row"):
        burstgpt(path, model="Claude", **SIZES)


def test_equal_mooncake_hash_ids_give_equal_token_blocks(tmp_path):
    """Two prompts sharing ids 7 and 8 (two 512-token blocks), then differing: equal tokens
    for 1,024 positions, different after; a third with id 7 alone shares 512."""
    path = mooncake_file(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [7, 8, 9]},
            {"timestamp": 1500, "input_length": 1030, "output_length": 5, "hash_ids": [7, 8, 4]},
            {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [7, 5]},
        ],
    )
    a, b, c = mooncake(path, **SIZES)
    assert b.arrival_time == 1.5 and len(a.prompt_token_ids) == 1100
    assert a.prompt_token_ids[:1024] == b.prompt_token_ids[:1024]
    assert a.prompt_token_ids[1024:1030] != b.prompt_token_ids[1024:1030]
    assert c.prompt_token_ids[:512] == a.prompt_token_ids[:512]
    assert c.prompt_token_ids[512:600] != a.prompt_token_ids[512:600]


def test_a_kvbench_block_inside_a_shared_mooncake_block_is_shared(tmp_path):
    """With a 16-token kvbench block, 1,024 shared tokens are 64 full shared blocks; a prompt
    sharing only the partial last block's id shares its tokens up to the shorter length."""
    path = mooncake_file(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [3]},
            {"timestamp": 1, "input_length": 100, "output_length": 1, "hash_ids": [3]},
        ],
    )
    a, b = mooncake(path, **SIZES)
    assert b.prompt_token_ids[:40] == a.prompt_token_ids


def test_a_different_hash_block_size_is_read(tmp_path):
    path = mooncake_file(
        tmp_path, [{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1, 2]}]
    )
    (r,) = mooncake(path, hash_block=64, **SIZES)
    assert len(r.prompt_token_ids) == 100
    with pytest.raises(TraceError, match="2 ids for input_length 100; one per 512 tokens is 1"):
        mooncake(path, **SIZES)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n",
            "line 1: header .* lacks column 'GeneratedTokens'",
        ),
        (
            AZURE.replace(",396,", ",abc,"),
            "line 3, column 'ContextTokens': 'abc' is not an integer >= 0",
        ),
        (
            AZURE.replace("18:15:47.1805900", "yesterday"),
            "line 3, column 'TIMESTAMP': '2023-11-16 yesterday'",
        ),
        (AZURE.replace("18:15:49", "18:15:40"), "line 4: its time is earlier than the previous"),
        (
            AZURE.replace(",44\n", ",-4\n"),
            "line 2, column 'GeneratedTokens': '-4' is not an integer >= 0",
        ),
        (AZURE.replace(",44\n", ",44,9\n"), "line 2: 4 fields for the header's 3"),
    ],
)
def test_a_malformed_azure_file_names_file_line_and_column(tmp_path, text, message):
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError, match=message) as e:
        azure(path, **SIZES)
    assert str(e.value).startswith(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 1: invalid JSON"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "column 'hash_ids': None"),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "column 'input_length': 0",
        ),
        (
            '{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            "column 'timestamp': 'x'",
        ),
    ],
)
def test_a_malformed_mooncake_file_names_file_line_and_column(tmp_path, line, message):
    path = write(tmp_path, "bad.jsonl", line + "\n")
    with pytest.raises(TraceError, match=message) as e:
        mooncake(path, **SIZES)
    assert str(e.value).startswith(path)


def test_a_missing_file_and_a_bad_window_name_their_setting(tmp_path):
    with pytest.raises(TraceError, match="trace.path='none.csv' is not a file"):
        azure("none.csv", **SIZES)
    with pytest.raises(ValueError, match="trace.time_scale=0 is invalid"):
        azure(write(tmp_path, "a.csv", AZURE), time_scale=0, **SIZES)


def test_clipping_takes_the_output_first_then_the_prompt_tail():
    assert clip(1500, 900, 2048) == (1500, 548)
    assert clip(3000, 10, 2048) == (2047, 1)
    assert clip(100, 10, 2048) == (100, 10)


def generate(seed: int = 0, n: int = 200):
    return mooncake_like(
        n,
        Poisson(5.0),
        seed=seed,
        user_blocks=Uniform(1, 4),
        output_len=LogNormal(mean=50, max=200),
        hash_block=16,
    )


def test_mooncake_like_is_seeded_sorted_and_shares_system_prompts_and_history():
    """Every prompt starts with one of the 8 system prompts (4 blocks of 16 tokens); a later
    turn of a session extends an earlier turn's prompt."""
    trace = generate()
    assert len(trace) == 200 and generate().requests == trace.requests
    assert generate(seed=1).requests != trace.requests
    arrivals = [r.arrival_time for r in trace]
    assert arrivals == sorted(arrivals)
    systems = {tuple(r.prompt_token_ids[:64]) for r in trace}
    assert len(systems) <= 8
    prompts = [r.prompt_token_ids for r in trace]
    extended = sum(
        any(len(q) > len(p) and q[: len(p) - 16] == p[: len(p) - 16] for q in prompts[i + 1 :])
        for i, p in enumerate(prompts[:50])
    )
    assert extended > 0  # multi-turn: some prompt's full blocks open a later prompt


def _request(i: int, at: float, prompt: list[int], out: int, after: str | None = None):
    return TraceRequest(f"r{i}", at, prompt, out, after=after)


def test_a_trace_written_as_mooncake_names_each_block_with_its_prefix(tmp_path):
    # Blocks of 2 tokens; an id names a block and every block before it, numbered as met:
    #   r0 [1 2|3 4|5]    -> 0, 1, 2      (the last block partial)
    #   r1 [1 2|3 4|6 7]  -> 0, 1, 3      (its first two blocks are r0's)
    #   r2 [9 2|3 4]      -> 4, 5         ([3 4] after another block: not r0's block 1)
    #   r3 [1 2|3]        -> 0, 6         ([3] is a block of its own, not r0's [3 4])
    trace = Trace((_request(0, 0.0, [1, 2, 3, 4, 5], 7), _request(1, 0.25, [1, 2, 3, 4, 6, 7], 1),
                   _request(2, 1.5, [9, 2, 3, 4], 2), _request(3, 2.0, [1, 2, 3], 3)))  # fmt: skip
    path = tmp_path / "t.jsonl"
    write_mooncake(trace, path, hash_block=2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {"timestamp": 0.0, "input_length": 5, "output_length": 7, "hash_ids": [0, 1, 2]},
        {"timestamp": 250.0, "input_length": 6, "output_length": 1, "hash_ids": [0, 1, 3]},
        {"timestamp": 1500.0, "input_length": 4, "output_length": 2, "hash_ids": [4, 5]},
        {"timestamp": 2000.0, "input_length": 3, "output_length": 3, "hash_ids": [0, 6]},
    ]


def test_a_mooncake_file_written_from_a_trace_reads_back_with_its_lengths_and_sharing(tmp_path):
    trace = generate(n=40)  # sessions over shared system prompts, turns arriving on their own
    assert not any(r.after for r in trace)
    path = tmp_path / "t.jsonl"
    write_mooncake(trace, path, hash_block=8)
    back = mooncake(str(path), max_len=None, vocab_size=1024, hash_block=8)
    assert [len(r.prompt_token_ids) for r in back] == [len(r.prompt_token_ids) for r in trace]
    assert [r.max_tokens for r in back] == [r.max_tokens for r in trace]
    assert [r.arrival_time for r in back] == pytest.approx([r.arrival_time for r in trace])

    def full_blocks_shared(a, b) -> int:  # what a prefix cache of 8-token blocks shares
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n // 8

    def sharing(t: Trace) -> list[int]:
        prompts = [r.prompt_token_ids for r in t]
        return [full_blocks_shared(p, q) for i, p in enumerate(prompts) for q in prompts[:i]]

    assert any(sharing(trace))  # the sessions' system prompts: some sharing to keep
    assert sharing(back) == sharing(trace)


def test_a_follow_up_turn_cannot_be_written_as_mooncake(tmp_path):
    trace = Trace((_request(0, 0.0, [1, 2], 1), _request(1, 0.5, [3], 1, after="r0")))
    with pytest.raises(TraceError, match="request 'r1' continues 'r0' \\(a follow-up turn\\)"):
        write_mooncake(trace, tmp_path / "t.jsonl", hash_block=2)
    assert not (tmp_path / "t.jsonl").exists()
