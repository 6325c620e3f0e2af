"""Where a model's slots go among the lease broker's holders (registry/leases.py): entitlements in whole slots,
the max-min fair split within a class of the client order, and the server kinds each holder's entitlement is
placed on. Pure functions, no state."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedpool.registry.leases import LeaseServer, ModelDemand

# The horizon rule, one for a process's own clients (federation/routing/horizon.py) and for the broker's holders:
HORIZON_MARGIN = 0.2  # a request may take up to (1 - margin) × the horizon on a kind (engines run below their
# full-batch price when long prompts share the batch: 0.1 let 20 s answers through at a 15 s bound)
CHEAPEST_TIE = 0.05  # kinds within this of a request's cheapest price are its cheapest too


def fluid_horizon(slots: Mapping[str, float], demand: Iterable[tuple[float, Mapping[str, float]]]) -> float:
    """The fluid bound of some work over some kinds: Σ requests × their cheapest price ÷ every kind's slots at
    the speed the mix runs there (its slots × the cheapest work ÷ the work priced there). `demand`: (requests, price
    on each kind of `slots`) per client; inf with no work. O(clients × kinds)."""
    cheapest = 0.0
    on_kind = dict.fromkeys(slots, 0.0)
    for n, prices in demand:
        cheapest += n * min(prices.values())
        for k, price in prices.items():
            on_kind[k] += n * price
    total = sum(n * cheapest / on_kind[k] for k, n in slots.items() if on_kind[k] > 0)
    return cheapest / total if cheapest > 0 and total > 0 else math.inf


def usable_kinds(prices: Mapping[str, float], horizon: float, margin: float = HORIZON_MARGIN) -> tuple[str, ...]:
    """The kinds where a request priced `prices` takes at most (1 − margin) × `horizon` — it cannot become the
    run's straggler there — or its cheapest (within CHEAPEST_TIE), in the order of `prices`."""
    best = min(prices.values())
    limit = max(horizon * (1 - margin), best * (1 + CHEAPEST_TIE))
    return tuple(k for k, price in prices.items() if price <= limit)


def kind_targets(servers: Sequence[LeaseServer], wants: Mapping[str, float], demands: Mapping[str, ModelDemand]
                 ) -> tuple[dict[str, dict[str, float]], dict[str, set[str]]]:
    """(Holder -> server kind -> slots of its entitlement to place there, holder -> the kinds it may be placed
    on at all). A holder may use a kind where its requests take at most (1 − HORIZON_MARGIN) × the horizon —
    the fluid bound of every holder's work (`ModelDemand.kind_costs` × its clients' requests, each at its
    cheapest, over every kind's slots at the speed the mix runs there) — or its cheapest kinds: one process's
    rule for its own clients (federation/routing/horizon.py) across processes, so no request lands where it would
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
    horizon = fluid_horizon({k: float(n) for k, n in capacity.items()}, ((work[h], cost[h]) for h in work))
    allowed = {holder_id: set(usable_kinds(costs, horizon)) for holder_id, costs in cost.items()}
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


def whole(wants: Mapping[str, float], ends: Mapping[str, float] | None = None,
          held: Mapping[str, int] | None = None) -> dict[str, float]:
    """Entitlements in whole slots, the fractions given by largest remainder (nothing lost to rounding). Among
    equal remainders, to the holders nearest their end first — `ends`: the work each says it has left, compared
    by factors of two (SRPT's order, never a worse makespan: the slots are used either way) — and among those to
    the holders that hold the slot already (`held`: slots each holds now), so two long holders whose work left
    crosses do not pass a slot back and forth."""
    out = {h: float(math.floor(w + 1e-9)) for h, w in wants.items()}
    spare = round(sum(wants.values()) - sum(out.values()))

    def key(h: str) -> tuple[float, float, int, str]:
        left = (ends or {}).get(h)
        end = math.inf if left is None else float(math.floor(math.log2(max(left, 1.0))))
        return round(out[h] - wants[h], 6), end, 0 if (held or {}).get(h, 0) > out[h] else 1, h

    for holder in sorted(wants, key=key)[:max(0, spare)]:
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
