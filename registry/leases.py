"""Capacity leases: each server's slots shared among the processes (holders) whose dispatchers use it.

Every dispatcher reports about twice a second what it wants, per model (for each client: the slots it could use
now, its weight and its rank in the client order; per server: what it has in flight and the lease it holds). The
broker answers with a lease: slots per server this holder may keep in flight for `ttl_s` seconds, so nothing on
the request path waits for the registry (Doorman's model: capacity leases refreshed in the background). One
model's servers at a time: entitlements follow the client order across every holder, on servers of several kinds
split by the min-makespan plan of every holder's work over the kinds (`_entitlements`, `placement.plan_by_kind`),
are rounded to whole slots and placed on servers (`placement.whole`, `placement.spread_slots`); a slot another
holder may still be using is never granted twice. A holder that stops reporting shares no more after `ttl_s`, and
what it may still use (its fallback) is not room for one TTL more; a restarted broker learns as long. The full
account: docs/architecture.md, "Many processes, one pool".

Pure bookkeeping: injected clock, no I/O; the registry actor wraps it. The reports' wire format is
registry/demand.py; who is on the pool, as the reports tell it, registry/holders.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import uuid
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fedpool.registry.demand import ClientDemand as ClientDemand  # (the wire format: its names from here too)
from fedpool.registry.demand import DemandReport, Served
from fedpool.registry.demand import ModelDemand as ModelDemand
from fedpool.registry.fills import SERVICE_NO_STEP, Ranked
from fedpool.registry.holders import (
    DurationHistogram,
    HeldBy,
    HoldersBook,
    LeaseFigures,
    PoolHolders,
    lease_figures,
    servers_over_capacity,
)
from fedpool.registry.placement import (
    KindPlan,
    kind_view,
    plan_by_kind,
    share_by_order,
    spread_slots,
    whole,
)

LEASE_TTL_S = 3.0  # a lease not renewed within this is gone (holders renew every ~0.5 s)
RESHARE_S = 0.02  # leases are re-shared at most this often (every report is taken at once)
# The share of one core the registry's re-shares may take: in a large pool one takes long enough that re-sharing
# every RESHARE_S would leave the actor no time for the calls, so the next waits in proportion.
RESHARE_BUDGET = 0.5
MAX_LEASE_WAIT_S = 5.0  # the longest a lease call may wait for its holder's slots to change
MAX_UNACKED = 32  # leases kept per holder that it has not said it received (a silent holder expires at its TTL)
SERVICE_TIE_S = 2.0  # clients ranked by service within this many seconds of an equal share are one class
# How each model's slots are shared where its servers are of several kinds: "plan" — the min-makespan split of every
# holder's work over the kinds (`placement.plan_by_kind`); "slots" — the client order over slot counts, then placed
# by kind (`placement.kind_targets`).
PLACEMENTS = ("plan", "slots")
MAKESPAN_ORDERS = ("fair", "longest_answers_first")  # client orders whose holders the plan may finish together
PLACEMENT = "plan"
NO_ANSWERS = Served()


@dataclass(frozen=True, slots=True)
class Lease:
    """Slots per server the holder may keep in flight until `ttl_s` after it received this."""

    holder: str
    broker: str  # the broker's incarnation; a new one means the registry restarted
    version: int  # grows whenever this holder's slots change
    ttl_s: float
    slots: Mapping[str, int]
    # What to keep for one TTL when the lease runs out unrenewed (`slots` capped at the capacity ÷ the holders, so
    # within the lease: the fallbacks of every holder add up to at most each server's slots); then nothing.
    safe: Mapping[str, int]
    holders: int  # holders known to the broker
    pool_served: Served = NO_ANSWERS  # every holder's answers at the last re-share (a process with none prices by it)


@dataclass(frozen=True, slots=True)
class LeaseServer:
    """A server as the broker sees it: what it serves and how many slots it has (0 when not routable)."""

    id: str
    model: str
    capacity: int
    kind: str = ""  # `snapshot.server_kind`: servers of one kind cost a request the same


@dataclass
class _Holder:
    report: DemandReport
    seen_at: float
    slots: dict[str, int] = field(default_factory=dict)
    safe: dict[str, int] = field(default_factory=dict)  # the fallback of the lease `slots`
    version: int = 0
    # Leases sent since the one the holder last said it holds (version -> slots): it may be using any of them (a
    # lease answered after its report, or one that has since shrunk), so their slots are not room either.
    unacked: dict[int, dict[str, int]] = field(default_factory=dict)


def learns_at_start(saved_state: bool, reconstructed: bool) -> bool:
    """Whether a broker starting now may find slots of a previous incarnation's leases in use: when the registry
    found saved state, or was restarted (by Ray) without any — its holders still work within their leases."""
    return saved_state or reconstructed


class LeaseBroker:
    def __init__(self, clock: Callable[[], float], *, ttl_s: float = LEASE_TTL_S, incarnation: str | None = None,
                 restarted: bool = True, placement: str = PLACEMENT, wall_clock: Callable[[], float] = time.time):
        """`restarted`: a previous broker may have leased slots that are still in use (`learns_at_start`): learn
        until every lease it granted, and the fallback after it, has run out. A pool started afresh has nothing to
        learn. `wall_clock`: the times the holders view shows."""
        self._clock = clock
        self.ttl_s = ttl_s
        self.placement = placement
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self._started = clock() if restarted else float("-inf")
        self._holders: dict[str, _Holder] = {}
        # Holders silent for a TTL: their leases ran out, but they may still work within their fallback (or still
        # have attempts in flight) for one more TTL: what they may be using is not room until then.
        self._silent: dict[str, _Holder] = {}
        self._versions = itertools.count(1)  # one sequence for every holder: a holder forgotten and back never
        # sees a version it had before
        self._servers: tuple[LeaseServer, ...] = ()
        self._shares: dict[str, int] = {}  # server -> its capacity ÷ the holders that want its model (≥ 1)
        self.recomputes = 0
        self.book = HoldersBook(clock, wall_clock)  # who is on the pool, for the people watching it
        self.over_capacity = 0  # servers whose leases summed past their slots after a re-share (a bug: stays 0)
        self.served = NO_ANSWERS  # every holder's answers, summed at each re-share

    # ---- what holders and the registry say ---------------------------------------------------------
    def report(self, report: DemandReport, known_version: int | None = None) -> None:
        """Take a holder's report (shares move at the next `reshare`); `known_version`: the version of the lease
        it held when it sent the report (None: the latest, as a holder reporting in step with the broker)."""
        now = self._clock()
        holder = self._holders.get(report.holder) or self._silent.pop(report.holder, None)
        if holder is None:
            holder = _Holder(report, now)
        self._holders[report.holder] = holder
        holder.report, holder.seen_at = report, now
        self.book.observe(report)
        if known_version is None or report.broker != self.incarnation:
            known_version = holder.version if known_version is None else -1
        for version in [v for v in holder.unacked if v <= known_version]:  # (held: that lease, in the report)
            del holder.unacked[version]

    def set_servers(self, servers: Iterable[LeaseServer]) -> None:
        """The registry's servers (membership, capacity, status), as of now."""
        self._servers = tuple(servers)

    def release(self, holder_id: str) -> bool:
        """A holder said goodbye: its slots are free at the next `reshare`."""
        silent = self._silent.pop(holder_id, None) is not None
        self.book.gone(holder_id, lost=False)
        return self._holders.pop(holder_id, None) is not None or silent

    def expire(self) -> bool:
        """Holders whose lease ran out unrenewed share no more (silent); a TTL later, when their fallback has run
        out too, they are forgotten. True when any was."""
        now = self._clock()
        silent = [h for h, holder in self._holders.items() if now - holder.seen_at > self.ttl_s]
        for holder_id in silent:
            self._silent[holder_id] = self._holders.pop(holder_id)
        gone = [h for h, holder in self._silent.items() if now - holder.seen_at > 2 * self.ttl_s]
        for holder_id in gone:
            del self._silent[holder_id]
            self.book.gone(holder_id, lost=True)
        return bool(silent or gone)

    # ---- reads ----------------------------------------------------------------------------------------
    def lease(self, holder_id: str) -> Lease:
        holder = self._holders.get(holder_id)
        if holder is None:
            return Lease(holder_id, self.incarnation, 0, self.ttl_s, {}, {}, len(self._holders), self.served)
        return Lease(holder_id, self.incarnation, holder.version, self.ttl_s, dict(holder.slots), dict(holder.safe),
                     len(self._holders), self.served)

    def version(self, holder_id: str) -> int:
        holder = self._holders.get(holder_id)
        return holder.version if holder is not None else 0

    def holders(self) -> list[str]:
        """The holders that share (those silent for a TTL do not)."""
        return sorted(self._holders)

    def safe_shares(self) -> dict[str, int]:
        """Each server's capacity divided among the holders that want its model (at least one slot each), as of
        the last `reshare`: a lease's fallback is the lease capped at these."""
        return dict(self._shares)

    def holders_view(self, *, detail: bool = True) -> PoolHolders:
        """Every holder with its clients and slots, and the clients finished lately (registry/holders.py); without
        `detail`, no holder's rows per server (`HoldersBook.view`)."""
        held = [HeldBy(h, x.report, x.slots, x.seen_at, h in self._silent)
                for h, x in (*self._holders.items(), *self._silent.items())]
        return self.book.view(held, self._servers, self._shares, broker=self.incarnation, learning=self.learning(),
                              detail=detail)

    def learning(self) -> bool:
        """After (re)starting, leases the previous incarnation granted may still be in use: for one TTL, and the
        fallback of a lease that ran out for one more."""
        return self._clock() - self._started < 2 * self.ttl_s

    # ---- sharing ----------------------------------------------------------------------------------------
    def reshare(self) -> set[str]:
        """Share every model's slots again from the latest reports; returns the holders whose lease changed.
        O(servers × holders): the registry calls it at most every few tens of milliseconds, not per report."""
        self.recomputes += 1
        by_model: dict[str, list[LeaseServer]] = {}
        for server in self._servers:
            if server.capacity > 0:
                by_model.setdefault(server.model, []).append(server)
        learning = self.learning()
        self._shares = self._share_out()
        reports = [h.report for h in self._holders.values()]
        self.served = Served(sum(r.served_work for r in reports), sum(r.served_slot_s for r in reports),
                             sum(r.served_answer_tokens for r in reports))
        new: dict[str, dict[str, int]] = {h: {} for h in (*self._holders, *self._silent)}
        for model, servers in by_model.items():
            ids = {s.id for s in servers}
            held = {h: sum(n for sid, n in holder.slots.items() if sid in ids) for h, holder in self._holders.items()}
            entitled, plan = self._entitlements(model, servers)
            wants = whole(entitled, self._ends(model), held)
            for holder_id, slots in self._spread(model, servers, wants, learning, plan).items():
                holder = self._holders.get(holder_id)  # (none for a silent one: it is dealt nothing)
                if holder is not None and not holder.report.announce:  # (an announced share stays free for it)
                    new[holder_id].update(slots)
        changed = set()
        for holder_id, holder in (*self._holders.items(), *self._silent.items()):
            slots = {s: n for s, n in new[holder_id].items() if n > 0}
            if slots != holder.slots:
                holder.slots = slots
                holder.safe = {s: min(n, self._shares.get(s, 0)) for s, n in slots.items()}
                holder.version = next(self._versions)
                holder.unacked[holder.version] = slots
                if len(holder.unacked) > MAX_UNACKED:
                    del holder.unacked[min(holder.unacked)]
                changed.add(holder_id)
        leases = (h.slots for h in (*self._holders.values(), *self._silent.values()))
        self.over_capacity += servers_over_capacity(self._servers, leases)
        return changed

    def _share_out(self) -> dict[str, int]:
        """Server -> its capacity ÷ the holders that want its model, at least 1."""
        users: dict[str, int] = {}
        for holder in self._holders.values():
            for demand in holder.report.models:
                users[demand.model] = users.get(demand.model, 0) + 1
        return {s.id: max(1, s.capacity // max(1, users.get(s.model, 1))) for s in self._servers if s.capacity > 0}

    def _ends(self, model: str) -> dict[str, float]:
        """Holder -> the least work left any of its clients that want slots on the model says it has (holders
        whose clients say nothing are absent)."""
        out: dict[str, float] = {}
        for holder_id, holder in self._holders.items():
            for demand in holder.report.models:
                if demand.model == model:
                    for c in demand.clients:
                        if c.wanted and c.work_left is not None:
                            out[holder_id] = min(out.get(holder_id, math.inf), c.work_left)
        return out

    def _work_per_slot_s(self) -> float:
        """Work per slot-second over every holder's answers: the scale that ranks service as work."""
        work, seconds, _ = self.served
        return work / seconds if seconds > 0 and work > 0 else 1.0

    def _work_per_answer_token(self) -> float:
        """Work per answer token over every holder's answers (1 before any): what a client that reported before any
        answer anywhere, its requests' answer steps, comes to on the scale service is ranked in."""
        work, _, tokens = self.served
        return work / tokens if tokens > 0 and work > 0 else 1.0

    def _ranked(self, model: str, by_client: bool = False) -> tuple[list[Ranked], Callable[[float], float]]:
        """The model's clients that want slots, in the client order (clients still loading in the first class), and
        the service tie for a capacity (a class's width among clients ranked by service). `by_client`: each named
        by its holder and itself (`unit`), not its holder alone."""
        clients: list[Ranked] = []  # rank, holder, weight, wanted, by service (its step)
        loading: list[tuple[str, float, float]] = []  # holder, weight, wanted of clients not ready yet
        scale: float | None = None
        for holder_id, holder in self._holders.items():
            for demand in holder.report.models:
                if demand.model != model:
                    continue
                for c in demand.clients:
                    if not c.wanted:
                        continue
                    name = unit(holder_id, c.client) if by_client else holder_id
                    if c.loading:
                        loading.append((name, c.weight, float(c.wanted)))
                        continue
                    rank, step = c.rank, 0.0
                    if c.served_s is not None:  # (by service: its level without its requests in flight, where said)
                        scale = self._work_per_slot_s() if scale is None else scale
                        rank = max(0.0, c.served_s - (c.running * c.request_s if c.request_s else 0.0)) * scale
                        step = c.request_s * scale if c.request_s else SERVICE_NO_STEP
                    elif c.request_s:  # (nothing answered anywhere when it reported: its shape's steps, from 0)
                        rank, step = 0.0, c.request_s * self._work_per_answer_token()
                    clients.append((rank, name, c.weight, float(c.wanted), step))
        clients.sort(key=lambda c: c[0])
        # Clients still loading share the first class: they take the first client's rank (and its kind).
        first = clients[0] if clients else (0.0, "", 1.0, 0.0, 0.0)
        clients[:0] = [(first[0], holder_id, weight, n, first[4]) for holder_id, weight, n in loading]
        # Clients ranked by the service they have attained and not saying what a request adds to it are one class
        # while they are within what an equal share of the slots gives in SERVICE_TIE_S: ranked strictly, the one a
        # hair behind got every slot it wanted and the other none until it fell behind in turn — whole requests
        # later, as slots are not taken back. (Those that say share by levels: registry/fills.py.)
        by_service = sum(1 for c in clients if c[4])

        def tie(capacity: float) -> float:
            return SERVICE_TIE_S * capacity / by_service * (scale or 1.0) if by_service else 0.0

        return clients, tie

    def _entitlements(self, model: str, servers: Sequence[LeaseServer]) -> tuple[dict[str, float], KindPlan | None]:
        """Holder -> slots it is entitled to on the model's servers (fractional), by the client order; and, placed
        by kind (`self.placement`), each holder's entitlement per server kind."""
        if self.placement != "slots":
            # Each client planned on its own (a process running several evals: each eval's requests on the kinds
            # they suit), its share counted to its holder.
            units, tie = self._ranked(model, by_client=True)
            demands = self._client_demands(model)
            view = kind_view(servers, demands, units)
            if len(view.capacity) > 1:
                together = all(d.order in MAKESPAN_ORDERS for d in demands.values())
                by_kind, allowed = holders_of(plan_by_kind(units, view, tie, finish_together=together), view.allowed)
                return {h: sum(k.values()) for h, k in by_kind.items()}, (by_kind, allowed)
        clients, tie = self._ranked(model)
        capacity = sum(s.capacity for s in servers)
        return share_by_order(clients, capacity, tie(capacity)), None

    def _client_demands(self, model: str) -> dict[str, ModelDemand]:
        """`unit` -> the demand of one client of a holder on the model: the client alone, priced as it says (its
        holder's mean where it does not), in its holder's order."""
        out: dict[str, ModelDemand] = {}
        for holder_id, holder in self._holders.items():
            for demand in holder.report.models:
                if demand.model == model:
                    for c in demand.clients:
                        out[unit(holder_id, c.client)] = ModelDemand.model_construct(
                            model=model, clients=(c,), kind_costs=c.kind_costs or demand.kind_costs,
                            order=demand.order)
        return out

    def _spread(self, model: str, servers: list[LeaseServer], wants: Mapping[str, float],
                learning: bool, plan: KindPlan | None) -> dict[str, dict[str, int]]:
        """Holder -> server -> whole slots (`placement.spread_slots`: sticky, each holder spread over the servers of
        the kinds its work suits). A slot another holder may be using — its last lease, the lease it says it holds,
        or its work in flight — is not room: a lease shrinks first and the slots move once its holder has let them
        go. O(holders' servers + slots dealt × log servers)."""
        ids = {s.id for s in servers}
        occupied = {h: self._occupied(holder, ids, learning)
                    for h, holder in (*self._holders.items(), *self._silent.items())}
        if learning:  # the previous incarnation's leases may be in use: nobody is granted more than it holds
            wants = {h: min(w, float(sum(occupied[h].values()))) for h, w in wants.items()}
        demands = {h: d for h, holder in self._holders.items() for d in holder.report.models if d.model == model}
        inflight = {h: holder.report.inflight for h, holder in self._holders.items()}
        return spread_slots(servers, wants, demands, inflight, occupied, plan)

    def _occupied(self, holder: _Holder, ids: Container[str], learning: bool) -> dict[str, int]:
        """Server (of `ids`) -> the most slots the holder may be using there: the lease it says it holds (granted by
        this incarnation, or any while learning), its work in flight, its lease and every lease it has not acked."""
        report = holder.report
        held = report.held if learning or report.broker == self.incarnation else {}
        mine: dict[str, int] = {}
        for source in (held, report.inflight, holder.slots, *holder.unacked.values()):
            for sid, n in source.items():
                if sid in ids and n > mine.get(sid, 0):
                    mine[sid] = n
        return mine


UNIT_SEP = "\n"  # (no holder id has one: `DemandReport.holder` is one line)


def unit(holder_id: str, client: str) -> str:
    """One client of a holder, as the broker's plan names it."""
    return f"{holder_id}{UNIT_SEP}{client}"


def holders_of(by_unit: Mapping[str, Mapping[str, float]], allowed: Mapping[str, set[str]]) -> KindPlan:
    """A plan over clients (`unit` -> kind -> slots; -> the kinds it may use), summed over each holder's: the kinds a
    holder may use are its clients' together (every kind where one of them may use every kind)."""
    by_kind: dict[str, dict[str, float]] = {}
    kinds: dict[str, set[str] | None] = {}
    for name, shares in by_unit.items():
        holder_id = name.split(UNIT_SEP, 1)[0]
        mine = by_kind.setdefault(holder_id, {})
        for kind, n in shares.items():
            mine[kind] = mine.get(kind, 0.0) + n
        may, had = allowed.get(name), kinds.get(holder_id, set())
        kinds[holder_id] = None if may is None or had is None else had | may
    return by_kind, {h: k for h, k in kinds.items() if k is not None}


class LeaseService:
    """The broker behind an async front (the registry actor's, and the simulator's in-process registry): every
    report is taken at once, slots are re-shared at most every `reshare_s` (and, with a `budget`, at most that
    share of one core: a re-share that took t seconds is followed by the next t ÷ budget later at the earliest),
    and a call whose holder's slots did not change waits (a long poll) until they do or `wait_s` passes. No
    budget where time is simulated: the schedule must not depend on the machine."""

    def __init__(self, broker: LeaseBroker, *, reshare_s: float = RESHARE_S, budget: float | None = None):
        self.broker = broker
        self._reshare_s = reshare_s
        self._budget = budget
        self._gap = reshare_s  # from one re-share's start to the next's
        self._changed: dict[str, asyncio.Event] = {}
        self._reshared_at = float("-inf")
        self._soon: asyncio.Task[None] | None = None
        self.calls = 0
        self.reshare_s = DurationHistogram()

    def set_servers(self, servers: Iterable[LeaseServer]) -> None:
        self.broker.set_servers(servers)

    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease:
        """The holder's lease once its report is shared; when its slots are still `known_version`, a long poll:
        answered when a re-share changes them, or `wait_s` after the call came (a call does not wait for the next
        re-share first: in a large pool that is seconds away, and renewals keep their rate)."""
        self.calls += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, MAX_LEASE_WAIT_S)
        self.broker.report(report, known_version)
        holder = report.holder
        if wait_s <= 0 or self.broker.version(holder) != known_version:
            await self._reshare()
            return self.broker.lease(holder)
        event = self._changed.setdefault(holder, asyncio.Event())
        self._reshare_soon(loop)
        if self.broker.version(holder) == known_version and deadline > loop.time():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), deadline - loop.time())
        return self.broker.lease(holder)

    async def release(self, holder: str) -> None:
        if self.broker.release(holder):
            self._changed.pop(holder, None)
            await self._reshare()

    def stats(self) -> dict[str, object]:
        broker = self.broker
        holders = {h: dict(broker.lease(h).slots) for h in broker.holders()}
        return {"incarnation": broker.incarnation, "holders": holders, "calls": self.calls,
                "reshares": broker.recomputes}

    def figures(self) -> LeaseFigures:
        """What the registry exports about its leases (registry/exporter.py)."""
        broker = self.broker
        return lease_figures(broker.holders_view(detail=False), over_capacity=broker.over_capacity, calls=self.calls,
                             reshares=broker.recomputes, reshare_s=self.reshare_s)

    async def _reshare(self) -> None:
        """Share again now, or (when the last share was under `reshare_s` ago) once that has passed."""
        soon = self._reshare_soon(asyncio.get_running_loop())
        if soon is not None:
            await asyncio.shield(soon)

    def _reshare_soon(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[None] | None:
        """Share again now, or schedule it for when the gap since the last share has passed (returned)."""
        wait = self._reshared_at + self._gap - loop.time()
        if wait > 0:
            if self._soon is None or self._soon.done():
                self._soon = loop.create_task(self._reshare_after(wait))
            return self._soon
        self._reshare_now(loop.time())
        return None

    async def _reshare_after(self, wait: float) -> None:
        await asyncio.sleep(wait)
        self._reshare_now(asyncio.get_running_loop().time())

    def _reshare_now(self, now: float) -> None:
        self._reshared_at = now
        started = time.perf_counter()
        if self.broker.expire():
            holders = set(self.broker.holders())
            for gone in [h for h in self._changed if h not in holders]:
                del self._changed[gone]
        for holder in sorted(self.broker.reshare()):  # (in a fixed order: a set of names iterates by their hash)
            event = self._changed.pop(holder, None)
            if event is not None:
                event.set()
        took = time.perf_counter() - started
        self.reshare_s.observe(took)
        if self._budget is not None:
            self._gap = max(self._reshare_s, took / self._budget)

