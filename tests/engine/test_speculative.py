"""Speculative decoding: the same tokens as plain decoding, and the same distribution.

Greedy runs are compared token for token with the plain engine and with mlx_lm's
``generate_step``, over every allocator; sampling runs are checked against the target's exact
distribution with chi-square tests (scipy is not a dependency: critical values are quoted
from the chi-square table, e.g. NIST/SEMATECH e-Handbook 1.3.6.7.4).
"""

from __future__ import annotations

from functools import partial

import hydra.utils
import mlx.core as mx
import numpy as np
import pytest
from support import ALLOCATORS

import harness  # noqa: F401  (BLAS switch before mlx)
from allocators.free_list import FreeListAllocator
from allocators.radix import RadixAllocator
from harness.analysis.metrics import requests_frame, steps_frame, summarize
from harness.engine import build_engine
from harness.engine.sampling import SampleRow, adjust_logits, filtered_probs
from harness.engine.sampling_params import SamplingParams
from harness.engine.speculative import Proposal, Speculation, accept_or_resample, verify
from harness.platform.models import noisy_copy, random_model
from schedulers.chunked_prefill import ChunkedPrefillScheduler
from schedulers.fcfs import FCFSScheduler
from schedulers.output import simultaneous
from schedulers.priority import PriorityScheduler

# Upper 0.1 % points of the chi-square distribution (a correct sampler fails 1 run in 1000).
CHI2_999 = {3: 16.266, 6: 22.458, 7: 24.322, 9: 27.877}
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_LENS = (1, 7, 16, 17, 40, 63)
PROMPT_SEED = 1


def spec_engine(
    model,
    allocator=FreeListAllocator,
    *,
    k=4,
    draft=None,
    block_size=16,
    num_blocks=256,
    max_num_seqs=8,
    policy=FCFSScheduler,
    max_model_len=None,
    logprobs_mode="raw_logprobs",
    **base,
):
    return build_engine(
        model,
        allocator,
        partial(policy, max_num_seqs=max_num_seqs, **base),
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        speculative=Speculation(num_draft_tokens=k, draft=draft),
        logprobs_mode=logprobs_mode,
    )


def plain_engine(model, **kwargs):
    return build_engine(
        model, FreeListAllocator, FCFSScheduler, block_size=16, num_blocks=256, **kwargs
    )


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_free(engine):
    for alloc in (engine.allocator, engine.proposer.allocator):
        alloc.check()
        assert alloc.stats().used_blocks == 0


def observe_plans(engine) -> list:
    """Keep every step's plan."""
    plans, schedule = [], engine.scheduler.schedule

    def keep(now):
        plans.append(schedule(now))
        return plans[-1]

    engine.scheduler.schedule = keep
    return plans


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("scale", [0.02, None], ids=["noisy-draft", "random-draft"])
def test_greedy_tokens_identical_to_mlx_lm(model, prompts, reference, allocator, scale):
    draft = None if scale is None else partial(noisy_copy, scale=scale)
    # Block size 4: verifications of 5 slots cross blocks, so trims drop whole blocks.
    engine = spec_engine(model, allocator, draft=draft, block_size=4, num_blocks=256)
    assert tokens(engine.generate(prompts, GREEDY)) == reference
    proposed = sum(r["spec_proposed"] for r in engine.recorder.requests)
    accepted = sum(r["spec_accepted"] for r in engine.recorder.requests)
    assert proposed > 0
    if scale is not None:  # a near copy agrees often, a random model almost never
        assert 0.2 < accepted / proposed < 1
    assert_all_free(engine)


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_preemption_frees_draft_kv_and_keeps_tokens(model, allocator):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 1024, 60).tolist() for _ in range(8)]
    plain = tokens(plain_engine(model).generate(prompts, GREEDY))
    # 8 x 15 blocks fill the arena at admission: decodes must preempt, survivors speculate.
    engine = spec_engine(
        model, allocator, draft=partial(noisy_copy, scale=0.02), block_size=4, num_blocks=128
    )
    assert tokens(engine.generate(prompts, GREEDY)) == plain
    assert sum(r["preemptions"] for r in engine.recorder.requests) > 0
    assert sum(r["spec_proposed"] for r in engine.recorder.requests) > 0
    assert_all_free(engine)


