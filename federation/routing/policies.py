"""The simple routing policies: each samples servers with room from the route's index and picks one.

`capacity_weighted` (the default) keeps long requests off kinds where they would outlast the run (the horizon
rule, federation/routing/horizon.py) and picks the lowest expected wait, taking turns among near-ties in
proportion to speed. The planning policies live beside it (planner.py, finish.py). `make_policy` builds any
registered policy by name.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Sequence
from typing import Any

from fedpool.federation.core.clientbook import client_size
from fedpool.federation.core.policy import _POLICIES, DispatchState, Hold, Policy, RouteView, ServerView, V
from fedpool.federation.core.types import InferenceRequest
from fedpool.federation.routing import finish, planner  # noqa: F401 (they register `earliest_finish`, `planned`, ...)
from fedpool.federation.routing.horizon import HORIZON_MARGIN, Horizons, demand_on, free_in_kinds

_NO_TRIED: set[str] = set()


class RoundRobin(Policy, name="round_robin"):
    def __init__(self, rng: random.Random | None = None):
        super().__init__(rng)
        self._next = 0

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        ordered = sorted(candidates, key=lambda c: c.id)
        pick = ordered[self._next % len(ordered)]
        self._next += 1
        return pick


class RandomChoice(Policy, name="random"):
    candidate_limit = 1

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        return self._rng.choice(candidates)


class LeastInflight(Policy, name="least_inflight"):
    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        return self._least(candidates, _inflight)


class PowerOfTwo(Policy, name="power_of_two"):
    candidate_limit = 2

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        pair = self._rng.sample(list(candidates), min(2, len(candidates))) if len(candidates) > 2 else candidates
        return self._least(pair, _load)


class CapacityWeighted(Policy, name="capacity_weighted"):
    """On a route of mixed server kinds, a request goes only to a kind where it cannot outlast the run
    (`federation/routing/horizon.py`: at most 0.8 × the route's fluid horizon there, or its cheapest kind); else it is
    held and the free slot goes to the next client that may use it. Among those servers with room:

    Lowest expected wait, (in-flight + waiting + 1) / weight, over a sample of candidates. Expected waits
    within `tie_tolerance` of the lowest are a tie: learned weights of identical servers always differ a
    little, and an exact comparison sent every request that found both idle to the one that happened to
    measure faster (92/8 between two equal servers at 100 req/s).

    Idle servers, and near-equal waits, take turns in proportion to speed by stride scheduling over a virtual clock:
    each server has a pass, the pick is the lowest, and a pick advances its pass by 1 / weight *at that
    moment*. A server's pass is never behind the clock (one that sat out, new or busy, rejoins at the clock:
    no burst of catch-up turns). Counting turns since the start instead (fewest picks per unit of the
    current weight) made every past turn count at today's weight: one slow measurement after 200 turns
    gave a server no turn for the rest of a run, so its speed was never measured again (276/24 between two
    equal servers at a light load)."""

    def __init__(self, rng: random.Random | None = None, sample_size: int = 4, tie_tolerance: float = 0.1,
                 horizon: bool = True, horizon_margin: float = HORIZON_MARGIN):
        super().__init__(rng)
        self._sample_size = sample_size
        self._tolerance = tie_tolerance
        self.candidate_limit = sample_size
        self._clock = 0.0  # virtual time: the pass of the latest turn
        self._pass: dict[str, float] = {}  # server -> its next turn on the virtual clock (one entry per server)
        self._horizons = Horizons(margin=horizon_margin) if horizon else None
        self._state: DispatchState | None = None

    def attach(self, state: DispatchState) -> None:
        self._state = state

    def place(self, route: RouteView, request: InferenceRequest, tried: set[str]) -> Any:
        state, horizons = self._state, self._horizons
        if horizons is None or state is None or tried:
            return super().place(route, request, tried)
        kinds, servers = horizons.routes.get(route.key), route.servers
        if kinds is None or kinds.servers_ref is not servers or kinds.servers_len != len(servers):  # (inlined)
            kinds = horizons.of(route)
        if len(kinds.kinds) < 2:  # one kind: nothing to keep off
            return super().place(route, request, tried)
        clients, inflight = state.clients, state.ledger.clients
        allowed = horizons.allowed(kinds, request.client_id, lambda c: client_size(clients.shape(c)), state.clock(),
                                   lambda: demand_on(route, inflight))
        memo = route.memo  # within one grant pass servers only fill: kinds found full stay full
        held = memo.get(allowed)
        if held is None:
            free = free_in_kinds(route, allowed, self._sample_size, self._rng)
            if free:
                return self.choose(free, request)
            held = memo[allowed] = (Hold.CLIENT_HELD if route.free_candidates(1, _NO_TRIED, self._rng)
                                    else Hold.ROUTE_FULL)
        if held is Hold.CLIENT_HELD:  # out of the grant passes until one of its kinds has room
            route.park(request.client_id, allowed, clients.key(request.client_id))
        return held

    def forget_client(self, client_id: str) -> None:
        if self._horizons is not None:
            self._horizons.forget_client(client_id)

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        pool = candidates
        if len(pool) > self._sample_size:
            pool = self._rng.sample(list(pool), self._sample_size)
        idle, waits, best = [], [], float("inf")
        for c in pool:
            if c.inflight == 0 and c.scraped_waiting <= 0:
                idle.append(c)
            wait = c.expected_wait
            waits.append(wait)
            if wait < best:
                best = wait
        if len(idle) > 1:
            # Several idle servers: each would start the request at once, so they take turns in proportion
            # to speed, not the fastest always (that starved the other of the answers that measure it).
            return self._take_turn(idle)
        limit = best * (1 + self._tolerance)
        near = [c for c, wait in zip(pool, waits, strict=True) if wait <= limit]
        return near[0] if len(near) == 1 else self._take_turn(near)

    def forget_server(self, server_id: str) -> None:
        self._pass.pop(server_id, None)

    def _take_turn(self, tied: Sequence[V]) -> V:
        """The tied server whose turn it is (equal passes: a random one of them). Only ties take turns: a
        request that had one place to go (the others busy) is no turn of anyone's. Counted as turns, those
        moved the clock between ties, so the order in which the forced picks came decided who won the next
        tie: one of two equal servers got two thirds of the turns."""
        clock, passes = self._clock, self._pass
        first, due = float("inf"), []
        for c in tied:
            turn = passes.get(c.id, clock)
            if turn < clock:
                turn = clock
            if turn < first:
                first, due = turn, [c]
            elif turn == first:
                due.append(c)
        pick = due[0] if len(due) == 1 else self._rng.choice(due)
        self._clock = first
        passes[pick.id] = first + 1.0 / max(pick.weight, 1e-12)
        return pick


class PrefixAffinity(Policy, name="prefix_affinity"):
    """Consistent hashing of the prompt prefix with bounded load (≤ (1+ε) × average in-flight)."""

    VIRTUAL_NODES = 64

    def __init__(self, rng: random.Random | None = None, epsilon: float = 0.25):
        super().__init__(rng)
        self._epsilon = epsilon

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        ring: list[tuple[int, int]] = sorted(
            (_hash(f"{c.id}#{i}"), n) for n, c in enumerate(candidates) for i in range(self.VIRTUAL_NODES)
        )
        keys = [k for k, _ in ring]
        total = sum(c.inflight for c in candidates) + 1
        bound = max(1.0, (1 + self._epsilon) * total / len(candidates))
        start = bisect.bisect(keys, _hash(request.prefix_text()))
        seen: set[int] = set()
        for offset in range(len(ring)):
            n = ring[(start + offset) % len(ring)][1]
            if n in seen:
                continue
            seen.add(n)
            if candidates[n].inflight + 1 <= bound:
                return candidates[n]  # the prefix's home, or the next on the ring when the home is full
        return self._least(candidates, _expected_wait)  # all over the bound


def _inflight(c: ServerView) -> float:
    return c.inflight


def _load(c: ServerView) -> float:
    return c.inflight + c.scraped_waiting


def _expected_wait(c: ServerView) -> float:
    return c.expected_wait


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def make_policy(name: str, rng: random.Random | None = None, **options: Any) -> Policy:
    """Build a policy by its registered name; unknown names list the known ones."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_POLICIES))}") from None
    return cls(rng, **options)


def prepare_policy(name: str) -> None:
    """What the named policy's first decision needs, loading in the background from now (a process that will
    route by it calls this before its slower start-up steps: joining Ray, starting its CPU actors). Unknown
    names are left to `make_policy` to refuse."""
    cls = _POLICIES.get(name)
    if cls is not None:
        cls.prepare()


def policy_names() -> list[str]:
    return sorted(_POLICIES)
