"""The offline prefix-cache optimum (Belady) against hand computation, the trace bound and
every online eviction policy of the radix allocator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocators.base import blocks_for
from allocators.offline import (
    HitStats,
    Request,
    belady_hit_rate,
    online_hit_rate,
    reusable_blocks,
    trace_requests,
)
from allocators.radix import RadixAllocator
from harness.workload.traces import TraceRequest, max_prefix_hit_rate

POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "slru"]


def radix(budget: int, block_size: int, eviction: str = "lru") -> RadixAllocator:
    return RadixAllocator(num_blocks=budget, block_size=block_size, eviction=eviction)


def test_belady_keeps_the_block_needed_soonest_where_lru_thrashes() -> None:
    # block_size 2, budget 3. Each request is one 2-token prefix X, Y or Z plus a unique
    # token: it can hit one block and holds two (the prefix and its partial last block).
    # Cycling X Y Z X Y Z, LRU always evicts exactly the prefix needed next: no hits.
    # Belady at r2 (Z) must evict one of X (next used r3) and Y (r4): it drops Y, so r3
    # hits X; at r4 (Y) it drops X (next used never) over Z (r5), so r5 hits Z.
    # Hits: 2 blocks = 4 of 6 * 3 = 18 prompt tokens; evictions at r2 and r4.
    x, y, z = (1, 1), (2, 2), (3, 3)
    requests = [(p + (10 + i,), ()) for i, p in enumerate([x, y, z, x, y, z])]
    assert belady_hit_rate(requests, block_size=2, budget=3) == HitStats(4, 18, 2)
    assert online_hit_rate(lambda: radix(3, 2), requests) == HitStats(0, 18, 4)


def test_ties_in_next_use_evict_the_child_before_its_parent() -> None:
    # block_size 2, budget 4. r0 = A B + x caches A and AB (its third block is partial).
    # r1 = Q R + y needs 3 new blocks with 2 free: one eviction, and A and AB are both
    # next used by r2. Evicting A would orphan AB (r2 could hit nothing); deeper first
    # evicts AB, so r2 = A B + z still hits A: 2 of 15 prompt tokens. r2 then needs 2 new
    # blocks with 1 free, a second eviction (QR, never used again and deeper than Q).
    requests: list[Request] = [((1, 1, 2, 2, 7), ()), ((3, 3, 4, 4, 8), ()), ((1, 1, 2, 2, 9), ())]
    assert belady_hit_rate(requests, block_size=2, budget=4) == HitStats(2, 15, 2)


def test_a_whole_block_prompt_recomputes_its_last_block_even_when_cached() -> None:
    # (1, 2, 3, 4) in blocks of 2 can match only its first block; the second is cached but
    # recomputed into a new block, which with budget 2 evicts the cached copy.
    requests: list[Request] = [((1, 2, 3, 4), ()), ((1, 2, 3, 4), ())]
    assert belady_hit_rate(requests, block_size=2, budget=2) == HitStats(2, 8, 1)
    assert online_hit_rate(lambda: radix(2, 2), requests) == HitStats(2, 8, 1)


def test_output_blocks_are_cached_and_matchable() -> None:
    # The first request's output completes block (3, 4), which the second prompt reuses.
    requests: list[Request] = [((1, 2, 3), (4, 5)), ((1, 2, 3, 4, 6), ())]
    assert belady_hit_rate(requests, block_size=2, budget=3) == HitStats(4, 8, 0)


def test_reusable_blocks_are_the_distinct_blocks_hit_later() -> None:
    # Blocks of 2: (1, 1) is hit by r1 and r2 (counted once), (1, 1, 2, 2) by r2; (3, 3) is
    # cached but never matched again, and r2's (1, 1, 2, 2) is hit, not new.
    requests: list[Request] = [((1, 1, 2, 2, 5), ()), ((1, 1, 3, 3, 6), ()), ((1, 1, 2, 2, 7), ())]
    assert reusable_blocks(requests, block_size=2) == 2


def test_a_request_larger_than_the_budget_is_an_error_naming_the_fix() -> None:
    requests: list[Request] = [((1,) * 5, (2,) * 4)]
    with pytest.raises(ValueError, match="needs 3 blocks.*budget is 2.*at least 3"):
        belady_hit_rate(requests, block_size=4, budget=2)
    with pytest.raises(ValueError, match="budget is 2"):
        online_hit_rate(lambda: radix(2, 4), requests)


def test_no_requests_hit_nothing() -> None:
    assert belady_hit_rate([], block_size=4, budget=1) == HitStats(0, 0, 0)
    assert HitStats(0, 0, 0).hit_rate == 0.0


def test_trace_outputs_are_fresh_ids_of_the_output_length() -> None:
    trace = [TraceRequest("a", 0.0, (5, 9), 3), TraceRequest("b", 0.0, (7,), 2)]
    (pa, oa), (pb, ob) = trace_requests(trace)
    assert (pa, pb) == ((5, 9), (7,))
    assert (len(oa), len(ob)) == (3, 2)
    assert min(oa + ob) > 9 and len(set(oa + ob)) == 5


tokens = st.integers(1, 3)  # a tiny alphabet, so blocks collide and outputs can be reused


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[Request], int, int]:
    """Prompts cut from a few shared prefixes plus a tail; a budget from the largest request
    (nothing fits twice) to a few blocks more."""
    block_size = draw(st.integers(1, 4))
    prefixes = draw(st.lists(st.lists(tokens, max_size=12), min_size=1, max_size=3))
    requests: list[Request] = []
    for _ in range(draw(st.integers(1, 12))):
        base = draw(st.sampled_from(prefixes))
        prompt = base[: draw(st.integers(0, len(base)))] + draw(st.lists(tokens, max_size=6))
        output = draw(st.lists(tokens, max_size=6))
        requests.append((tuple(prompt or [1]), tuple(output)))
    largest = max(blocks_for(len(p) + len(o), block_size) for p, o in requests)
    return requests, block_size, draw(st.integers(largest, largest + 6))


@pytest.mark.parametrize("eviction", POLICIES)
@settings(max_examples=150, deadline=None)
@given(workload=workloads())
def test_belady_is_at_least_every_online_policy(
    eviction: str, workload: tuple[list[Request], int, int]
) -> None:
    requests, block_size, budget = workload
    best = belady_hit_rate(requests, block_size, budget)
    online = online_hit_rate(lambda: radix(budget, block_size, eviction), requests)
    assert best.prompt_tokens == online.prompt_tokens
    assert best.hit_tokens >= online.hit_tokens


@settings(max_examples=150, deadline=None)
@given(workload=workloads())
def test_with_an_infinite_budget_belady_reaches_the_trace_bound(
    workload: tuple[list[Request], int, int],
) -> None:
    requests, block_size, _ = workload
    trace = [TraceRequest(f"r{i}", 0.0, p, len(o) + 1) for i, (p, o) in enumerate(requests)]
    replay = trace_requests(trace)
    infinite = sum(blocks_for(len(p) + len(o), block_size) for p, o in replay)
    best = belady_hit_rate(replay, block_size, infinite)
    assert best.evictions == 0
    assert best.hit_rate == max_prefix_hit_rate(trace, block_size)
    # Nothing is evicted, so the online replay is the same model and must agree exactly.
    assert online_hit_rate(lambda: radix(infinite, block_size), replay) == best
    # Room for every block hit later, plus the request running, is enough for Belady.
    largest = max(blocks_for(len(p) + len(o), block_size) for p, o in replay)
    enough = reusable_blocks(replay, block_size) + largest
    assert belady_hit_rate(replay, block_size, enough).hit_tokens == best.hit_tokens


def test_bench_hit_rates_put_belady_above_every_policy_at_every_budget() -> None:
    """The radix_prefix reproduction's curve (harness.bench.eviction.hit_rates): a row per
    policy, Belady and the bound at each budget; Belady is never beaten and, at the working
    set, reaches the bound."""
    from harness.bench import eviction
    from harness.workload.distributions import Poisson, Uniform
    from harness.workload.generators import shared_prefix

    trace = shared_prefix(num_system_prompts=3, users_per_prompt=4, system_prompt_len=48,
                          user_prompt_len=Uniform(4, 20), output_len=Uniform(4, 20),
                          arrival=Poisson(1.0), seed=0, vocab_size=100)  # fmt: skip
    curve = eviction.hit_rates(trace, 16, [0.3, 1.0])
    assert list(curve["policy"].unique()) == [*eviction.POLICIES, eviction.BELADY, eviction.BOUND]
    for _, at in curve.groupby("budget"):
        rates = at.set_index("policy")["hit_rate"]
        assert rates[eviction.BELADY] >= rates[list(eviction.POLICIES)].max()
        assert rates[eviction.BOUND] == pytest.approx(max_prefix_hit_rate(trace, 16))
    full = curve[curve["fraction"] == 1.0].set_index("policy")["hit_rate"]
    assert full[eviction.BELADY] == pytest.approx(full[eviction.BOUND])
