"""A route's plan for `planned` (federation/routing/planner.py): what it is, how it is made, and the pace at which
the clients planned on a kind follow it. Pure functions of their inputs (the policy gathers them).

Making one: minimise T subject to each client's unsent requests placed and each server kind's share of that work at
most T (`plan_lp.solve_plan`). Servers of one kind form one LP column, so the LP is as small as the number of kinds
and identical servers cannot swap roles from one plan to the next (a degenerate LP flipped a client between two
equal servers every period); a kind's members share its work by their measured speeds relative to each other. A
per-request latency bound keeps a client off kinds where one of its requests would outlast the plan's makespan;
with a client order other than `fair`, a phased plan makes clients finish in that order within `makespan_slack` of
the shortest makespan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedpool.federation.core.policy import RouteView
from fedpool.federation.routing.plan_lp import MIN_SHARE, solve_phased_plan, solve_plan
from fedpool.federation.routing.pricing import ServerCost, kind_key

LATENCY_ROUNDS = 3  # re-solves that move a client off kinds where one of its requests outlasts the makespan
LATENCY_SLACK = 0.1  # a request may run this much past the plan's makespan on a kind before the kind is off
FORBIDDEN_COST = 1e9  # a cost no LP solution pays
TIEBREAK = 1e-3  # weight of the server time a plan spends, beside its makespan (plan_lp.solve_plan)
MAX_PHASE_VARIABLES = 20_000  # clients² × server kinds above which only the makespan plan is made
PACE_SLACK = 0.25  # a client may run this far ahead of the most-behind client's share of its quota on a kind

Shape = tuple[float, float]  # (prompt tokens, completion tokens) expected per request


@dataclass(frozen=True, slots=True)
class Plan:
    made_at: float
    makespan: float  # nominal seconds (ServerCost units)
    quotas: Mapping[str, Mapping[str, float]]  # client -> server -> requests to send there
    kind_quotas: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # client -> kind -> requests
    members: Mapping[str, Sequence[Any]] = field(default_factory=dict)  # kind -> its servers
    kind_of: Mapping[str, str] = field(default_factory=dict)  # server id -> kind
    cost: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (client, kind) -> one request's price


@dataclass
class RoutePlan:
    """One route's plan and what was placed on it since."""

    plan: Plan | None = None
    made_at: float = float("-inf")
    servers_key: tuple[str, ...] = ()
    servers_ref: Sequence[Any] | None = None
    sent: dict[str, Counter[str]] = field(default_factory=dict)  # since the plan: client -> kind -> placed
    clients: set[str] = field(default_factory=set)  # clients that sent on this route
    replanning: bool = False  # a re-plan is scheduled (off the grant path)
    route: RouteView | None = None  # where its held clients park (back in the order under a new plan)


def kind_columns(servers: Sequence[Any]) -> dict[str, list[Any]]:
    """The plan's columns: kind -> its servers (route servers with the registry's `entry`), in the route's order."""
    columns: dict[str, list[Any]] = {}
    for server in servers:
        columns.setdefault(kind_key(server.entry), []).append(server)
    return columns


def held_work(columns: Mapping[str, Sequence[Any]], shapes: Mapping[str, Shape], kind_cost: Mapping[str, Any],
              clients_on: Callable[[str], Mapping[str, int]], shape_of: Callable[[str], Shape | None]
              ) -> dict[str, float]:
    """Work each kind holds now (its requests in flight, priced by their clients' shapes): the plan's makespan
    counts from when each kind will have drained it. O(servers), once per plan."""
    held: dict[str, float] = {}
    for col, members in columns.items():
        total = 0.0
        for server in members:
            for client, n in clients_on(server.id).items():
                shape = shapes.get(client) or shape_of(client)
                if shape is not None:
                    total += n * kind_cost[col].of(*shape)
        held[col] = total
    return held


def make_plan(now: float, columns: Mapping[str, Sequence[Any]], counts: Mapping[str, int],
              shapes: Mapping[str, Shape], kind_cost: Mapping[str, ServerCost], held: Mapping[str, float],
              speed: Mapping[str, float], phase_key: Callable[[str], Any] | None, makespan_slack: float) -> Plan:
    """The plan for `counts` (client -> unsent requests, those with a shape, sorted) over the kinds' `columns`:
    `held` is what each kind holds now (`held_work`), `speed` each server's speed factor, `phase_key` the client
    order a phased plan follows (None: `fair`, the makespan plan alone)."""
    clients = list(counts)
    weight = {col: float(len(members)) for col, members in columns.items()}
    cost = {(c, col): max(1e-12, kind_cost[col].of(*shapes[c])) for col in columns for c in clients}
    price = dict(cost)  # (the latency bound forbids pairs by raising their cost)
    ids = sorted(columns)
    # The tie-break keeps the plan from piling the rest on one kind when one kind's held work sets T.
    makespan, by_kind = _bounded(clients, ids, columns, counts, shapes, kind_cost, cost, held, weight)
    if phase_key is not None and 1 < len(clients) and len(clients) ** 2 * len(ids) <= MAX_PHASE_VARIABLES:
        ranked = sorted(clients, key=phase_key)
        phased = solve_phased_plan(ranked, ids, counts, cost, {}, makespan * (1 + makespan_slack), weight)
        if phased is not None:
            by_kind = phased
    x = _member_quotas(by_kind, columns, speed, weight)
    kind_of = {m.id: col for col, members in columns.items() for m in members}
    return Plan(now, makespan, x, by_kind, columns, kind_of, price)


