"""Drafting without a second checkpoint: prompt lookup (``speculative=ngram``) and the
target's own first layers (``speculative=layerskip``).

Both keep greedy tokens identical to plain decoding; prompts that repeat a pattern make the
tiny random model loop, so n-gram drafts are proposed and accepted. Sampling with n-gram
drafts follows Leviathan et al. with a point-mass q: a draft x is kept with probability
p(x), a rejection draws from p without x.
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
from harness.cli.config import validate
from harness.engine import build_engine
from harness.engine.ngram import NGramProposer, ngram_lookup
from harness.engine.request import Seq
from harness.engine.sampling import SampleRow, adjust_logits, filtered_probs
from harness.engine.sampling_params import SamplingParams
from harness.engine.speculative import LayerSkip, NGram, Proposal, Speculation, verify
from harness.platform.models import prefix_model, random_model
from schedulers.fcfs import FCFSScheduler
from schedulers.output import Scheduled

# Upper 0.1 % points of the chi-square distribution (as in test_speculative.py).
CHI2_999 = {7: 24.322, 9: 27.877}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Patterns the prompt repeats, then a prompt that does not repeat.
PROMPTS = [[5, 6, 7, 8] * 6, [1, 2, 3] * 10 + [9], [40, 41] * 4 + [7, 8, 9], list(range(10, 40))]


def engine_with(model, speculative, allocator=FreeListAllocator, **kwargs):
    return build_engine(
        model,
        allocator,
        partial(FCFSScheduler, max_num_seqs=4),
        block_size=kwargs.pop("block_size", 4),
        num_blocks=kwargs.pop("num_blocks", 256),
        speculative=speculative,
        **kwargs,
    )


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(model):
    return tokens(engine_with(model, None).generate(PROMPTS, GREEDY))


@pytest.mark.parametrize(
    "seq, lo, hi, k, expected",
    [
        ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),  # vLLM's docstring example: 3 follow
        ([1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 2, [9, 1]),  # the earliest occurrence, as vLLM
        ([1, 2, 3, 5, 2, 3, 6, 1, 2, 3], 1, 3, 2, [5, 2]),  # the longest suffix wins
        ([7, 7, 7], 1, 2, 4, [7]),  # an occurrence may overlap the suffix
        ([1, 2, 3, 4], 1, 3, 4, []),  # nothing recurs
        ([1, 2, 1, 2], 3, 3, 4, []),  # only suffixes shorter than prompt_lookup_min recur
        ([4], 1, 1, 4, []),
    ],
)
def test_ngram_lookup_follows_vllms_rule(seq, lo, hi, k, expected):
    assert ngram_lookup(seq, lo, hi, k) == expected


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda c: c.__name__)
def test_ngram_greedy_tokens_identical_to_plain_decoding(model, plain, allocator):
    engine = engine_with(model, NGram(4, prompt_lookup_max=3, prompt_lookup_min=1), allocator)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == plain
    steps = engine.recorder.steps
    proposed = sum(r["spec_proposed"] for r in steps)
    assert sum(r["spec_accepted"] for r in steps) > 0
    # Widths vary: some verifications proposed fewer than k (or nothing at all).
    assert 0 < proposed < 4 * sum(r["spec_verifications"] for r in steps)
    engine.allocator.check()
    assert engine.allocator.stats().used_blocks == 0


def test_ngram_keeps_no_draft_kv_and_runs_no_draft(model):
    """No draft allocator: a byte budget buys the target as many blocks as plain decoding,
    no step records draft blocks or draft forwards; the lookahead slots are the target's."""
    budget = 64 * 16 * 4096  # tiny: 4096 bytes per token
    kwargs = {"block_size": 16, "num_blocks": None, "kv_cache_bytes": budget}
    engine = engine_with(model, NGram(3, prompt_lookup_max=2), **kwargs)
    assert engine.allocator.num_blocks == 64
    assert engine.scheduler.draft is None and engine.scheduler.num_lookahead_slots == 3
    engine.generate(PROMPTS, GREEDY)
    steps = engine.recorder.steps
    assert sum(r["spec_verifications"] for r in steps) > 0
    assert all(r["draft_blocks_used"] == r["draft_rounds"] == r["draft_tokens"] == 0 for r in steps)
    # Tokens fed, not slots reserved: each decode row's token plus the drafts it verified.
    decoding = [r for r in steps if r["batch_size"] and not r["prefill_tokens"]]
    assert all(r["decode_tokens"] == r["batch_size"] + r["spec_proposed"] for r in decoding)
    assert all(r["query_tokens_padded"] >= r["decode_tokens"] for r in decoding)


