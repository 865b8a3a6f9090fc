"""The one engine builder: size the KV arena, build the allocators and the policy, then the
engine (the ``engine`` config group's ``_target_``, and what scripts and tests call).

    model ──┬── max_model_len (the model's max_position_embeddings at most)
            ├── draft model (speculative=draft, layerskip) ── its allocator, as many blocks
            │   as the target's (speculative=ngram: no draft model, no draft KV)
            ├── window rings (sliding-window layers) ── sized by the policy's max_num_seqs
            └── num_blocks (given, or what kv_cache_bytes pays for after the rings, at
                kv_bits: a quantized block's packed values, scales and biases)
    allocator(num_blocks, block_size) ── scheduler(allocator, draft=, window=, stopping=)
        ── LLMEngine
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Literal

from allocators.base import BlockAllocator
from allocators.tiers import KVTier
from harness.costmodel.profile import Profile, ProfileWarning, fingerprint
from harness.costmodel.profile import load as load_profile
from harness.costmodel.tiers import TierCost
from harness.engine.clock import CLOCKS
from harness.engine.kv_cache import KVFormat
from harness.engine.llm_engine import LLMEngine
from harness.engine.model_runner import key_cost
from harness.engine.modelled import ModelClock, ModelledProposer, ModelledRunner
from harness.engine.ngram import NGramProposer
from harness.engine.sampling_params import LogprobsMode
from harness.engine.speculative import DraftProposer, NGram, Speculative
from harness.engine.window import WindowGroup, WindowTables
from harness.platform.models import LoadedModel
from schedulers.base import Scheduler
from schedulers.kv_groups import WindowRings
from schedulers.stopping import Stopping

DEFAULT_MAX_MODEL_LEN = 2048  # for a model whose config sets no max_position_embeddings


def build_engine(
    model: LoadedModel,
    allocator: Callable[..., BlockAllocator],
    scheduler: Callable[..., Scheduler],
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_bytes: int | None = None,
    kv_bits: Literal[16, 8, 4] = 16,
    kv_group_size: Literal[32, 64, 128] = 64,
    max_model_len: int | None = None,
    speculative: Speculative | None = None,
    clock: Literal["virtual", "wall", "model"] = "virtual",
    profile: str | None = None,
    acceptance: float | None = None,
    seed: int = 0,
    record: bool = True,
    pipeline: bool = False,
    logprobs_mode: LogprobsMode = "raw_logprobs",
    kv_tier: KVTier | None = None,
    batch_steps: bool = True,
    decode_runs: bool = True,
) -> LLMEngine:
    """Size the arena (from ``num_blocks`` or a byte budget), then build the parts.

    ``allocator`` and ``scheduler`` are partials (Hydra's ``_partial_``): the allocator takes
    ``num_blocks`` and ``block_size``, the scheduler its allocator and what the engine sets.
    ``max_model_len`` (prompt + output tokens at most) is the model's, given to the
    scheduler: at most the model's ``max_position_embeddings``, which is also the default
    (``DEFAULT_MAX_MODEL_LEN`` when the model sets none), as vLLM derives it.

    ``speculative``: drafts the target verifies, from a draft model (``Speculation``, or
    ``LayerSkip``: the target's first layers) or from the sequence itself (``NGram``). A
    draft model's KV lives on an allocator built like the target's, with as many blocks,
    and counts in the budget: ``kv_cache_bytes`` then sizes both arenas (target + draft
    bytes per block). N-gram lookup keeps no KV: the target's arena has the budget.

    A model with sliding-window layers gets rings (harness/engine/window.py): one per
    running sequence, ``max_num_seqs`` of them, in an arena of their own (on the model
    clock, their tables alone: ``WindowTables``); ``num_blocks`` counts the full-attention
    layers' blocks, and ``kv_cache_bytes`` pays for the rings first. Its scheduler reads no
    prefix cache.

    ``kv_bits``: 16 stores K and V in the model's dtype; 8 or 4 quantizes them group-wise
    (``kv_group_size`` values per scale and bias, as ``mx.quantize``) in the arena, the
    draft's included, and ``kv_cache_bytes`` buys blocks at their quantized size. Not with
    sliding-window layers (their rings are not quantized); on the model clock, only with a
    roofline profile derived at the same format (``--kv-bits``: measured profiles price
    unquantized attention).

    ``clock``: ``virtual`` or ``wall`` (harness/engine/clock.py), or ``model``: no model
    forward, each step priced by the cost ``profile`` file (harness/engine/modelled.py),
    speculative drafts accepted with probability ``acceptance`` (default: the profile's
    measured rate). ``seed``, ``record``, ``pipeline``, ``logprobs_mode``, ``batch_steps``
    and ``decode_runs`` are ``LLMEngine``'s.

    ``kv_tier``: lower tiers under the prefix cache (the ``kv_tier`` group; a radix
    allocator's): the target's allocator is built with them, never the draft's. The real
    engine moves their bytes (harness/engine/tier_kv.py); on the model clock their moves are
    priced (harness/costmodel/tiers.py ``TierCost``: the profile's host link, the device
    sheet's disk; a disk tier needs a profile that prices the disk)."""
    if model.model is None and clock != "model":
        raise ValueError(
            f"model=shape ({model.name!r}) has no weights to run on engine.clock={clock}: "
            "set engine.clock=model engine.profile=PATH (a roofline of its config)"
        )
    modelled = _modelled(model, clock, profile, acceptance, speculative, pipeline, block_size)
    kv_format = KVFormat(kv_bits, kv_group_size)
    kv_format.check(model)
    if kv_format.quantized and model.window_layers:
        raise ValueError(
            f"engine.kv_bits={kv_bits} is not supported for the sliding-window layers of "
            f"model {model.name!r} (their rings are not quantized): use engine.kv_bits=16"
        )
    tier_cost = None
    if modelled is not None:
        _check_priced_kv(modelled[0], kv_format)
        if kv_tier is not None and kv_tier.enabled:
            # Prices the step's tier moves, and ``tier_cost.worth_loading`` is the prefix
            # cache's load-or-recompute rule (kv_tier.min_load_ratio) for the allocator.
            block_bytes = model.kv_bytes_per_token(kv_bits, kv_group_size) * block_size
            tier_cost = TierCost.of(
                modelled[0],
                block_bytes,
                block_size,
                disk=kv_tier.disk_blocks > 0,
                prefetch=kv_tier.prefetch,
                min_load_ratio=kv_tier.min_load_ratio,
            )
    limit = model.max_position_embeddings
    if max_model_len is not None and (isinstance(max_model_len, bool) or max_model_len < 1):
        raise ValueError(
            f"engine.max_model_len={max_model_len!r} is invalid: an int >= 1, or None for "
            "the model's max_position_embeddings"
        )
    if max_model_len is None:
        max_model_len = limit or DEFAULT_MAX_MODEL_LEN
    elif limit is not None and max_model_len > limit:
        raise ValueError(
            f"engine.max_model_len={max_model_len} exceeds model {model.name!r}'s "
            f"max_position_embeddings={limit}: lower it to {limit} or less"
        )
    if (num_blocks is None) == (kv_cache_bytes is None):
        raise ValueError("set exactly one of engine.num_blocks and engine.kv_cache_bytes")
    if num_blocks is not None and num_blocks < 1:
        raise ValueError(f"engine.num_blocks={num_blocks} must be at least 1")
    if speculative is not None and model.window_layers:
        raise ValueError(
            f"model {model.name!r} has sliding-window layers: speculative decoding is not "
            "supported with them (a rollback would have to restore overwritten ring "
            "slots); run it without speculative"
        )
    draft = speculative.draft_for(model) if speculative is not None else None
    if draft is not None and draft.window_layers:
        raise ValueError(
            f"draft model {draft.name!r} has sliding-window layers: speculative decoding "
            "needs a draft of full-attention layers only"
        )
    window = None
    if model.window_layers:
        window = partial(WindowRings, allocator, window=model.window, block_size=block_size)

    tokenizer = model.tokenizer
    stopping = Stopping(model.eos_token_ids, tokenizer.decode if tokenizer is not None else None)

    tiered = kv_tier is not None and kv_tier.enabled
    if tiered and model.window_layers:
        raise ValueError(
            f"kv_tier: model {model.name!r} has sliding-window layers, whose scheduler reads "
            "no prefix cache: use kv_tier=none"
        )
    if tiered and not allocator(num_blocks=1, block_size=block_size).caches_prefixes:
        raise ValueError(
            "kv_tier keeps blocks the prefix cache evicts, and this allocator keeps no prefix "
            "cache: use the radix allocator, or kv_tier=none"
        )
    # the load-or-recompute rule: priced on the model clock, else every lower-tier hit loads
    worth_loading = tier_cost.worth_loading if tier_cost is not None else None
    tiers = {"kv_tier": kv_tier, "worth_loading": worth_loading} if tiered else {}

    def policy(num_blocks: int) -> Scheduler:
        return scheduler(
            allocator(num_blocks=num_blocks, block_size=block_size, **tiers),
            max_model_len=max_model_len,
            num_lookahead_slots=speculative.num_draft_tokens if speculative else 0,
            draft=allocator(num_blocks=num_blocks, block_size=block_size) if draft else None,
            window=window,
            stopping=stopping,
        )

    if num_blocks is None:
        rings = 0
        if window is not None:
            # The rings come first, one per sequence the policy runs: ask a policy built
            # over a single block how many that is.
            ring_blocks = policy(1).rings.allocator.num_blocks
            rings = ring_blocks * block_size * len(model.window_layers)
            rings *= model.layer_bytes_per_token()
            kv_cache_bytes -= rings
        per_token = model.kv_bytes_per_token(kv_bits, kv_group_size)
        if draft is not None:
            per_token += draft.kv_bytes_per_token(kv_bits, kv_group_size)
        per_block = per_token * block_size
        num_blocks = kv_cache_bytes // per_block
        if num_blocks < 1:
            after = f" after {rings} for the window rings" if rings else ""
            raise ValueError(
                f"engine.kv_cache_bytes leaves {kv_cache_bytes} bytes{after}: no block of "
                f"{per_block} bytes; raise it"
            )
    built = policy(num_blocks)
    if modelled is not None:
        profile_, rate = modelled
        runner = ModelledRunner(
            block_size=block_size,
            key_cost=key_cost(model),
            vocab_size=model.vocab_size,
            acceptance=rate,
            seed=seed,
            window=model.window if window is not None else None,
            verifies=speculative is not None,
        )
        proposer = ModelledProposer(runner, seed) if draft is not None else None
        return LLMEngine(
            model,
            built.allocator,
            built,
            proposer=proposer,
            window=WindowTables(model, built.rings) if window is not None else None,
            runner=runner,
            clock=ModelClock(profile_, tiers=tier_cost),
            seed=seed,
            record=record,
            logprobs_mode=logprobs_mode,
            kv_format=kv_format,
            batch_steps=batch_steps,
            decode_runs=decode_runs,
        )
    proposer = None
    if isinstance(speculative, NGram):
        proposer = NGramProposer(speculative, model.vocab_size)
    elif draft is not None:
        proposer = DraftProposer(draft, built.draft.allocator, kv_format)
    rings = WindowGroup(model, built.rings) if window is not None else None
    return LLMEngine(
        model,
        built.allocator,
        built,
        proposer=proposer,
        window=rings,
        clock=CLOCKS[clock](),
        seed=seed,
        record=record,
        pipeline=pipeline,
        logprobs_mode=logprobs_mode,
        kv_format=kv_format,
        kv_tier=kv_tier,
        batch_steps=batch_steps,
        decode_runs=decode_runs,
    )


def _modelled(
    model: LoadedModel,
    clock: str,
    profile: str | None,
    acceptance: float | None,
    speculative: Speculative | None,
    pipeline: bool,
    block_size: int,
) -> tuple[Profile, float] | None:
    """The model clock's profile and acceptance rate, checked (None for a measuring clock)."""
    if clock != "model":
        if clock not in CLOCKS:
            raise ValueError(
                f"engine.clock={clock!r} is unknown: choose one of {', '.join(CLOCKS)}, model"
            )
        if profile is not None or acceptance is not None:
            raise ValueError(
                "engine.profile and engine.acceptance are the model clock's: set "
                "engine.clock=model, or drop them"
            )
        return None
    if profile is None:
        raise ValueError(
            "engine.clock=model needs engine.profile=PATH (a kvbench-calibrate profile, or "
            "python -m harness.costmodel.roofline for a device you do not have)"
        )
    priced = load_profile(profile)
    mine, theirs = fingerprint(model.shape()), priced.data["model"].get("fingerprint")
    if mine != theirs:
        raise ValueError(
            f"engine.profile={profile!r} prices model {priced.data['model'].get('name')!r} "
            f"(fingerprint {theirs}), not {model.name!r} ({mine}): calibrate this model, "
            "pick its model= group, or derive the roofline from the same shape (config, "
            "model.bits, model.dtype)"
        )
    if priced.data["block_size"] != block_size:  # its per-block costs were counted at its own
        warnings.warn(
            f"engine.profile={profile!r} was calibrated at block size "
            f"{priced.data['block_size']} and prices this engine's engine.block_size="
            f"{block_size}: calibrate at {block_size} for per-block costs that hold",
            ProfileWarning,
            stacklevel=3,
        )
    if pipeline:
        raise ValueError("engine.pipeline=true has nothing to overlap on engine.clock=model")
    if speculative is not None and speculative.name != "draft":
        raise ValueError(
            f"engine.clock=model prices drafts as the profile's calibrated draft model "
            f"(speculative=draft), not speculative={speculative.name}: use engine.clock=virtual"
        )
    rate = acceptance if acceptance is not None else priced.data.get("acceptance_rate")
    if speculative is not None and rate is None:
        raise ValueError(
            f"engine.profile={profile!r} measured no speculative acceptance: set "
            "engine.acceptance=A (0 <= A <= 1)"
        )
    if rate is not None and not (isinstance(rate, (int, float)) and 0 <= rate <= 1):
        raise ValueError(f"engine.acceptance={rate!r} is invalid: a number in [0, 1]")
    return priced, 0.0 if rate is None else float(rate)


def _check_priced_kv(profile: Profile, kv_format: KVFormat) -> None:
    """The profile prices K and V as the arena stores them: a roofline at its ``kv_format``
    (16 bits when it names none, as before it could), a measured profile at 16."""
    section = profile.data.get("roofline") or {}
    priced = section.get("kv_format", {"bits": 16, "group_size": kv_format.group_size})
    same = priced["bits"] == kv_format.bits
    if same and kv_format.quantized:
        same = priced["group_size"] == kv_format.group_size
    if not same:
        raise ValueError(
            f"engine.kv_bits={kv_format.bits} (kv_group_size={kv_format.group_size}) is not "
            f"what engine.profile prices (K and V at {priced['bits']} bits, group "
            f"{priced['group_size']}): derive the roofline with --kv-bits {kv_format.bits}, or "
            f"set engine.kv_bits={priced['bits']}"
        )