@pytest.mark.parametrize(
    "policy",
    [
        partial(FCFSScheduler, preemption_mode="swap"),
        partial(PriorityScheduler, victim="shortest_remaining"),
        partial(ChunkedPrefillScheduler, max_chunk=6, max_num_batched_tokens=48),
    ],
    ids=["fcfs-swap", "priority", "chunked-prefill"],
)
def test_any_base_policy_keeps_greedy_tokens(model, policy):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 1024, 60).tolist() for _ in range(8)]
    plain = tokens(plain_engine(model).generate(prompts, GREEDY))
    engine = spec_engine(
        model, draft=partial(noisy_copy, scale=0.02), block_size=4, num_blocks=128, policy=policy
    )
    assert tokens(engine.generate(prompts, GREEDY)) == plain
    assert sum(r["preemptions"] for r in engine.recorder.requests) > 0
    assert sum(r["spec_accepted"] for r in engine.recorder.requests) > 0
    assert_all_free(engine)


def test_exact_draft_accepts_everything(model, prompts):
    k = 4
    engine = spec_engine(model, draft=partial(noisy_copy, scale=0.0), k=k, max_num_seqs=1)
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=31, ignore_eos=True))
    verified = [r for r in engine.recorder.steps if r["spec_verifications"]]
    assert all(r["spec_accepted"] == r["spec_proposed"] == k for r in verified)
    # 31 tokens: one from the prefill, then six verifications of k + 1 = 5 tokens each
    assert len(verified) == 6 * len(prompts)
    assert all(r["spec_accepted"] == r["spec_proposed"] == 6 * k for r in engine.recorder.requests)


@pytest.mark.parametrize("batch", [1, 6])
def test_speculative_figures_are_per_sequence_verification(model, prompts, batch):
    """Leviathan et al.: an exact draft has alpha = 1 and every verification yields k + 1 = 5
    tokens, at batch 1 as at batch 6 (a per-step sum would grow with the batch). The 5 tokens
    of a verification arrive together: one chunk, one ITL, as vLLM's bench serve streams."""
    engine = spec_engine(model, draft=partial(noisy_copy, scale=0.0), k=4, max_num_seqs=batch)
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=31, ignore_eos=True))
    requests, steps = engine.recorder.requests, engine.recorder.steps
    s = summarize(requests_frame(requests), steps_frame(steps), clock="virtual")
    assert s["spec_acceptance_rate"] == 1.0 and s["spec_draft_acceptance_rate"] == 1.0
    assert s["spec_tokens_per_verification"] == 5.0
    # 31 tokens: 1 from the prefill, then 6 chunks of 5: 6 gaps per request.
    assert all(len(np.unique(r["token_times"])) == 7 for r in requests)
    assert sum(r["spec_verifications"] for r in steps) == 6 * len(prompts)


def test_sampling_with_an_exact_draft_accepts_everything(model, prompts):
    engine = spec_engine(model, draft=partial(noisy_copy, scale=0.0))
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=3)
    engine.generate(prompts, params)
    requests = engine.recorder.requests
    assert sum(r["spec_accepted"] for r in requests) == sum(r["spec_proposed"] for r in requests)


def test_stops_inside_accepted_drafts_drop_what_follows(model, prompts):
    plain_out = tokens(plain_engine(model).generate(prompts, GREEDY))
    # Stop at the 6th token of each output, unless min_tokens keeps going past it.
    params = [
        SamplingParams(
            temperature=0, max_tokens=24, stop_token_ids=(out[5],), min_tokens=m, ignore_eos=True
        )
        for out, m in zip(plain_out, [0, 8, 0, 3, 0, 9], strict=True)
    ]
    expected = tokens(plain_engine(model).generate(prompts, params))
    engine = spec_engine(model, draft=partial(noisy_copy, scale=0.0), k=8)
    assert tokens(engine.generate(prompts, params)) == expected
    assert any(len(t) < 24 for t in expected)
    assert_all_free(engine)