def test_an_empty_proposal_is_a_plain_decode(model, plain):
    """A prompt that never repeats, on a bound no suffix reaches: every verification proposes
    nothing and yields one token, the plain one."""
    engine = engine_with(model, NGram(4, prompt_lookup_min=40, prompt_lookup_max=40))
    out = tokens(engine.generate([PROMPTS[3]], GREEDY))
    assert out == [plain[3]]
    steps = engine.recorder.steps
    assert sum(r["spec_verifications"] for r in steps) > 0
    assert sum(r["spec_proposed"] for r in steps) == 0


def test_ngram_with_penalties_and_logprobs_matches_plain_decoding(model):
    """Penalised greedy rows verify prompt-lookup drafts against the penalised target; each
    emitted token carries the target's logprobs at its position, as plain decoding."""
    params = SamplingParams(
        temperature=0, max_tokens=30, repetition_penalty=1.1, logprobs=2, ignore_eos=True
    )
    plain = engine_with(model, None).generate(PROMPTS, params)
    engine = engine_with(model, NGram(4, prompt_lookup_max=3, prompt_lookup_min=1))
    spec = engine.generate(PROMPTS, params)
    assert tokens(spec) == tokens(plain)
    assert sum(r["spec_accepted"] for r in engine.recorder.requests) > 0
    for s, p in zip(spec, plain, strict=True):
        for a, b in zip(s.outputs[0].logprobs, p.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert np.allclose(
                [x.logprob for x in a.values()], [x.logprob for x in b.values()], atol=1e-4
            )


def test_ngram_sampling_drafts_are_point_masses(model):
    seq = Seq("a", [1, 2, 3, 1, 2], SamplingParams(temperature=1.0, seed=0), 0.0)
    proposer = NGramProposer(NGram(3, prompt_lookup_max=2), model.vocab_size)
    (proposal,) = proposer.propose([Scheduled(seq, 4, True, num_draft_tokens=3)], lambda s, d: None)
    assert proposal.tokens == [3, 1, 2]
    for token, q in zip(proposal.tokens, proposal.probs, strict=True):
        assert q[token] == 1.0 and q.sum() == 1.0


def test_a_point_mass_draft_is_kept_with_probability_p():
    """q = 1 on the draft: Leviathan's rule keeps x with probability p(x) and otherwise
    draws from norm(max(0, p - q)), p without x; the emitted token follows p exactly."""
    vocab, n, x = 8, 20_000, 2
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(vocab))
    q = np.zeros(vocab)
    q[x] = 1.0
    row = SampleRow(SamplingParams(temperature=1.0), [0], 1, rng)
    logits = np.tile(np.log(p), (2, 1))
    firsts = np.zeros(vocab)
    kept = 0
    for _ in range(n):
        got = verify(logits, Proposal([x], [q]), lambda j: row)
        firsts[got.tokens[0]] += 1
        kept += got.accepted
    assert abs(kept / n - p[x]) < 4 * np.sqrt(p[x] * (1 - p[x]) / n)
    expected = n * p
    assert ((firsts - expected) ** 2 / expected).sum() < CHI2_999[7]


