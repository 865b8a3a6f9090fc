"""The model clock (``engine.clock=model``): the engine's own schedule, priced by a profile.

Token times are computed by hand from a toy profile; a replay's tables are the same bytes
with two busy processes beside it; speculative acceptance follows the set probability."""

from __future__ import annotations

import subprocess
import sys
from functools import partial

import pytest

from allocators.free_list import FreeListAllocator
from harness.analysis.metrics import acceptance_rate, steps_frame
from harness.cli.run import UsageError
from harness.cli.run import run as run_experiment
from harness.costmodel.profile import FORMAT, VERSION, ProfileWarning, fingerprint, save
from harness.costmodel.work import PRICED
from harness.engine import build_engine
from harness.engine.intake import RequestError
from harness.engine.sampling_params import SamplingParams
from harness.engine.speculative import LayerSkip, NGram, Speculation
from schedulers.fcfs import FCFSScheduler

DECODE, PREFILL_PER_TOKEN = 0.010, 0.025  # seconds: a decode step, a prompt token


def toy_profile(model, tmp_path, **extra) -> str:
    """Decode steps cost 10 ms whatever their batch; prefill steps 25 ms per query token;
    mixed steps both; verifications 10 ms + 1 ms per draft token fed."""
    shape = model.shape()
    data = {
        "format": FORMAT,
        "version": VERSION,
        "kind": "measured",
        "model": shape | {"fingerprint": fingerprint(shape)},
        "block_size": 16,
        "features": list(PRICED),
        "kinds": {
            "decode": {"coefficients": {"step": DECODE}},
            "prefill": {"coefficients": {"query_tokens_padded": PREFILL_PER_TOKEN}},
            "mixed": {"coefficients": {"step": DECODE, "query_tokens_padded": PREFILL_PER_TOKEN}},
            "verify": {"coefficients": {"step": DECODE, "draft_tokens": 0.001}},
        },
        "moves": {"block_copies": 0.0, "swap_blocks": 0.0},
        **extra,
    }
    path = tmp_path / "profile.json"
    save(data, path)
    return str(path)