def test_model_length_limit_holds_with_drafts(model, prompts):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = build_engine(
        model,
        FreeListAllocator,
        partial(FCFSScheduler, max_num_batched_tokens=128),
        block_size=16,
        num_blocks=64,
        max_model_len=70,
    )
    expected = tokens(plain.generate(prompts, params))
    draft = partial(noisy_copy, scale=0.0)
    engine = spec_engine(model, draft=draft, k=8, max_model_len=70, max_num_batched_tokens=128)
    assert tokens(engine.generate(prompts, params)) == expected
    assert [len(p) + len(t) for p, t in zip(prompts, expected, strict=True)] == [
        65,
        70,
        70,
        70,
        70,
        70,
    ]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_greedy_penalties_and_logprobs_match_plain_decoding(model, prompts, mode):
    """Each emitted token's logprobs (the sampled one's, with its rank, and the top 3) are
    the target's at its position, as plain decoding gives them."""
    params = SamplingParams(
        temperature=0,
        max_tokens=20,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        logprobs=3,
        ignore_eos=True,
    )
    plain = plain_engine(model, logprobs_mode=mode).generate(prompts, params)
    spec = spec_engine(model, draft=partial(noisy_copy, scale=0.02), logprobs_mode=mode)
    spec = spec.generate(prompts, params)
    assert tokens(spec) == tokens(plain)
    for s, p in zip(spec, plain, strict=True):
        assert len(s.outputs[0].logprobs) == len(s.outputs[0].token_ids)
        for token, a, b in zip(
            s.outputs[0].token_ids, s.outputs[0].logprobs, p.outputs[0].logprobs, strict=True
        ):
            assert token in a and a.keys() == b.keys()
            assert [x.rank for x in a.values()] == [x.rank for x in b.values()]
            got, want = ([x.logprob for x in d.values()] for d in (a, b))
            assert np.allclose(got, want, atol=1e-4)


def test_abort_frees_target_and_draft_kv(model, prompts):
    engine = spec_engine(model, draft=partial(noisy_copy, scale=0.02))
    engine.add_request("a", prompts[4], GREEDY)
    engine.add_request("b", prompts[5], GREEDY)
    for _ in range(3):  # prefill, then two verifications: the draft holds KV for both
        engine.step()
    assert engine.proposer.allocator.stats().used_blocks > 0
    engine.abort_request("a")
    engine.abort_request("b")
    assert_all_free(engine)


def test_rejection_sampler_preserves_the_target_distribution():
    # A toy vocabulary of 8: q puts mass where p has none and little where p has most.
    p = np.array([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.07, 0.0])
    q = np.array([0.05, 0.05, 0.10, 0.10, 0.20, 0.10, 0.20, 0.20])
    rng = np.random.default_rng(0)
    n = 100_000
    picks = [accept_or_resample(p, q, int(rng.choice(8, p=q)), rng) for _ in range(n)]
    counts = np.bincount(picks, minlength=8)
    assert counts[7] == 0
    assert chi_square(counts[:7], n * p[:7]) < CHI2_999[6]


def test_verify_emits_target_distributed_tokens_at_every_position():
    # Context-free p and q, k = 3 drafts: every emitted token must follow p, and the count
    # of tokens per verification must follow the truncated geometric law of Leviathan.
    vocab, k, n = 8, 3, 20_000
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab))
    params = SamplingParams(temperature=1.0)
    row = SampleRow(params, [0], 1, rng)
    logits = np.tile(np.log(p), (k + 1, 1))
    counts, lengths = np.zeros(vocab), np.zeros(k + 2)
    for _ in range(n):
        drafts = [int(rng.choice(vocab, p=q)) for _ in range(k)]
        got = verify(logits, Proposal(drafts, [q] * k), lambda j: row)
        np.add.at(counts, got.tokens, 1)
        lengths[len(got.tokens)] += 1
    assert chi_square(counts, counts.sum() * p) < CHI2_999[7]
    a = np.minimum(p, q).sum()  # Leviathan's alpha: 1 - total variation distance
    expected = [a**i * (1 - a) for i in range(k)] + [a**k]  # 1 .. k+1 tokens
    assert chi_square(lengths[1:], n * np.array(expected)) < CHI2_999[3]


