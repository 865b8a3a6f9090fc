"""How the runner groups a step's rows into padded batches (no row pays for another's
length or context beyond what a batch of its own would cost). Costs are in tokens through
the weights, for the tiny model: a key costs 1 / (4 x 256) of a token, a group 16 tokens.
And that a step of several groups still writes the arena in place."""

from __future__ import annotations

import mlx.core as mx

from allocators.free_list import FreeListAllocator
from harness.engine.kv_cache import KVArena
from harness.engine.model_runner import ModelRunner, Row
from harness.engine.step_shape import GROUP_COST, group_rows

KEY = 1 / 1024


def rows(*specs: tuple[int, int]) -> tuple[list[int], list[int]]:
    """Rows of (new tokens, cached context): their queries and contexts."""
    return [n for n, _ in specs], [n + start for n, start in specs]


def test_a_long_prompt_is_not_padded_with_short_ones():
    """Seven 16-token prompts batch together (each adds 16.25 < 32.25 alone); the 1024-token
    one alone costs 16 + 2048, padding the seven to it 16 + 8 x 2048."""
    assert GROUP_COST == 16
    assert group_rows(*rows((1024, 0), *[(16, 0)] * 7), KEY) == [[1, 2, 3, 4, 5, 6, 7], [0]]


def test_one_long_context_decode_reads_alone():
    """31 decodes at context 64 and one at 3000: together 16 + 32 x 3.93 = 142, apart
    16 + 31 x 1.06 plus 16 + 3.93 = 69."""
    assert group_rows(*rows(*[(1, 63)] * 31, (1, 2999)), KEY) == [list(range(31)), [31]]


def test_rows_of_similar_shape_share_one_batch():
    decodes = [(1, 100 + i) for i in range(32)]
    assert group_rows(*rows(*decodes), KEY) == [list(range(32))]


def test_decodes_are_not_padded_to_a_prefill():
    """Eight decodes at context 51 and a 64-token prompt: together 16 + 9 x 64 x 1.06,
    apart 24.4 + 84."""
    assert group_rows(*rows(*[(1, 50)] * 8, (64, 0)), KEY) == [list(range(8)), [8]]


def test_a_step_of_two_row_groups_writes_the_arena_in_place(model):
    """Two groups in one step (a long context decode reads alone): the second group's
    writes must not copy a layer of the arena (MLX copies an array written while a read of
    it is pending). A 4096-block arena's layer is 33.6 MB; the step needs far less."""
    alloc = FreeListAllocator(num_blocks=4096, block_size=16)
    arena = KVArena.for_model(model, alloc.num_blocks, alloc.block_size)
    runner = ModelRunner(model, arena)
    layer = arena.keys[0].nbytes
    specs = [*[(str(i), 64) for i in range(31)], ("long", 3000)]
    for rid, n in specs:
        alloc.allocate(rid, n)
    step = [Row([1], n - 1, alloc.block_table(rid)) for rid, n in specs]
    assert len(group_rows([1] * len(specs), [n for _, n in specs], runner.key_cost)) == 2
    runner.run(step)  # first-time allocations are not the point
    mx.eval(arena.keys, arena.values)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    runner.run(step)
    assert mx.get_peak_memory() - before < layer / 2
