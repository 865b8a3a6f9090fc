"""How the runner groups a step's rows into padded batches (no row pays for another's
length or context beyond what a batch of its own would cost). Costs are in tokens through
the weights, for the tiny model: a key costs 1 / (4 x 256) of a token, a group 16 tokens."""

from __future__ import annotations

from harness.engine.model_runner import GROUP_COST, Row, group_rows

KEY = 1 / 1024


def rows(*specs: tuple[int, int]) -> list[Row]:
    """Rows of (new tokens, cached context)."""
    return [Row([0] * n, start, []) for n, start in specs]


def test_a_long_prompt_is_not_padded_with_short_ones():
    """Seven 16-token prompts batch together (each adds 16.25 < 32.25 alone); the 1024-token
    one alone costs 16 + 2048, padding the seven to it 16 + 8 x 2048."""
    assert GROUP_COST == 16
    assert group_rows(rows((1024, 0), *[(16, 0)] * 7), KEY) == [[1, 2, 3, 4, 5, 6, 7], [0]]


def test_one_long_context_decode_reads_alone():
    """31 decodes at context 64 and one at 3000: together 16 + 32 x 3.93 = 142, apart
    16 + 31 x 1.06 plus 16 + 3.93 = 69."""
    assert group_rows(rows(*[(1, 63)] * 31, (1, 2999)), KEY) == [list(range(31)), [31]]


def test_rows_of_similar_shape_share_one_batch():
    decodes = [(1, 100 + i) for i in range(32)]
    assert group_rows(rows(*decodes), KEY) == [list(range(32))]


def test_decodes_are_not_padded_to_a_prefill():
    """Eight decodes at context 51 and a 64-token prompt: together 16 + 9 x 64 x 1.06,
    apart 24.4 + 84."""
    assert group_rows(rows(*[(1, 50)] * 8, (64, 0)), KEY) == [list(range(8)), [8]]
