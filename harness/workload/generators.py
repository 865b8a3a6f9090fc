"""Seeded workload generators: synthetic, shared_prefix, multi_turn, mooncake_like (Hydra
``_target_``s).

Each draws everything from ``np.random.default_rng(seed)`` in a fixed order, so the same
arguments give the same trace. Token ids are uniform on ``[1, vocab_size)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from harness.workload.distributions import ArrivalProcess, LengthDist
from harness.workload.public import Record, hashed_trace
from harness.workload.traces import Trace, TraceRequest, max_prefix_hit_rate, random_prompts


def describe_component(component: Any) -> Any:
    """A distribution or arrival process (a dataclass) as trace metadata: its type and fields."""
    return {"type": type(component).__name__, **asdict(component)}


def make_trace(
    requests: list[TraceRequest],
    generator: str,
    params: dict[str, Any],
    seed: int,
    vocab_size: int,
) -> Trace:
    """The generator's ``requests`` as a Trace with the metadata every generator records."""
    # by arrival (stable: ties keep order); follow-up turns after, in the order given, their
    # arrival_time a think time from the end of the turn before (TraceRequest.after)
    firsts = sorted((r for r in requests if r.after is None), key=lambda r: r.arrival_time)
    ordered = tuple(firsts + [r for r in requests if r.after is not None])
    follow_ups = len(ordered) > len(firsts)
    metadata = {
        "generator": generator,
        "parameters": params,
        "seed": seed,
        "vocab_size": vocab_size,
        # a follow-up's prompt holds answers known only once sent: the run's summary has it
        "max_prefix_hit_rate": None if follow_ups else max_prefix_hit_rate(ordered),
    }
    return Trace(ordered, metadata)


def check_count(key: str, value: int) -> None:
    """A count of requests or conversations (``key``: its config knob) is >= 0."""
    if value < 0:
        raise ValueError(f"{key}={value} is invalid: a count >= 0")


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
    check_count("trace.num_requests", num_requests)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    times = arrival.sample(num_requests, rng)
    plens, olens = prompt_len.sample(num_requests, rng), output_len.sample(num_requests, rng)
    classes = [(int(c["priority"]), float(c["weight"])) for c in priorities or ()] or [(0, 1.0)]
    weights = np.array([w for _, w in classes])
    drawn = rng.choice(len(classes), num_requests, p=weights / weights.sum())
    slo_of = {int(p): (v.get("ttft"), v.get("tpot")) for p, v in (slos or {}).items()}
    prompts = random_prompts(rng, plens, vocab_size)
    requests = []
    for i in range(num_requests):
        prio = classes[drawn[i]][0]
        ttft, tpot = slo_of.get(prio, (None, None))
        requests.append(
            TraceRequest(f"req-{i}", float(times[i]), prompts[i], int(olens[i]), prio, ttft, tpot)
        )
    params = {
        "num_requests": num_requests,
        "arrival": describe_component(arrival),
        "prompt_len": describe_component(prompt_len),
        "output_len": describe_component(output_len),
        "priorities": [{"priority": p, "weight": w} for p, w in classes],
        "slos": {str(p): {"ttft": t, "tpot": s} for p, (t, s) in slo_of.items()},
    }
    return make_trace(requests, "synthetic", params, seed, vocab_size)


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
    check_count("trace.num_system_prompts", num_system_prompts)
    check_count("trace.users_per_prompt", users_per_prompt)
    _check_vocab(vocab_size)
    if system_prompt_len < 1:
        raise ValueError(f"system_prompt_len must be >= 1, got {system_prompt_len}")
    rng = np.random.default_rng(seed)
    n = num_system_prompts * users_per_prompt
    times = arrival.sample(n, rng)
    order = rng.permutation(n)
    ulens, olens = user_prompt_len.sample(n, rng), output_len.sample(n, rng)
    systems = random_prompts(rng, [system_prompt_len] * num_system_prompts, vocab_size)
    users = random_prompts(rng, ulens, vocab_size)
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
        "user_prompt_len": describe_component(user_prompt_len),
        "output_len": describe_component(output_len),
        "arrival": describe_component(arrival),
    }
    return make_trace(requests, "shared_prefix", params, seed, vocab_size)


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
    check_count("trace.num_conversations", num_conversations)
    _check_vocab(vocab_size)
    if turns < 1 or think_time < 0:
        raise ValueError(f"need turns >= 1 and think_time >= 0, got {turns}, {think_time}")
    rng = np.random.default_rng(seed)
    starts = arrival.sample(num_conversations, rng)
    n = num_conversations * turns
    ulens, olens = user_prompt_len.sample(n, rng), output_len.sample(n, rng)
    thinks = rng.exponential(think_time, n) if think_time > 0 else np.zeros(n)
    users = random_prompts(rng, ulens, vocab_size)
    answers = random_prompts(rng, olens, vocab_size)
    requests = []
    for c in range(num_conversations):
        prompt = users[c * turns][:0]
        t = float(starts[c])
        for k in range(turns):
            i = c * turns + k
            prompt = prompt + (answers[i - 1] if k else prompt[:0]) + users[i]
            requests.append(TraceRequest(f"conv{c}-turn{k}", t, prompt, int(olens[i])))
            t += float(thinks[i])
    params = {
        "num_conversations": num_conversations,
        "turns": turns,
        "user_prompt_len": describe_component(user_prompt_len),
        "output_len": describe_component(output_len),
        "arrival": describe_component(arrival),
        "think_time": think_time,
    }
    return make_trace(requests, "multi_turn", params, seed, vocab_size)


