"""The step rows' work counts (``row_groups``, ``query_tokens_padded``, ``kv_slots_read``,
``kv_slots_attended``, ``block_copies``) on scenarios small enough to count by hand.

Tiny model (hidden 256): a key costs 1/1024 of a token through the weights, a padded batch
16 tokens (``step_shape.GROUP_COST``); block size 4 throughout."""

from __future__ import annotations

from functools import partial

from allocators.contiguous import ContiguousAllocator
from allocators.free_list import FreeListAllocator
from harness.engine import build_engine
from harness.engine.sampling_params import SamplingParams
from schedulers.fcfs import FCFSScheduler

WORK = ("row_groups", "query_tokens_padded", "kv_slots_read", "kv_slots_attended")


def run(model, allocator, prompts: list[int], max_tokens: list[int]) -> list[dict]:
    """Step rows of greedy requests of ``prompts`` tokens, all added before the first step."""
    engine = build_engine(
        model,
        allocator,
        partial(FCFSScheduler, max_num_seqs=8),
        block_size=4,
        num_blocks=64,
    )
    for i, (n, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        engine.add_request(str(i), list(range(1, n + 1)), params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.recorder.steps


def work(step: dict) -> tuple[int, ...]:
    return tuple(step[c] for c in WORK)


def test_rows_of_3_and_7_tokens_share_a_group_and_pad_4_query_tokens(model):
    """Together 16 + 2 x 7 x (1 + 7/1024) = 30.1 beats apart 16 + 3.0 + 16 + 7.0 = 42.1.
    Prefill: 2 rows x 7 = 14 query positions for 10 tokens (the 3-token row pads 4); the
    longest context, 7, needs ceil(7/4) = 2 blocks, read by both rows: 2 x 2 x 4 = 16 slots
    for contexts 3 + 7 = 10. Decode: positions 3 and 7, contexts 4 and 8: 2 x 1 query
    positions, ceil(8/4) = 2 blocks each: 16 slots read for 12 attended."""
    steps = run(model, FreeListAllocator, [3, 7], [2, 2])
    assert [work(s) for s in steps] == [(1, 14, 16, 10), (1, 2, 16, 12)]
    assert steps[0]["prefill_tokens"] == 10 and steps[1]["decode_tokens"] == 2
    assert [s["block_copies"] for s in steps] == [0, 0]  # a free list never moves a block


def test_rows_of_3_and_200_tokens_run_as_two_groups_without_padding(model):
    """Together 16 + 2 x 200 x (1 + 200/1024) = 494 loses to apart 16 + 3.0 + 16 + 239.1 =
    274.1. Each row is its own group: 3 + 200 = 203 query positions, no padding; the short
    row reads ceil(3/4) = 1 block, the long one ceil(200/4) = 50: (1 + 50) x 4 = 204 slots
    read for contexts 3 + 200 = 203 (one slot of the short row's block tail)."""
    steps = run(model, FreeListAllocator, [3, 200], [1, 1])
    assert [work(s) for s in steps] == [(2, 203, 204, 203)]


def test_a_relocated_region_counts_its_written_blocks_as_copies(model):
    """First fit, exact regions: prompt a (4 tokens) takes block 0, prompt b (3) block 1.
    Decode: a writes position 4 and needs 2 blocks, but block 1 is b's, so a moves to the
    first free run of 2 disjoint from its own, blocks 2-3: its one written block is copied
    (0 -> 2). b writes position 3, still in its block: no copy."""
    steps = run(model, partial(ContiguousAllocator, reserve="exact"), [4, 3], [2, 2])
    assert [s["block_copies"] for s in steps] == [0, 1]
    assert steps[1]["swap_out_blocks"] == steps[1]["preempted"] == 0


def test_the_cost_model_counts_of_two_rows_sharing_a_group(model):
    """The 3- and 7-token rows above, one group: the prefill scores 2 rows x 7 queries x
    8 keys read (2 blocks of 4) = 112 query-key pairs and runs the LM head on 2 positions
    (each row's last); no row feeds one token. The decode: 2 x 1 x 8 = 16 pairs, 2 logits,
    both rows single-token."""
    steps = run(model, FreeListAllocator, [3, 7], [2, 2])
    counts = [(s["attention_pairs"], s["logit_rows"], s["single_token_rows"]) for s in steps]
    assert counts == [(112, 2, 0), (16, 2, 2)]
    assert [s["draft_rounds"] + s["draft_tokens"] for s in steps] == [0, 0]
