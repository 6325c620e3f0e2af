"""Policies composed of small parts: the route's servers with room, narrowed by filters, then a picker.

`SampledPolicy` is the composition: a sample of the route's index of servers with room (window and breaker; the
request's failed servers avoided), optionally narrowed to the server kinds the horizon rule allows the request's
client (federation/routing/horizon.py), then a `Picker` chooses one. `capacity_weighted`, the default, is that with
`LeastWait`. The planning policies live beside it (planner.py, finish.py); the baselines benchmarks compare against
(round robin, random, least in flight, power of two, prefix affinity) are pickers in benchmarks/baselines.py.
`make_policy` builds any registered policy by name.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

from fedpool.federation.core.clientbook import client_size
from fedpool.federation.core.policy import (
    DispatchState,
    Hold,
    Policy,
    PolicyHooks,
    RouteView,
    S,
    V,
    registered_policies,
)
from fedpool.federation.core.types import InferenceRequest
from fedpool.federation.routing.horizon import HORIZON_MARGIN, Horizons, demand_on, free_in_kinds

_NO_TRIED: set[str] = set()


class Picker(Protocol):
    """Chooses one of a request's candidate servers (never empty), handed back as given."""

    def pick(self, candidates: Sequence[V], request: InferenceRequest) -> V: ...

    def forget_server(self, server_id: str) -> None: ...


class SampledPolicy(Policy):
    """Filters, then a picker: up to `sample` of the route's servers with room (all where None), on a route of
    several server kinds only those of the kinds the horizon rule allows the client (`horizon`), then `picker`."""

    def __init__(self, picker: Picker, rng: random.Random | None = None, *, sample: int | None = None,
                 horizon: bool = False, horizon_margin: float = HORIZON_MARGIN):
        super().__init__(rng)
        self._picker = picker
        self._sample = sample
        self._horizons = Horizons(margin=horizon_margin) if horizon else None
        self._state: DispatchState | None = None

    def attach(self, state: DispatchState) -> PolicyHooks:
        self._state = state
        horizons = self._horizons
        return PolicyHooks(forget_client=horizons.forget_client if horizons is not None else None,
                           forget_server=self._picker.forget_server, pick=self._picker.pick, sample=self._sample)

    def place(self, route: RouteView[S], request: InferenceRequest, tried: set[str]) -> S | Hold:
        state = self._state
        if (self._horizons is not None and route.kinds > 1 and not tried and state is not None
                and not state.clients.open_ended(request.client_id)):
            return self._within_horizon(route, request, self._horizons, state)
        free = route.free_candidates(self._sample, tried, self._rng)
        if not free:
            return Hold.CLIENT_HELD if tried and route.free_candidates(None, _NO_TRIED, self._rng) else Hold.ROUTE_FULL
        return self._picker.pick(free, request)

    def _within_horizon(self, route: RouteView[S], request: InferenceRequest, horizons: Horizons,
                        state: DispatchState) -> S | Hold:
        """On a route of mixed kinds a request goes only to a kind where it cannot outlast the run (at most
        (1 - margin) x the route's fluid horizon there, or its cheapest kind); else it is held, out of the grant
        passes until one of its kinds has room, and the free slot goes to the next client that may use it."""
        clients, inflight = state.clients, state.ledger.clients
        allowed = horizons.allowed(horizons.of(route), request.client_id, lambda c: client_size(clients.shape(c)),
                                   state.clock(), lambda: demand_on(route, inflight, clients.requests_left_of))
        memo = route.memo  # within one grant pass servers only fill: kinds found full stay full
        held = memo.get(allowed)
        if held is None:
            free = free_in_kinds(route, allowed, self._sample or len(route.servers), self._rng)
            if free:
                return self._picker.pick(free, request)
            held = memo[allowed] = (Hold.CLIENT_HELD if route.free_candidates(1, _NO_TRIED, self._rng)
                                    else Hold.ROUTE_FULL)
        if held is Hold.CLIENT_HELD:
            route.park(request.client_id, allowed, clients.key(request.client_id))
        return held


class LeastWait:
    """The lowest expected wait, (in flight + queued + 1) / weight, over the candidates; waits within `tolerance` of
    the lowest are a tie (learned weights of identical servers always differ a little), and idle servers and ties
    take turns in proportion to speed (stride scheduling over a virtual clock: a pick advances the server's pass by
    1 / weight at that moment; a server that sat out rejoins at the clock, with no burst of catch-up turns).
    docs/architecture.md says why turns, and why not by count."""

    def __init__(self, rng: random.Random, tolerance: float = 0.1):
        self._rng = rng
        self._tolerance = tolerance
        self._clock = 0.0  # virtual time: the pass of the latest turn
        self._pass: dict[str, float] = {}  # server -> its next turn on the virtual clock (one entry per server)

    def pick(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        idle, waits, best = [], [], float("inf")
        for c in candidates:
            inflight, queued, weight = c.inflight, c.scraped_waiting, c.weight
            if inflight == 0 and queued <= 0:
                idle.append(c)
            wait = (inflight + queued + 1) / (weight if weight > 1e-9 else 1e-9)  # this scorer's measure
            waits.append(wait)
            if wait < best:
                best = wait
        if len(idle) > 1:  # each would start it at once: they take turns (the fastest always starves the rest)
            return self._take_turn(idle)
        limit = best * (1 + self._tolerance)
        near = [c for c, wait in zip(candidates, waits, strict=True) if wait <= limit]
        return near[0] if len(near) == 1 else self._take_turn(near)

    def forget_server(self, server_id: str) -> None:
        self._pass.pop(server_id, None)

    def _take_turn(self, tied: Sequence[V]) -> V:
        """The tied server whose turn it is (equal passes: a random one of them). Only ties take turns: a request
        that had one place to go is no turn of anyone's (counted, forced picks would decide who wins the next tie)."""
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


class LeastExpectedWait:
    """The lowest expected wait, ties broken at random (the fallback of the planning policies, outside a plan)."""

    def __init__(self, rng: random.Random):
        self._rng = rng

    def pick(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        best, tied = None, []
        for c in candidates:
            wait = c.expected_wait
            if best is None or wait < best:
                best, tied = wait, [c]
            elif wait == best:
                tied.append(c)
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def forget_server(self, server_id: str) -> None:
        return None


class CapacityWeighted(SampledPolicy, name="capacity_weighted"):
    """A sample of 4 servers with room, within the horizon rule's kinds, picked by the lowest expected wait."""

    def __init__(self, rng: random.Random | None = None, sample_size: int = 4, tie_tolerance: float = 0.1,
                 horizon: bool = True, horizon_margin: float = HORIZON_MARGIN):
        rng = rng or random.Random(0)
        super().__init__(LeastWait(rng, tie_tolerance), rng, sample=sample_size, horizon=horizon,
                         horizon_margin=horizon_margin)


def make_policy(name: str, rng: random.Random | None = None, **options: Any) -> Policy:
    """Build a policy by its registered name; unknown names list the known ones."""
    policies = registered_policies()
    try:
        cls = policies[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(policies))}") from None
    return cls(rng, **options)


def prepare_policy(name: str) -> None:
    """What the named policy's first decision needs, loading in the background from now (a process that will
    route by it calls this before its slower start-up steps: joining Ray, starting its CPU actors). Unknown
    names are left to `make_policy` to refuse."""
    cls = registered_policies().get(name)
    if cls is not None:
        cls.prepare()


def policy_names() -> list[str]:
    return sorted(registered_policies())
