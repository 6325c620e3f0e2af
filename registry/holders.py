"""Who is on the pool: every holder (a process whose dispatcher uses it) with its clients, their progress, rate and
ETA, and the slots it holds per server and server kind against its fair share, as the lease broker knows them from
the holders' reports (registry/demand.py). `PoolHolders` is the wire format (`RegistryActor.holders`, the API's
`GET /v1/holders`); `HoldersBook` is the broker's bookkeeping behind it: bounded, everything kept for a holder or a
client is forgotten when it has gone, and a finished client stays listed, with its outcome, for a few minutes only.
`PoolHolders.redacted` is the view for whoever may not see who the clients are; `lease_figures` what the registry
exports to Prometheus about its leases (registry/exporter.py)."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from fedpool.registry.demand import ClientDemand, DemandReport, HolderInfo, HolderKind

FINISHED_KEEP_S = 300.0  # a finished client stays listed this long ...
MAX_FINISHED = 200  # ... and at most this many of them, the oldest going first
RATE_SAMPLE_S = 2.0  # a client's progress is sampled at most this often ...
RATE_SAMPLES = 16  # ... and its rate measured over this many samples (about half a minute)
RATE_MIN_SPAN_S = 2.0  # no rate before its samples span this long
MAX_CLIENT_SERIES = 20  # per-client Prometheus series at most; the rest are summed into client="other"
RESHARE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

ClientState = Literal["loading", "running", "finished"]
# How a client left the view: "done" — it had sent its last request (or said it had none left) and nothing of it
# is in flight; "stopped" — it went with requests left; "idle" — it went saying nothing of what it has left (a
# gateway caller between runs comes back as running); "lost" — its holder stopped reporting with work left.
Outcome = Literal["done", "stopped", "idle", "lost"]
HolderState = Literal["announced", "active", "silent"]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClientProgress(_Wire):
    """One client of a holder on one model (an eval, a gateway caller, a batch)."""

    client: str
    model: str
    state: ClientState
    wanted: int  # the slots it could use now: requests waiting and in flight (0 once finished)
    done: int  # requests answered (a client finished "done": every request it sent)
    requests_left: int | None  # what it says it has left (None: it says nothing)
    rate_per_s: float | None  # requests answered per second over the last half minute (None: not known yet)
    eta_s: float | None  # requests_left ÷ rate_per_s
    since: float  # Unix time the broker first heard of it
    outcome: Outcome | None = None  # finished clients only
    ended_at: float | None = None  # Unix time it finished


class FinishedClient(ClientProgress):
    """A client that finished lately, with the holder it ran in (which may have gone since)."""

    holder: str
    holder_kind: HolderKind


class ServerSlots(_Wire):
    """What a holder holds on one server."""

    server: str
    model: str
    kind: str  # the server's kind (`snapshot.server_kind`)
    slots: int  # its lease there
    inflight: int  # what it reported in flight there
    fair_share: int  # the server's slots ÷ the holders that want its model


class KindSlots(_Wire):
    """What a holder holds on the servers of one kind serving one model, against its fair share of them."""

    model: str
    kind: str
    slots: int
    inflight: int
    fair_share: int
    capacity: int  # the slots of every server of that kind and model


class HolderView(_Wire):
    holder: str  # its name at the broker
    kind: HolderKind
    host: str | None  # None: not said, or hidden
    pid: int | None
    since: float  # Unix time it joined the pool (as it says; else when the broker first heard of it)
    last_report_s: float  # seconds since its last report
    state: HolderState  # announced: before its lease client reports; silent: no report for a lease TTL
    slots: int  # its lease, every server
    fair_share: int  # its fair share of the servers of the models it wants
    clients: tuple[ClientProgress, ...]
    servers: tuple[ServerSlots, ...]  # the servers where it holds or runs anything
    kinds: tuple[KindSlots, ...]  # every server kind of the models it wants


class ServerUse(_Wire):
    """One server as the broker shares it."""

    server: str
    model: str
    kind: str
    capacity: int  # its slots (0: not routable)
    leased: int  # the slots of every holder's lease there
    holders: int  # holders with a lease there


class PoolHolders(_Wire):
    """Everyone on the pool, as the broker knows it now."""

    taken_at: float  # Unix time
    broker: str  # the broker's incarnation
    learning: bool  # just (re)started: leases an earlier incarnation granted may still be in use
    names_hidden: bool = False  # client names, holder names and hosts replaced by stable aliases (`redacted`)
    holders: tuple[HolderView, ...] = ()
    finished: tuple[FinishedClient, ...] = ()  # newest first
    servers: tuple[ServerUse, ...] = ()

    def redacted(self, secret: bytes) -> PoolHolders:
        """The view without who the clients and processes are: names replaced by aliases keyed with `secret` (the
        same name, the same alias, while the secret is kept; unguessable without it), no hosts or pids."""

        def alias(prefix: str, name: str) -> str:
            return f"{prefix}-{hmac.new(secret, name.encode(), hashlib.sha256).hexdigest()[:10]}"

        def clients(rows: Sequence[ClientProgress]) -> tuple[ClientProgress, ...]:
            return tuple(c.model_copy(update={"client": alias("client", c.client)}) for c in rows)

        holders = tuple(h.model_copy(update={"holder": alias("holder", h.holder), "host": None, "pid": None,
                                             "clients": clients(h.clients)}) for h in self.holders)
        finished = tuple(f.model_copy(update={"client": alias("client", f.client), "holder": alias("holder", f.holder)})
                         for f in self.finished)
        return self.model_copy(update={"names_hidden": True, "holders": holders, "finished": finished})


@runtime_checkable
class HoldersSource(Protocol):
    """A registry client that can say who is on the pool (the Ray and the HTTP client)."""

    async def holders(self, detail: bool = True) -> PoolHolders: ...


class LeaseServerLike(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def capacity(self) -> int: ...

    @property
    def kind(self) -> str: ...


@dataclass(frozen=True, slots=True)
class HeldBy:
    """One holder as the broker has it: its last report, its lease and when it reported."""

    holder: str
    report: DemandReport
    slots: Mapping[str, int]
    seen_at: float  # on the broker's clock
    silent: bool


@dataclass
class _Track:
    """One client of a holder, across its reports."""

    model: str
    since: float  # wall clock
    last: ClientDemand
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))

    def note(self, demand: ClientDemand, now: float) -> None:
        if demand.answered < self.last.answered:  # (its dispatcher forgot it and began again)
            self.samples.clear()
        self.last = demand
        if not self.samples or now - self.samples[-1][0] >= RATE_SAMPLE_S:
            self.samples.append((now, demand.answered))

    def rate(self, now: float) -> float | None:
        """Requests answered per second over its samples and its last report."""
        if not self.samples:
            return None
        t0, n0 = self.samples[0]
        span = now - t0
        return (self.last.answered - n0) / span if span >= RATE_MIN_SPAN_S else None


@dataclass
class _Seen:
    """One holder, across its reports."""

    info: HolderInfo | None
    since: float  # wall clock
    clients: dict[tuple[str, str], _Track] = field(default_factory=dict)  # (model, client) -> its track
    last_at: float = 0.0  # its last report, on the broker's clock


class HoldersBook:
    """The broker's record of who is on the pool, fed with every report (O(its clients)) and every holder that
    goes; read as a `PoolHolders` (`view`). `clock`: the broker's; `wall_clock`: for the times shown."""

    def __init__(self, clock: Callable[[], float], wall_clock: Callable[[], float] = time.time, *,
                 keep_finished_s: float = FINISHED_KEEP_S, max_finished: int = MAX_FINISHED):
        self._clock = clock
        self._wall = wall_clock
        self._keep_s = keep_finished_s
        self._max_finished = max_finished
        self._seen: dict[str, _Seen] = {}
        # (holder, model, client) -> (its track, as shown): oldest first
        self._finished: OrderedDict[tuple[str, str, str], tuple[_Track, FinishedClient]] = OrderedDict()

    def observe(self, report: DemandReport) -> None:
        """A holder's report: its clients' progress; a client missing from it since the last has finished."""
        now = self._clock()
        seen = self._seen.get(report.holder)
        if seen is None:
            seen = self._seen[report.holder] = _Seen(report.info, self._wall())
        if report.info is not None:
            seen.info = report.info
        seen.last_at = now
        for ended in report.ended:
            for demand in ended.clients:
                self._ended(report.holder, seen, (ended.model, demand.client), demand, now)
        current = {(m.model, c.client): c for m in report.models for c in m.clients}
        for key in [k for k in seen.clients if k not in current]:
            self._finish(report.holder, seen, key, lost=False)
        for key, demand in current.items():
            track = seen.clients.get(key)
            if track is None:
                back = self._finished.pop((report.holder, *key), None)  # (a caller back from a pause)
                track = back[0] if back is not None else _Track(key[0], self._wall(), demand)
                track.samples.clear()
                seen.clients[key] = track
            track.note(demand, now)
        self._age()

    def _ended(self, holder: str, seen: _Seen, key: tuple[str, str], demand: ClientDemand, now: float) -> None:
        """A client the holder says has ended, with its progress: its last word (it finishes as the report leaves it
        out), or, where an earlier report already left it out, how it finished said again."""
        track = seen.clients.get(key)
        if track is not None:
            track.note(demand, now)
            return
        finished = self._finished.get((holder, *key))
        if finished is not None:
            track, shown = finished
            track.note(demand, now)
            self._finished[(holder, *key)] = (track, self._shown(holder, seen, track, lost=False,
                                                                 ended_at=shown.ended_at))

    def gone(self, holder: str, *, lost: bool) -> None:
        """The holder said goodbye (`lost` False) or was forgotten after going silent: its clients finish."""
        seen = self._seen.pop(holder, None)
        if seen is not None:
            for key in list(seen.clients):
                self._finish(holder, seen, key, lost=lost)
        self._age()

    def forget_unless(self, holders: Iterable[str]) -> None:
        """Forget every holder not among `holders` (those the broker still knows)."""
        known = set(holders)
        for holder in [h for h in self._seen if h not in known]:
            self.gone(holder, lost=True)

    def _finish(self, holder: str, seen: _Seen, key: tuple[str, str], *, lost: bool) -> None:
        track = seen.clients.pop(key)
        self._finished.pop((holder, *key), None)
        self._finished[(holder, *key)] = (track, self._shown(holder, seen, track, lost=lost, ended_at=self._wall()))

    @staticmethod
    def _shown(holder: str, seen: _Seen, track: _Track, *, lost: bool, ended_at: float | None) -> FinishedClient:
        """A finished client as the view shows it, its outcome judged by its last progress."""
        last = track.last
        outcome: Outcome
        if last.sent_all or last.requests_left == 0:
            outcome = "done"
        elif lost:
            outcome = "lost"
        else:
            outcome = "stopped" if last.requests_left else "idle"
        done = last.answered + (last.wanted if outcome == "done" else 0)  # (its last in flight ended too)
        return FinishedClient(
            client=last.client, model=track.model, state="finished", wanted=0, done=done,
            requests_left=0 if outcome == "done" else last.requests_left, rate_per_s=None, eta_s=None,
            since=track.since, outcome=outcome, ended_at=ended_at, holder=holder,
            holder_kind=seen.info.kind if seen.info is not None else "other")

    def _age(self) -> None:
        """Finished clients older than the keep, or beyond the most kept, go (oldest first)."""
        oldest = self._wall() - self._keep_s
        while self._finished:
            ended = next(iter(self._finished.values()))[1].ended_at or 0.0
            if len(self._finished) <= self._max_finished and ended >= oldest:
                break
            self._finished.popitem(last=False)

    def kind_of(self, holder: str) -> HolderKind:
        seen = self._seen.get(holder)
        return seen.info.kind if seen is not None and seen.info is not None else "other"

    def view(self, held: Sequence[HeldBy], servers: Sequence[LeaseServerLike], shares: Mapping[str, int], *,
             broker: str, learning: bool, detail: bool = True) -> PoolHolders:
        """Everyone on the pool now: `held`, the broker's holders; `shares`, each server's fair share (its
        slots ÷ the holders that want its model). Without `detail`, no holder's rows per server (the pool page and the
        metrics need its kinds only: pydantic rows for every server every holder uses are most of the view's cost)."""
        self.forget_unless(h.holder for h in held)
        self._age()
        now, wall = self._clock(), self._wall()
        by_id = {s.id: s for s in servers}
        totals = _KindTotals.of(servers, shares)  # (once: a holder's kinds cost O(its kinds + its servers))
        leased: Counter[str] = Counter()
        holding: Counter[str] = Counter()
        for h in held:
            leased.update(h.slots)
            holding.update(sid for sid, n in h.slots.items() if n > 0)
        return PoolHolders(
            taken_at=wall, broker=broker, learning=learning,
            holders=tuple(self._holder(h, by_id, shares, totals, now, detail)
                          for h in sorted(held, key=lambda h: h.holder)),
            finished=tuple(shown for _, shown in reversed(self._finished.values())),
            servers=tuple(ServerUse(server=s.id, model=s.model, kind=s.kind, capacity=s.capacity,
                                    leased=leased.get(s.id, 0), holders=holding.get(s.id, 0)) for s in servers))

    def _holder(self, h: HeldBy, servers: Mapping[str, LeaseServerLike], shares: Mapping[str, int],
                totals: _KindTotals, now: float, detail: bool = True) -> HolderView:
        seen = self._seen.get(h.holder) or _Seen(h.report.info, self._wall())
        info = seen.info or HolderInfo()  # (one that does not say who it is: "other", nowhere)
        models = {m.model for m in h.report.models}
        rows: list[ServerSlots] = []
        for sid in sorted(set(h.slots) | set(h.report.inflight)) if detail else ():
            server = servers.get(sid)
            if server is not None and (h.slots.get(sid) or h.report.inflight.get(sid)):
                rows.append(ServerSlots(server=sid, model=server.model, kind=server.kind, slots=h.slots.get(sid, 0),
                                        inflight=h.report.inflight.get(sid, 0),
                                        fair_share=shares.get(sid, 0) if server.model in models else 0))
        kinds = _kinds(h, servers, totals, models)
        state: HolderState = "silent" if h.silent else "announced" if h.report.announce else "active"
        return HolderView(
            holder=h.holder, kind=info.kind, host=info.host or None, pid=info.pid or None,
            since=info.started_at or seen.since,
            last_report_s=max(0.0, now - h.seen_at), state=state, slots=sum(h.slots.values()),
            fair_share=sum(k.fair_share for k in kinds), clients=self._clients(seen, now), servers=tuple(rows),
            kinds=kinds)

    def _clients(self, seen: _Seen, now: float) -> tuple[ClientProgress, ...]:
        out = []
        for (model, _), track in sorted(seen.clients.items()):
            last = track.last
            rate = track.rate(now)
            left = last.requests_left
            eta = (0.0 if left == 0 else left / rate if left is not None and rate else None)
            out.append(ClientProgress(
                client=last.client, model=model, state="loading" if last.loading else "running", wanted=last.wanted,
                done=last.answered, requests_left=left, rate_per_s=rate, eta_s=eta, since=track.since))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class _KindTotals:
    """Per (model, server kind): the servers' slots and fair shares summed, once per view."""

    capacity: dict[tuple[str, str], int]
    fair: dict[tuple[str, str], int]
    by_model: dict[str, list[str]]  # model -> its kinds, sorted

    @classmethod
    def of(cls, servers: Iterable[LeaseServerLike], shares: Mapping[str, int]) -> _KindTotals:
        capacity: Counter[tuple[str, str]] = Counter()
        fair: Counter[tuple[str, str]] = Counter()
        for server in servers:
            capacity[(server.model, server.kind)] += server.capacity
            fair[(server.model, server.kind)] += shares.get(server.id, 0)
        by_model: dict[str, list[str]] = {}
        for model, kind in sorted(capacity):
            by_model.setdefault(model, []).append(kind)
        return cls(dict(capacity), dict(fair), by_model)


