"""Frozen views of the pool that the registry hands to every other room."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from registry.records import Engine, ServerRecord


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


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A versioned, immutable picture of the pool. A higher version means something changed."""

    version: int
    taken_at: float
    entries: tuple[ServerEntry, ...] = ()
    _by_id: Mapping[str, ServerEntry] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {entry.id: entry for entry in self.entries})

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def get(self, server_id: str) -> ServerEntry | None:
        return self._by_id.get(server_id)

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

    def models(self) -> dict[str, list[str]]:
        """model name -> ids of the servers that serve it."""
        out: dict[str, list[str]] = {}
        for entry in self.entries:
            out.setdefault(entry.record.model, []).append(entry.id)
        return out
