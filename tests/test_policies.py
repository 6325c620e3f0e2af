"""Every routing policy through the public interface (`place` on a route of candidates), with an injected Random."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import pytest

from fedpool.benchmarks.baselines import BASELINES
from fedpool.federation import Candidate, Endpoint, Hold, InferenceRequest, Policy, make_policy, policy_names
from fedpool.federation.core.policy import registered_policies
from fedpool.federation.routing.policies import SampledPolicy


def cand(sid: str, inflight: int = 0, weight: float = 1.0, waiting: float = 0.0, window: int = 8) -> Candidate:
    return Candidate(id=sid, inflight=inflight, window=window, capacity=window, weight=weight,
                     scraped_waiting=waiting)


def req(prompt: str = "prompt") -> InferenceRequest:
    return InferenceRequest(request_id="r1", model="m", endpoint=Endpoint.COMPLETIONS, prompt=prompt)


CTX = req()


class Pool:
    """A route as a policy sees it (`RouteView`): these candidates, every one with room, of one server kind."""

    def __init__(self, candidates: list[Candidate]):
        self.free = self.servers = list(candidates)
        self.kinds = 1
        self.memo: dict[object, object] = {}
        self.key = ("m", None, None, None)

    def free_candidates(self, limit: int | None, tried: set[str], rng: random.Random) -> list[Candidate]:
        free = [c for c in self.free if c.id not in tried] or self.free
        return free if limit is None or len(free) <= limit else rng.sample(free, limit)


def choose(policy: Policy, candidates: list[Candidate], request: InferenceRequest = CTX) -> Candidate:
    """The policy's pick among `candidates` (all with room), asked as the dispatcher asks it."""
    placed = policy.place(Pool(candidates), request, set())  # type: ignore[arg-type]
    assert not isinstance(placed, Hold), placed
    return placed


def test_known_policies_registered_by_name() -> None:
    assert {"round_robin", "random", "least_inflight", "power_of_two", "capacity_weighted",
            "prefix_affinity"} <= set(policy_names())
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")


def test_the_product_offers_only_its_own_policies_and_the_benchmarks_add_the_baselines() -> None:
    """The baselines (benchmarks/baselines.py) are known to `make_policy` only where that module is imported (the
    tests import it in conftest.py); the product, and so the CLI's `--policy`, offers its own."""
    code = ("import fedpool.federation as f; a = f.policy_names(); import fedpool.benchmarks.baselines; "
            "print(' '.join(a)); print(' '.join(f.policy_names()))")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    product, with_baselines = (set(line.split()) for line in shown.stdout.splitlines())
    assert product == {"capacity_weighted", "earliest_finish", "planned", "planned_finish"}
    assert with_baselines == product | set(BASELINES)