def _kinds(h: HeldBy, servers: Mapping[str, LeaseServerLike], totals: _KindTotals,
           models: set[str]) -> tuple[KindSlots, ...]:
    """The holder's slots, in flight and fair share per (model, server kind) of the models it wants, and of any
    other kind where it holds or runs something. O(its kinds + the servers it holds or runs on)."""
    rows: dict[tuple[str, str], list[int]] = {}  # -> slots, in flight
    for model in models:
        for kind in totals.by_model.get(model, ()):
            rows[(model, kind)] = [0, 0]
    for sid in set(h.slots) | set(h.report.inflight):
        server = servers.get(sid)
        if server is not None and (h.slots.get(sid) or h.report.inflight.get(sid)):
            row = rows.setdefault((server.model, server.kind), [0, 0])
            row[0] += h.slots.get(sid, 0)
            row[1] += h.report.inflight.get(sid, 0)
    return tuple(KindSlots(model=m, kind=k, slots=r[0], inflight=r[1],
                           fair_share=totals.fair.get((m, k), 0) if m in models else 0,
                           capacity=totals.capacity.get((m, k), 0))
                 for (m, k), r in sorted(rows.items()))


def servers_over_capacity(servers: Iterable[LeaseServerLike], leases: Iterable[Mapping[str, int]]) -> int:
    """How many servers the leases together grant more slots than they have."""
    leased: Counter[str] = Counter()
    for slots in leases:
        leased.update(slots)
    return sum(1 for s in servers if leased.get(s.id, 0) > s.capacity)


