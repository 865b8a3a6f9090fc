"""Reproductions 2-4 (issue 14): each bundled experiment runs through the CLI at tiny size, so
none rots; the figures its summary quotes come out of the run and are sane."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support import compose_config, run_kvbench, timed_forwards

from harness.analysis import metrics, results
from harness.cli.run import run

# Seconds-long versions of the experiments: few requests, short prompts, a small arena.
SMALL = ("engine.num_blocks=256", "progress=false")


def sweep(tmp_path: Path, name: str, *overrides: str) -> dict[str, dict]:
    """``kvbench -m experiment=NAME OVERRIDES``: each finished run's summary by its folder name."""
    run_kvbench("-m", f"experiment={name}", *SMALL, "sweep_id=t", *overrides, cwd=tmp_path)
    folder = tmp_path / "results" / name / "multiruns" / "t"
    return {
        d.name: results.read_summary(d) for d in folder.iterdir() if (d / "summary.json").exists()
    }


@pytest.mark.parametrize(
    "trace",
    [
        ("trace=shared_prefix", "trace.num_system_prompts=2", "trace.users_per_prompt=3",
         "trace.system_prompt_len=64"),
        ("trace=multi_turn", "trace.num_conversations=3", "trace.turns=2"),
    ],
    ids=["shared_prefix", "multi_turn"],
)  # fmt: skip
def test_radix_prefix_hits_within_the_block_bound_and_the_free_list_none(tmp_path, trace):
    runs = sweep(tmp_path, "radix_prefix", *trace, "trace.rate=1")  # spread: prefixes written first
    by_allocator = {s["choices"]["allocator"]: s for s in runs.values()}
    assert set(by_allocator) == {"free_list", "radix"}
    radix, free = by_allocator["radix"], by_allocator["free_list"]
    assert free["prefix_hit_rate"] == 0
    assert 0 < radix["prefix_hit_rate"] <= radix["max_prefix_hit_rate_blocks"] + 1e-12
    assert radix["completed"] == free["completed"] == radix["num_requests"]


def test_chunked_prefill_bounds_each_step_and_the_baselines_compute_prompts_whole(tmp_path):
    tiny = ("trace.num_requests=6", "trace.generator.prompt_len.max=512")
    runs = sweep(tmp_path, "chunked_prefill", "scheduler.max_chunk=64,2048", *tiny)
    run_kvbench("experiment=chunked_prefill", "scheduler=fcfs", "scheduler.order=prefill_first",
                "scheduler.max_num_batched_tokens=2048", *SMALL, *tiny, cwd=tmp_path)  # fmt: skip
    baseline = next((tmp_path / "results" / "chunked_prefill" / "runs").iterdir())
    folder = tmp_path / "results" / "chunked_prefill" / "multiruns" / "t"
    tokens = {}
    for name in [*runs, baseline]:
        requests, steps = results.load_tables(folder / name)
        assert (requests["finish_reason"] == "length").all()
        tokens[Path(name).name] = steps["prefill_tokens"] + steps["decode_tokens"]
    chunk64 = next(v for k, v in tokens.items() if "max_chunk=64" in k)
    whole = [v for k, v in tokens.items() if "max_chunk=64" not in k]
    assert chunk64.max() <= 64  # the token budget: decodes plus a chunk
    assert len(whole) == 2 and all(v.max() > 64 for v in whole)  # some prompt in one step


def test_chunks_within_the_budget_stall_no_decode_and_whole_prompts_do(tmp_path, monkeypatch):
    """Injected time: a forward takes 1 s plus 0.05 s per token fed beyond one a row, so a
    decode-only step takes 1 s and a stall (a gap over 5 decode steps) needs a step feeding
    over 80 prompt tokens: never in a 64-token budget, and whole prompts of up to 512 do."""
    timed_forwards(monkeypatch, lambda rows: 1 + 0.05 * sum(len(r.tokens) - 1 for r in rows))
    tiny = ["experiment=chunked_prefill", "trace.num_requests=6", "warmup=0", "progress=false",
            "trace.generator.prompt_len.max=512"]  # fmt: skip
    policies = {
        "chunk 64": ["scheduler.max_chunk=64"],
        "whole": ["scheduler=fcfs", "scheduler.order=prefill_first",
                  "scheduler.max_num_batched_tokens=2048"],
    }  # fmt: skip
    stalls = {}
    for name, policy in policies.items():
        run(compose_config([*tiny, *policy], tiny=False), tmp_path / name)
        requests, steps = results.load_tables(tmp_path / name)
        assert metrics.decode_step_time(steps) == 1.0
        stalls[name] = metrics.decode_stalls(requests, 5 * 1.0)
    assert stalls["chunk 64"] == 0 < stalls["whole"]


def test_speculative_exact_draft_accepts_everything_and_plain_has_no_verification(tmp_path):
    tiny = ("trace.num_requests=2", "trace.generator.output_len.low=24",
            "trace.generator.output_len.high=32")  # fmt: skip
    runs = sweep(tmp_path, "speculative", "speculative.num_draft_tokens=2",
                 "speculative.draft.scale=0.0,0.05", *tiny)  # fmt: skip

    def scale(value: str) -> dict:
        return next(
            s for s in runs.values() if f"speculative.draft.scale={value}" in s["overrides"]
        )

    exact = scale("0.0")
    assert exact["spec_acceptance_rate"] == 1.0
    # k + 1 = 3 tokens a verification, fewer only where max_tokens cut the drafts short
    assert 2.5 < exact["spec_tokens_per_verification"] <= 3.0
    noisy = scale("0.05")
    assert 0 <= noisy["spec_acceptance_rate"] < 1
    run_kvbench("experiment=speculative", "~speculative", *SMALL, *tiny, cwd=tmp_path)
    plain_dir = next((tmp_path / "results" / "speculative" / "runs").iterdir())
    plain = results.read_summary(plain_dir)
    assert math.isnan(plain["spec_acceptance_rate"]) and plain["completed"] == 2
