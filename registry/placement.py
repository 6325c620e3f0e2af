"""Where a model's slots go among the lease broker's holders (registry/leases.py): shares in the client order (the
max-min fair split within a class), over slot counts or kind by kind, or the min-makespan plan of every holder's
work over the server kinds; entitlements in whole slots; the kinds each holder's entitlement is placed on, and the
servers its slots are dealt onto. Pure functions: no state outlives a call."""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedpool.registry.fills import Ranked, level_fill, water_fill

if TYPE_CHECKING:
    from scipy.optimize import linprog

    from fedpool.registry.leases import LeaseServer, ModelDemand
else:
    def linprog(*args: object, **kwargs: object) -> object:
        """SciPy's, imported on the first plan (costly to import; only `plan_by_kind` needs it)."""
        from scipy.optimize import linprog as solve

        return solve(*args, **kwargs)

KindPlan = tuple[dict[str, dict[str, float]], dict[str, set[str]]]  # holder -> kind -> slots; -> kinds it may use
RANK_TIE = 1e-9  # ranks closer than this (relative) are one class: they share by weight

# The horizon rule, one for a process's own clients (federation/routing/horizon.py) and for the broker's holders:
HORIZON_MARGIN = 0.2  # a request may take up to (1 - margin) × the horizon on a kind (engines run below their
# full-batch price when long prompts share the batch)
CHEAPEST_TIE = 0.05  # kinds within this of a request's cheapest price are its cheapest too
SPREAD_LOOK = 8  # servers with the most room a dealt slot looks among for one under its holder's fair spread


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


def _order_fill(clients: Sequence[Ranked], capacity: float, service_tie: float) -> tuple[list[float], float]:
    """Each client's share of `capacity` in the client order — clients of a smaller rank first, each up to what
    it wants; equal ranks (within RANK_TIE, or `service_tie` between clients ranked by service) share by weight;
    a run of clients ranked by service that each say what one slot adds to their service share by levels
    (`level_fill`) — and what is left."""
    got = [0.0] * len(clients)
    left = float(capacity)
    i = 0
    while i < len(clients) and left > 1e-9:
        j = i + 1  # one class: ranks equal within a relative tolerance (within service_tie, by service)
        if clients[i][4] > 0:
            while j < len(clients) and clients[j][4] > 0:
                j += 1
            shares = level_fill(clients[i:j], left)
        else:
            tie = RANK_TIE * max(1.0, abs(clients[i][0]))
            while j < len(clients) and clients[j][0] - clients[i][0] <= (
                    max(tie, service_tie) if clients[i][4] and clients[j][4] else tie):
                j += 1
            shares = water_fill(list(clients[i:j]), left)
        for k, share in enumerate(shares):
            got[i + k] = share
            left -= share
        i = j
    return got, left


def share_by_order(clients: Sequence[Ranked], capacity: float, service_tie: float) -> dict[str, float]:
    """Holder -> its share of `capacity` in the client order (fractional); what nobody wants yet is headroom for
    whoever wants something, in proportion to what it wants."""
    got, left = _order_fill(clients, capacity, service_tie)
    out: dict[str, float] = {}
    for (_, holder_id, *_), share in zip(clients, got, strict=True):
        out[holder_id] = out.get(holder_id, 0.0) + share
    wanted: dict[str, float] = {}
    for _, holder_id, _, n, _ in clients:
        wanted[holder_id] = wanted.get(holder_id, 0.0) + n
    total = sum(wanted.values())
    if left > 1e-9 and total > 0:
        for holder_id, n in wanted.items():
            out[holder_id] += left * n / total
    return out


@dataclass(frozen=True)
class KindView:
    """One model's server kinds as the broker's holders see them: each kind's slots, what a request of each holder
    costs there, and the kinds each holder's requests may use at all (the horizon rule)."""

    capacity: dict[str, int]
    cost: dict[str, dict[str, float]]  # holder -> kind -> one request (the median holder's where it sent none)
    allowed: dict[str, set[str]]  # holder -> kinds (absent: every kind)

    def may(self, holder_id: str, kind: str) -> bool:
        kinds = self.allowed.get(holder_id)
        return kinds is None or kind in kinds

    def slowest_first(self, wanted: Mapping[str, float]) -> list[str]:
        """The kinds by the speed the holders' mix runs at there (their cheapest cost ÷ their cost there, weighted
        by what they want), the slowest first."""
        total = sum(wanted.values())
        speed = {k: sum(n * min(self.cost[h].values()) / self.cost[h][k] for h, n in wanted.items()) / total
                 if total else 1.0 for k in self.capacity}
        return sorted(self.capacity, key=lambda k: (speed[k], k))


