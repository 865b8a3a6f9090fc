"""Seeded workload generators: synthetic, shared_prefix, multi_turn (Hydra ``_target_``s).

Each draws everything from ``np.random.default_rng(seed)`` in a fixed order, so the same
arguments give the same trace. Token ids are uniform on ``[1, vocab_size)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from harness.workload.distributions import ArrivalProcess, LengthDist
from harness.workload.traces import Trace, TraceRequest, max_prefix_hit_rate


def _describe(component: Any) -> Any:
    return {"type": type(component).__name__, **asdict(component)}


def _random_prompts(
    rng: np.random.Generator, lengths: Iterable[int], vocab_size: int
) -> list[tuple[int, ...]]:
    lengths = [int(n) for n in lengths]
    # Token 0 is left out: many tokenizers reserve it for padding/BOS.
    flat = rng.integers(1, vocab_size, sum(lengths)).tolist()
    out, start = [], 0
    for n in lengths:
        out.append(tuple(flat[start : start + n]))
        start += n
    return out


def _make_trace(
    requests: list[TraceRequest],
    generator: str,
    params: dict[str, Any],
    seed: int,
    vocab_size: int,
) -> Trace:
    ordered = tuple(sorted(requests, key=lambda r: r.arrival_time))  # stable: ties keep order
    metadata = {
        "generator": generator,
        "parameters": params,
        "seed": seed,
        "vocab_size": vocab_size,
        "max_prefix_hit_rate": max_prefix_hit_rate(ordered),
    }
    return Trace(ordered, metadata)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < 2:
        raise ValueError(
            f"vocab_size must be >= 2 (ids are drawn from [1, vocab_size)), got {vocab_size}"
        )


def synthetic(
    num_requests: int,
    seed: int,
    vocab_size: int,
    arrival: ArrivalProcess,
    prompt_len: LengthDist,
    output_len: LengthDist,
    priorities: Sequence[Mapping[str, float]] | None = None,
    slos: Mapping[int, Mapping[str, float]] | None = None,
) -> Trace:
    """Independent requests with random prompts.

    ``priorities``: classes ``[{priority: 0, weight: 0.8}, {priority: 1, weight: 0.2}]``,
    drawn per request by weight (default: everyone priority 0). ``slos``: per class
    ``{priority: {ttft: s, tpot: s}}``; a class without an entry has no SLO.
    """
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    times = arrival.sample(num_requests, rng)
    plens, olens = prompt_len.sample(num_requests, rng), output_len.sample(num_requests, rng)
    classes = [(int(c["priority"]), float(c["weight"])) for c in priorities or ()] or [(0, 1.0)]
    weights = np.array([w for _, w in classes])
    drawn = rng.choice(len(classes), num_requests, p=weights / weights.sum())
    slo_of = {int(p): (v.get("ttft"), v.get("tpot")) for p, v in (slos or {}).items()}
    prompts = _random_prompts(rng, plens, vocab_size)
    requests = []
    for i in range(num_requests):
        prio = classes[drawn[i]][0]
        ttft, tpot = slo_of.get(prio, (None, None))
        requests.append(
            TraceRequest(f"req-{i}", float(times[i]), prompts[i], int(olens[i]), prio, ttft, tpot)
        )
    params = {
        "num_requests": num_requests,
        "arrival": _describe(arrival),
        "prompt_len": _describe(prompt_len),
        "output_len": _describe(output_len),
        "priorities": [{"priority": p, "weight": w} for p, w in classes],
        "slos": {str(p): {"ttft": t, "tpot": s} for p, (t, s) in slo_of.items()},
    }
    return _make_trace(requests, "synthetic", params, seed, vocab_size)


def shared_prefix(
    num_system_prompts: int,
    users_per_prompt: int,
    system_prompt_len: int,
    user_prompt_len: LengthDist,
    output_len: LengthDist,
    arrival: ArrivalProcess,
    seed: int,
    vocab_size: int,
) -> Trace:
    """N system prompts x M users: each request is its system prompt plus a unique user part.

    The N*M requests arrive in a random interleaving, so a prefix cache sees each system
    prompt first cold, then warm.
    """
    _check_vocab(vocab_size)
    if system_prompt_len < 1:
        raise ValueError(f"system_prompt_len must be >= 1, got {system_prompt_len}")
    rng = np.random.default_rng(seed)
    n = num_system_prompts * users_per_prompt
    times = arrival.sample(n, rng)
    order = rng.permutation(n)
    ulens, olens = user_prompt_len.sample(n, rng), output_len.sample(n, rng)
    systems = _random_prompts(rng, [system_prompt_len] * num_system_prompts, vocab_size)
    users = _random_prompts(rng, ulens, vocab_size)
    requests = []
    for i, k in enumerate(order):
        sys_id, user = divmod(int(k), users_per_prompt)
        requests.append(
            TraceRequest(
                f"sys{sys_id}-user{user}",
                float(times[i]),
                systems[sys_id] + users[i],
                int(olens[i]),
            )
        )
    params = {
        "num_system_prompts": num_system_prompts,
        "users_per_prompt": users_per_prompt,
        "system_prompt_len": system_prompt_len,
        "user_prompt_len": _describe(user_prompt_len),
        "output_len": _describe(output_len),
        "arrival": _describe(arrival),
    }
    return _make_trace(requests, "shared_prefix", params, seed, vocab_size)


def multi_turn(
    num_conversations: int,
    turns: int,
    user_prompt_len: LengthDist,
    output_len: LengthDist,
    arrival: ArrivalProcess,
    think_time: float,
    seed: int,
    vocab_size: int,
) -> Trace:
    """Chat sessions: turn k+1's prompt is turn k's prompt + k's answer + new user tokens.

    The answer is placeholder tokens of length ``max_tokens`` (the engine's real output
    differs, so only the previous prompt is a reusable prefix of the same ids). Conversations
    start by ``arrival``; turn k+1 arrives an exponential think time (mean ``think_time`` s)
    after turn k's arrival. The trace is open-loop: a short think time can send a turn before
    the previous answer is finished.
    """
    _check_vocab(vocab_size)
    if turns < 1 or think_time < 0:
        raise ValueError(f"need turns >= 1 and think_time >= 0, got {turns}, {think_time}")
    rng = np.random.default_rng(seed)
    starts = arrival.sample(num_conversations, rng)
    n = num_conversations * turns
    ulens, olens = user_prompt_len.sample(n, rng), output_len.sample(n, rng)
    thinks = rng.exponential(think_time, n) if think_time > 0 else np.zeros(n)
    users = _random_prompts(rng, ulens, vocab_size)
    answers = _random_prompts(rng, olens, vocab_size)
    requests = []
    for c in range(num_conversations):
        prompt: tuple[int, ...] = ()
        t = float(starts[c])
        for k in range(turns):
            i = c * turns + k
            prompt = prompt + (answers[i - 1] if k else ()) + users[i]
            requests.append(TraceRequest(f"conv{c}-turn{k}", t, prompt, int(olens[i])))
            t += float(thinks[i])
    params = {
        "num_conversations": num_conversations,
        "turns": turns,
        "user_prompt_len": _describe(user_prompt_len),
        "output_len": _describe(output_len),
        "arrival": _describe(arrival),
        "think_time": think_time,
    }
    return _make_trace(requests, "multi_turn", params, seed, vocab_size)
