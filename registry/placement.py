"""Where a model's slots go among the lease broker's holders (registry/leases.py): entitlements in whole slots,
the max-min fair split within a class of the client order, and the server kinds each holder's entitlement is
placed on. Pure functions, no state."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedpool.registry.leases import LeaseServer, ModelDemand

HORIZON_MARGIN = 0.2  # a holder may use a kind where its requests take at most (1 - this) × the pool's horizon ...
CHEAPEST_TIE = 0.05  # ... or within this of its cheapest kind's price (federation/horizon.py: the same rule)


def kind_targets(servers: Sequence[LeaseServer], wants: Mapping[str, float], demands: Mapping[str, ModelDemand]
                 ) -> tuple[dict[str, dict[str, float]], dict[str, set[str]]]:
    """(Holder -> server kind -> slots of its entitlement to place there, holder -> the kinds it may be placed
    on at all). A holder may use a kind where its requests take at most (1 − HORIZON_MARGIN) × the horizon —
    the fluid bound of every holder's work (`ModelDemand.kind_costs` × its clients' requests, each at its
    cheapest, over every kind's slots at the speed the mix runs there) — or its cheapest kinds: one process's
    rule for its own clients (federation/horizon.py) across processes, so no request lands where it would
    become the run's straggler (without it, 64 processes' videos went to the V100s as the captions there ended
    and ran to 2.7× the ideal). The kinds the entitlements fill are the ones the work runs best on; each is
    given, the slowest first, to the holders whose requests cost least there, among those that may use it (a
    holder that sent no costs counts as the median one and may use every kind). Placed by capacity alone,
    64 processes' captions ran on the A100s and their videos on the V100s (scale_sim_processes.md).
    O(holders × kinds × log holders)."""
    capacity: dict[str, int] = {}
    for server in servers:
        capacity[server.kind] = capacity.get(server.kind, 0) + server.capacity
    holders = sorted(h for h, w in wants.items() if w > 0)
    if len(capacity) < 2:
        return {h: {k: wants[h] for k in capacity} for h in holders}, {}
    cost: dict[str, dict[str, float]] = {}
    work: dict[str, float] = {}  # requests waiting and in flight
    for holder_id in holders:
        demand = demands.get(holder_id)
        costs = demand.kind_costs if demand is not None else {}
        if all(costs.get(k, 0.0) > 0 for k in capacity):
            cost[holder_id] = {k: costs[k] for k in capacity}
            work[holder_id] = float(sum(c.wanted for c in demand.clients)) if demand is not None else 0.0
    median = {k: statistics.median(c[k] for c in cost.values()) if cost else 1.0 for k in capacity}
    # The horizon: Σ requests × their cheapest price over Σ kind slots × (cheapest ÷ price there).
    cheapest = sum(work[h] * min(cost[h].values()) for h in work)
    on_kind = {k: sum(work[h] * cost[h][k] for h in work) for k in capacity}
    slots = sum(capacity[k] * cheapest / on_kind[k] for k in capacity if on_kind[k] > 0)
    horizon = cheapest / slots if cheapest > 0 and slots > 0 else math.inf
    allowed: dict[str, set[str]] = {}
    for holder_id, costs in cost.items():
        best = min(costs.values())
        limit = max(horizon * (1 - HORIZON_MARGIN), best * (1 + CHEAPEST_TIE))
        allowed[holder_id] = {k for k, c in costs.items() if c <= limit}
    for holder_id in holders:
        cost.setdefault(holder_id, median)
    total = sum(wants[h] for h in holders)
    # A kind's speed for this work: the holders' cheapest cost over their cost there, weighted by their wants.
    speed = {k: sum(wants[h] * min(cost[h].values()) / cost[h][k] for h in holders) / total if total else 1.0
             for k in capacity}
    used: dict[str, float] = {}
    left = total
    for kind in sorted(capacity, key=lambda k: (-speed[k], k)):
        used[kind] = min(float(capacity[kind]), left)
        left -= used[kind]
    remaining = {h: wants[h] for h in holders}
    room = dict(used)
    out: dict[str, dict[str, float]] = {h: {} for h in holders}
    for kind in sorted(used, key=lambda k: (speed[k], k)):
        for holder_id in sorted(holders, key=lambda h: (cost[h][kind], h)):
            if room[kind] <= 1e-9:
                break
            if holder_id in allowed and kind not in allowed[holder_id]:
                continue
            give = min(room[kind], remaining[holder_id])
            if give > 0:
                out[holder_id][kind] = out[holder_id].get(kind, 0.0) + give
                remaining[holder_id] -= give
                room[kind] -= give
    return out, allowed


def whole(wants: Mapping[str, float]) -> dict[str, float]:
    """Entitlements in whole slots, the fractions given by largest remainder (nothing lost to rounding)."""
    out = {h: float(math.floor(w + 1e-9)) for h, w in wants.items()}
    spare = round(sum(wants.values()) - sum(out.values()))
    for holder in sorted(wants, key=lambda h: (out[h] - wants[h], h))[:max(0, spare)]:
        out[holder] += 1.0
    return out


def water_fill(clients: list[tuple[float, str, float, float, bool]], capacity: float) -> list[float]:
    """Max-min fair by weight: each client gets weight × level, capped at what it wants."""
    got = [0.0] * len(clients)
    active = [i for i, c in enumerate(clients) if c[3] > 0]
    left = capacity
    while active and left > 1e-9:
        weight = sum(clients[i][2] for i in active)
        level = left / weight
        capped = [i for i in active if clients[i][3] - got[i] <= level * clients[i][2]]
        if not capped:
            for i in active:
                got[i] += level * clients[i][2]
            return got
        for i in capped:
            left -= clients[i][3] - got[i]
            got[i] = clients[i][3]
        active = [i for i in active if i not in capped]
    return got