def horizon_work(demand: ModelDemand | None, wanted: float) -> tuple[float, bool]:
    """(The requests a holder has on a model for the horizon, whether its run has no end in view.) Requests: those
    waiting and in flight (`wanted`), or, per client, what it says it has left where more (a client that streams
    its run a few at a time has more ahead than in view). No end in view: some client says nothing of what it
    has left and has not sent its last (a gateway's streaming caller) — nothing it sends can outlast the run, so
    none of the holder's kinds are held off (a process's own rule, `ClientBook.open_ended`)."""
    if demand is None:
        return wanted, False
    declared, open_ended = 0.0, False
    for client in demand.clients:
        left = client.requests_left
        if left is None and client.work_left is None and not client.sent_all and not client.loading:
            open_ended = True
        declared += max(client.wanted, left or 0)
    return max(wanted, declared), open_ended


def _horizon_allowed(capacity: Mapping[str, int], cost: Mapping[str, dict[str, float]],
                     work: Mapping[str, tuple[float, bool]]) -> dict[str, set[str]]:
    """Holder -> the kinds it may use (absent: every kind): where its requests take at most (1 − HORIZON_MARGIN)
    × the fluid horizon of every holder's work at its cheapest price, or its cheapest kinds."""
    horizon = fluid_horizon({k: float(n) for k, n in capacity.items()},
                            ((work[h][0], cost[h]) for h in cost if h in work))
    return {h: set(usable_kinds(costs, horizon)) for h, costs in cost.items() if h in work and not work[h][1]}


def kind_view(servers: Sequence[LeaseServer], demands: Mapping[str, ModelDemand], clients: Sequence[Ranked]
              ) -> KindView:
    """The kinds of `servers`; a holder may use a kind where its requests take at most (1 − HORIZON_MARGIN) × the
    fluid horizon of every holder's work (`horizon_work` at its cheapest price), or its cheapest kinds."""
    capacity: dict[str, int] = {}
    for server in servers:
        capacity[server.kind] = capacity.get(server.kind, 0) + server.capacity
    wanted: dict[str, float] = {}
    for _, holder_id, _, n, _ in clients:
        wanted[holder_id] = wanted.get(holder_id, 0.0) + n
    work = {h: horizon_work(demands.get(h), n) for h, n in wanted.items()}
    cost: dict[str, dict[str, float]] = {}
    for holder_id in work:
        demand = demands.get(holder_id)
        costs = demand.kind_costs if demand is not None else {}
        if all(costs.get(k, 0.0) > 0 for k in capacity):
            cost[holder_id] = {k: costs[k] for k in capacity}
    median = {k: statistics.median(c[k] for c in cost.values()) if cost else 1.0 for k in capacity}
    allowed = _horizon_allowed(capacity, cost, work)
    for holder_id in work:
        cost.setdefault(holder_id, median)
    return KindView(capacity, cost, allowed)


def _holder_wants(clients: Sequence[Ranked]) -> dict[str, float]:
    wanted: dict[str, float] = {}
    for _, holder_id, _, n, _ in clients:
        wanted[holder_id] = wanted.get(holder_id, 0.0) + n
    return wanted


def _headroom(out: dict[str, dict[str, float]], view: KindView, wanted: Mapping[str, float]) -> None:
    """What nobody wants yet on each kind goes to the holders that may use it, in proportion to what they want."""
    for kind, capacity in view.capacity.items():
        left = capacity - sum(k.get(kind, 0.0) for k in out.values())
        takers = {h: n for h, n in wanted.items() if n > 0 and view.may(h, kind)}
        total = sum(takers.values())
        if left > 1e-9 and total > 0:
            for holder_id, n in takers.items():
                out[holder_id][kind] = out[holder_id].get(kind, 0.0) + left * n / total