def mooncake_like(
    num_requests: int,
    arrival: ArrivalProcess,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    max_len: int = 2048,
    hash_block: int = 64,
    num_system_prompts: int = 8,
    system_blocks: int = 4,
    turns: float = 3.0,
    user_blocks: LengthDist,
    output_len: LengthDist,
    think_time: float = 30.0,
) -> Trace:
    """Multi-turn sessions over shared system prompts, as block hash ids (Mooncake's form,
    harness/workload/public.py): a session starts at each ``arrival``, picks one of
    ``num_system_prompts`` prompts of ``system_blocks`` blocks, and runs a Geometric number
    of turns (mean ``turns``, at least 1), ``think_time`` s apart on average (exponential).
    Turn k's prompt is the system prompt, every earlier turn's user blocks and answer blocks
    (the answer as fresh ids: the trace's answer, not the engine's), then ``user_blocks`` new
    blocks, the last one partial. Requests are the first ``num_requests`` by arrival."""
    check_count("trace.num_requests", num_requests)
    _check_vocab(vocab_size)
    if turns < 1 or hash_block < 1 or system_blocks < 0:
        raise ValueError(
            "mooncake_like: turns >= 1, hash_block >= 1 and system_blocks >= 0 required"
        )
    rng = np.random.default_rng(seed)
    starts = arrival.sample(num_requests, rng)  # enough sessions: each has >= 1 request
    next_id = num_system_prompts * system_blocks  # ids below: the system prompts' blocks
    records: list[Record] = []
    horizon = np.inf
    for start in starts:
        if start > horizon:
            break  # every later session starts after the requests already kept
        system = int(rng.integers(num_system_prompts))
        history = list(range(system * system_blocks, (system + 1) * system_blocks))
        at = float(start)
        for _ in range(int(rng.geometric(1 / turns))):
            new = int(user_blocks.sample(1, rng)[0])
            ids = history + list(range(next_id, next_id + new))
            next_id += new
            length = len(ids) * hash_block - int(rng.integers(hash_block))
            output = int(output_len.sample(1, rng)[0])
            records.append(Record(at, length, output, tuple(ids)))
            answer = -(-output // hash_block)
            history = ids + list(range(next_id, next_id + answer))
            next_id += answer
            at += float(rng.exponential(think_time))
        if len(records) >= num_requests and horizon == np.inf:
            # The num_requests-th arrival so far: later records only lower it, so no
            # session starting after it can give one of the first num_requests.
            horizon = np.partition([r.arrival for r in records], num_requests - 1)[num_requests - 1]
    records.sort(key=lambda r: r.arrival)
    params = {
        "num_requests": num_requests,
        "arrival": describe_component(arrival),
        "hash_block": hash_block,
        "num_system_prompts": num_system_prompts,
        "system_blocks": system_blocks,
        "turns": turns,
        "user_blocks": describe_component(user_blocks),
        "output_len": describe_component(output_len),
        "think_time": think_time,
        "seed": seed,
    }
    return hashed_trace(
        "mooncake_like", records[:num_requests], params, max_len, vocab_size, seed, hash_block
    )
