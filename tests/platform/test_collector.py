"""The collector pause around a replay (harness/platform/collector.py): off inside, put back
as it was after, and what only it could free, made inside, counted by hand."""

from __future__ import annotations

import gc

from harness.platform.collector import collector_paused


def test_the_collector_is_off_inside_and_counts_the_cycles_made_there():
    assert gc.isenabled()
    with collector_paused() as paused:
        assert not gc.isenabled()
        loop: list = []
        loop.append(loop)  # one object in a cycle: reference counting never frees it
        pair_a: dict = {}
        pair_b = {"a": pair_a}
        pair_a["b"] = pair_b  # two more
        del loop, pair_a, pair_b
        acyclic = [1, 2, 3]
        del acyclic  # freed by its count, never the collector's
    assert gc.isenabled()
    # The three, and whatever another thread of the test process left meanwhile (none, most
    # runs: the count is a floor, not an exact figure, to stay true beside other threads).
    assert paused.cyclic >= 3


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