def plan_requests(wanted: Mapping[str, float], view: KindView) -> tuple[dict[str, dict[str, float]], float]:
    """(Holder -> kind -> how many of its requests the min-makespan split puts there, T): min T (+ PLAN_TIEBREAK × the
    server time spent: among splits of one T, each request where it costs least) subject to each holder's requests
    all placed on the kinds it may use and each kind's work at most T × its slots (HiGHS)."""
    holders = [h for h, n in wanted.items() if n > 0]
    pairs = [(h, k) for h in holders for k in view.capacity if view.may(h, k)]
    out: dict[str, dict[str, float]] = {h: {} for h in holders}
    if not pairs:
        return out, 0.0
    kinds = {k: row for row, k in enumerate(view.capacity)}
    rows = {h: row for row, h in enumerate(holders)}
    n = len(pairs) + 1
    objective = [0.0] * n
    objective[-1] = 1.0
    columns = list(range(len(pairs)))
    eq = ([rows[h] for h, _ in pairs], columns, [1.0] * len(pairs))  # (rows, columns, values): sparse, O(pairs)
    ub = ([kinds[k] for _, k in pairs] + list(kinds.values()), columns + [n - 1] * len(kinds),
          [view.cost[h][k] for h, k in pairs] + [-float(view.capacity[k]) for k in kinds])
    for i, (h, k) in enumerate(pairs):
        objective[i] = PLAN_TIEBREAK * view.cost[h][k] / view.capacity[k]
    result = linprog(objective, A_ub=_sparse(ub, (len(kinds), n)), b_ub=[0.0] * len(kinds),
                     A_eq=_sparse(eq, (len(holders), n)), b_eq=[wanted[h] for h in holders],
                     bounds=[(0, None)] * n, method="highs")
    if not result.success or result.x[-1] <= 0:
        return out, 0.0
    for i, (h, k) in enumerate(pairs):
        if result.x[i] > MIN_PLANNED:
            out[h][k] = float(result.x[i])
    return out, float(result.x[-1])


def _sparse(entries: tuple[list[int], list[int], list[float]], shape: tuple[int, int]) -> object:
    from scipy.sparse import coo_array

    rows, columns, values = entries
    return coo_array((values, (rows, columns)), shape=shape).tocsr()


def plan_by_kind(clients: Sequence[Ranked], view: KindView, service_tie: Callable[[float], float], *,
                 finish_together: bool) -> dict[str, dict[str, float]]:
    """Holder -> kind -> its share there: the min-makespan split decides where each holder's requests go
    (`plan_requests`); `finish_together`: each kind's slots dealt in proportion to the work planned there (a
    holder's slots there: its requests × their cost ÷ the makespan, at most its requests), every holder finishing
    at the plan's makespan — else in the client order among the holders planned there, each client up to its
    part of its holder's requests planned there (a short eval is not stretched to the long ones' end); then the
    headroom."""
    wanted = _holder_wants(clients)
    planned, makespan = plan_requests(wanted, view)
    out: dict[str, dict[str, float]] = {h: {} for h in wanted}
    for kind, capacity in view.capacity.items():
        if finish_together:
            for holder_id, kinds in planned.items():
                if kinds.get(kind, 0.0) > 0:
                    x = kinds[kind]
                    out[holder_id][kind] = min(x, x * view.cost[holder_id][kind] / makespan)
            continue
        on = [(c[0], c[1], c[2], c[3] * planned.get(c[1], {}).get(kind, 0.0) / wanted[c[1]], c[4])
              for c in clients if wanted[c[1]] > 0 and planned.get(c[1], {}).get(kind, 0.0) > 0]
        got, _ = _order_fill(on, float(capacity), service_tie(float(capacity)))
        for (_, holder_id, *_), share in zip(on, got, strict=True):
            if share > 0:
                out[holder_id][kind] = out[holder_id].get(kind, 0.0) + share
    _headroom(out, view, wanted)
    return out


MIN_PLANNED = 1e-6  # requests below this on a kind are not planned there
PLAN_TIEBREAK = 1e-3  # weight of the server time a plan spends, beside its makespan