@pytest.mark.slow
def test_end_to_end_sampling_follows_the_target_distribution():
    # Toy vocabulary of 32; a draft far from the target (noise of 20 % of its weights' RMS), so
    # accepting drafts blindly would show. Each emitted token's randomised probability integral
    # transform under the target's exact (filtered, penalised) distribution must be uniform.
    target = random_model("llama", "tiny", seed=5, vocab_size=32)
    engine = spec_engine(target, draft=partial(noisy_copy, scale=0.2), k=3, max_num_seqs=64)
    params = [
        SamplingParams(temperature=0.8, top_k=12, repetition_penalty=1.2, max_tokens=5, seed=s)
        for s in range(800)
    ]
    prompt = [3, 1, 4, 1, 5]
    outputs = tokens(engine.generate([prompt] * len(params), params))
    proposed = sum(r["spec_proposed"] for r in engine.recorder.requests)
    accepted = sum(r["spec_accepted"] for r in engine.recorder.requests)
    assert proposed > 2000 and 0.1 < accepted / proposed < 0.9
    seqs = mx.array([prompt + out for out in outputs])
    logits = np.array(target.model(seqs).astype(mx.float32))
    rng = np.random.default_rng(7)
    pit = []
    for b, out in enumerate(outputs):
        for i in range(1, len(out)):  # every token after the first came from a verification
            pos = len(prompt) + i - 1
            row = SampleRow(params[b], prompt + out[:i], len(prompt), None)
            probs = filtered_probs(adjust_logits(logits[b, pos], row), params[b])
            probs /= probs.sum()
            below = probs[: out[i]].sum()
            pit.append(below + rng.random() * probs[out[i]])
    counts = np.histogram(pit, bins=10, range=(0, 1))[0]
    assert chi_square(counts, np.full(10, len(pit) / 10)) < CHI2_999[9]


def test_tokens_per_step_follow_leviathan_for_the_measured_acceptance(model):
    k = 2
    engine = spec_engine(
        model, draft=partial(noisy_copy, scale=0.1), k=k, max_num_seqs=64, num_blocks=1024
    )
    plans = observe_plans(engine)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 1024, 8).tolist() for _ in range(64)]
    params = [SamplingParams(temperature=1.0, max_tokens=90, seed=s) for s in range(64)]
    engine.generate(prompts, params)
    scheduled = [s for p in plans for s in p.scheduled if s.num_draft_tokens]
    accepted = sum(r["spec_accepted"] for r in engine.recorder.steps)
    rejected = sum(r["spec_rejected"] for r in engine.recorder.steps)
    assert len(scheduled) >= 2000
    a = accepted / (accepted + rejected)  # per draft token, as Leviathan's alpha
    predicted = sum((1 - a ** (s.num_draft_tokens + 1)) / (1 - a) for s in scheduled)
    measured = accepted + len(scheduled)  # accepted drafts plus one target token each
    assert abs(measured / predicted - 1) < 0.05, (a, measured, predicted)


def test_hydra_builds_speculation_for_any_policy(model, prompts, reference):
    """The speculative/ config group's node builds the engine feature; any policy decides."""
    config = {
        "_target_": "harness.engine.speculative.Speculation",
        "num_draft_tokens": 3,
        "draft": {
            "_target_": "harness.platform.models.noisy_copy",
            "_partial_": True,
            "scale": 0.02,
        },
    }
    speculation = hydra.utils.instantiate(config)
    engine = build_engine(
        model,
        FreeListAllocator,
        partial(PriorityScheduler, max_num_seqs=4),
        block_size=16,
        num_blocks=64,
        speculative=speculation,
    )
    assert engine.scheduler.num_lookahead_slots == 3
    assert tokens(engine.generate(prompts, GREEDY)) == reference


