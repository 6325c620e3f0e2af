"""The registry as a named, detached Ray actor in namespace `fedpool`. Never on the request path."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import pickle
import secrets
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, cast

import aiohttp
import orjson
import ray
import ray.actor
from pydantic import BaseModel, ConfigDict, Field

from fedpool.registry.auth import check_token
from fedpool.registry.checks import verify_server
from fedpool.registry.errors import AuthError
from fedpool.registry.holders import PoolHolders
from fedpool.registry.leases import (
    LEASE_TTL_S,
    RESHARE_BUDGET,
    DemandReport,
    Lease,
    LeaseBroker,
    LeaseService,
    learns_at_start,
)
from fedpool.registry.persistence import StateStore
from fedpool.registry.prober import ProbePlan, ProberActor
from fedpool.registry.records import ServerRecord
from fedpool.registry.snapshot import ProbeRow, ServerEntry, probe_from_row
from fedpool.registry.state import RegistryState, RegistryTimings
from fedpool.registry.status import StatusThresholds

log = logging.getLogger("fedpool.registry")

REGISTRY_NAME = "fedpool-registry"
PROBER_NAME = "fedpool-prober"
PROBE_APPLY_SLICE = 100
LAG_PROBE_S = 0.05
NAMESPACE = "fedpool"


class RegistryConfig(BaseModel):
    """How the registry actor runs. The token itself is never part of it: only its SHA-256."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: str
    token_sha256: str = Field(min_length=64, max_length=64)
    probe_interval_s: float = Field(default=2.0, gt=0, le=300)
    probe_timeout_s: float = Field(default=5.0, gt=0, le=120)
    health_every: int = Field(default=3, ge=1)  # health endpoint every Nth cycle; /metrics proves life between
    check_timeout_s: float = Field(default=10.0, gt=0, le=300)
    down_after_failures: int = Field(default=3, ge=1)
    up_after_successes: int = Field(default=2, ge=1)
    lease_grace_s: float = Field(default=60.0, ge=0)
    capacity_lease_ttl_s: float = Field(default=LEASE_TTL_S, gt=0, le=300)  # a lease not renewed in this is gone
    drain_timeout_s: float = Field(default=300.0, ge=0)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)  # serve /metrics for Prometheus
    # The HTTP API (registry/api.py) for client processes that are not Ray drivers: on `api_host`, port `api_port`
    # (0: a free port; None: no API). Its URL is written to STATE_DIR/registry.url for clients on this host.
    api_host: str = "127.0.0.1"
    api_port: int | None = Field(default=0, ge=0, le=65535)
    # Custom Ray resources that pin the registry and its prober to nodes, e.g. {"fedpool-head": 0.01} with
    # `ray start --head --resources '{"fedpool-head": 1}'`. Empty: anywhere.
    resources: dict[str, float] = Field(default_factory=dict)
    # The Ray namespace of the registry's named actors: `fedpool` for the pool; a run that needs a registry
    # of its own in someone's cluster (the speedup benchmark) takes another, so it never finds theirs.
    namespace: str = Field(default=NAMESPACE, min_length=1)


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (it may have lost its state: leases granted before are still in use); when
    Ray cannot say, as if it had."""
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # (a state API that does not answer: learning costs a few seconds, granting twice does not)
        log.warning("could not tell whether the registry actor was restarted: learning the leases in use first")
        return True


class RegistryActor:
    """Registration, heartbeats, drain, probing and snapshots. Wrapped by `ray.remote` at creation."""

    def __init__(self, config: dict[str, Any]):
        self._config = RegistryConfig.model_validate(config)
        self._state = RegistryState(
            clock=time.time,
            thresholds=StatusThresholds(
                down_after_failures=self._config.down_after_failures,
                up_after_successes=self._config.up_after_successes,
            ),
            timings=RegistryTimings(
                lease_grace_s=self._config.lease_grace_s, drain_timeout_s=self._config.drain_timeout_s
            ),
        )
        self._store = StateStore(Path(self._config.state_dir))
        saved = self._store.load()
        if saved is not None:
            self._state.load_json(saved)
        self._saved_version = -1
        self._changed: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        self._prober: Any = None  # ProberActor handle
        self._probe_cycles = 0
        self._last_cycle_s = 0.0
        self._recent_cycles: deque[float] = deque(maxlen=120)
        self._recent_busy: deque[float] = deque(maxlen=120)  # time spent probing, pacing excluded
        self._loop_lag: deque[float] = deque(maxlen=200)
        self._lag_task: asyncio.Task[None] | None = None
        self._incarnation = uuid.uuid4().hex[:12]  # changes on every (re)start of the actor
        # Only this actor and its prober know it (new on every start, never saved): probe deliveries must
        # carry it, so no other Ray driver can forge probe results (servers down, capacities) into the state.
        self._prober_credential = secrets.token_urlsafe(32)
        self._started_at = time.time()
        self._metrics_runner: Any = None
        self._api_runner: Any = None
        self._api_url: str | None = None
        self._api_starting: asyncio.Lock | None = None
        self._json_rows: tuple[int, float, bytes] | None = None
        self._json_records: tuple[int, bytes] | None = None
        self._rows_cache: tuple[int, float, bytes] | None = None
        self._records_cache: tuple[int, bytes] | None = None
        # Capacity leases (registry/leases.py): a new broker per incarnation; after a restart, with saved state or
        # without (Ray restarted the actor), it learns before it leases a slot the old one may have leased.
        restarted = learns_at_start(saved is not None, _reconstructed())
        self._leases = LeaseService(LeaseBroker(time.monotonic, ttl_s=self._config.capacity_lease_ttl_s,
                                                incarnation=self._incarnation, restarted=restarted),
                                    budget=RESHARE_BUDGET)
        self._lease_servers_version = -1

    # ---- lifecycle ----------------------------------------------------------------------------
    async def _ensure_started(self) -> None:
        await self._ensure_api()
        if self._changed is None:
            self._changed = asyncio.Event()
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        if self._lag_task is None:
            self._lag_task = asyncio.get_running_loop().create_task(self._watch_loop_lag())
        if self._prober is None:
            # The prober lives in its own process; it pulls plans from here and hands results back.
            self._prober = ray.remote(ProberActor).options(
                name=PROBER_NAME, namespace=self._config.namespace, lifetime="detached", get_if_exists=True,
                max_restarts=-1, num_cpus=0, resources=dict(self._config.resources),
            ).remote(REGISTRY_NAME, self._config.namespace)
            await self._prober.adopt.remote(self._prober_credential)
            await self._prober.start.remote()
            if self._config.metrics_port is not None and self._metrics_runner is None:
                await self._serve_metrics()

    async def _ensure_api(self) -> None:
        """Serve the HTTP API once per incarnation, and say where beside the token. Also called from the prober's
        every cycle, so an actor Ray restarted serves it again though only HTTP clients use it."""
        if self._api_runner is not None or self._config.api_port is None:
            return
        if self._api_starting is None:
            self._api_starting = asyncio.Lock()
        async with self._api_starting:
            if self._api_runner is not None:
                return
            from fedpool.registry.api import make_api, serve_api, write_api_file

            try:
                runner, url = await serve_api(make_api(self, self._config.token_sha256), self._config.api_host,
                                              self._config.api_port)
            except OSError as exc:  # the port is taken: clients reach the registry through Ray, as before
                log.error("registry API not served on %s:%s (%s); clients use Ray", self._config.api_host,
                          self._config.api_port, exc)
                self._config = self._config.model_copy(update={"api_port": None})
                return
            self._api_runner = runner
            self._api_url = url
            await write_api_file(Path(self._config.state_dir), url, self._incarnation)
            log.info("registry API on %s", url)

    async def api_info(self) -> dict[str, Any]:
        """What the API's /v1/ping says besides the token check."""
        return {"incarnation": self._incarnation, "version": self._state.version,
                "servers": len(self._state.ids()), "state_dir": self._config.state_dir}

    async def _serve_metrics(self) -> None:
        from aiohttp import web

        async def handle(request: web.Request) -> web.Response:
            return web.Response(body=await self.metrics_text(), content_type="text/plain", charset="utf-8")

        app = web.Application()
        app.router.add_get("/metrics", handle)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, self._config.metrics_host, self._config.metrics_port)
        await site.start()
        log.info("registry metrics on http://%s:%s/metrics", self._config.metrics_host, self._config.metrics_port)

    async def metrics_text(self) -> bytes:
        """The pool in Prometheus text format."""
        from fedpool.registry.exporter import pool_metrics_text

        stats = {"last_probe_cycle_s": self._last_cycle_s, "probe_cycles": float(self._probe_cycles)}
        self._sync_lease_servers()
        return pool_metrics_text(self._state.snapshot(), stats, self._leases.figures())

    async def node_id(self) -> str:
        """The Ray node this actor runs on."""
        return ray.get_runtime_context().get_node_id()

    async def ping(self) -> dict[str, Any]:
        await self._ensure_started()
        return {
            "version": self._state.version,
            "servers": len(self._state.ids()),
            "probe_cycles": self._probe_cycles,
            "last_probe_cycle_s": self._last_cycle_s,
            "probe_interval_s": self._config.probe_interval_s,
            "state_dir": self._config.state_dir,
            "api_url": self._api_url,
            "incarnation": self._incarnation,
            "started_at": self._started_at,
            "pid": os.getpid(),
            "recent_probe_cycles_s": list(self._recent_cycles),
            "recent_probe_busy_s": list(self._recent_busy),
            "recent_loop_lag_s": list(self._loop_lag)[-200:],  # about the last 10 s
            "prober_pid": await self._prober.pid.remote() if self._prober is not None else None,
        }

    async def _watch_loop_lag(self) -> None:
        """How late the actor's event loop wakes a 50 ms sleeper: the delay any call can see from it."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            self._loop_lag.append(time.perf_counter() - start - LAG_PROBE_S)

    async def probe_plan(self) -> ProbePlan:
        """Called by the prober each cycle."""
        await self._ensure_api()
        return ProbePlan(
            records=tuple(self._state.records()),
            busy_ids=self._state.busy_ids(),
            need_health=self._state.ids_needing_health(),
            need_generate=self._state.ids_needing_generate(),
            interval_s=self._config.probe_interval_s,
            timeout_s=self._config.probe_timeout_s,
            health_every=self._config.health_every,
        )

    async def deliver_probes(
        self, credential: str, rows: list[ProbeRow], cycle_s: float | None = None, busy_s: float | None = None
    ) -> None:
        """Called by the prober with one cycle's results as rows; applied in slices. Refused (AuthError)
        without the prober's credential."""
        if not hmac.compare_digest(credential.encode(), self._prober_credential.encode()):
            raise AuthError("probe results are accepted from this registry's own prober only")
        with self._state.batch():  # readers keep the previous version until the cycle is applied
            for i, row in enumerate(rows):
                self._state.record_probe(probe_from_row(row))
                if i % PROBE_APPLY_SLICE == PROBE_APPLY_SLICE - 1:
                    await asyncio.sleep(0)  # let snapshot readers in between slices of a big cycle
            if cycle_s is not None:
                self._state.expire()
        if cycle_s is not None:
            self._probe_cycles += 1
            self._last_cycle_s = cycle_s
            self._recent_cycles.append(cycle_s)
            self._recent_busy.append(busy_s or 0.0)
        self._after_change()

    async def shutdown_prober(self) -> None:
        """Stop the prober actor (for a registry that is being removed for good)."""
        if self._prober is not None:
            await asyncio.to_thread(ray.kill, self._prober, no_restart=True)
            self._prober = None

    def _after_change(self) -> None:
        """Persist membership changes and wake long-polling snapshot readers."""
        if self._state.persist_version != self._saved_version:
            self._store.save(self._state.to_json())
            self._saved_version = self._state.persist_version
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def check_token(self, token: str | None) -> None:
        """Raises AuthError unless `token` is this registry's (so a client can be refused before it acts)."""
        await self._ensure_api()
        check_token(token, self._config.token_sha256)

    # ---- mutations (token required) -----------------------------------------------------------
    async def register(
        self, record: dict[str, Any], token: str | None, *, lease_ttl_s: float | None = None, replace: bool = False,
        verify: bool = True,
    ) -> ServerEntry:
        check_token(token, self._config.token_sha256)
        await self._ensure_started()
        server = ServerRecord.model_validate(record)
        self._state.check_duplicate(server, replace=replace)
        assert self._session is not None
        if verify:
            capacity, kv = await verify_server(self._session, server, timeout_s=self._config.check_timeout_s)
            if kv != server.kv_cache_tokens:  # discovered: the record carries it to every dispatcher
                server = server.model_copy(update={"kv_cache_tokens": kv})
        else:
            from fedpool.registry.adapters import adapter_for

            capacity = server.capacity or adapter_for(server.engine).default_capacity
        self._state.check_duplicate(server, replace=replace)  # again: another call may have raced us
        entry = self._state.upsert(server, capacity, lease_ttl_s=lease_ttl_s)
        self._after_change()
        log.info("registered server %s (%s, %s, %s)", server.id, server.engine, server.model, server.accelerator)
        return entry

    async def deregister(self, server_id: str, token: str | None) -> ServerRecord:
        check_token(token, self._config.token_sha256)
        await self._ensure_started()
        record = self._state.remove(server_id)
        self._after_change()
        return record

    async def drain(self, server_id: str, token: str | None) -> ServerEntry:
        check_token(token, self._config.token_sha256)
        await self._ensure_started()
        entry = self._state.drain(server_id)
        self._after_change()
        return entry

    async def heartbeat(self, server_id: str, token: str | None, ttl_s: float | None = None) -> ServerEntry:
        check_token(token, self._config.token_sha256)
        await self._ensure_started()
        entry = self._state.heartbeat(server_id, ttl_s)
        self._after_change()
        return entry

    async def report_failure(self, server_id: str, kind: str) -> bool:
        """A dispatcher's passive report. It can only make a server suspect and hurry its next probe,
        never mark it down, so it needs no token."""
        await self._ensure_started()
        known = self._state.report_failure(server_id)
        if known and self._prober is not None:
            self._prober.hurry.remote()
        self._after_change()
        return known

    # ---- capacity leases (no token: like failure reports; Ray's own auth is the cluster's boundary) ---
    async def lease(self, report: dict[str, Any], known_version: int = -1, wait_s: float = 0.0) -> Lease:
        """A holder (one process's dispatcher) says what it wants and holds; the answer is its lease. Returns at
        once when the holder's slots differ from `known_version`, else waits up to `wait_s` for them to change."""
        await self._ensure_started()
        parsed = DemandReport.model_validate(report)
        self._sync_lease_servers()
        return await self._leases.lease(parsed, known_version, wait_s)

    def _sync_lease_servers(self) -> None:
        """The broker's servers as of the registry's current version."""
        if self._lease_servers_version != self._state.version:
            self._leases.set_servers(self._state.lease_servers())
            self._lease_servers_version = self._state.version

    async def release_lease(self, holder: str) -> None:
        """A holder is going away: its slots are free for the others at once."""
        await self._leases.release(holder)

    async def leases(self) -> dict[str, Any]:
        """The broker's view: holders, their slots, and how often it was called and re-shared."""
        return self._leases.stats()

    async def holders(self, detail: bool = True) -> PoolHolders:
        """Who is on the pool: every holder with its clients, their progress and its slots, and the clients
        finished lately (registry/holders.py; without `detail`, no holder's rows per server). Client names
        included: the HTTP API serves it to the token's holders only, and Ray's callers are the cluster's members."""
        self._sync_lease_servers()
        return self._leases.broker.holders_view(detail=detail)

    # ---- reads (open) -------------------------------------------------------------------------
    async def snapshot_wire(
        self, since_version: int = -1, timeout_s: float = 0.0, known_membership: int = -1, have_version: int = -1
    ) -> tuple[int, float, int, bytes | None, bytes | None]:
        """(version, taken_at, membership_version, pickled records or None when the caller has them,
        pickled rows or None when the caller already holds this version).

        Rows are pickled once per version and records once per membership change, so a thousand readers
        cost the actor a cache lookup and a bytes copy each, and a reader whose copy is current gets a
        few bytes back."""
        await self._wait_newer(since_version, timeout_s)
        version = self._state.version
        if have_version == version and self._rows_cache is not None and self._rows_cache[0] == version:
            return (version, self._rows_cache[1], self._state.membership_version, None, None)
        if self._rows_cache is None or self._rows_cache[0] != version:
            rows = pickle.dumps(self._state.wire_rows(), protocol=pickle.HIGHEST_PROTOCOL)
            self._rows_cache = (version, time.time(), rows)
        membership = self._state.membership_version
        records = None
        if known_membership != membership:
            if self._records_cache is None or self._records_cache[0] != membership:
                # Pickled once per membership change: a thousand readers then cost a bytes copy each.
                blob = pickle.dumps(tuple(self._state.records()), protocol=pickle.HIGHEST_PROTOCOL)
                self._records_cache = (membership, blob)
            records = self._records_cache[1]
        return (version, self._rows_cache[1], membership, records, self._rows_cache[2])

    async def snapshot_json(
        self, since_version: int = -1, timeout_s: float = 0.0, known_membership: int = -1, have_version: int = -1
    ) -> bytes:
        """`snapshot_wire` for the HTTP API, as one JSON object: version, taken_at, membership, records (null when
        the caller has them) and rows (null when it holds this version). Encoded once per version and once per
        membership change, as the pickles are."""
        await self._wait_newer(since_version, timeout_s)
        version = self._state.version
        if self._json_rows is None or self._json_rows[0] != version:
            self._json_rows = (version, time.time(), orjson.dumps(self._state.wire_rows()))
        membership = self._state.membership_version
        records = b"null"
        if known_membership != membership:
            if self._json_records is None or self._json_records[0] != membership:
                self._json_records = (membership, orjson.dumps([r.model_dump(mode="json")
                                                                for r in self._state.records()]))
            records = self._json_records[1]
        rows = b"null" if have_version == version else self._json_rows[2]
        return b'{"version":%d,"taken_at":%s,"membership":%d,"records":%s,"rows":%s}' % (
            version, orjson.dumps(self._json_rows[1]), membership, records, rows)

    async def _wait_newer(self, since_version: int, timeout_s: float) -> None:
        await self._ensure_started()
        if self._state.version <= since_version and timeout_s > 0 and self._changed is not None:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except TimeoutError:
                pass

    async def version(self) -> int:
        return self._state.version

    async def get(self, server_id: str) -> ServerEntry:
        await self._ensure_started()
        return self._state.get(server_id)


def create_registry_actor(config: RegistryConfig) -> ray.actor.ActorHandle:
    """Get the registry actor, creating it (detached, restartable) when it does not exist yet."""
    remote_cls = ray.remote(RegistryActor)
    # Ray types ActorClass.remote() as `ActorHandle[T] | type[T]`; what it returns is always the handle.
    return cast(ray.actor.ActorHandle, remote_cls.options(
        name=REGISTRY_NAME,
        namespace=config.namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=3,
        num_cpus=0,
        max_concurrency=1000,
        resources=dict(config.resources),
    ).remote(config.model_dump()))


def get_registry_actor(namespace: str = NAMESPACE) -> ray.actor.ActorHandle:
    """The existing registry actor; raises ValueError when none runs in this Ray cluster."""
    return ray.get_actor(REGISTRY_NAME, namespace=namespace)
