"""A multirun checks every job's config before its first job runs."""

from __future__ import annotations

from pathlib import Path


def test_a_bad_value_in_a_later_job_fails_before_the_first_job_runs(kvbench, tmp_path: Path):
    proc = kvbench("-m", "sampling.top_p=0.9,2", check=False)
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("kvbench: error: sampling.top_p=2 is invalid: it must be in (0, 1]")
    assert line.endswith("(job 2 of 2: trace=smoke engine.num_blocks=64 progress=false "
                         "sampling.top_p=2)")  # fmt: skip
    assert not list(tmp_path.rglob("requests.parquet"))  # no job ran
