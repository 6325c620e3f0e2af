"""The run's horizon on a route of mixed server kinds: which kinds a client's requests may go to.

Why: placed by capacity alone, a long-answer request lands on a slow server as often as any other, and one of them
can take longer there than the whole pool needs for everything.

What. Every `refresh_s` the route's *horizon* is estimated: the work its clients have waiting and in flight, each
request priced on the kind where it is cheapest, spread over every kind's slots at the speed the mix runs there (a
fluid bound; O(clients × kinds)). A client's request may go to a kind where it takes at most (1 − `margin`) × the
horizon — it cannot become the run's straggler there — or to its cheapest kinds (within `tie`); elsewhere it is
held for a kind it may use. Prices are the data-sheet priors (`pricing.server_cost`), not corrected by the learned
per-sequence speed (it depends on what each server happened to run); shapes are the clients' own. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedpool.federation.routing.pricing import ServerCost, kind_key, server_cost
from fedpool.registry import HORIZON_MARGIN, fluid_horizon, usable_kinds

HORIZON_REFRESH_S = 0.25  # the horizon is estimated again at most this often (O(clients × kinds))
MAX_ROUTES = 256  # routes whose kinds are kept (a gateway's callers pick models and revisions at will)


def kind_of_state(server: Any) -> str:
    """A route server's kind (`pricing.kind_key` of its registry entry)."""
    return kind_key(server.entry)


@dataclass
class _Kind:
    cost: ServerCost  # one member's data-sheet prior
    slots: int
    members: list[Any]
    open: bool = True  # some member's breaker lets attempts through (as of the last estimate)


@dataclass
class RouteHorizon:
    """One route's kinds, its horizon and each client's allowed kinds (rebuilt when the route's servers change)."""

    servers_ref: Sequence[Any]
    servers_len: int
    kinds: dict[str, _Kind]
    horizon: float = float("inf")
    refreshed_at: float = float("-inf")
    allowed: dict[str, tuple[str, ...]] = field(default_factory=dict)  # client -> kinds its requests may use

    def current(self, servers: Sequence[Any]) -> bool:
        """Whether these are still the route's servers (a route's list is replaced or resized when they change)."""
        return self.servers_ref is servers and self.servers_len == len(servers)


Shape = Callable[[str], "tuple[float, float] | None"]  # client -> (prompt tokens, answer tokens)