def test_round_robin_cycles_in_id_order() -> None:
    policy = make_policy("round_robin")
    cands = [cand("b"), cand("a"), cand("c")]
    assert [choose(policy, cands).id for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_inflight_picks_fewest_and_breaks_ties_randomly() -> None:
    policy = make_policy("least_inflight", random.Random(1))
    assert choose(policy, [cand("a", 3), cand("b", 1), cand("c", 2)], CTX).id == "b"
    picks = Counter(choose(policy, [cand("a", 1), cand("b", 1)], CTX).id for _ in range(200))
    assert picks["a"] > 50 and picks["b"] > 50  # no server always wins a tie


def test_power_of_two_never_picks_the_worse_of_two() -> None:
    policy = make_policy("power_of_two", random.Random(2))
    picks = Counter(choose(policy, [cand("busy", 7), cand("idle", 0)], CTX).id for _ in range(50))
    assert picks == {"idle": 50}


def test_capacity_weighted_prefers_lowest_expected_wait() -> None:
    policy = make_policy("capacity_weighted", random.Random(3))
    # A100-like weight 2 with 3 in flight: wait (3+1)/2 = 2; V100-like weight 1 with 2 in flight: 3.
    assert choose(policy, [cand("a100", 3, weight=2.0), cand("v100", 2, weight=1.0)], CTX).id == "a100"
    assert choose(policy, [cand("a100", 3, weight=2.0, waiting=4), cand("v100", 2)], CTX).id == "v100"


def test_capacity_weighted_shares_in_proportion_to_weight() -> None:
    policy = make_policy("capacity_weighted", random.Random(4))
    inflight = Counter({"fast": 0, "slow": 0})
    for _ in range(30):
        cands = [cand("fast", inflight["fast"], weight=2.0, window=100), cand("slow", inflight["slow"], window=100)]
        inflight[choose(policy, cands).id] += 1
    assert 19 <= inflight["fast"] <= 21 and inflight["fast"] + inflight["slow"] == 30


def test_prefix_affinity_is_sticky_and_load_bounded() -> None:
    policy = make_policy("prefix_affinity", random.Random(5), epsilon=0.25)
    cands = [cand(s) for s in ("a", "b", "c", "d")]
    home = choose(policy, cands, req("shared prefix")).id
    assert all(choose(policy, cands, req("shared prefix")).id == home for _ in range(5))
    # once the home server carries more than (1+ε)× the average, the same prefix goes elsewhere
    loaded = [cand(c.id, 6 if c.id == home else 0) for c in cands]
    assert choose(policy, loaded, req("shared prefix")).id != home


def test_policies_are_deterministic_given_the_seed() -> None:
    """Those that place by sampling and a picker (the planning policies place within a dispatcher: their
    simulations, in tests/test_planner.py and tests/test_finish.py, are deterministic)."""
    for name in [n for n in policy_names() if issubclass(registered_policies()[n], SampledPolicy)]:
        cands = [cand(s, i % 3) for i, s in enumerate("abcdef")]
        first = [choose(make_policy(name, random.Random(9)), cands).id for _ in range(3)]
        again = [choose(make_policy(name, random.Random(9)), cands).id for _ in range(3)]
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
    picks = _Counter(choose(policy, idle).id for _ in range(2000))
    assert abs(picks["a"] - 2000 * 100 / 203) <= 2, picks  # stride scheduling: exact turns, no drift
    fast = [Candidate("v100", 0, 64, 64, 100.0), Candidate("a100", 0, 64, 64, 200.0)]
    picks = _Counter(choose(policy, fast).id for _ in range(300))
    assert abs(picks["a100"] - 200) <= 2, picks  # twice the speed, twice the share while both are idle
    # Busy: the expected wait decides, and near-equal waits are a tie, taken in turns by speed.
    busy = [Candidate("a", 3, 64, 64, 100.0), Candidate("b", 3, 64, 64, 105.0)]
    picks = _Counter(choose(policy, busy).id for _ in range(1000))
    assert abs(picks["a"] - 1000 * 100 / 205) <= 2, picks
    unequal = [Candidate("v100", 3, 64, 64, 100.0), Candidate("a100", 3, 64, 64, 200.0)]
    assert {choose(policy, unequal).id for _ in range(200)} == {"a100"}


def test_capacity_weighted_turns_follow_todays_speeds_not_the_history_of_turns() -> None:
    """Two equal idle servers take 200 turns; then one measures 4× slower (a stalled loop charged its
    requests). From then on it gets a fifth of the turns, at once. Counting turns since the start at today's
    weight gave it none for the next 300 (the 276/24 split CI saw between two equal servers)."""
    policy = make_policy("capacity_weighted", random.Random(5))
    equal = [cand("a", 0, weight=100.0), cand("b", 0, weight=100.0)]
    first = Counter(choose(policy, equal).id for _ in range(200))
    assert first == {"a": 100, "b": 100}
    slow = [cand("a", 0, weight=25.0), cand("b", 0, weight=100.0)]
    after = Counter(choose(policy, slow).id for _ in range(100))
    assert abs(after["a"] - 20) <= 1, after
    again = Counter(choose(policy, equal).id for _ in range(100))  # measured equal again: even
    assert abs(again["a"] - 50) <= 2, again


def test_capacity_weighted_gives_equal_turns_to_no_server_by_name() -> None:
    """Two equal servers, each busy while the other is sent one, then both idle: the both-idle turns split
    about evenly. Equal passes are common (a server that sat out rejoins at the clock), and giving them to the
    lower id handed s0 194 of 300 requests between two equal servers."""
    policy = make_policy("capacity_weighted", random.Random(6))
    both_idle: Counter[str] = Counter()
    for _ in range(300):
        choose(policy, [cand("a", 1, weight=100.0), cand("b", 0, weight=100.0)], CTX)
        choose(policy, [cand("a", 0, weight=100.0), cand("b", 1, weight=100.0)], CTX)
        both_idle[choose(policy, [cand("a", 0, weight=100.0), cand("b", 0, weight=100.0)], CTX).id] += 1
    assert 110 <= both_idle["a"] <= 190, both_idle
