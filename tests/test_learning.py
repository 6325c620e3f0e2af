"""Throughput learning and adaptive admission windows, driven by an explicit clock."""

from __future__ import annotations

import pytest
from fedpool.federation.learning import ThroughputEstimator, WindowController, WindowObservation


def test_throughput_counts_busy_time_only() -> None:
    est = ThroughputEstimator(alpha=1.0, period_s=2.0)
    est.on_start(0.0)
    assert est.on_finish(100, 1.0) is None  # period not over yet
    # idle from 1.0 to 10.0: not counted
    est.on_start(10.0)
    rate = est.on_finish(100, 11.0)
    assert rate == pytest.approx(100.0)  # 200 tokens over 2 busy seconds


def test_faster_server_learns_a_higher_rate() -> None:
    fast, slow = ThroughputEstimator(alpha=0.5), ThroughputEstimator(alpha=0.5)
    t = 0.0
    for _ in range(10):
        fast.on_start(t)
        slow.on_start(t)
        fast.on_finish(40, t + 0.5)
        slow.on_finish(40, t + 1.0)
        t += 1.0
        fast.on_start(t - 0.5)
        fast.on_finish(40, t)
    assert fast.rate is not None and slow.rate is not None
    assert fast.rate == pytest.approx(2 * slow.rate, rel=0.1)


def obs(**kw: object) -> WindowObservation:
    base: dict[str, object] = {"throughput": 100.0, "per_token_latency_s": 0.01, "scraped_waiting": 0.0,
                               "rate_limited": 0, "window_was_full": True}
    return WindowObservation(**{**base, **kw})  # type: ignore[arg-type]


def test_window_grows_while_the_engine_does_not_queue_and_shrinks_on_queueing() -> None:
    ctl = WindowController(capacity=8, window=4, max_factor=1.0)
    assert ctl.decide(obs(throughput=100)).window == 5  # at least +1
    assert ctl.decide(obs(throughput=120)).window == pytest.approx(6.25)  # then × 1.25
    d = ctl.decide(obs(throughput=120, scraped_waiting=3))  # no in-flight count given: a quarter off
    assert d.window == pytest.approx(6.25 * 0.75) and "queue" in d.reason
    assert ctl.limit == 4
    # With an exact in-flight count the window drops in one step to what the engine runs plus the allowance.
    big = WindowController(capacity=256)
    d = big.decide(obs(scraped_waiting=150, inflight=250))
    assert d.window == pytest.approx(250 - 150 + 0.05 * 256)
    # The allowance is a share of the capacity, not of the window: a queue under it no longer shrinks a
    # small window (it used to ratchet windows down under prompt-heavy load).
    assert big.decide(obs(scraped_waiting=10, inflight=100, window_was_full=False)).reason == "steady"
    assert big.decide(obs(scraped_waiting=3, inflight=100)).reason == "full window, engine not queueing"


def test_window_shrinks_on_429_and_latency_inflation_and_respects_bounds() -> None:
    ctl = WindowController(capacity=4, inflation_limit=3.0)
    assert ctl.window == 4
    assert ctl.decide(obs()).window == 4  # already at capacity: the ceiling holds
    assert ctl.decide(obs(rate_limited=2)).window == 3
    assert ctl.decide(obs(per_token_latency_s=0.05)).reason == "latency inflation"
    for _ in range(20):
        ctl.decide(obs(rate_limited=1))
    assert ctl.limit == 1  # never below one
    assert ctl.decide(obs(window_was_full=False)).reason == "steady"


def test_a_lasting_shift_of_the_mix_becomes_the_new_latency_baseline() -> None:
    """Per-token latency jumps when long-prompt requests arrive: one shrink for the sudden inflation, then
    the new level is the baseline and the window is left alone (against the best ever seen it would
    shrink every period down to 1)."""
    ctl = WindowController(capacity=64, inflation_limit=3.0)
    for _ in range(4):
        ctl.decide(obs(per_token_latency_s=0.001))
    assert ctl.decide(obs(per_token_latency_s=0.02)).reason == "latency inflation"
    reasons = [ctl.decide(obs(per_token_latency_s=0.02)).reason for _ in range(12)]
    assert reasons[-6:].count("latency inflation") == 0 and ctl.limit >= 16
    off = WindowController(capacity=4)  # the default: off
    off.decide(obs(per_token_latency_s=0.001))
    off.decide(obs(per_token_latency_s=0.001))
    assert off.decide(obs(per_token_latency_s=9.0)).reason != "latency inflation"