def modelled(model, profile, **kwargs):
    return build_engine(
        model,
        FreeListAllocator,
        partial(FCFSScheduler, max_num_seqs=8),
        num_blocks=64,
        clock="model",
        profile=profile,
        **kwargs,
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_token_times_are_the_profiles_prices_of_the_steps(model, tmp_path):
    """A 4-token prompt's prefill costs 4 x 25 = 100 ms: its first token at 0.100 s. Then
    decode steps of 10 ms each: tokens at 0.110 and 0.120 s; the request finishes at 0.120."""
    engine = modelled(model, toy_profile(model, tmp_path))
    engine.add_request("a", [1, 2, 3, 4], greedy(3), arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    (row,) = engine.recorder.requests
    assert list(row["token_times"]) == pytest.approx([0.100, 0.110, 0.120])
    assert row["output_tokens"] == 3
    steps = engine.recorder.steps
    assert [s["duration"] for s in steps] == pytest.approx([0.100, 0.010, 0.010])
    assert {s["forward_time"] for s in steps} == {0.0}  # nothing is measured
    assert {s["mlx_peak_bytes"] for s in steps} == {0}


def test_final_only_returns_the_finished_output_alone(model, tmp_path):
    """``output_kind="final_only"``: no output while the request runs, then the finished one
    with every token, as the cumulative outputs' last; the recorded rows do not change."""
    got = {}
    for kind in ("cumulative", "final_only"):
        engine = modelled(model, toy_profile(model, tmp_path))
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, output_kind=kind)
        engine.add_request("a", [1, 2, 3, 4], params, arrival_time=0.0)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        got[kind] = outputs, engine.recorder.requests, engine.recorder.steps
    (final,) = got["final_only"][0]
    assert final.finished and final == got["cumulative"][0][-1]
    assert len(got["cumulative"][0]) == 5
    assert repr(got["final_only"][1:]) == repr(got["cumulative"][1:])  # NaN SLOs: by repr


def test_a_prefill_beside_a_decode_is_a_mixed_step(model, tmp_path):
    """a (2 tokens) prefills alone: 50 ms. b (3 tokens) arrives then and prefills beside a's
    decode: 10 + 3 x 25... padded with a's row to 2 rows x 3 query tokens = 6: 10 + 150 =
    160 ms. So a's tokens are at 0.050 and 0.210, b's first at 0.210."""
    engine = modelled(model, toy_profile(model, tmp_path))
    engine.add_request("a", [1, 2], greedy(2), arrival_time=0.0)
    engine.step()
    engine.add_request("b", [1, 2, 3], greedy(1), arrival_time=0.05)
    while engine.has_unfinished_requests():
        engine.step()
    times = {r["request_id"]: list(r["token_times"]) for r in engine.recorder.requests}
    kinds = [(s["batch_size"], s["query_tokens_padded"]) for s in engine.recorder.steps]
    if kinds[1] == (2, 4):  # grouped apart: a's 1 + b's 3 query tokens, no padding
        assert times["a"] == pytest.approx([0.050, 0.050 + 0.010 + 4 * 0.025])
    else:
        assert kinds[1] == (2, 6)
        assert times["a"] == pytest.approx([0.050, 0.210])
    assert times["b"][0] == times["a"][1]


@pytest.mark.parametrize("acceptance", [1.0, 0.0])
def test_speculative_acceptance_follows_the_set_probability(model, tmp_path, acceptance):
    """Four drafts per verification, all accepted (each verification then emits 4 drafts
    and a bonus token: 20 tokens after the prompt's first in 4 verifications) or none
    accepted (each emits the target's one token)."""
    engine = modelled(
        model,
        toy_profile(model, tmp_path),
        speculative=Speculation(num_draft_tokens=4),
        acceptance=acceptance,
    )
    engine.add_request("a", [1, 2, 3], greedy(21), arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    (row,) = engine.recorder.requests
    assert row["output_tokens"] == 21 and row["spec_proposed"] > 0
    assert row["spec_accepted"] == acceptance * row["spec_proposed"]
    if acceptance == 1.0:
        assert sum(s["spec_verifications"] for s in engine.recorder.steps) == 4
    # The first verification: the draft catches up on the 3 prompt tokens and the sampled
    # one (4 tokens), then feeds 3 of its 4 proposals: 4 sequential forwards, 7 tokens.
    first = engine.recorder.steps[1]
    assert (first["draft_rounds"], first["draft_tokens"]) == (4, 7)


class NoBatchTables(FreeListAllocator):
    """A free list whose step batch's block tables must not be asked for."""

    def block_tables(self, seq_ids):
        raise AssertionError("a model-clock step read its batch's block tables")


def test_a_model_clock_step_reads_no_block_table(model, tmp_path):
    """The modelled runner gets the step's shape, not rows: no batch's block tables are
    read, verifications included (2 drafts each, all accepted: a's 7 tokens come as its
    prompt's first, then 3 in each of two verifications)."""
    engine = build_engine(
        model,
        NoBatchTables,
        partial(FCFSScheduler, max_num_seqs=8),
        num_blocks=64,
        clock="model",
        profile=toy_profile(model, tmp_path),
        speculative=Speculation(num_draft_tokens=2),
        acceptance=1.0,
    )
    engine.add_request("a", [1, 2, 3], greedy(7), arrival_time=0.0)
    engine.add_request("b", [4, 5], greedy(3), arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    rows = {r["request_id"]: r for r in engine.recorder.requests}
    assert (rows["a"]["output_tokens"], rows["b"]["output_tokens"]) == (7, 3)
    assert rows["a"]["spec_accepted"] == rows["a"]["spec_proposed"] > 0


def test_a_half_acceptance_rate_accepts_about_half_the_drafts(model, tmp_path):
    """1 draft per verification accepted with probability 0.5: over 300+ drafts the rate is
    within 3.5 standard deviations (3.5 x 0.029) of 0.5."""
    engine = modelled(
        model,
        toy_profile(model, tmp_path),
        speculative=Speculation(num_draft_tokens=1),
        acceptance=0.5,
    )
    for i in range(4):
        engine.add_request(str(i), [1, 2, 3], greedy(150))
    while engine.has_unfinished_requests():
        engine.step()
    proposed = sum(r["spec_proposed"] for r in engine.recorder.requests)
    accepted = sum(r["spec_accepted"] for r in engine.recorder.requests)
    assert proposed >= 300
    assert abs(accepted / proposed - 0.5) < 0.1


def test_the_profiles_acceptance_rate_is_the_runs_per_token_alpha(model, tmp_path):
    """A profile's ``acceptance_rate`` is Leviathan's per-token alpha, the rate the run's
    summary reports back: with 4 drafts a verification and alpha 0.8, alpha estimates
    within 3.5 standard deviations (3.5 x 0.017 over 500+ judged drafts) of 0.8, while
    accepted / proposed is near (0.8 + 0.8^2 + 0.8^3 + 0.8^4) / 4 = 0.590 (a request's last
    verifications propose fewer drafts, which can raise it a little)."""
    engine = modelled(
        model,
        toy_profile(model, tmp_path, acceptance_rate=0.8),
        speculative=Speculation(num_draft_tokens=4),
    )
    for i in range(4):
        engine.add_request(str(i), [1, 2, 3], greedy(150))
    while engine.has_unfinished_requests():
        engine.step()
    steps = steps_frame(engine.recorder.steps)
    assert steps["spec_accepted"].sum() + steps["spec_rejected"].sum() >= 500
    assert abs(acceptance_rate(steps) - 0.8) < 0.06
    draft_rate = steps["spec_accepted"].sum() / steps["spec_proposed"].sum()
    assert 0.59 - 0.06 < draft_rate < 0.59 + 0.08


def test_what_needs_logits_is_refused_in_one_line(model, tmp_path):
    engine = modelled(model, toy_profile(model, tmp_path))
    with pytest.raises(RequestError, match="logprobs needs a model's logits"):
        engine.add_request("a", [1, 2], SamplingParams(logprobs=2))


def test_a_profile_of_another_model_is_refused(model, tmp_path):
    from harness.platform.models import random_model

    other = random_model("llama", "small")
    with pytest.raises(ValueError, match="prices model 'llama-tiny.*calibrate this model"):
        modelled(other, toy_profile(model, tmp_path))


def test_a_profile_used_at_another_block_size_warns_naming_both(model, tmp_path, recwarn):
    profile = toy_profile(model, tmp_path)  # calibrated at 16
    modelled(model, profile)
    assert not [w for w in recwarn if issubclass(w.category, ProfileWarning)]
    with pytest.warns(ProfileWarning) as said:
        modelled(model, profile, block_size=32)
    assert [str(w.message) for w in said] == [
        f"engine.profile={profile!r} was calibrated at block size 16 and prices this "
        "engine's engine.block_size=32: calibrate at 32 for per-block costs that hold"
    ]


def test_the_model_clock_needs_a_profile_and_speculation_an_acceptance(model, tmp_path):
    with pytest.raises(ValueError, match="needs engine.profile=PATH"):
        modelled(model, None)
    with pytest.raises(ValueError, match="set engine.acceptance"):
        modelled(model, toy_profile(model, tmp_path), speculative=Speculation())
    with pytest.raises(ValueError, match="the model clock's: set engine.clock=model"):
        build_engine(model, FreeListAllocator, FCFSScheduler, num_blocks=8, profile="p.json")


@pytest.mark.parametrize("speculative", [NGram(), LayerSkip()], ids=["ngram", "layerskip"])
def test_drafts_the_profile_did_not_price_are_refused(model, tmp_path, speculative):
    """The profile prices a verification's draft work as its calibrated draft model's: a
    prompt lookup (no model) or a layer prefix (cheaper) would be mispriced."""
    profile = toy_profile(model, tmp_path, acceptance_rate=0.5)
    with pytest.raises(ValueError, match=f"not speculative={speculative.name}: use engine"):
        modelled(model, profile, speculative=speculative)


BUSY = [sys.executable, "-c", "while True: pass"]


@pytest.mark.slow
def test_a_replay_writes_the_same_bytes_under_load(compose_cfg, model, tmp_path):
    """The same config and seed, quiet and with two busy processes beside it: identical
    requests.parquet and steps.parquet, byte for byte."""
    profile = toy_profile(model, tmp_path)
    cfg = compose_cfg(
        ["engine.clock=model", f"engine.profile={profile}", "trace=poisson",
         "trace.num_requests=40", "scheduler=chunked_prefill", "scheduler.max_chunk=32"]
    )  # fmt: skip
    run_experiment(cfg, tmp_path / "quiet")
    busy = [subprocess.Popen(BUSY) for _ in range(2)]
    try:
        run_experiment(cfg, tmp_path / "loaded")
    finally:
        for p in busy:
            p.kill()
    for name in ("requests.parquet", "steps.parquet"):
        quiet, loaded = (tmp_path / d / name for d in ("quiet", "loaded"))
        assert quiet.read_bytes() == loaded.read_bytes(), name


def test_a_profile_that_does_not_exist_is_one_usage_line(compose_cfg, tmp_path):
    cfg = compose_cfg(["engine.clock=model", f"engine.profile={tmp_path / 'none.json'}"])
    with pytest.raises(UsageError, match="none.json'?: no such file"):
        run_experiment(cfg, tmp_path / "out")
