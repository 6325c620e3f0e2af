"""Frozen views of the pool that the registry hands to every other room."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fedpool.registry.records import Engine, ServerRecord


class ServerStatus(StrEnum):
    """Derived from facts (probes, heartbeats, passive failures, drain requests); never assigned ad hoc."""

    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DOWN = "down"
    DRAINING = "draining"

    @property
    def routable(self) -> bool:
        """Whether new requests may be sent to a server in this status."""
        return self in (ServerStatus.HEALTHY, ServerStatus.SUSPECT)


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One reading of an engine's own metrics. Every figure is the engine's, summed over its series."""

    running: float
    waiting: float
    observed_at: float
    kv_cache_usage: float | None = None  # fraction 0..1
    generation_tokens_total: float | None = None  # counter; rates are derived between two samples
    tokens_per_s: float | None = None
    capacity_hint: int | None = None  # slots / max running requests, when the metrics reveal it


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one probe of one server found: `(server_id, ok, latency, observed_at)` plus the reason."""

    server_id: str
    ok: bool
    latency_s: float
    observed_at: float
    error: str | None = None
    load: LoadSample | None = None
    busy: bool = False  # failed by timeout while the engine had work: slow, not (yet) dead


ProbeRow = tuple[str, bool, float, float, str | None, bool, tuple[float, ...] | None]


def probe_to_row(p: ProbeResult) -> ProbeRow:
    """A probe result as plain tuples: 1,000 of them cross a process boundary ten times cheaper."""
    load = p.load
    figures = None
    if load is not None:
        figures = (load.running, load.waiting, load.observed_at, _nan(load.kv_cache_usage),
                   _nan(load.generation_tokens_total), _nan(load.tokens_per_s), float(load.capacity_hint or 0))
    return (p.server_id, p.ok, p.latency_s, p.observed_at, p.error, p.busy, figures)


def probe_from_row(row: ProbeRow) -> ProbeResult:
    server_id, ok, latency, observed_at, error, busy, figures = row
    load = None
    if figures is not None:
        running, waiting, seen, kv, gen, tps, hint = figures
        load = LoadSample(running=running, waiting=waiting, observed_at=seen, kv_cache_usage=_none(kv),
                          generation_tokens_total=_none(gen), tokens_per_s=_none(tps),
                          capacity_hint=int(hint) or None)
    return ProbeResult(server_id, ok, latency, observed_at, error, load, busy)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _none(value: float) -> float | None:
    return None if value != value else value  # NaN marks "not reported"


def server_kind(record: ServerRecord, capacity: int) -> str:
    """A server's kind: its accelerator, GPU count and capacity. Servers of one kind cost a request the same (the
    plan's columns, the horizon's kinds, and the lease broker's: which processes' work suits which servers)."""
    return f"{record.accelerator}x{record.gpu_count}/{capacity}"


@dataclass(frozen=True, slots=True)
class ServerEntry:
    """A server as a client sees it in one snapshot."""

    record: ServerRecord
    status: ServerStatus
    capacity: int
    weight: float
    load: LoadSample | None = None
    probe_latency_s: float | None = None
    consecutive_failures: int = 0
    last_error: str | None = None
    probe_failures_total: int = 0

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def url(self) -> str:
        return self.record.url

    @property
    def engine(self) -> Engine:
        return self.record.engine

    @property
    def kind(self) -> str:
        return server_kind(self.record, self.capacity)

    def describe(self) -> dict[str, Any]:
        """The server as `fedpool server list | show | add | drain --json` print it: JSON-ready, no secrets."""
        load, record = self.load, self.record
        return {
            "id": self.id, "url": self.url, "engine": self.engine.value, "model": record.model,
            "revision": record.revision, "accelerator": record.accelerator, "gpu_count": record.gpu_count,
            "capacity": self.capacity, "status": self.status.value,
            "running": load.running if load else None, "waiting": load.waiting if load else None,
            "kv_cache_usage": load.kv_cache_usage if load else None,
            "tokens_per_s": load.tokens_per_s if load else None,
            "probe_latency_ms": self.probe_latency_s * 1000 if self.probe_latency_s is not None else None,
            "last_error": self.last_error, "labels": dict(record.labels),
        }


# One server's fast-changing facts on the wire: (id, status, capacity, running, waiting, kv, tokens_per_s,
# generation_tokens_total, observed_at, probe_latency_s, consecutive_failures, last_error, probe_failures).
# Built by `registry.state`; records travel only when membership changed, so a snapshot of many servers is
# cheap to ship.
WireRow = tuple[str, str, int, float | None, float | None, float | None, float | None, float | None,
                float | None, float | None, int, str | None, int]


def entry_from_row(row: WireRow, record: ServerRecord, weight: float) -> ServerEntry:
    (_, status, capacity, running, waiting, kv, tps, gen_total, observed_at,
     latency, failures, last_error, failures_total) = row
    load = None
    if running is not None and waiting is not None and observed_at is not None:
        load = LoadSample(running=running, waiting=waiting, observed_at=observed_at, kv_cache_usage=kv,
                          generation_tokens_total=gen_total, tokens_per_s=tps)
    return ServerEntry(record=record, status=ServerStatus(status), capacity=capacity, weight=weight, load=load,
                       probe_latency_s=latency, consecutive_failures=failures, last_error=last_error,
                       probe_failures_total=failures_total)


class PoolSnapshot:
    """A versioned, immutable picture of the pool. A higher version means something changed.

    Built either from entries or lazily from wire rows (entries are made on first use, once)."""

    __slots__ = ("_by_id", "_count", "_entries", "_make", "taken_at", "version")
    # Set through object.__setattr__ (the class forbids plain assignment): `_make`, when given, builds
    # `_entries` on first read; `_by_id` is built on the first lookup by id.
    version: int
    taken_at: float
    _entries: tuple[ServerEntry, ...]
    _count: int
    _make: Callable[[], tuple[ServerEntry, ...]] | None
    _by_id: dict[str, ServerEntry] | None

    def __init__(self, version: int, taken_at: float, entries: tuple[ServerEntry, ...] = ()):
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "taken_at", taken_at)
        object.__setattr__(self, "_entries", tuple(entries))
        object.__setattr__(self, "_count", len(self._entries))
        object.__setattr__(self, "_make", None)
        object.__setattr__(self, "_by_id", None)

    @classmethod
    def from_rows(
        cls, version: int, taken_at: float, rows: tuple[WireRow, ...] | Callable[[], tuple[WireRow, ...]],
        records: Mapping[str, ServerRecord], weight_of: Callable[[ServerRecord], float], count: int | None = None,
    ) -> PoolSnapshot:
        """A snapshot whose entries are made on first use from `rows`, or from what `rows()` returns (then
        `count`, the number of rows, must be given: decoding waits until someone reads the entries)."""
        snap = cls(version, taken_at)
        if callable(rows):
            if count is None:
                raise ValueError("from_rows: a row loader needs the row count")
            load = rows
        else:
            count, rows_now = len(rows), rows

            def load() -> tuple[WireRow, ...]:
                return rows_now

        def make() -> tuple[ServerEntry, ...]:
            return tuple(entry_from_row(r, records[r[0]], weight_of(records[r[0]])) for r in load())

        object.__setattr__(snap, "_count", count)
        object.__setattr__(snap, "_make", make)
        return snap

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"PoolSnapshot is immutable; cannot set {name!r}")

    def __repr__(self) -> str:
        return f"PoolSnapshot(version={self.version}, servers={len(self)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PoolSnapshot) and (self.version, self.entries) == (other.version, other.entries)

    def __hash__(self) -> int:
        return hash((self.version, self.entries))

    def __reduce__(self) -> tuple[Any, ...]:
        return (PoolSnapshot, (self.version, self.taken_at, self.entries))

    @property
    def entries(self) -> tuple[ServerEntry, ...]:
        if self._make is not None:
            object.__setattr__(self, "_entries", self._make())
            object.__setattr__(self, "_make", None)
        return self._entries

    @property
    def _index(self) -> Mapping[str, ServerEntry]:
        by_id = self._by_id
        if by_id is None:
            by_id = {entry.id: entry for entry in self.entries}
            object.__setattr__(self, "_by_id", by_id)
        return by_id

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[ServerEntry]:
        return iter(self.entries)

    def get(self, server_id: str) -> ServerEntry | None:
        return self._index.get(server_id)

    def ids(self) -> tuple[str, ...]:
        return tuple(entry.id for entry in self.entries)

    def filter(
        self,
        *,
        model: str | None = None,
        revision: str | None = None,
        engines: Iterable[Engine | str] | None = None,
        server_ids: Iterable[str] | None = None,
        labels: Mapping[str, str] | None = None,
        routable_only: bool = False,
    ) -> PoolSnapshot:
        """The same snapshot (same version) restricted to servers matching every given criterion."""
        engine_set = {Engine(e) for e in engines} if engines is not None else None
        id_set = set(server_ids) if server_ids is not None else None
        kept = []
        for entry in self.entries:
            rec = entry.record
            if model is not None and not rec.serves(model, revision):
                continue
            if engine_set is not None and rec.engine not in engine_set:
                continue
            if id_set is not None and rec.id not in id_set:
                continue
            if labels and any(rec.labels.get(k) != v for k, v in labels.items()):
                continue
            if routable_only and not entry.status.routable:
                continue
            kept.append(entry)
        return PoolSnapshot(version=self.version, taken_at=self.taken_at, entries=tuple(kept))

    def summary(self) -> dict[str, Any]:
        """The pool at a glance (`fedpool pool status`): servers by status and by (status, engine, accelerator),
        servers per model, and the routable servers' capacity and live load."""
        entries = self.entries
        routable = [e for e in entries if e.status.routable]
        groups = Counter((e.status.value, e.engine.value, e.record.accelerator) for e in entries)
        return {
            "version": self.version, "servers": len(entries),
            "by_status": dict(Counter(e.status.value for e in entries)),
            "groups": [{"status": s, "engine": g, "accelerator": a, "servers": n}
                       for (s, g, a), n in sorted(groups.items())],
            "models": {m: len(ids) for m, ids in self.models().items()},
            "capacity_routable": sum(e.capacity for e in routable),
            "running": sum(e.load.running for e in routable if e.load),
            "waiting": sum(e.load.waiting for e in routable if e.load),
            "tokens_per_s": sum(e.load.tokens_per_s or 0.0 for e in routable if e.load),
        }

    def revisions(self) -> dict[str, set[str]]:
        """model name -> the revisions its registered servers (routable or not) serve."""
        out: dict[str, set[str]] = {}
        for entry in self.entries:
            out.setdefault(entry.record.model, set()).add(entry.record.revision)
        return out

    def models(self) -> dict[str, list[str]]:
        """model name -> ids of the servers that serve it."""
        out: dict[str, list[str]] = {}
        for entry in self.entries:
            out.setdefault(entry.record.model, []).append(entry.id)
        return out
