"""The per-step KV breakdown (the vLLM paper's Fig. 2) against values computed by hand.

Each scenario is small enough to count on paper; the expected rows are written out from the
reasoning in the comments, never from the recorder's own formulas. Block size 16, greedy,
EOS ignored: a request with prompt P and max_tokens M writes P + M - 1 KV slots (its last
token is sampled and returned, never fed back), so that is what its allocation ever fills.
"""

from __future__ import annotations

from functools import partial

import pytest

from allocators.buddy import BuddyAllocator
from allocators.contiguous import ContiguousAllocator
from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from harness.engine import build_engine
from harness.engine.sampling_params import SamplingParams
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler

PARTS = ("slots_tokens", "slots_future", "slots_internal", "slots_external")


def _engine(model, allocator, *, num_blocks, scheduler=FCFSScheduler, max_model_len=256):
    return build_engine(
        model,
        allocator,
        scheduler,
        block_size=16,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )


def _run(engine, prompts, max_tokens, *, later=()):
    """Add ``prompts`` now and each of ``later`` (step index, prompt) before that step."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    later = dict(later)
    step = 0
    while engine.has_unfinished_requests() or later:
        if step in later:
            engine.add_request(f"late{step}", later.pop(step), params)
        engine.step()
        step += 1
    return [tuple(r[p] for p in PARTS) for r in engine.recorder.steps]


def _prompt(n, start=1):
    return list(range(start, start + n))


def test_contiguous_max_len_books_the_reservation_as_future_then_internal(model):
    """3 requests, prompt 40, max_tokens 60, regions of max_len 256 (16 blocks each).

    Each request fills 40 + 60 - 1 = 99 of its 256 slots: 157 slots per region are never
    used (3 x 157 = 471 internal at every step). At step k the three have written 40 + k
    slots each and will write 99 - (40 + k) more."""
    engine = _engine(
        model, partial(ContiguousAllocator, reserve="max_len", max_len=256), num_blocks=64
    )
    rows = _run(engine, [_prompt(40, s) for s in (1, 100, 200)], 60)
    assert len(rows) == 60
    assert rows[0] == (120, 177, 471, 0)
    assert rows[1] == (123, 174, 471, 0)
    assert rows == [(3 * (40 + k), 3 * (59 - k), 471, 0) for k in range(60)]


def test_contiguous_oracle_reserves_the_true_length_so_only_block_tails_are_waste(model):
    """Same requests, contiguous reserving the scheduler's expect hint (Orca (Oracle)): each
    region is sized for the 99 slots the request will fill, 7 blocks (112 slots), up front.
    At step k: tokens 3 x (40 + k), future 3 x (59 - k), internal 3 x (112 - 99) = 39, all
    block tail; it never grows or moves."""
    engine = _engine(model, partial(ContiguousAllocator, reserve="oracle"), num_blocks=64)
    rows = _run(engine, [_prompt(40, s) for s in (1, 100, 200)], 60)
    assert rows == [(3 * (40 + k), 3 * (59 - k), 39, 0) for k in range(60)]
    alloc = engine.scheduler.allocator
    assert alloc.stats().relocations == 0
    assert alloc.blocks_needed("r0", 40) == 3  # finished: its hint is forgotten


def test_buddy_books_region_rounding_as_future_until_it_is_outgrown(model):
    """Same requests, buddy: 40 tokens need 3 blocks, a region of 4 (64 slots) is taken.

    Steps 0..24 (written 40 + k <= 64): the region fills up to 64 before it must grow, so
    future = 3 x (64 - 40 - k) and internal = 0. From step 25 (65 slots) the region is 8
    blocks (128 slots) of which 99 are ever filled: internal 3 x 29 = 87."""
    engine = _engine(model, BuddyAllocator, num_blocks=64)
    rows = _run(engine, [_prompt(40, s) for s in (1, 100, 200)], 60)
    assert rows[1] == (123, 69, 0, 0)
    want = [
        (3 * (40 + k), 3 * (64 - 40 - k), 0, 0) if k <= 24 else (3 * (40 + k), 3 * (59 - k), 87, 0)
        for k in range(60)
    ]
    assert rows == want


def test_one_token_requests_leave_block_tails_as_internal_waste(model):
    """4 prompts of 20 tokens, max_tokens 1: one step, 2 blocks (32 slots) each. The step
    writes all 80 prompt slots and nothing is ever written after it: future 0, and the 4 x
    12 unused block tails are internal waste."""
    engine = _engine(model, FreeListAllocator, num_blocks=64)
    rows = _run(engine, [_prompt(20, s) for s in (1, 30, 60, 90)], 1)
    assert rows == [(80, 0, 48, 0)]


def test_chunked_prefill_counts_each_chunk_when_it_is_written(model):
    """One 300-token prompt in 64-token chunks, max_tokens 3. Admission allocates the whole
    prompt (19 blocks, 304 slots); the request writes 300 + 3 - 1 = 302 slots in all, so 2
    slots are internal throughout. Written after each step: 64, 128, 192, 256, 300 (the last
    chunk, 44 tokens), then one decode slot per step: 301, 302."""
    scheduler = partial(ChunkedPrefillScheduler, max_chunk=64, max_num_batched_tokens=64)
    engine = _engine(
        model, FreeListAllocator, num_blocks=64, scheduler=scheduler, max_model_len=512
    )
    rows = _run(engine, [_prompt(300)], 3)
    written = [64, 128, 192, 256, 300, 301, 302]
    assert rows == [(w, 302 - w, 2, 0) for w in written]
    split = [(r["prefill_tokens"], r["decode_tokens"]) for r in engine.recorder.steps]
    assert split == [(64, 0), (64, 0), (64, 0), (64, 0), (44, 0), (0, 1), (0, 1)]


def test_a_one_token_prompt_chunk_is_prefill_not_decode(model):
    """A 65-token prompt in 64-token chunks ends with a 1-token chunk: still prefill."""
    scheduler = partial(ChunkedPrefillScheduler, max_chunk=64, max_num_batched_tokens=64)
    engine = _engine(model, FreeListAllocator, num_blocks=64, scheduler=scheduler)
    _run(engine, [_prompt(65)], 2)
    split = [(r["prefill_tokens"], r["decode_tokens"]) for r in engine.recorder.steps]
    assert split == [(64, 0), (1, 0), (0, 1)]


def test_radix_counts_a_shared_block_once(model):
    """A (prompt 40, max_tokens 4) runs; B (A's first 32 tokens + 8 of its own) arrives at
    step 1 and shares A's two full blocks. Step 1: A has written 41, B 40 of which 32 are
    A's: 49 token slots in 3 + 1 blocks (64 slots). A fills 43 of its 48 slots, B 43 of its
    48 (two shared + one own): future A 2 + B 3; internal = the two last blocks' 5 unused
    slots each."""
    engine = _engine(model, RadixAllocator, num_blocks=64)
    a = _prompt(40)
    b = a[:32] + _prompt(8, 500)
    rows = _run(engine, [a], 4, later=[(1, b)])
    assert rows[0] == (40, 3, 5, 0)  # A alone: 3 blocks, fills 43
    assert rows[1] == (49, 5, 10, 0)
    assert rows[2] == (51, 3, 10, 0)  # both decode
    assert rows[3] == (53, 1, 10, 0)  # A's last step: it has written 43
    assert rows[4] == (43, 0, 5, 0)  # B alone, the shared blocks now its own
    assert len(rows) == 5


def test_external_fragmentation_is_free_memory_the_next_request_cannot_use(model):
    """Regions of max_len 256 (16 blocks) in an arena of 40 blocks: two requests fit, the
    third waits while the 8 free blocks cannot hold its region (8 x 16 = 128 slots)."""
    engine = _engine(
        model, partial(ContiguousAllocator, reserve="max_len", max_len=256), num_blocks=40
    )
    _run(engine, [_prompt(40, s) for s in (1, 100, 200)], 3)
    steps = engine.recorder.steps
    first = steps[0]
    assert (first["num_running"], first["num_waiting"]) == (2, 1)
    assert first["slots_external"] == 128 and first["blocks_free"] == 8
    assert first["external_fragmentation"] == pytest.approx(1.0)
    last = steps[-1]  # the third runs alone: nobody waits, nothing is unusable
    assert (last["num_waiting"], last["slots_external"], last["external_fragmentation"]) == (
        0,
        0,
        0.0,
    )


def test_slots_freed_by_preemption_were_never_future(model):
    """Free list of 5 blocks, two prompts of 30 (2 blocks each), max_tokens 12 (41 slots, 3
    blocks each: both cannot finish together).

    Steps 0-2: both decode up to 32 written slots (2 blocks full). Step 3: r0 takes the last
    block; r1 cannot grow and is preempted (recompute) having written 32: the slots it held
    were all written, so it adds no future. r0 fills 41 of its 48 slots (7 internal). r1
    waits for 3 free blocks (30 + 3 tokens), which exist once r0 finishes at step 11; from
    step 12 it recomputes 33 slots and decodes to 41, in 3 blocks (7 internal)."""
    engine = _engine(model, FreeListAllocator, num_blocks=5)
    rows = _run(engine, [_prompt(30, 1), _prompt(30, 100)], 12)
    want = [(60, 4, 0, 0), (62, 2, 0, 0), (64, 0, 0, 0)]
    want += [(30 + k, 11 - k, 7, 0) for k in range(3, 12)]  # r0 alone, written 33..41
    want += [(33 + j, 8 - j, 7, 0) for j in range(9)]  # r1 recomputed, written 33..41
    assert rows == want
    preempted = [r["preempted"] for r in engine.recorder.steps]
    assert preempted == [0, 0, 0, 1] + [0] * 17