def _bounded(clients: list[str], ids: list[str], columns: Mapping[str, Sequence[Any]], counts: Mapping[str, int],
             shapes: Mapping[str, Shape], kind_cost: Mapping[str, ServerCost], cost: dict[tuple[str, str], float],
             held: Mapping[str, float], weight: Mapping[str, float]) -> tuple[float, dict[str, dict[str, float]]]:
    """The makespan plan under the per-request latency bound: one request of a client alone takes its prefill plus
    its answer's decode steps at a full batch there, and no client's requests go to a kind where one of them would
    outlast the plan's makespan (its fastest kind is always allowed): at a run's end, the last requests of a short
    eval no longer start on a slow kind where each would hold the run up. A request's latency there is priced, not
    measured: bounds from measured latencies moved work onto kinds whose busy engines then stretched it far more.
    Forbidden pairs get `FORBIDDEN_COST` in `cost`."""
    makespan, by_kind = solve_plan(clients, ids, counts, cost, held, weight, tiebreak=TIEBREAK)
    latency = {(c, col): shapes[c][0] * kind_cost[col].prefill_s_per_token
               + shapes[c][1] * kind_cost[col].decode_s_per_token * max(1, columns[col][0].capacity)
               for col in columns for c in clients}
    fastest = {c: min(latency[c, col] for col in columns) for c in clients}
    for _ in range(LATENCY_ROUNDS):
        late = [(c, col) for c, quotas in by_kind.items() for col in quotas
                if latency[c, col] > max(makespan, fastest[c]) * (1 + LATENCY_SLACK)]
        if not late:
            break
        for pair in late:
            cost[pair] = FORBIDDEN_COST
        makespan, by_kind = solve_plan(clients, ids, counts, cost, held, weight, tiebreak=TIEBREAK)
    return makespan, by_kind


def _member_quotas(by_kind: Mapping[str, Mapping[str, float]], columns: Mapping[str, Sequence[Any]],
                   speed: Mapping[str, float], weight: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Client -> server -> requests: each kind's share split among its members by their speeds relative to the
    kind's mean."""
    within = {}
    for members in columns.values():
        mean = sum(speed[m.id] for m in members) / len(members)
        within.update({m.id: speed[m.id] / mean for m in members})
    x: dict[str, dict[str, float]] = {}
    for c, quotas in by_kind.items():
        for col, n in quotas.items():
            for member in columns[col]:
                x.setdefault(c, {})[member.id] = n * within[member.id] / weight[col]
    return x


def next_share(sent: Counter[str] | None, kind: str, quota: float) -> float:
    """The share of a client's quota on a kind that its next request there would reach (the pace's measure)."""
    return ((sent.get(kind, 0) if sent else 0) + 1) / quota


def kind_paces(plan: Plan, sent: Mapping[str, Counter[str]], sets_pace: Callable[[str], bool],
               free_in: Callable[[str], Sequence[Any]]) -> dict[str, float]:
    """Kind -> the smallest share of its quota there that the next request of a waiting client bound for it
    would reach. A client sets the pace only on the kind with room where that share is smallest (where its
    pick goes): counted on every kind, a client that always picked another would hold the others off a kind
    it never used. `sets_pace`: whether a client does (it waits, and it is not outside the pace)."""
    paces: dict[str, float] = {}
    room: dict[str, bool] = {}
    for client, quotas in plan.kind_quotas.items():
        if not sets_pace(client):
            continue
        mine = sent.get(client)
        best_kind, best = None, float("inf")
        for kind, quota in quotas.items():
            if quota <= MIN_SHARE:
                continue
            has_room = room.get(kind)
            if has_room is None:
                has_room = room[kind] = bool(free_in(kind))
            if not has_room:
                continue
            share = next_share(mine, kind, quota)
            if share < best:
                best_kind, best = kind, share
        if best_kind is not None and best < paces.get(best_kind, float("inf")):
            paces[best_kind] = best
    return paces


def due_kinds(quotas: Mapping[str, float], sent: Counter[str] | None, paces: Mapping[str, float]) -> dict[str, float]:
    """The client's planned kinds (kind -> quota) where its next request is not ahead of the kind's pace."""
    due: dict[str, float] = {}
    for kind, quota in quotas.items():
        if quota <= MIN_SHARE:
            continue
        share = next_share(sent, kind, quota)
        pace = paces.get(kind)
        if pace is None or share <= pace * (1 + PACE_SLACK):
            due[kind] = quota
    return due
