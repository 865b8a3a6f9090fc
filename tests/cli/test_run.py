"""The main job: one run in-process, the kvbench command, sweeps on every local launcher, and
an interrupted sweep finished by a re-run."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import FakeTime

from harness.analysis import results
from harness.analysis.metrics import SUMMARY_KEYS, summarize
from harness.cli.run import SweepMismatchError, check, finished_run, run, run_id
from harness.engine.intake import OutputCutWarning

SWEEP_2X2 = ("allocator=free_list,radix", "scheduler=fcfs,chunked_prefill")


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9)
    return a == b


def assert_recomputes(run_dir: Path, summary: dict) -> None:
    """Every summary figure equals the figure recomputed from the run's own tables."""
    requests, steps = results.load_tables(run_dir)
    again = summarize(requests, steps, clock=summary["clock"])
    for key in SUMMARY_KEYS:
        assert same(summary[key], again[key]), (key, summary[key], again[key])


def test_run_writes_tables_and_summary(compose_cfg, tmp_path: Path) -> None:
    summary = run(compose_cfg(["allocator=radix"]), tmp_path, overrides=["allocator=radix"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["requests.parquet", "steps.parquet", "summary.json", "vllm_bench.json"]
    written = results.read_summary(tmp_path)
    assert set(written) == set(summary)
    assert all(same(written[k], summary[k]) for k in SUMMARY_KEYS)
    assert summary["clock"] == "virtual" and summary["completed"] == 6
    assert summary["num_requests"] == 6 and summary["overrides"] == ["allocator=radix"]
    assert summary["machine"]["blas"]["blas"] and summary["machine"]["mlx"]
    assert 0 <= summary["max_prefix_hit_rate"] <= 1
    assert_recomputes(tmp_path, summary)


def test_wall_clock_replays_in_real_time(compose_cfg, tmp_path: Path, monkeypatch) -> None:
    """On an injected wall clock that only sleeping moves (every step takes 0 s of it), the
    replay sleeps until each arrival: in all, exactly until the last, and every request
    arrives when the trace says."""
    fake = FakeTime()
    monkeypatch.setattr("harness.engine.clock.time", fake)
    cfg = compose_cfg(["engine.clock=wall", "warmup=0"])
    summary = run(cfg, tmp_path)
    requests, _ = results.load_tables(tmp_path)
    trace = {r.request_id: r.arrival_time for r in check(cfg)[0]}
    assert summary["clock"] == "wall"
    assert fake.slept == pytest.approx(max(trace.values())) and fake.slept > 0
    assert requests["arrival_time"].to_numpy() == pytest.approx(
        requests["request_id"].map(trace).to_numpy()
    )
    assert_recomputes(tmp_path, summary)


def test_kvbench_command_prints_the_summary(kvbench, tmp_path: Path) -> None:
    proc = kvbench("allocator=buddy")
    assert "TTFT (virtual clock)" in proc.stdout and "Requests completed / aborted" in proc.stdout
    (run_dir,) = (tmp_path / "results" / "default" / "runs").iterdir()
    assert f"results: {run_dir}" in proc.stdout
    assert (run_dir / ".hydra" / "overrides.yaml").exists()
    assert results.read_summary(run_dir)["choices"]["allocator"] == "buddy"


def test_sweep_2x2_and_results_load(kvbench, tmp_path: Path) -> None:
    kvbench("-m", *SWEEP_2X2, "sweep_id=s")
    table = results.load(tmp_path / "results")
    assert len(table) == 4
    pairs = set(zip(table["allocator"], table["scheduler"], strict=True))
    assert pairs == {(a, s) for a in ("free_list", "radix") for s in ("fcfs", "chunked_prefill")}
    for row in table.to_dict("records"):
        assert Path(row["run_dir"]).parent == tmp_path / "results/default/multiruns/s"
        assert row["completed"] == 6
        assert_recomputes(Path(row["run_dir"]), row)


def test_sweep_with_joblib_launcher(kvbench, tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="kvbench[joblib] needed")
    proc = kvbench(
        "-m", "allocator=free_list,contiguous", "trace.rate=4,16", "hydra/launcher=joblib"
    )  # fmt: skip
    assert "jobs in parallel" in proc.stdout and "contention" in proc.stdout  # Hydra's log
    table = results.load(tmp_path / "results")
    assert len(table) == 4
    assert sorted(table["trace.rate"]) == [4, 4, 16, 16]
    assert (table["completed"] == 6).all()


@pytest.mark.slow  # starting a local Ray instance takes ~20 s here
def test_sweep_with_ray_launcher_on_a_local_instance(kvbench, tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="kvbench[ray] needed")
    kvbench(
        "-m",
        "allocator=free_list,buddy",
        "hydra/launcher=ray",
        "hydra.launcher.ray.init.num_cpus=2",
    )
    table = results.load(tmp_path / "results")
    assert sorted(table["allocator"]) == ["buddy", "free_list"]
    for row in table.to_dict("records"):
        assert row["completed"] == 6
        assert_recomputes(Path(row["run_dir"]), row)


# How long an interrupted run may take to save its rows and exit: a hang guard, not a timing
# figure.
HANG = 300


def _interruptible() -> None:
    """In the child, before exec: SIGINT as a terminal's Ctrl-C delivers it. A test suite
    started in the background by a non-interactive shell (``pytest &``, ``nohup``) inherits
    SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the interrupt
    would never land (both interrupt tests failed so in loaded runs started that way)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # a 4-job sweep of 40-request jobs, run about 1.5 times: ~30 s here
def test_interrupted_sweep_rerun_completes_only_missing_jobs(tmp_path: Path) -> None:
    from support import TINY, run_kvbench

    # Longer jobs (40 requests each) so the interrupt lands while the sweep is running.
    args = ["-m", *TINY, "trace.num_requests=40", *SWEEP_2X2, "sweep_id=s"]
    sweep = tmp_path / "results/default/multiruns/s"
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.cli.run", *args],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_interruptible,
    )
    try:
        deadline = time.monotonic() + 300
        while len(list(sweep.glob("*/summary.json"))) < 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "the sweep made no progress"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=HANG) != 0
    finally:
        proc.kill()
    before = {p.parent.name: p.stat().st_mtime_ns for p in sweep.glob("*/summary.json")}
    assert 2 <= len(before) < 4, f"interrupt landed too late: {sorted(before)}"

    rerun = run_kvbench(*args, cwd=tmp_path)
    after = {p.parent.name: p.stat().st_mtime_ns for p in sweep.glob("*/summary.json")}
    assert len(after) == 4
    assert all(after[name] == mtime for name, mtime in before.items())  # not re-run
    assert rerun.stdout.count("skipped:") == len(before)
    assert rerun.stdout.count("Requests completed / aborted") == 4 - len(before)
    assert len(results.load(sweep)) == 4


@pytest.mark.parametrize(
    ("sig", "said", "code"),
    [(signal.SIGINT, "interrupted", 130), (signal.SIGTERM, "terminated", 143)],
    ids=["ctrl_c", "sigterm"],
)
def test_a_stop_says_in_one_line_what_was_kept_and_exits_128_plus_signal(
    tmp_path: Path, sig: int, said: str, code: int
) -> None:
    # SIGTERM: kill, timeout, a batch scheduler's time limit; it reaches a run that ignores
    # SIGINT (started in the background), and it keeps the rows as Ctrl-C does.
    from support import ROOT, TINY

    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    args = [*TINY, "trace.num_requests=20000", "warmup=0"]  # still replaying when interrupted
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.cli.run", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_interruptible,
    )
    try:
        for line in proc.stdout:  # Hydra's log, flushed line by line
            if "replaying 20000 requests" in line:
                break
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=HANG)
    finally:
        proc.kill()
    (run_dir,) = (tmp_path / "results/default/runs").iterdir()
    kept = len(results.load_tables(run_dir)[0])
    assert proc.returncode == code
    assert err == (
        f"kvbench: {said}: the {kept} finished requests' rows kept in "
        f"{run_dir / 'requests.parquet'} and steps.parquet; no summary.json, so a sweep re-run "
        "repeats this run\n"
    )
    assert results.read_summary(run_dir) is None


def test_a_folder_holding_other_overrides_is_never_skipped(tmp_path: Path) -> None:
    summary = {"overrides": ["allocator=radix", "sweep_id=a"], "clock": "virtual"}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert finished_run(tmp_path, ["sweep_id=b", "allocator=radix"], ignore=["sweep_id"])
    assert finished_run(tmp_path / "missing", ["allocator=radix"]) is None
    with pytest.raises(SweepMismatchError, match="new sweep_id"):
        finished_run(tmp_path, ["allocator=buddy"], ignore=["sweep_id"])


def test_run_ids_differ_within_one_second() -> None:
    # The folder name is the start time plus random digits: 50 ids in well under a second.
    ids = {run_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith(time.strftime("%Y-%m-%d_")) for i in ids)


@pytest.mark.slow  # two kvbench processes side by side: ~20 s here
def test_two_runs_started_together_write_two_folders(tmp_path: Path) -> None:
    from support import TINY

    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "harness.cli.run", *TINY, f"allocator={name}"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("radix", "buddy")
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    runs = sorted((tmp_path / "results/default/runs").iterdir())
    assert len(runs) == 2
    chosen = {json.loads((r / "summary.json").read_text())["overrides"][-1] for r in runs}
    assert chosen == {"allocator=radix", "allocator=buddy"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("engine.num_blocks=0", r"engine\.num_blocks=0 must be at least 1"),
        ("engine.num_blocks=abc", r"engine\.num_blocks='abc' must be int"),
        ("trace=file trace.path=/no/such.jsonl", r"trace\.path='/no/such\.jsonl' is not a file"),
        ("+allocator.blok_size=3", r"allocator\.blok_size is not a parameter.*no options"),
        ("allocator=radix allocator.eviction=nope", r"allocator\.eviction='nope' must be one of"),
        ("kv_tier=host", r"kv_tier keeps blocks the prefix cache evicts.*use allocator=radix"),
        ("sampling.top_p=2", r"sampling\.top_p=2 is invalid: it must be in \(0, 1\]"),
        ("sampling=beam sampling.beam_width=0", r"sampling\.beam_width=0 is invalid: it must be"),
    ],
)
def test_a_wrong_setting_is_one_line_naming_it_and_exit_status_2(kvbench, override, message):
    proc = kvbench(*override.split(), check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvbench: error:")]
    assert re.search(message, line), line


def test_a_run_that_completes_nothing_counts_requests_by_abort_reason(kvbench) -> None:
    proc = kvbench("engine.max_model_len=8", check=False)  # every smoke prompt is longer
    assert proc.returncode == 1
    assert "n/a" not in proc.stdout  # no table of figures that do not exist
    assert re.fullmatch(
        r"kvbench: error: 0 of 6 requests completed: 6 aborted \(prompt of \d+-\d+ tokens "
        r"exceeds max_model_len=8\); see abort_reason in \S+requests\.parquet\n",
        proc.stderr,
    ), proc.stderr


@pytest.mark.parametrize("keep", [False, True])
def test_a_disk_tier_leaves_its_folder_behind_only_when_kept(kvbench, tmp_path, keep) -> None:
    kvbench(
        "allocator=radix",
        "kv_tier=host_disk",
        "kv_tier.host_blocks=1",
        "kv_tier.disk_blocks=16",
        f"kv_tier.keep={keep}",
        "engine.num_blocks=8",  # smoke's prompts need 2-3 blocks each: the cache evicts
    )
    (summary,) = tmp_path.glob("results/**/summary.json")
    folders = list(summary.parent.glob("kv-tier-*"))
    assert len(folders) == keep
    assert not keep or list(folders[0].glob("block-*.safetensors"))


def test_a_run_where_some_requests_abort_counts_them(kvbench) -> None:
    proc = kvbench("engine.max_model_len=30")  # smoke's prompts: 24, 28, 29, 32, 38, 40 tokens
    expected = (
        "3 of 6 requests completed: 3 aborted (prompt of 32-40 tokens exceeds max_model_len=30)"
    )
    assert expected in proc.stdout.splitlines()


@pytest.mark.parametrize(
    ("overrides", "knob"),
    [(["trace.num_requests=0"], "trace.num_requests=0"),
     (["trace=file", "trace.path=empty.jsonl"], "trace.path='empty.jsonl'")],
)  # fmt: skip
def test_an_empty_trace_names_its_knob_before_any_work(kvbench, tmp_path, overrides, knob):
    (tmp_path / "empty.jsonl").write_text("")
    proc = kvbench(*overrides, check=False)
    assert proc.returncode == 2
    assert proc.stderr == f"kvbench: error: the trace has no requests ({knob}): nothing to run\n"


def test_the_warm_up_leaves_the_measured_engine_clean(compose_cfg, tmp_path: Path) -> None:
    """The warm-up runs the trace's first prompts on a throwaway engine: the measured radix
    cache does not hold them, so those requests find no prefix hit (smoke prompts share
    none), and the first step holds no cached block."""
    summary = run(compose_cfg(["allocator=radix", "warmup=4"]), tmp_path)
    requests, steps = results.load_tables(tmp_path)
    assert summary["warmup_requests"] == 4 and summary["completed"] == 6
    assert (requests["cached_tokens"] == 0).all()
    assert steps["blocks_cached"].iloc[0] == 0


def test_a_replay_runs_without_the_cyclic_collector_and_warns_of_cycles_it_left(
    compose_cfg, tmp_path: Path, monkeypatch, caplog
) -> None:
    """While the trace replays the collector is off; a replay that makes reference cycles
    (here one a step, made by a wrapped ``engine.step``) gets them freed at its end and one
    warning that counts them: at least two objects a step."""
    import gc

    import harness.cli.run as run_module

    steps_seen = []
    real_replay = run_module.replay

    def replay(engine, *args, **kwargs):
        real_step = engine.step

        def step(*a, **k):
            steps_seen.append(gc.isenabled())
            a_, b_ = {}, {}
            a_["b"], b_["a"] = b_, a_  # a cycle of two, dropped at once
            return real_step(*a, **k)

        engine.step = step
        return real_replay(engine, *args, **kwargs)

    monkeypatch.setattr(run_module, "replay", replay)
    with caplog.at_level(logging.WARNING, logger="harness.cli.run"):
        summary = run(compose_cfg(["warmup=0"]), tmp_path)
    assert steps_seen and not any(steps_seen) and gc.isenabled()
    (warned,) = [r.getMessage() for r in caplog.records if "reference cycles" in r.getMessage()]
    # Two a step, and whatever another thread of the test process left meanwhile (a floor).
    assert int(re.search(r"left (\d+) objects", warned).group(1)) >= 2 * len(steps_seen)
    assert summary["completed"] == 6


def test_peak_memory_is_the_runs_own(compose_cfg, tmp_path: Path) -> None:
    """A small job after a large one in the same process reports its own peak: 2048 blocks
    of the tiny model are 128 MiB of KV, 64 blocks 4 MiB. MLX's peak counts every live array
    of the process, so arrays other tests keep (a session's model) are taken off; garbage
    that only the cyclic collector frees (arrays in cycles earlier tests left) goes first,
    as it goes when a run starts its replay."""
    import gc

    import mlx.core as mx

    gc.collect()
    held = mx.get_active_memory()
    big = run(compose_cfg(["engine.num_blocks=2048", "warmup=0"]), tmp_path / "big")
    small = run(compose_cfg(["engine.num_blocks=64", "warmup=0"]), tmp_path / "small")
    assert big["mlx_peak_bytes"] - held >= 128 * 2**20
    assert small["mlx_peak_bytes"] - held < 64 * 2**20


def test_a_failed_run_is_marked_failed_and_keeps_its_rows(
    compose_cfg, tmp_path: Path, monkeypatch
) -> None:
    import harness.cli.run

    def fail(engine, trace, **kwargs):
        engine.add_request("x", trace.requests[0].prompt_token_ids)
        while engine.has_unfinished_requests():
            engine.step()
        raise RuntimeError("the machine fell over")

    monkeypatch.setattr(harness.cli.run, "replay", fail)
    with pytest.raises(RuntimeError):
        run(compose_cfg(), tmp_path)
    assert (tmp_path / results.FAILED_FILE).read_text() == "RuntimeError: the machine fell over\n"
    assert results.read_summary(tmp_path) is None
    requests, _ = results.load_tables(tmp_path)
    assert requests["request_id"].tolist() == ["x"]


def test_a_setting_error_marks_the_folder_failed(compose_cfg, tmp_path: Path) -> None:
    from harness.cli.run import UsageError

    with pytest.raises(UsageError):
        run(compose_cfg(["trace=file", "trace.path=/no/such.jsonl"]), tmp_path)
    assert "is not a file" in (tmp_path / results.FAILED_FILE).read_text()


def test_summary_reports_the_prefix_bound_at_the_runs_block_size(compose_cfg, tmp_path: Path):
    """Two users of one 100-token system prompt: the second can reuse 100 tokens, but a
    cache of 32-token blocks shares only its 3 full blocks, 96 tokens."""
    from hydra.utils import instantiate

    shape = ["trace.num_system_prompts=1", "trace.users_per_prompt=2"]
    shape += ["trace.system_prompt_len=100", "engine.block_size=32"]
    cfg = compose_cfg(["trace=shared_prefix", *shape])
    summary = run(cfg, tmp_path)
    total = sum(len(r.prompt_token_ids) for r in instantiate(cfg.trace.generator))
    assert summary["max_prefix_hit_rate"] == pytest.approx(100 / total)
    assert summary["max_prefix_hit_rate_blocks"] == pytest.approx(96 / total)


def test_a_replay_can_sample(compose_cfg, tmp_path: Path) -> None:
    """sampling.* reaches every replayed request, with the trace's max_tokens and EOS
    ignored; the same seed gives every request the same length (rows are in finish order,
    which the measured step times decide, so they are compared by request)."""
    over = ["sampling.temperature=0.8", "sampling.top_p=0.9", "sampling.repetition_penalty=1.1"]
    first = run(compose_cfg([*over, "warmup=0"]), tmp_path / "a")
    second = run(compose_cfg([*over, "warmup=0"]), tmp_path / "b")
    assert first["completed"] == second["completed"] == 6
    a, _ = results.load_tables(tmp_path / "a")
    b, _ = results.load_tables(tmp_path / "b")
    lengths = [t.set_index("request_id")["output_tokens"].sort_index() for t in (a, b)]
    assert lengths[0].to_dict() == lengths[1].to_dict()


def test_the_sampling_node_builds_each_requests_params() -> None:
    from functools import partial

    from harness.cli.replay import sampling_params
    from harness.engine.sampling_params import SamplingParams
    from harness.workload.traces import TraceRequest

    req = TraceRequest("r", 0.0, (1, 2, 3), max_tokens=7)
    got = sampling_params(req, partial(SamplingParams, temperature=0.8, top_p=0.9))
    assert got == SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7, ignore_eos=True)
    assert sampling_params(req) == SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)


def test_a_replays_params_are_made_once_per_length_and_eos_and_shared() -> None:
    from harness.cli.replay import params_for
    from harness.engine.sampling_params import SamplingParams
    from harness.workload.traces import TraceRequest

    params = params_for()
    asks = [(7, True), (9, True), (7, True), (7, False), (9, True)]
    got = [
        params(TraceRequest(f"r{i}", 0.0, (1,), max_tokens=m, ignore_eos=e))
        for i, (m, e) in enumerate(asks)
    ]
    for p, (m, e) in zip(got, asks, strict=True):
        assert p == SamplingParams(
            temperature=0, max_tokens=m, ignore_eos=e, output_kind="final_only"
        )
    assert got[1] is got[4] and got[2] is not got[3]  # the first request's params are its own
    assert len({id(p) for p in got}) == 4


def test_a_timed_run_records_the_machines_noise_and_a_priced_one_none(
    compose_cfg, tmp_path: Path
) -> None:
    from support import ROOT

    timed = run(compose_cfg(["warmup=0"]), tmp_path / "virtual")
    assert math.isfinite(timed["timing_noise"]) and timed["timing_noise"] >= 0
    profile = ROOT / "results/baselines/profile-llama-tiny.json"
    priced = run(compose_cfg(["engine.clock=model", f"engine.profile={profile}"]), tmp_path / "m")
    assert math.isnan(priced["timing_noise"])


def test_a_sweep_rerun_over_a_damaged_summary_names_it_and_exits_2(kvbench, tmp_path) -> None:
    job = tmp_path / "results/default/multiruns/s/allocator=radix,engine.num_blocks=64,trace=smoke"
    job.mkdir(parents=True)
    (job / "summary.json").write_text("[]")
    proc = kvbench("-m", "allocator=radix", "sweep_id=s", check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        f"kvbench: error: {job / 'summary.json'} holds a JSON list, not an "
        "object of figures; delete the run's folder and run it again (a sweep re-run with its "
        "sweep_id repeats it)"
    )
    assert (job / "summary.json").read_text() == "[]"  # nothing of it lost
    assert not (job.parent / ".partial" / job.name).exists()


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:47.1805900,396,109
2023-11-16 18:15:49.6805900,1500,900
2023-11-16 18:15:50.0000000,10,5
"""


def test_a_public_traces_max_len_follows_engine_max_model_len(compose_cfg, tmp_path) -> None:
    (tmp_path / "a.csv").write_text(AZURE)
    path = f"trace.path={tmp_path / 'a.csv'}"
    for max_model_len in (1024, 4096):
        cfg = compose_cfg(["trace=azure", path, f"engine.max_model_len={max_model_len}"])
        trace, _ = check(cfg)
        assert cfg.trace.generator.max_len == max_model_len
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in trace)
        assert longest == min(max_model_len, 1500 + 900)  # 4096: the trace whole


def test_a_trace_max_len_above_engine_max_model_len_is_refused_before_any_work(kvbench) -> None:
    # the file does not exist: refused before it is read
    proc = kvbench("trace=azure", "trace.path=none.csv", "trace.max_len=4096", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == (
        "kvbench: error: trace.max_len=4096 is above engine.max_model_len=2048: lower "
        "trace.max_len to 2048 or less, or raise engine.max_model_len\n"
    )


def test_a_clipped_replay_says_what_changed_in_one_line_before_it(
    compose_cfg, tmp_path, caplog
) -> None:
    """At 1,024 tokens the 1,500 + 900 record keeps 1,023 prompt tokens and 1 output token:
    mean prompt (374 + 396 + 1,500 + 10) / 4 = 570 -> (374 + 396 + 1,023 + 10) / 4 = 450.75,
    mean output (44 + 109 + 900 + 5) / 4 = 264.5 -> (44 + 109 + 1 + 5) / 4 = 39.75."""
    (tmp_path / "a.csv").write_text(AZURE)
    overrides = ["trace=azure", f"trace.path={tmp_path / 'a.csv'}", "engine.max_model_len=1024"]
    caplog.set_level(logging.INFO, logger="harness.cli.run")
    run(compose_cfg([*overrides, "warmup=0"]), tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records]
    clipped = (
        "trace.max_len=1024 clipped 1 of 4 requests, the output first: mean prompt 570.0 -> "
        "450.8 tokens, mean output 264.5 -> 39.8; raise engine.max_model_len (and the arena) "
        "to replay them whole"
    )
    assert lines.index(clipped) < lines.index("replaying 4 requests")


def test_outputs_cut_to_fit_max_model_len_are_counted_once_before_the_replay(
    compose_cfg, tmp_path, caplog, recwarn
) -> None:
    """smoke's (prompt, max_tokens): (29, 9), (38, 8), (24, 9), (28, 12), (40, 6), (32, 11);
    in 40 tokens the 2nd, 5th and 6th cannot have all theirs."""
    cfg = compose_cfg(["engine.max_model_len=40", "warmup=0"])
    caplog.set_level(logging.INFO, logger="harness.cli.run")
    run(cfg, tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    said = (
        "3 of 6 requests ask for more output than fits a sequence of 40 tokens "
        "(engine.max_model_len=40, or what the arena holds): their outputs are cut to fit "
        "(finish_reason=length)"
    )
    assert lines.index(said) < lines.index("replaying 6 requests")
    asked = {r.request_id: r.max_tokens for r in check(cfg)[0]}
    requests, _ = results.load_tables(tmp_path)
    short = requests[requests["output_tokens"] < requests["request_id"].map(asked)]
    assert len(short) == 3 and (short["finish_reason"] == "length").all()
    assert not [w for w in recwarn if issubclass(w.category, OutputCutWarning)]  # said once


def test_a_sweep_job_named_by_a_path_override_lands_in_place(kvbench, tmp_path) -> None:
    # An override whose value is a path (engine.profile=.../x.json) puts "/" in the job's
    # name: its folder is several deep under .partial while written, and must still be moved
    # into the sweep folder whole when it ends, the emptied folders under .partial gone.
    from support import ROOT

    from harness.cli.run import job_folder, publish

    profile = ROOT / "results/baselines/profile-llama-tiny.json"
    kvbench("-m", "engine.clock=model", f"engine.profile={profile}", "sweep_id=p")
    sweep = tmp_path / "results/default/multiruns/p"
    summaries = list(sweep.rglob("summary.json"))
    assert len(summaries) == 1 and ".partial" not in summaries[0].parts
    name = f"engine.clock=model,engine.num_blocks=64,engine.profile={profile},trace=smoke"
    assert summaries[0].parent == sweep / name  # the kvbench fixture adds the last two
    assert not (sweep / ".partial").exists()
    # The same by hand, folder by folder: where a name's path goes, and what is left behind.
    written = tmp_path / "s/.partial/a=x/y/z.json,b=1"
    assert job_folder(written) == tmp_path / "s/a=x/y/z.json,b=1"
    assert job_folder(tmp_path / "plain/run") == tmp_path / "plain/run"
    written.mkdir(parents=True)
    (written / "summary.json").write_text("{}")
    (tmp_path / "s/.partial/a=x/other").mkdir()  # another job's folder still being written
    publish(written, job_folder(written))
    assert (tmp_path / "s/a=x/y/z.json,b=1/summary.json").read_text() == "{}"
    assert not (tmp_path / "s/.partial/a=x/y").exists()
    assert (tmp_path / "s/.partial/a=x/other").exists()
