"""The registry's state machine: pure Python, injected clock, no I/O. The Ray actor wraps it."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fedpool.registry.errors import RegistrationError, UnknownServerError
from fedpool.registry.leases import LeaseServer
from fedpool.registry.records import ServerRecord
from fedpool.registry.snapshot import (
    LoadSample,
    PoolSnapshot,
    ProbeResult,
    ServerEntry,
    ServerStatus,
    WireRow,
    entry_from_row,
    server_kind,
)
from fedpool.registry.status import StatusThresholds, derive_status
from fedpool.registry.weights import prior_weight

PROBE_HISTORY_LEN = 16
REMOVALS_KEPT = 1024  # the ids operators removed last, so their launchers stop rather than register them again


@dataclass
class ServerState:
    """Everything the registry knows about one server; only RegistryState mutates it."""

    record: ServerRecord
    capacity: int
    probes: deque[ProbeResult] = field(default_factory=lambda: deque(maxlen=PROBE_HISTORY_LEN))
    passive_failures: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    load: LoadSample | None = None
    lease_ttl_s: float | None = None
    lease_expires_at: float | None = None
    draining_since: float | None = None
    status: ServerStatus = ServerStatus.HEALTHY
    probe_failures_total: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "record": self.record.model_dump(mode="json"),
            "capacity": self.capacity,
            "lease_ttl_s": self.lease_ttl_s,
            "lease_expires_at": self.lease_expires_at,
            "draining_since": self.draining_since,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServerState:
        return cls(
            record=ServerRecord.model_validate(data["record"]),
            capacity=int(data["capacity"]),
            lease_ttl_s=data.get("lease_ttl_s"),
            lease_expires_at=data.get("lease_expires_at"),
            draining_since=data.get("draining_since"),
        )


@dataclass(frozen=True, slots=True)
class RegistryTimings:
    lease_grace_s: float = 60.0  # after a lease expires: down at once, removed after this
    drain_timeout_s: float = 300.0  # a draining server is removed after this even if still busy


class RegistryState:
    """Servers, their probe facts and derived status. Every change bumps `version`."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        thresholds: StatusThresholds | None = None,
        timings: RegistryTimings | None = None,
    ):
        self._clock = clock
        self._thresholds = thresholds or StatusThresholds()
        self._timings = timings or RegistryTimings()
        self._servers: dict[str, ServerState] = {}
        # id -> when it was removed on purpose (`server remove`, or drained and idle), and its record; until the id
        # is registered again
        self._removed: dict[str, tuple[float, ServerRecord]] = {}
        self.version = 0
        self.membership_version = 0  # bumps only when records or capacities change
        self.persist_version = 0  # bumps when anything that is saved to disk changes
        self._batch_depth = 0
        self._batch_changed = False

    # ---- membership -------------------------------------------------------------------------
    def check_duplicate(self, record: ServerRecord, *, replace: bool) -> bool:
        """Decide what a registration means for existing entries; True when it updates one.

        Same id and same URL: an update (a launcher re-registering after a restart). Same id, other URL:
        refused unless `replace`. Another id with the same URL: always refused, one server has one id.
        """
        for other in self._servers.values():
            if other.record.url == record.url and other.record.id != record.id:
                raise RegistrationError(
                    record.id, f"url {record.url} is already registered as server {other.record.id!r}",
                    field="url",
                )
        existing = self._servers.get(record.id)
        if existing is None:
            return False
        if existing.record.url != record.url and not replace:
            raise RegistrationError(
                record.id,
                f"id is already registered with url {existing.record.url}; "
                "deregister it first or register with replace=True",
                field="id",
            )
        return True

    def upsert(self, record: ServerRecord, capacity: int, *, lease_ttl_s: float | None = None) -> ServerEntry:
        now = self._clock()
        state = ServerState(record=record, capacity=capacity)
        if lease_ttl_s is not None:
            state.lease_ttl_s = lease_ttl_s
            state.lease_expires_at = now + lease_ttl_s
        self._servers[record.id] = state
        self._removed.pop(record.id, None)
        self.membership_version += 1
        self.persist_version += 1
        self._bump(now=True)
        return self._entry(state)

    def remove(self, server_id: str) -> ServerRecord:
        """Deregister a server (an operator's `server remove`, or its launcher stopping); its id is remembered as
        removed until it is registered again: a heartbeat for it says so (UnknownServerError.removed). One removed
        already (again, or drained and idle) is no error: its record again."""
        state = self._servers.get(server_id)
        if state is None and server_id in self._removed:
            return self._removed[server_id][1]
        state = self._require(server_id)
        del self._servers[server_id]
        self._remember_removed(state.record)
        self.membership_version += 1
        self.persist_version += 1
        self._bump(now=True)
        return state.record

    def drain(self, server_id: str) -> ServerEntry:
        state = self._require(server_id)
        if state.draining_since is None:
            state.draining_since = self._clock()
            self.persist_version += 1
            self._refresh(state)
            self._bump(now=True)
        return self._entry(state)

    def heartbeat(self, server_id: str, ttl_s: float | None = None) -> ServerEntry:
        state = self._require(server_id)
        ttl = ttl_s if ttl_s is not None else state.lease_ttl_s
        if ttl is None:
            raise ValueError(f"server {server_id!r} has no lease; give ttl_s to start one")
        state.lease_ttl_s = ttl
        state.lease_expires_at = self._clock() + ttl
        self.persist_version += 1
        if self._refresh(state):
            self._bump(now=True)
        return self._entry(state)

    # ---- facts --------------------------------------------------------------------------------
    def record_probe(self, result: ProbeResult) -> None:
        state = self._servers.get(result.server_id)
        if state is None:  # removed while the probe was in flight
            return
        state.probes.append(result)
        if not result.ok:
            state.probe_failures_total += 1
        changed = False
        if result.load is not None:
            state.load = _with_rate(state.load, result.load)
            if result.load.capacity_hint and result.load.capacity_hint != state.capacity:
                state.capacity = result.load.capacity_hint
                self.membership_version += 1
                self.persist_version += 1
            changed = True
        if self._refresh(state) or changed:
            self._bump()

    def report_failure(self, server_id: str) -> bool:
        """A dispatcher saw a request fail there. Only raises suspicion; probes decide 'down'."""
        state = self._servers.get(server_id)
        if state is None:
            return False
        state.passive_failures.append(self._clock())
        if self._refresh(state):
            self._bump()
        return True

    def expire(self) -> list[str]:
        """Apply lease expiry and drain completion; returns the ids removed. A draining server with a lease (its
        launcher heartbeats: `fedpool serve`, `fedpool up`) stays, draining, until it is removed or stops: removed
        here, its launcher would register it again."""
        now = self._clock()
        removed = []
        for sid, state in list(self._servers.items()):
            if state.lease_expires_at is not None and now > state.lease_expires_at + self._timings.lease_grace_s:
                removed.append(sid)
            elif state.draining_since is not None and state.lease_ttl_s is None and self._drain_done(state, now):
                removed.append(sid)
                self._remember_removed(state.record)
            elif (state.lease_expires_at is not None or state.passive_failures) and self._refresh(state):
                # Only time-dependent facts (a lease running out, passive failures ageing) can change a
                # status here; probes refresh it as they arrive.
                self._bump()
        for sid in removed:
            del self._servers[sid]
        if removed:
            self.membership_version += 1
            self.persist_version += 1
            self._bump()
        return removed

    # ---- views --------------------------------------------------------------------------------
    def ids(self) -> list[str]:
        return sorted(self._servers)

    def ids_needing_health(self) -> frozenset[str]:
        """Servers whose last probe failed or that were never probed: check them fully every cycle."""
        return frozenset(sid for sid, s in self._servers.items() if not s.probes or not s.probes[-1].ok)

    def ids_needing_generate(self) -> frozenset[str]:
        """Servers a dispatcher reported failures of recently: their probes also ask for one generated token,
        which tells an engine that answers /health but cannot generate (hung) from a healthy one."""
        now = self._clock()
        window = self._thresholds.passive_window_s
        return frozenset(sid for sid, s in self._servers.items()
                         if s.passive_failures and now - s.passive_failures[-1] <= window)

    def busy_ids(self) -> frozenset[str]:
        """Servers whose engine reported work at the last reading."""
        return frozenset(
            sid for sid, s in self._servers.items() if s.load is not None and (s.load.running or s.load.waiting)
        )

    def records(self) -> list[ServerRecord]:
        return [self._servers[sid].record for sid in self.ids()]

    def lease_servers(self) -> list[LeaseServer]:
        """Every server as the lease broker shares it: its slots while routable, none otherwise."""
        return [LeaseServer(sid, s.record.model, s.capacity if s.status.routable else 0,
                            server_kind(s.record, s.capacity))
                for sid, s in sorted(self._servers.items())]

    def get(self, server_id: str) -> ServerEntry:
        return self._entry(self._require(server_id))

    def snapshot(self) -> PoolSnapshot:
        entries = tuple(self._entry(self._servers[sid]) for sid in self.ids())
        return PoolSnapshot(version=self.version, taken_at=self._clock(), entries=entries)

    def wire_rows(self) -> tuple[WireRow, ...]:
        """Every server's row in id order, straight from its state (no ServerEntry in between: this runs on
        the actor's event loop once per version, for 1,000 servers)."""
        return tuple(_row(self._servers[sid]) for sid in self.ids())

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "servers": [self._servers[s].to_json() for s in self.ids()],
                "removed": {sid: {"at": at, "record": record.model_dump(mode="json")}
                            for sid, (at, record) in self._removed.items()}}

    def load_json(self, data: dict[str, Any]) -> None:
        self._servers = {}
        for item in data.get("servers", []):
            state = ServerState.from_json(item)
            self._servers[state.record.id] = state
            self._refresh(state)
        self._removed = {str(sid): (float(r["at"]), ServerRecord.model_validate(r["record"]))
                         for sid, r in (data.get("removed") or {}).items()}
        # A restarted registry continues the version sequence so clients never see it go back.
        self.version = int(data.get("version", 0)) + 1
        self.membership_version += 1
        self.persist_version += 1

    # ---- internals ----------------------------------------------------------------------------
    def _remember_removed(self, record: ServerRecord) -> None:
        self._removed[record.id] = (self._clock(), record)
        while len(self._removed) > REMOVALS_KEPT:
            del self._removed[next(iter(self._removed))]

    def _require(self, server_id: str) -> ServerState:
        state = self._servers.get(server_id)
        if state is None:
            raise UnknownServerError(server_id, removed=server_id in self._removed)
        return state

    def _bump(self, *, now: bool = False) -> None:
        """A new version. Inside a batch, probe facts wait for its end; operator actions (`now`) never do."""
        if self._batch_depth and not now:
            self._batch_changed = True  # one version for the whole batch, at its end
        else:
            self.version += 1

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Apply many facts (a probe cycle) as one change: readers see the old version until it is done."""
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
            if not self._batch_depth and self._batch_changed:
                self._batch_changed = False
                self.version += 1

    def _refresh(self, state: ServerState) -> bool:
        now = self._clock()
        status = derive_status(
            state.probes,
            thresholds=self._thresholds,
            now=now,
            lease_expired=state.lease_expires_at is not None and now > state.lease_expires_at,
            draining=state.draining_since is not None,
            passive_failure_times=state.passive_failures,
        )
        changed = status is not state.status
        state.status = status
        return changed

    def _drain_done(self, state: ServerState, now: float) -> bool:
        assert state.draining_since is not None
        if now - state.draining_since >= self._timings.drain_timeout_s:
            return True
        load = state.load
        # Idle by the engine's own metrics, read after the drain began: in-flight requests have finished.
        return (
            load is not None
            and load.observed_at > state.draining_since
            and load.running == 0
            and load.waiting == 0
        )

    def _entry(self, state: ServerState) -> ServerEntry:
        return entry_from_row(_row(state), state.record, prior_weight(state.record))


def _row(state: ServerState) -> WireRow:
    """One server's fast-changing facts in the wire layout of `registry.snapshot.WireRow`."""
    probes = state.probes
    failures = 0
    last_error = None
    for probe in reversed(probes):
        if probe.ok:
            break
        failures += 1
    for probe in reversed(probes):
        if probe.error:
            last_error = probe.error
            break
    load = state.load
    return (
        state.record.id, state.status.value, state.capacity,
        load.running if load else None, load.waiting if load else None,
        load.kv_cache_usage if load else None, load.tokens_per_s if load else None,
        load.generation_tokens_total if load else None, load.observed_at if load else None,
        probes[-1].latency_s if probes else None, failures, last_error, state.probe_failures_total,
    )


def _with_rate(previous: LoadSample | None, current: LoadSample) -> LoadSample:
    """Fill tokens_per_s from two counter readings when the engine exports a counter, not a rate."""
    if current.tokens_per_s is not None or current.generation_tokens_total is None or previous is None:
        return current
    if previous.generation_tokens_total is None:
        return current
    dt = current.observed_at - previous.observed_at
    delta = current.generation_tokens_total - previous.generation_tokens_total
    if dt <= 0 or delta < 0:  # counter reset: the engine restarted
        return current
    return LoadSample(
        running=current.running,
        waiting=current.waiting,
        observed_at=current.observed_at,
        kv_cache_usage=current.kv_cache_usage,
        generation_tokens_total=current.generation_tokens_total,
        tokens_per_s=delta / dt,
        capacity_hint=current.capacity_hint,
    )