def kind_targets(servers: Sequence[LeaseServer], wants: Mapping[str, float], demands: Mapping[str, ModelDemand]
                 ) -> tuple[dict[str, dict[str, float]], dict[str, set[str]]]:
    """(Holder -> server kind -> slots of its entitlement to place there, holder -> the kinds it may be placed
    on at all). A holder may use a kind where its requests take at most (1 − HORIZON_MARGIN) × the horizon —
    the fluid bound of every holder's work (`ModelDemand.kind_costs` × its clients' requests, each at its
    cheapest, over every kind's slots at the speed the mix runs there) — or its cheapest kinds: one process's
    rule for its own clients (federation/routing/horizon.py) across processes, so no request lands where it would
    become the run's straggler. The kinds the entitlements fill are the ones the work runs best on; each is
    given, the slowest first, to the holders whose requests cost least there, among those that may use it (a
    holder that sent no costs counts as the median one and may use every kind), rather than by capacity alone.
    O(holders × kinds × log holders)."""
    capacity: dict[str, int] = {}
    for server in servers:
        capacity[server.kind] = capacity.get(server.kind, 0) + server.capacity
    holders = sorted(h for h, w in wants.items() if w > 0)
    if len(capacity) < 2:
        return {h: {k: wants[h] for k in capacity} for h in holders}, {}
    cost: dict[str, dict[str, float]] = {}
    work: dict[str, tuple[float, bool]] = {}
    for holder_id in holders:
        demand = demands.get(holder_id)
        costs = demand.kind_costs if demand is not None else {}
        if demand is not None and all(costs.get(k, 0.0) > 0 for k in capacity):
            cost[holder_id] = {k: costs[k] for k in capacity}
            work[holder_id] = horizon_work(demand, float(sum(c.wanted for c in demand.clients)))
    median = {k: statistics.median(c[k] for c in cost.values()) if cost else 1.0 for k in capacity}
    allowed = _horizon_allowed(capacity, cost, work)
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


def spread_slots(servers: Sequence[LeaseServer], wants: Mapping[str, float], demands: Mapping[str, ModelDemand],
                 inflight: Mapping[str, Mapping[str, int]], occupied: Mapping[str, Mapping[str, int]],
                 plan: KindPlan | None = None) -> dict[str, dict[str, int]]:
    """Holder -> server -> whole slots of one model. Each holder (of `occupied`, in its order) first keeps the slots
    it uses (`inflight`; then those it may be using, `occupied`, up to its fair spread) up to its entitlement in
    `wants` — leases are sticky, no churn of servers between holders — then the rest is dealt one slot at a time,
    the holder with the most still owed first, onto the server with the most room where it is under its spread:
    each holder spread over the servers of the kinds its work suits (`kind_targets`). Every holder's `occupied`
    slots are taken: they are not room. O(holders' servers + slots dealt × log servers)."""
    spread = _Spread(servers, occupied, *(plan if plan is not None else kind_targets(servers, wants, demands)))
    owed: list[tuple[int, str]] = []
    for holder_id, want in wants.items():
        left = spread.keep(holder_id, int(want), inflight[holder_id], occupied[holder_id])
        if left > 0:
            owed.append((-left, holder_id))
    spread.open_rooms(occupied)
    spread.deal(owed)
    return spread.out


def _most_first(item: tuple[str, int]) -> tuple[int, str]:
    """Sort key: the most slots first, then by server id."""
    return -item[1], item[0]


