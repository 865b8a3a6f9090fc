"""python -m harness.bench kv_quant: its agreement definition by hand, and one small run."""

from __future__ import annotations

from harness.bench import kv_quant


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
    # tiny, float32, blocks of 16: 65,536 / 18,432 / 10,240 bytes (tests/engine/test_kv_quant.py)
    assert [rows[b][4] for b in ("16", "8", "4")] == ["16384", "58254", "104857"]
    budget = 16 * 65536
    assert [rows[b][5] for b in ("16", "8", "4")] == [
        str(budget // 65536),
        str(budget // 18432),
        str(budget // 10240),
    ]
    assert lines[-1].startswith("note: llama-tiny-random-seed0 has random weights")
