"""A measured profile's pricing, its file's checks, and the fit, on values computed by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.analysis.metrics import STEP_SCHEMA
from harness.costmodel.fit import fit_kinds, nnls, residuals
from harness.costmodel.profile import FORMAT, VERSION, ProfileError, load, save
from harness.costmodel.work import COLUMNS, PRICED, StepWork


def profile_data(**kinds) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "measured",
        "model": {"name": "toy", "fingerprint": "f"},
        "block_size": 16,
        "features": list(PRICED),
        "kinds": {k: {"coefficients": c} for k, c in kinds.items()},
        "moves": {"block_copies": 0.001, "swap_blocks": 0.01},
    }


@pytest.fixture
def saved(tmp_path):
    def write(data: dict):
        path = tmp_path / "profile.json"
        save(data, path)
        return path

    return write


def test_a_step_is_priced_by_its_kinds_line_plus_its_block_moves(saved):
    """Decode: 2 ms + 0.5 ms x 4 rows + 1 ms per block copied (2) = 6 ms. Prefill:
    10 ms + 0.1 ms x 100 query tokens + 10 ms per block swapped (1) = 30 ms. A step that ran
    no row pays its moves alone: 3 copies (2 of them the draft's) = 3 ms."""
    p = load(
        saved(
            profile_data(
                decode={"step": 0.002, "batch_size": 0.0005},
                prefill={"step": 0.01, "query_tokens_padded": 0.0001},
            )
        )
    )
    decode = StepWork(
        batch_size=4, row_groups=1, query_tokens_padded=4, single_token_rows=4, block_copies=2
    )
    prefill = StepWork(batch_size=1, row_groups=1, query_tokens_padded=100, swap_in_blocks=1)
    assert decode.kind == "decode" and prefill.kind == "prefill"
    assert p.predict(decode) == pytest.approx(0.006)
    assert p.predict(prefill) == pytest.approx(0.030)
    idle = StepWork(block_copies=1, draft_block_copies=2)
    assert p.predict(idle) == pytest.approx(0.003)


def test_a_kind_the_profile_never_measured_names_the_calibration_that_runs_it(saved):
    p = load(saved(profile_data(decode={"step": 0.002})))
    verify = StepWork(
        batch_size=1, row_groups=1, query_tokens_padded=5, draft_rounds=4, draft_tokens=4
    )
    with pytest.raises(ProfileError, match="no 'verify' steps.*speculative=draft"):
        p.predict(verify)


def test_step_kinds():
    assert StepWork().kind == "idle"
    assert StepWork(batch_size=2, single_token_rows=1).kind == "mixed"
    assert StepWork(batch_size=2, single_token_rows=2, draft_rounds=1).kind == "verify"


def test_step_work_fields_are_steps_columns_priced_by_name():
    """Every field is an int column of steps.parquet; each priced count is the column of its
    name, but block_copies (the target's and the draft's) and swap_blocks (out and in)."""
    assert all(STEP_SCHEMA.get(c) == "int" for c in COLUMNS)
    sums = {"block_copies": ("block_copies", "draft_block_copies")}
    sums["swap_blocks"] = ("swap_out_blocks", "swap_in_blocks")
    for i, name in enumerate(PRICED):
        for column in sums.get(name, (name,)):
            assert StepWork(**{column: 7}).vector() == tuple(7 * (j == i) for j in range(10))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="other"), "field 'format'"),
        (lambda d: d.update(version=99), "field 'version' is 99"),
        (lambda d: d.pop("model"), "field 'model' is missing"),
        (lambda d: d.update(kind="guess"), "field 'kind' is 'guess'"),
        (lambda d: d["kinds"].update(warmup={"coefficients": {}}), "'warmup'"),
        (lambda d: d["kinds"]["decode"]["coefficients"].update(flops=1.0), "flops"),
    ],
)
def test_a_bad_profile_names_its_file_and_field(saved, edit, message):
    data = profile_data(decode={"step": 0.002})
    edit(data)
    path = saved(data)
    with pytest.raises(ProfileError, match=message) as e:
        load(path)
    assert str(path) in str(e.value)


def test_a_missing_or_unreadable_profile_says_how_to_make_one(tmp_path):
    with pytest.raises(ProfileError, match="no such file; write one with kvbench-calibrate"):
        load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not a JSON profile"):
        load(tmp_path / "bad.json")