class DurationHistogram:
    """Cumulative counts of durations by upper bound (Prometheus' histogram, kept across scrapes)."""

    def __init__(self, bounds: Sequence[float] = RESHARE_BUCKETS_S):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: beyond every bound
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(self.bounds) and seconds > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum_s += seconds

    def buckets(self) -> list[tuple[str, float]]:
        """(upper bound as Prometheus writes it, cumulative count), +Inf last."""
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, float(total)))
        return out


@dataclass(frozen=True, slots=True)
class LeaseFigures:
    """What the registry exports about its leases (registry/exporter.py)."""

    holders: Mapping[tuple[str, str], int]  # (holder kind, state) -> holders
    servers: tuple[ServerUse, ...]
    over_capacity: int  # re-shares that found a server whose leases sum past its slots (stays 0)
    calls: int  # lease calls (renewals) since the broker started
    reshares: int
    reshare_s: DurationHistogram
    requests_left: Mapping[tuple[str, str], int]  # (client, model) -> requests left, at most `max_series` + other


def lease_figures(view: PoolHolders, *, over_capacity: int, calls: int, reshares: int, reshare_s: DurationHistogram,
                  max_series: int = MAX_CLIENT_SERIES) -> LeaseFigures:
    """The figures of a holders view; per-client series capped at `max_series`, the clients with the least left
    summed into ("other", "other")."""
    holders: Counter[tuple[str, str]] = Counter((h.kind, h.state) for h in view.holders)
    left: Counter[tuple[str, str]] = Counter()
    for h in view.holders:
        for c in h.clients:
            if c.requests_left is not None:
                left[(c.client, c.model)] += c.requests_left  # (one name in several processes: summed)
    ranked = sorted(left.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = dict(ranked[:max_series])
    if len(ranked) > max_series:
        shown[("other", "other")] = sum(n for _, n in ranked[max_series:])
    return LeaseFigures(holders=dict(holders), servers=view.servers, over_capacity=over_capacity, calls=calls,
                        reshares=reshares, reshare_s=reshare_s, requests_left=shown)
