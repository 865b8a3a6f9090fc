"""Two kvbench sweeps with one sweep_id, as two real processes: the second is refused naming
the holder, or waits behind it with sweep_wait=true; a job's folder appears only whole."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, TINY

from harness.analysis import results

HANG = 300  # a hang guard for a stopped sweep to exit, not a timing figure
SWEEP = "results/default/multiruns/same"


def start(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    """``kvbench -m`` in the sweep ``same`` at tiny sizes, its output piped, line by line."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli.run", "-m", *TINY, "warmup=0", "sweep_id=same",
         *overrides],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip


def replaying(proc: subprocess.Popen) -> None:
    """Read ``proc``'s log until its job's replay has begun (the sweep's lock is held)."""
    for line in proc.stdout:
        if "replaying 20000 requests" in line:
            return
    raise AssertionError(f"the sweep ended before replaying:\n{proc.stderr.read()}")


def visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


@pytest.mark.slow  # two kvbench processes: ~20 s here
def test_a_second_sweep_in_the_same_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    # radix's job still running when the second starts; buddy's after it
    holder = start(tmp_path, "allocator=radix,buddy", "trace.num_requests=20000")
    try:
        replaying(holder)
        sweep = tmp_path / SWEEP
        assert visible(sweep) == ["jobs.json", "multirun.yaml"]  # no job's folder yet
        second = start(tmp_path, "allocator=free_list,radix")
        out, err = second.communicate(timeout=HANG)
        assert second.returncode == 2, out + err
        assert err.startswith(
            f"kvbench: error: {SWEEP} is in use by another sweep (pid {holder.pid} on "
            f"{socket.gethostname()}, started "
        )
        assert err.count("\n") == 1 and "sweep_wait=true" in err
        assert "replaying" not in out  # it ran no job
        assert visible(sweep) == ["jobs.json", "multirun.yaml"]
        holder.send_signal(signal.SIGTERM)
        holder.communicate(timeout=HANG)
    finally:
        holder.kill()
    assert holder.returncode == 143
    # the stopped job's folder moved into place whole: its rows and its failure mark
    (job,) = [name for name in visible(sweep) if name.startswith("allocator=")]
    assert job.startswith("allocator=radix,")
    assert (sweep / job / results.FAILED_FILE).read_text().startswith("Terminated")
    assert (sweep / job / results.REQUESTS_FILE).exists()
    assert "free_list" not in (sweep / job / "run.log").read_text()
    # kvbench-compare's list: the stopped job, and the one the sweep never reached
    assert [(Path(d).name.split(",")[0], why.split(":")[0]) for d, why in
            results.unfinished(sweep)] == [("allocator=radix", "failed"),
                                           ("allocator=buddy", "not started")]  # fmt: skip


@pytest.mark.slow  # two kvbench processes: ~25 s here
def test_with_sweep_wait_the_second_sweep_runs_once_the_first_ends(tmp_path: Path) -> None:
    holder = start(tmp_path, "allocator=radix", "trace.num_requests=20000")
    try:
        replaying(holder)
        second = start(tmp_path, "allocator=free_list", "sweep_wait=true")
        try:
            for line in second.stderr:
                if line.startswith("kvbench: waiting for"):
                    break
            assert f"in use by pid {holder.pid} on " in line
            assert second.poll() is None  # still waiting: the holder has not ended
            holder.send_signal(signal.SIGTERM)
            holder.communicate(timeout=HANG)
            out, err = second.communicate(timeout=HANG)
        finally:
            second.kill()
    finally:
        holder.kill()
    assert holder.returncode == 143 and second.returncode == 0, err
    sweep = tmp_path / SWEEP
    finished = results.load(sweep)
    assert finished["allocator"].tolist() == ["free_list"]
    assert [why.split(":")[0] for _, why in results.unfinished(sweep)] == ["failed"]
