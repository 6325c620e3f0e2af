"""Filling one class of the client order with slots: by weight (`water_fill`) or by levels of service
(`level_fill`). The order and its classes: registry/placement.py."""

from __future__ import annotations

from collections.abc import Sequence

# A client in the order: rank, holder, weight, wanted, and how it is ranked by its service: 0 not by service; else
# the service one more slot adds to its level, on the rank's scale (`level_fill`), or SERVICE_NO_STEP where unknown.
Ranked = tuple[float, str, float, float, float]
SERVICE_NO_STEP = -1.0  # ranked by service, one request's service not said: a class within the service tie


def level_fill(clients: Sequence[Ranked], capacity: float) -> list[float]:
    """Shares of `capacity` for clients ranked by their service, as one dispatcher serves each free slot to the
    client least served so far: each client's level is its service without its requests in flight (its rank)
    plus, per slot, what one of its requests adds (its step) ÷ its weight; the slots raise the lowest levels
    together, each client up to what it wants. A client whose requests are short gets as many times the slots,
    and two a hair apart share nearly evenly (no class boundary for shares to flip across)."""
    wanted = [c[3] for c in clients]
    if sum(wanted) <= capacity:
        return list(wanted)

    def shares(level: float) -> list[float]:
        return [min(n, max(0.0, (level - rank) * weight / step)) for rank, _, weight, n, step in clients]

    low = min(c[0] for c in clients)
    high = max(rank + n * step / weight for rank, _, weight, n, step in clients)
    for _ in range(100):  # (bisection to the float's precision: the shares are monotone in the level)
        mid = 0.5 * (low + high)
        if sum(shares(mid)) < capacity:
            low = mid
        else:
            high = mid
    got = shares(high)
    total = sum(got)
    return [g * capacity / total for g in got] if total > capacity else got


def water_fill(clients: list[Ranked], capacity: float) -> list[float]:
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
