"""Every routing policy through the public interface, with an injected Random."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from fedpool.federation import Candidate, Endpoint, InferenceRequest, make_policy, policy_names


def cand(sid: str, inflight: int = 0, weight: float = 1.0, waiting: float = 0.0, window: int = 8) -> Candidate:
    return Candidate(id=sid, inflight=inflight, window=window, capacity=window, weight=weight,
                     scraped_waiting=waiting)


def req(prompt: str = "prompt") -> InferenceRequest:
    return InferenceRequest(request_id="r1", model="m", endpoint=Endpoint.COMPLETIONS, prompt=prompt)


CTX = req()


def test_known_policies_registered_by_name() -> None:
    assert {"round_robin", "random", "least_inflight", "power_of_two", "capacity_weighted",
            "prefix_affinity"} <= set(policy_names())
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")


def test_round_robin_cycles_in_id_order() -> None:
    policy = make_policy("round_robin")
    cands = [cand("b"), cand("a"), cand("c")]
    assert [policy.choose(cands, CTX).id for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_inflight_picks_fewest_and_breaks_ties_randomly() -> None:
    policy = make_policy("least_inflight", random.Random(1))
    assert policy.choose([cand("a", 3), cand("b", 1), cand("c", 2)], CTX).id == "b"
    picks = Counter(policy.choose([cand("a", 1), cand("b", 1)], CTX).id for _ in range(200))
    assert picks["a"] > 50 and picks["b"] > 50  # no server always wins a tie


def test_power_of_two_never_picks_the_worse_of_two() -> None:
    policy = make_policy("power_of_two", random.Random(2))
    picks = Counter(policy.choose([cand("busy", 7), cand("idle", 0)], CTX).id for _ in range(50))
    assert picks == {"idle": 50}


def test_capacity_weighted_prefers_lowest_expected_wait() -> None:
    policy = make_policy("capacity_weighted", random.Random(3))
    # A100-like weight 2 with 3 in flight: wait (3+1)/2 = 2; V100-like weight 1 with 2 in flight: 3.
    assert policy.choose([cand("a100", 3, weight=2.0), cand("v100", 2, weight=1.0)], CTX).id == "a100"
    assert policy.choose([cand("a100", 3, weight=2.0, waiting=4), cand("v100", 2)], CTX).id == "v100"


def test_capacity_weighted_shares_in_proportion_to_weight() -> None:
    policy = make_policy("capacity_weighted", random.Random(4))
    inflight = Counter({"fast": 0, "slow": 0})
    for _ in range(30):
        cands = [cand("fast", inflight["fast"], weight=2.0, window=100), cand("slow", inflight["slow"], window=100)]
        inflight[policy.choose(cands, CTX).id] += 1
    assert 19 <= inflight["fast"] <= 21 and inflight["fast"] + inflight["slow"] == 30


def test_prefix_affinity_is_sticky_and_load_bounded() -> None:
    policy = make_policy("prefix_affinity", random.Random(5), epsilon=0.25)
    cands = [cand(s) for s in ("a", "b", "c", "d")]
    home = policy.choose(cands, req("shared prefix")).id
    assert all(policy.choose(cands, req("shared prefix")).id == home for _ in range(5))
    # once the home server carries more than (1+ε)× the average, the same prefix goes elsewhere
    loaded = [cand(c.id, 6 if c.id == home else 0) for c in cands]
    assert policy.choose(loaded, req("shared prefix")).id != home


def test_policies_are_deterministic_given_the_seed() -> None:
    for name in policy_names():
        cands = [cand(s, i % 3) for i, s in enumerate("abcdef")]
        first = [make_policy(name, random.Random(9)).choose(cands, CTX).id for _ in range(3)]
        again = [make_policy(name, random.Random(9)).choose(cands, CTX).id for _ in range(3)]
        assert first == again, name


def test_capacity_weighted_shares_idle_servers_by_speed_and_breaks_near_ties_evenly() -> None:
    """Identical servers learn slightly different rates; both idle, they must share (it sent all to one, and
    the one starved of answers never had its rate measured again). Idle servers take turns in proportion to
    speed; busy servers whose expected waits are within 10% are a tie, shared the same way."""
    import random as _random
    from collections import Counter as _Counter

    from fedpool.federation.core.policy import Candidate
    from fedpool.federation.routing.policies import make_policy

    policy = make_policy("capacity_weighted", _random.Random(3))
    idle = [Candidate("a", 0, 64, 64, 100.0), Candidate("b", 0, 64, 64, 103.0)]
    picks = _Counter(policy.choose(idle, CTX).id for _ in range(2000))
    assert abs(picks["a"] - 2000 * 100 / 203) <= 2, picks  # stride scheduling: exact turns, no drift
    fast = [Candidate("v100", 0, 64, 64, 100.0), Candidate("a100", 0, 64, 64, 200.0)]
    picks = _Counter(policy.choose(fast, CTX).id for _ in range(300))
    assert abs(picks["a100"] - 200) <= 2, picks  # twice the speed, twice the share while both are idle
    # Busy: the expected wait decides, and near-equal waits are a tie, taken in turns by speed.
    busy = [Candidate("a", 3, 64, 64, 100.0), Candidate("b", 3, 64, 64, 105.0)]
    picks = _Counter(policy.choose(busy, CTX).id for _ in range(1000))
    assert abs(picks["a"] - 1000 * 100 / 205) <= 2, picks
    unequal = [Candidate("v100", 3, 64, 64, 100.0), Candidate("a100", 3, 64, 64, 200.0)]
    assert {policy.choose(unequal, CTX).id for _ in range(200)} == {"a100"}


def test_capacity_weighted_turns_follow_todays_speeds_not_the_history_of_turns() -> None:
    """Two equal idle servers take 200 turns; then one measures 4× slower (a stalled loop charged its
    requests). From then on it gets a fifth of the turns, at once. Counting turns since the start at today's
    weight gave it none for the next 300 (the 276/24 split CI saw between two equal servers)."""
    policy = make_policy("capacity_weighted", random.Random(5))
    equal = [cand("a", 0, weight=100.0), cand("b", 0, weight=100.0)]
    first = Counter(policy.choose(equal, CTX).id for _ in range(200))
    assert first == {"a": 100, "b": 100}
    slow = [cand("a", 0, weight=25.0), cand("b", 0, weight=100.0)]
    after = Counter(policy.choose(slow, CTX).id for _ in range(100))
    assert abs(after["a"] - 20) <= 1, after
    again = Counter(policy.choose(equal, CTX).id for _ in range(100))  # measured equal again: even
    assert abs(again["a"] - 50) <= 2, again


def test_capacity_weighted_gives_equal_turns_to_no_server_by_name() -> None:
    """Two equal servers, each busy while the other is sent one, then both idle: the both-idle turns split
    about evenly. Equal passes are common (a server that sat out rejoins at the clock), and giving them to the
    lower id handed s0 194 of 300 requests between two equal servers."""
    policy = make_policy("capacity_weighted", random.Random(6))
    both_idle: Counter[str] = Counter()
    for _ in range(300):
        policy.choose([cand("a", 1, weight=100.0), cand("b", 0, weight=100.0)], CTX)
        policy.choose([cand("a", 0, weight=100.0), cand("b", 1, weight=100.0)], CTX)
        both_idle[policy.choose([cand("a", 0, weight=100.0), cand("b", 0, weight=100.0)], CTX).id] += 1
    assert 110 <= both_idle["a"] <= 190, both_idle