class _Spread:
    """One model's slots as `spread_slots` places them: the grants so far, each kind's servers by room left and
    what each holder's fair spread on a server is."""

    def __init__(self, servers: Sequence[LeaseServer], holders: Iterable[str], targets: dict[str, dict[str, float]],
                 allowed: dict[str, set[str]]):
        self.capacity = {s.id: s.capacity for s in servers}
        self.kind_of = {s.id: s.kind for s in servers}
        self.kind_capacity: dict[str, int] = {}
        for server in servers:
            self.kind_capacity[server.kind] = self.kind_capacity.get(server.kind, 0) + server.capacity
        self.targets = targets
        self.allowed = allowed  # holder -> the kinds it may be placed on (absent: every kind)
        self.out: dict[str, dict[str, int]] = {h: {} for h in holders}
        self.rooms: dict[str, list[tuple[int, str]]] = {}  # kind -> (-room, server), the most room first
        self.placed: dict[str, dict[str, int]] = {}  # holder -> kind -> slots granted there so far

    def fair(self, holder_id: str, sid: str) -> int:
        """A holder's fair spread on a server: its entitlement on the server's kind in proportion to the server's
        capacity."""
        kind = self.kind_of[sid]
        target = self.targets.get(holder_id, {}).get(kind, 0.0)
        return math.ceil(target * self.capacity[sid] / (self.kind_capacity[kind] or 1) - 1e-9)

    def keep(self, holder_id: str, want: int, inflight: Mapping[str, int], occupied: Mapping[str, int]) -> int:
        """Grant the holder, up to `want`, the slots it uses; returns what is left to deal it."""
        left = want
        grant = self.out[holder_id]
        capacity, kind_of, kind_capacity = self.capacity, self.kind_of, self.kind_capacity
        targets = self.targets.get(holder_id, {})
        # Where its requests are in flight first (those slots are taken either way), then the rest it holds
        # up to its fair spread (its entitlement in proportion to each server's capacity): idle slots piled on
        # one server go back, so one process's requests do not all land on one replica.
        # A holder in flight beyond its entitlement keeps its fair spread of them on each server first (the rest
        # it gives back, its youngest at once: federation/core/attempts.py), so a shrunk lease does not leave it all
        # on the servers it happened to fill first.
        ranked = sorted(((sid, n) for sid, n in inflight.items() if sid in capacity), key=_most_first)
        held = sorted(occupied.items(), key=_most_first)
        passes: tuple[tuple[list[tuple[str, int]], bool], ...] = ((ranked, True), (ranked, False), (held, True))
        for source, spread in passes:
            if left <= 0:  # (nothing more can be kept)
                break
            for sid, n in source:
                if sid not in capacity:
                    continue
                had = grant.get(sid, 0)
                keep = min(n - had, left)
                if spread:  # (the fair spread, as `fair` computes it)
                    kind = kind_of[sid]
                    fair = math.ceil(targets.get(kind, 0.0) * capacity[sid] / (kind_capacity[kind] or 1) - 1e-9)
                    keep = min(keep, fair - had)
                if keep > 0:
                    grant[sid] = had + keep
                    left -= keep
                    if left <= 0:
                        break
        return left

    def open_rooms(self, occupied: Mapping[str, Mapping[str, int]]) -> None:
        """Each kind's servers with room left once every holder's occupied slots are taken, the most room first."""
        used = dict.fromkeys(self.capacity, 0)
        for mine in occupied.values():
            for sid, n in mine.items():
                used[sid] += n
        for sid, cap in self.capacity.items():
            if cap > used[sid]:
                self.rooms.setdefault(self.kind_of[sid], []).append((used[sid] - cap, sid))
        for heap in self.rooms.values():
            heapq.heapify(heap)

    def deal(self, owed: list[tuple[int, str]]) -> None:
        """Deal `owed` ((-slots owed, holder)) a slot at a time, the holder owed most first."""
        heapq.heapify(owed)
        while owed:
            minus_left, holder_id = heapq.heappop(owed)
            found = self._room_for(holder_id)
            if found is None:  # no room on a kind it may use: the rest of its entitlement stays idle
                continue
            (minus_room, sid), heap = found
            grant = self.out[holder_id]
            grant[sid] = grant.get(sid, 0) + 1
            mine = self.placed[holder_id]
            mine[self.kind_of[sid]] = mine.get(self.kind_of[sid], 0) + 1
            if minus_room + 1 < 0:
                heapq.heappush(heap, (minus_room + 1, sid))
            if minus_left + 1 < 0:
                heapq.heappush(owed, (minus_left + 1, holder_id))

    def _room_for(self, holder_id: str) -> tuple[tuple[int, str], list[tuple[int, str]]] | None:
        """The server to deal the holder's next slot onto (popped from its kind's heap, returned with it): in the
        kind where it is owed most of its target (then any with room), the one with the most room where it is under
        its fair spread (among the SPREAD_LOOK with the most room), else the one with the most room."""
        mine = self.placed.setdefault(holder_id, {})
        if not mine:
            for sid, n in self.out[holder_id].items():
                mine[self.kind_of[sid]] = mine.get(self.kind_of[sid], 0) + n
        target = self.targets.get(holder_id, {})
        usable = self.allowed.get(holder_id)  # (None: every kind)
        order = sorted((k for k in self.rooms if self.rooms[k] and (usable is None or k in usable)),
                       key=lambda k: (mine.get(k, 0) - target.get(k, 0.0), k))
        for kind in order:
            heap = self.rooms[kind]
            chosen = self._under_spread(holder_id, heap)
            if chosen is not None:
                return chosen, heap
        if not order:
            return None
        heap = self.rooms[order[0]]
        return heapq.heappop(heap), heap

    def _under_spread(self, holder_id: str, heap: list[tuple[int, str]]) -> tuple[int, str] | None:
        """Pop the server with the most room where the holder is under its fair spread, among the SPREAD_LOOK with
        the most room (those passed over go back); None when there is none."""
        grant = self.out[holder_id]
        looked: list[tuple[int, str]] = []
        chosen = None
        while heap and len(looked) < SPREAD_LOOK:
            room = heapq.heappop(heap)
            if grant.get(room[1], 0) < self.fair(holder_id, room[1]):
                chosen = room
                break
            looked.append(room)
        for room in looked:
            heapq.heappush(heap, room)
        return chosen


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