def test_ngram_sampling_requests_finish_with_drafts_accepted(model):
    engine = engine_with(model, NGram(4, prompt_lookup_max=3, prompt_lookup_min=1))
    params = SamplingParams(temperature=0.3, max_tokens=30, seed=1, ignore_eos=True)
    outputs = tokens(engine.generate(PROMPTS, params))
    assert [len(o) for o in outputs] == [30] * len(PROMPTS)
    assert sum(r["spec_accepted"] for r in engine.recorder.requests) > 0


@pytest.mark.parametrize("allocator", ALLOCATORS[:2], ids=lambda c: c.__name__)
def test_layerskip_greedy_tokens_identical_to_plain_decoding(model, plain, allocator):
    engine = engine_with(model, LayerSkip(3, num_layers=2), allocator)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == plain
    assert sum(r["spec_proposed"] for r in engine.recorder.requests) > 0
    for alloc in (engine.allocator, engine.proposer.allocator):
        alloc.check()
        assert alloc.stats().used_blocks == 0


def test_layerskip_draft_shares_the_targets_weights(model):
    """Default: half the layers. The draft's modules are the target's (no copy) and its KV
    arena holds only its own layers, so its KV costs half the target's per token."""
    engine = engine_with(model, LayerSkip(2))
    draft = engine.proposer.model
    assert draft.num_layers == 2 and len(draft.model.layers) == 2
    body, target = draft.model.model, model.model.model
    assert all(a is b for a, b in zip(body.layers, target.layers[:2], strict=False))
    assert body.embed_tokens is target.embed_tokens and body.norm is target.norm
    assert draft.model.lm_head is model.model.lm_head
    assert 2 * draft.kv_bytes_per_token() == model.kv_bytes_per_token()
    assert len(model.model.layers) == 4  # the target keeps its layers


def test_a_prefix_of_every_layer_accepts_every_draft(model):
    """The draft that is the whole target (prefix_model at all layers, through the draft
    seam): every greedy draft is the target's own choice."""
    speculation = Speculation(4, partial(prefix_model, num_layers=model.num_layers))
    engine = engine_with(model, speculation)
    engine.generate(PROMPTS, GREEDY)
    requests = engine.recorder.requests
    assert sum(r["spec_proposed"] for r in requests) > 0
    assert all(r["spec_accepted"] == r["spec_proposed"] for r in requests)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: LayerSkip(num_layers=4), r"speculative.num_layers=4 is invalid .* < 4"),
        (lambda: LayerSkip(num_layers=0), r"speculative.num_layers=0 is invalid"),
        (lambda: NGram(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min=3"),
        (lambda: NGram(prompt_lookup_max=0), "prompt_lookup_max=0"),
        (lambda: NGram(num_draft_tokens=0), "num_draft_tokens=0"),
    ],
)
def test_bad_settings_name_the_field(model, make, message):
    with pytest.raises(ValueError, match=message):
        engine_with(model, make())


def test_unset_lookup_bounds_resolve_as_vllms():
    assert (NGram().prompt_lookup_min, NGram().prompt_lookup_max) == (5, 5)
    assert NGram(prompt_lookup_max=3).prompt_lookup_min == 3
    assert NGram(prompt_lookup_min=2).prompt_lookup_max == 2


@pytest.mark.parametrize("option, kind", [("ngram", NGram), ("layerskip", LayerSkip)])
def test_the_config_options_build_their_proposer(compose_cfg, model, plain, option, kind):
    cfg = compose_cfg([f"speculative={option}"])
    validate(cfg)
    speculative = hydra.utils.instantiate(cfg.speculative)
    assert isinstance(speculative, kind)
    engine = engine_with(model, speculative)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == plain