def test_a_saved_profile_is_json_a_reader_can_load_again(saved):
    data = profile_data(decode={"step": 0.002})
    assert json.loads(saved(data).read_text()) == data


def test_nnls_keeps_coefficients_non_negative():
    """b = a @ (1, -1): unconstrained least squares would give -1; with x >= 0 the second
    coefficient is 0 and the first the least-squares fit of b on a's first column alone:
    a = [[1, 0], [0, 1], [1, 1]], b = (1, -1, 0): x1 = (1 + 0) / (1 + 1) = 0.5."""
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([1.0, -1.0, 0.0])
    assert nnls(a, b) == pytest.approx([0.5, 0.0])


def test_the_fit_recovers_the_costs_that_made_the_steps():
    """Decode steps made by 1 ms + 0.2 ms per row + 0.01 us per KV slot read, plus 1 ms per
    block copied (the moves are priced apart): the fit gives those coefficients back and
    zero residuals."""
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(40):
        rows, kv, copies = (
            int(rng.integers(1, 33)),
            int(rng.integers(16, 4096)),
            int(rng.integers(0, 3)),
        )
        work = StepWork(
            batch_size=rows,
            row_groups=1,
            query_tokens_padded=rows,
            kv_slots_read=kv,
            logit_rows=rows,
            single_token_rows=rows,
            block_copies=copies,
        )
        steps.append((work, 0.001 + 0.0002 * rows + 1e-8 * kv + 0.001 * copies))
    fitted = fit_kinds(steps, {"block_copies": 0.001})
    c = fitted["decode"]["coefficients"]
    assert c["step"] + c.get("row_groups", 0) == pytest.approx(0.001, rel=1e-6)
    per_row = sum(c.get(n, 0) for n in ("batch_size", "query_tokens_padded", "logit_rows"))
    assert per_row == pytest.approx(0.0002, rel=1e-6)
    assert c["kv_slots_read"] == pytest.approx(1e-8, rel=1e-6)
    assert fitted["decode"]["residuals"]["p90_abs"] == pytest.approx(0, abs=1e-9)


def test_residuals_by_hand():
    """Predicted (1.1, 0.9, 2.0) against measured (1, 1, 2): relative errors +10 %, -10 %,
    0: median |err| 10 %, bias 0, total 4.0 / 4.0 - 1 = 0."""
    r = residuals(np.array([1.1, 0.9, 2.0]), np.array([1.0, 1.0, 2.0]))
    assert r["steps"] == 3
    assert r["median_abs"] == pytest.approx(0.1)
    assert r["bias"] == pytest.approx(0.0, abs=1e-12)
    assert r["total"] == pytest.approx(0.0, abs=1e-12)


def test_a_steps_table_row_gives_the_counts_it_recorded():
    row = {
        "batch_size": 3,
        "row_groups": 1,
        "query_tokens_padded": 5,
        "attention_pairs": 80,
        "kv_slots_read": 48,
        "logit_rows": 3,
        "block_copies": 1,
        "draft_block_copies": 2,
        "swap_out_blocks": 4,
        "swap_in_blocks": 1,
        "draft_rounds": 0,
        "draft_tokens": 0,
        "single_token_rows": 2,
        "kv_slots_attended": 40,
        "window_kv_slots_read": 24,
        "window_attention_pairs": 30,
        "window_swap_blocks": 6,
        "host_blocks_loaded": 3,
        "disk_blocks_loaded": 1,
        "host_blocks_written": 2,
        "disk_blocks_written": 0,
        "duration": 0.5,  # not work: left out
    }
    work = StepWork.from_row(row)
    recorded = {k: v for k, v in row.items() if k != "duration"}
    assert dict(zip(COLUMNS, work, strict=True)) == recorded
    assert (work.vector()[6:8], work.kind) == ((3, 5), "mixed")
    # A row recorded before the window columns existed: no window work.
    older = StepWork.from_row({k: v for k, v in row.items() if not k.startswith("window_")})
    assert (older.window_kv_slots_read, older.window_attention_pairs) == (0, 0)
    assert older.window_swap_blocks == 0
    assert older.vector() == work.vector()  # not among the priced counts
