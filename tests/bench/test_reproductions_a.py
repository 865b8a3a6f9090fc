"""Reproductions vllm_memory, preemption and padding_waste (issue 14) at tiny size, so none rots.

Each runs its bundled experiment through the CLI (fewer requests, shorter lengths, a subset of
its sweep) and its benchmark's measuring function, and checks what the scenario makes certain:
orderings that follow from the reservations, not from timings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import timed_forwards

from harness.analysis import results
from harness.bench import batch_memory, preemption
from harness.engine.model_runner import ModelRunner
from harness.platform.models import LoadedModel

# Lengths at most 64 each, every request at t=0 (the experiments' own rate).
SHORT = ("trace.num_requests=6", "trace.max_len=64", "progress=false", "warmup=0")


def _runs(tmp_path: Path, experiment: str):
    """Finished runs of the experiment's sweep, one row each (``harness.analysis.results.load``)."""
    return results.load(tmp_path / "results" / experiment)


def _share(row) -> float:
    """Token states over the memory in use or unusable (the vLLM paper's Fig. 2 bars)."""
    parts = [row[f"kv_{p}_frac_mean"] for p in ("tokens", "future", "internal", "external")]
    return parts[0] / sum(parts)


def test_vllm_memory_orders_the_token_state_share_as_the_paper(run_kvbench_at, tmp_path):
    # 256 blocks: contiguous_max_len's 2048-slot regions fit two requests at a time; the six
    # short requests fit at once for the others, so the paged and oracle runs batch the same.
    run_kvbench_at(
        "-m",
        "experiment=vllm_memory",
        "allocator=contiguous_max_len,contiguous_oracle,free_list",
        "engine.num_blocks=256",
        *SHORT,
    )
    runs = _runs(tmp_path, "vllm_memory").set_index("allocator")
    max_len, oracle, paged = (
        runs.loc[a] for a in ("contiguous_max_len", "contiguous_oracle", "free_list")
    )
    assert all(r["completed"] == 6 for r in (max_len, oracle, paged))
    assert _share(max_len) < _share(oracle) < _share(paged)
    assert _share(paged) > 0.8  # only block tails and this step's slots are not tokens
    assert max_len["batch_size_mean"] <= 2 < paged["batch_size_mean"]


def test_preemption_runs_both_modes_and_swaps_only_in_swap_mode(run_kvbench_at, tmp_path):
    run_kvbench_at(
        "-m",
        "experiment=preemption",
        "allocator=free_list",
        "engine.num_blocks=8",  # 128 slots: the six requests outgrow it
        *SHORT,
    )
    runs = _runs(tmp_path, "preemption").set_index("scheduler.preemption_mode")
    for mode in ("recompute", "swap"):
        run = runs.loc[mode]
        assert run["completed"] == 6 and run["preemptions"] > 0
        _, steps = results.load_tables(run["run_dir"])
        assert (steps["swap_out_blocks"].sum() > 0) == (mode == "swap")


def test_one_controlled_preemption_costs_what_it_moves_or_recomputes(
    model: LoadedModel, monkeypatch
) -> None:
    """Injected time: a forward takes 1 s per token it feeds, a swap 1 s per block, nothing
    else any. one_preemption checks the scenario itself (one preemption, a recompute of
    every token or a step that only swaps in); its cost, for a 40-token victim: recompute
    feeds 41 tokens where a decode feeds 1, 40 s; swap moves the victim's 3 blocks out,
    then in, 6 s."""
    fake = timed_forwards(monkeypatch, lambda rows: sum(len(r.tokens) for r in rows))
    swap_out, swap_in = ModelRunner.swap_out, ModelRunner.swap_in

    def timed_out(self, blocks):
        fake.sleep(len(blocks))
        return swap_out(self, blocks)

    def timed_in(self, host, blocks, first=0):
        fake.sleep(len(blocks))
        return swap_in(self, host, blocks, first)

    monkeypatch.setattr(ModelRunner, "swap_out", timed_out)
    monkeypatch.setattr(ModelRunner, "swap_in", timed_in)
    assert preemption.one_preemption(model, "contiguous", "recompute", 40) == 40
    assert preemption.one_preemption(model, "contiguous", "swap", 40) == 6


def test_crossover_is_the_length_from_which_swap_stays_cheaper() -> None:
    costs = {
        ("a", 16, "recompute"): 1.0,
        ("a", 16, "swap"): 2.0,
        ("a", 64, "recompute"): 3.0,
        ("a", 64, "swap"): 2.0,
        ("a", 256, "recompute"): 9.0,
        ("a", 256, "swap"): 4.0,
    }
    assert preemption.crossover(costs, "a", [16, 64, 256]) == 64
    costs["a", 256, "swap"] = 10.0
    assert preemption.crossover(costs, "a", [16, 64, 256]) is None


def test_padding_waste_batch_generator_holds_more_than_its_tokens(
    run_kvbench_at, tmp_path, monkeypatch
):
    run_kvbench_at("-m", "experiment=padding_waste", "allocator=free_list", *SHORT)
    ((_, run),) = _runs(tmp_path, "padding_waste").iterrows()
    assert run["completed"] == 6 and run["preemptions"] == 0
    # Injected time: each BatchGenerator call and each kvbench forward takes 1 s, nothing
    # else any, so a system's throughput is the trace's tokens over its calls.
    calls = {"generator": 0, "kvbench": 0}

    def forward_cost(rows) -> float:
        calls["kvbench"] += 1
        return 1.0

    fake = timed_forwards(monkeypatch, forward_cost)
    step = batch_memory.BatchGenerator.next

    def timed_step(self):
        calls["generator"] += 1
        fake.sleep(1.0)
        return step(self)

    monkeypatch.setattr(batch_memory.BatchGenerator, "next", timed_step)
    got, facts = batch_memory.measure(list(SHORT[:2]) + ["warmup=0"], ["free_list"])
    generator, paged = got["BatchGenerator"], got["free_list"]
    # At most 128 tokens a row: BatchGenerator's 256-slot growth step leaves over half of
    # every row empty, a 16-slot block at most 15 slots.
    assert 0 < generator.tokens < generator.allocated <= generator.peak_allocated
    assert generator.utilisation < 0.5 < paged.utilisation <= 1
    # every output token produced (EOS ignored): the trace's prompt and output tokens
    assert generator.tokens_per_s == pytest.approx(facts["tokens"] / calls["generator"])
    assert paged.tokens_per_s == pytest.approx(facts["tokens"] / calls["kvbench"])


@pytest.fixture
def run_kvbench_at(tmp_path: Path):
    """kvbench in ``tmp_path`` with exactly these arguments (no tiny trace: the experiments
    keep their own, shortened by the test)."""
    from support import run_kvbench

    def call(*args: str):
        return run_kvbench(*args, cwd=tmp_path)

    return call