def test_the_draft_kv_is_counted_in_the_budget(model):
    """A byte budget sizes both arenas: target + draft bytes per block (the tiny model and
    its noisy copy: 4 layers x 2 K/V x 2 heads x 64 x 4 bytes = 4096 bytes per token each);
    the draft's blocks are recorded each step."""
    budget = 64 * 16 * 2 * 4096
    plain = build_engine(model, FreeListAllocator, FCFSScheduler, kv_cache_bytes=budget)
    spec = build_engine(
        model,
        FreeListAllocator,
        FCFSScheduler,
        kv_cache_bytes=budget,
        speculative=Speculation(2, partial(noisy_copy, scale=0.0)),
    )
    assert (plain.allocator.num_blocks, spec.allocator.num_blocks) == (128, 64)
    assert spec.proposer.allocator.num_blocks == 64
    assert type(spec.proposer.allocator) is FreeListAllocator
    spec.generate([[1, 2, 3]], GREEDY)
    assert max(r["draft_blocks_used"] for r in spec.recorder.steps) >= 1
    assert spec.proposer.allocator.stats().used_blocks == 0  # released at finish


def test_bad_configuration_names_the_problem(model):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        spec_engine(model, k=0)
    other = random_model("llama", "tiny", seed=1, vocab_size=512)
    with pytest.raises(ValueError, match="needs the same"):
        spec_engine(model, draft=lambda target: other)


def test_chained_copies_become_one_simultaneous_pass():
    assert simultaneous([(1, 2), (2, 3)]) == [(1, 2), (1, 3)]
    assert simultaneous([(1, 2), (5, 2)]) == [(5, 2)]
    assert simultaneous([(1, 2), (2, 1)]) == [(1, 2)]


def chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def test_a_draft_without_room_verifies_only_what_it_proposed(model):
    """The radix draft shares no prefix, so with four requests on one 256-token prefix it runs
    out of blocks before the target does: its proposals shrink. A step then verifies (and
    records) only the drafts that exist, and a sequence with none decodes plainly."""
    prefix = list(range(1, 257))
    prompts = [prefix + [300 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = build_engine(model, RadixAllocator, FCFSScheduler, num_blocks=40)
    expected = tokens(plain.generate(prompts, params))
    engine = spec_engine(
        model, RadixAllocator, draft=partial(noisy_copy, scale=0.0), k=4, num_blocks=40
    )
    assert tokens(engine.generate(prompts, params)) == expected
    steps = engine.recorder.steps
    assert all(r["spec_proposed"] >= r["spec_verifications"] for r in steps)
    assert any(r["spec_proposed"] < 4 * r["spec_verifications"] for r in steps)
    assert sum(r["spec_accepted"] for r in steps) == sum(r["spec_proposed"] for r in steps)


def test_blocks_filled_by_a_finishing_verification_reach_the_prefix_cache(model):
    """Prompt 14, max_tokens 6, exact draft k=4: the prefill gives token 1, one verification
    the other 5 and finishes the request, with KV for positions 0..18 in place. Block 0
    (positions 0..15) filled in that verification: a next request on the same 19 tokens finds
    it cached (16 tokens), as it would without speculation."""
    prompt = list(range(1, 15))
    engine = spec_engine(model, RadixAllocator, draft=partial(noisy_copy, scale=0.0), k=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (first,) = engine.generate([prompt], params)
    follow_up = prompt + first.outputs[0].token_ids[:5]
    engine.generate([follow_up], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    cached = {r["request_id"]: r["cached_tokens"] for r in engine.recorder.requests}
    assert cached == {"gen-0": 0, "gen-1": 16}