@pytest.mark.slow
def test_ngram_sampling_follows_the_target_distribution():
    """Toy vocabulary of 32 at a low temperature: the random model's outputs loop, so prompt
    lookup finds drafts and the target keeps some and rejects others. Each draft judged is
    kept with probability p(x) under the target's exact (filtered, penalised) distribution at
    its position, and each emitted token's randomised probability integral transform is
    uniform (resampling from p without x adds no bias)."""
    target = random_model("llama", "tiny", seed=5, vocab_size=32)
    engine = build_engine(
        target,
        FreeListAllocator,
        partial(FCFSScheduler, max_num_seqs=64),
        num_blocks=256,
        speculative=NGram(3, prompt_lookup_max=2, prompt_lookup_min=1),
    )
    proposed, propose = [], engine.proposer.propose

    def keep(work, row_for):
        proposals = propose(work, row_for)
        proposed.extend(
            (s.seq.request_id, s.seq.num_tokens, p.tokens)
            for s, p in zip(work, proposals, strict=True)
        )
        return proposals

    engine.proposer.propose = keep
    params = [
        SamplingParams(temperature=0.3, top_k=12, repetition_penalty=1.05, max_tokens=16, seed=s)
        for s in range(200)
    ]
    prompt = [3, 1, 4, 1, 5]
    outputs = tokens(engine.generate([prompt] * len(params), params))
    seqs = [prompt + out for out in outputs]
    logits = np.array(target.model(mx.array(seqs)).astype(mx.float32))

    def p(b: int, pos: int) -> np.ndarray:  # the target's law of seqs[b][pos]
        row = SampleRow(params[b], seqs[b][:pos], len(prompt), None)
        probs = filtered_probs(adjust_logits(logits[b, pos - 1], row), params[b])
        return probs / probs.sum()

    kept = expected = variance = 0.0
    for request_id, start, drafts in proposed:
        b = int(request_id.removeprefix("gen-"))
        for j, x in enumerate(drafts):  # judged up to the first rejection
            px = p(b, start + j)[x]
            kept += seqs[b][start + j] == x
            expected, variance = expected + px, variance + px * (1 - px)
            if seqs[b][start + j] != x:
                break
    assert variance > 100 and 300 < kept < sum(len(d) for _, _, d in proposed) / 2
    assert abs(kept - expected) < 4 * np.sqrt(variance), (kept, expected)
    rng = np.random.default_rng(7)
    pit = []
    for b, out in enumerate(outputs):
        for i in range(1, len(out)):  # every token after the first came from a verification
            probs = p(b, len(prompt) + i)
            pit.append(probs[: out[i]].sum() + rng.random() * probs[out[i]])
    counts = np.histogram(pit, bins=10, range=(0, 1))[0]
    uniform = np.full(10, len(pit) / 10)
    assert ((counts - uniform) ** 2 / uniform).sum() < CHI2_999[9]


@pytest.mark.slow
def test_prompt_lookup_drafts_a_trained_models_copy_of_its_prompt(smollm2):
    """SmolLM2-135M asked to repeat a paragraph copies it: prompt lookup proposes from the
    prompt and the target keeps most of it, with the tokens of plain decoding."""
    paragraph = (
        "The committee met on Tuesday to review the budget for the new library. After a long "
        "discussion, the members agreed to fund the children's reading room."
    )
    request = f"Repeat the following paragraph exactly, word for word:\n\n{paragraph}"
    chat = [{"role": "user", "content": request}]
    prompt = list(smollm2.tokenizer.apply_chat_template(chat, add_generation_prompt=True))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sized = {"block_size": 16, "num_blocks": 32}
    plain = tokens(engine_with(smollm2, None, **sized).generate([prompt], params))
    lookup = NGram(4, prompt_lookup_max=4, prompt_lookup_min=2)
    engine = engine_with(smollm2, lookup, **sized)
    assert tokens(engine.generate([prompt], params)) == plain
    (row,) = engine.recorder.requests
    assert row["spec_accepted"] >= 12 and row["spec_accepted"] / row["spec_proposed"] > 0.5
