"""python -m harness.bench kv_quant: its agreement definition by hand, and one small run."""

from __future__ import annotations

from harness.bench import kv_quant
from harness.platform.models import random_model


def test_agreement_counts_the_prefix_and_every_equal_position():
    reference = [1, 2, 3, 4, 5, 6, 7, 8]
    # differs first at position 2; equal at 0, 1, 4, 5 and 7
    assert kv_quant.agreement([1, 2, 9, 9, 5, 6, 0, 8], reference) == (2 / 8, 5 / 8)
    assert kv_quant.agreement(reference, reference) == (1.0, 1.0)


def test_a_small_run_prints_a_row_per_kv_bits(capsys):
    kv_quant.main(
        ["--model", "tiny", "--prompts", "2", "--prompt-len", "16", "--tokens", "8"]
        + ["--requests", "6"]
        + ["--budget-blocks", "16"]
    )
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("kv_bits")))
    rows = {r.split()[0]: r.split() for r in lines[header + 2 : header + 5]}
    assert set(rows) == {"16", "8", "4"}
    # 16 bits against itself: every token agrees, the distributions are the same.
    assert rows["16"][1:4] == ["1.000", "1.000", "0.00e+00"]
    # A block of 16 tokens holds K and V of every layer and KV head: 16 x 4 layers x 2 x 2
    # heads x 64 dims = 16,384 values, 4 bytes each in tiny's float32; quantized, bits / 8
    # bytes each plus a float32 scale and bias per group of 64 (kv_group_size).
    shape = random_model("llama", "tiny").shape()
    values = 16 * shape["num_layers"] * 2 * shape["num_kv_heads"] * shape["head_dim"]
    block = {"16": values * 4, "8": values * (1 + 8 / 64), "4": values * (0.5 + 8 / 64)}
    assert block == {"16": 65_536, "8": 18_432, "4": 10_240}
    assert [rows[b][4] for b in block] == [str(int(2**30 // n)) for n in block.values()]
    budget = 16 * block["16"]  # --budget-blocks 16, in 16-bit blocks' bytes
    assert [rows[b][5] for b in block] == [str(int(budget // n)) for n in block.values()]
    assert lines[-1].startswith("note: llama-tiny-random-seed0 has random weights")
