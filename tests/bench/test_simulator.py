"""python -m harness.bench simulator: its fit error, computed by hand."""

import pandas as pd
import pytest

from harness.analysis.metrics import STEP_SCHEMA
from harness.bench.simulator import priced_error
from harness.costmodel.profile import MeasuredProfile


def test_priced_error_is_the_profiles_price_of_the_real_steps_over_their_measured_time() -> None:
    # decode: 1 ms a step + 0.5 ms a row; a block copy 0.25 ms, whatever the kind.
    profile = MeasuredProfile(
        "hand.json",
        {
            "kinds": {"decode": {"coefficients": {"step": 1e-3, "batch_size": 5e-4}}},
            "moves": {"block_copies": 2.5e-4},
        },
    )
    steps = pd.DataFrame([{name: 0 for name in STEP_SCHEMA}] * 2)
    # Two decode steps of 2 and 4 rows, one row group each; the second copies 4 blocks.
    steps["batch_size"] = steps["single_token_rows"] = [2, 4]
    steps["row_groups"] = [1, 1]
    steps["block_copies"] = [0, 4]
    steps["duration"] = [4e-3, 6e-3]  # measured: 10 ms in all
    # priced: (1 + 2 x 0.5) + (1 + 4 x 0.5 + 4 x 0.25) = 2 + 4 = 6 ms; 6 / 10 - 1
    assert priced_error(steps, profile) == pytest.approx(-0.4)