class Horizons:
    """Per route: the kinds a client's requests may be placed on (see the module docstring)."""

    def __init__(self, *, margin: float = HORIZON_MARGIN, refresh_s: float = HORIZON_REFRESH_S):
        self._margin = margin
        self._refresh_s = refresh_s
        self.routes: dict[Any, RouteHorizon] = {}  # route key -> its kinds (`RouteHorizon.current` tells if still so)
        self.refreshes = 0

    def of(self, route: Any) -> RouteHorizon:
        """The route's kinds, as of its servers now."""
        ref = route.servers
        known = self.routes.get(route.key)
        if known is not None and known.current(ref):
            return known
        members: dict[str, list[Any]] = {}
        for state in ref:
            if state.entry is not None:
                members.setdefault(kind_of_state(state), []).append(state)
        kinds = {name: _Kind(server_cost(states[0].entry), sum(max(1, s.capacity) for s in states), states)
                 for name, states in members.items()}
        if route.key not in self.routes and len(self.routes) >= MAX_ROUTES:
            del self.routes[next(iter(self.routes))]  # the longest known: routes come and go with callers
        known = self.routes[route.key] = RouteHorizon(ref, len(ref), kinds)
        if len(kinds) > 1:
            route.group_by(kind_of_state)
        return known

    def allowed(self, horizon: RouteHorizon, client: str, shape: Shape, now: float,
                demand: Callable[[], Iterable[tuple[str, int]]]) -> tuple[str, ...]:
        """The kinds `client`'s requests may go to now. `demand`: (client, requests waiting or in flight) on the
        route, read only when the horizon is estimated again."""
        if now - horizon.refreshed_at >= self._refresh_s:
            self._estimate(horizon, shape, now, demand())
        kinds = horizon.allowed.get(client)
        if kinds is None:
            kinds = horizon.allowed[client] = self._allowed(horizon, shape(client))
        return kinds

    def cached(self, horizon: RouteHorizon, client: str, now: float) -> tuple[str, ...] | None:
        """The client's kinds as last estimated, while that estimate is still current (else None: ask `allowed`)."""
        if now - horizon.refreshed_at >= self._refresh_s:
            return None
        return horizon.allowed.get(client)

    def forget_client(self, client: str) -> None:
        for horizon in self.routes.values():
            horizon.allowed.pop(client, None)

    def _estimate(self, horizon: RouteHorizon, shape: Shape, now: float, demand: Iterable[tuple[str, int]]) -> None:
        """The fluid bound of the route's work: Σ requests × cheapest price ÷ every kind's slots at the speed
        the mix runs there. Kinds whose every server's breaker is open are left out (held requests would wait
        for them while others could serve); O(clients × kinds + servers)."""
        self.refreshes += 1
        for kind in horizon.kinds.values():
            # The slots this process may use: a leasing process (many share the servers) spreads its own work
            # over its leases, not over every server's capacity (its horizon would be its share's, tiny, and
            # hold its requests off every kind but the cheapest while its leases there sit idle).
            kind.slots = sum(max(1, m.capacity) if m.lease is None else m.lease for m in kind.members)
            # A kind where it leases nothing is not one to hold requests for: the broker places a process's slots
            # on the kinds its work suits (registry/leases.py), and may place none on its cheapest.
            kind.open = kind.slots > 0 and any(m.admits for m in kind.members)
        kinds = {k: kind for k, kind in horizon.kinds.items() if kind.open} or horizon.kinds
        horizon.horizon = fluid_horizon(
            {k: float(kind.slots) for k, kind in kinds.items()},
            ((n, {k: kind.cost.of(*size) for k, kind in kinds.items()})
             for client, n in demand if n > 0 and (size := shape(client)) is not None))
        horizon.refreshed_at = now
        horizon.allowed.clear()

    def _allowed(self, horizon: RouteHorizon, size: tuple[float, float] | None) -> tuple[str, ...]:
        kinds = {k: kind for k, kind in horizon.kinds.items() if kind.open} or horizon.kinds
        if size is None:
            return tuple(kinds)
        return usable_kinds({k: kind.cost.of(*size) for k, kind in kinds.items()}, horizon.horizon, self._margin)


def kind_costs(entries: Iterable[Any], sizes: Mapping[str, tuple[int, tuple[float, float]]]
               ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The data-sheet prices on one server of each kind, over the routable `entries` of one model, of these clients'
    requests (client -> (requests, (prompt, answer tokens))): (kind -> their mean request's, client -> kind -> one
    of its requests'). What the lease broker needs to place a process's slots on the kinds each client's work suits
    (registry/leases.py). Empty with fewer than two kinds or no size known. O(entries + kinds × clients)."""
    costs: dict[str, ServerCost] = {}
    for entry in entries:
        if entry.status.routable and entry.capacity > 0 and entry.kind not in costs:
            costs[entry.kind] = server_cost(entry)
    known = {c: (n, size) for c, (n, size) in sizes.items() if n > 0}
    if len(costs) < 2 or not known:
        return {}, {}
    per = {c: {k: cost.of(*size) for k, cost in costs.items()} for c, (_, size) in known.items()}
    total = sum(n for n, _ in known.values())
    return {k: sum(n * per[c][k] for c, (n, _) in known.items()) / total for k in costs}, per


def free_in_kinds(route: Any, kinds: Sequence[str], limit: int, rng: Any) -> list[Any]:
    """Up to `limit` servers with room in these kinds, sampled uniformly over them (O(kinds + limit))."""
    lists = [route.free_in(k) for k in kinds]
    total = sum(len(free) for free in lists)
    if total <= limit:
        return [s for free in lists for s in free]
    out = []
    for i in rng.sample(range(total), limit):
        for free in lists:
            if i < len(free):
                out.append(free[i])
                break
            i -= len(free)
    return out


def demand_on(route: Any, inflight: Mapping[str, int],
              left: Callable[[str], int | None] = lambda client: None) -> Iterable[tuple[str, int]]:
    """(client, requests it has on the route) for the route's waiting clients and those with requests in flight:
    those waiting + in flight, or the requests it says it has still to complete (`left`) where more (a client
    that streams its run a few at a time has more ahead than in view). A client's in-flight count is over every
    route: most clients use one model."""
    queues = route.queues
    for client, queue in queues.items():
        yield client, max(len(queue) + inflight.get(client, 0), left(client) or 0)
    for client, n in inflight.items():
        if client not in queues:
            yield client, max(n, left(client) or 0)
