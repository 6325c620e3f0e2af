"""The registry as a named, detached Ray actor in namespace `fedpool`. Never on the request path."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import ray
from pydantic import BaseModel, ConfigDict, Field

from registry.auth import check_token
from registry.checks import verify_server
from registry.persistence import StateStore
from registry.records import ServerRecord
from registry.snapshot import PoolSnapshot, ServerEntry
from registry.state import RegistryState, RegistryTimings
from registry.status import StatusThresholds

log = logging.getLogger("fedpool.registry")

REGISTRY_NAME = "fedpool-registry"
NAMESPACE = "fedpool"


class RegistryConfig(BaseModel):
    """How the registry actor runs. The token itself is never part of it: only its SHA-256."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: str
    token_sha256: str = Field(min_length=64, max_length=64)
    probe_interval_s: float = Field(default=2.0, gt=0, le=300)
    probe_timeout_s: float = Field(default=5.0, gt=0, le=120)
    check_timeout_s: float = Field(default=10.0, gt=0, le=300)
    down_after_failures: int = Field(default=3, ge=1)
    up_after_successes: int = Field(default=2, ge=1)
    lease_grace_s: float = Field(default=60.0, ge=0)
    drain_timeout_s: float = Field(default=300.0, ge=0)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)  # serve /metrics for Prometheus


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
        self._saved_json: dict[str, Any] | None = None
        self._changed: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task[None] | None = None
        self._probe_cycles = 0
        self._last_cycle_s = 0.0
        self._probe_now: asyncio.Event | None = None
        self._incarnation = uuid.uuid4().hex[:12]  # changes on every (re)start of the actor
        self._started_at = time.time()
        self._metrics_runner: Any = None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def _ensure_started(self) -> None:
        if self._prober is None or self._prober.done():
            self._changed = asyncio.Event()
            self._probe_now = asyncio.Event()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
            )
            self._prober = asyncio.get_running_loop().create_task(self._probe_loop())
            if self._config.metrics_port is not None and self._metrics_runner is None:
                await self._serve_metrics()

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
        from registry.exporter import pool_metrics_text

        stats = {"last_probe_cycle_s": self._last_cycle_s, "probe_cycles": float(self._probe_cycles)}
        return pool_metrics_text(self._state.snapshot(), stats)

    async def ping(self) -> dict[str, Any]:
        await self._ensure_started()
        return {
            "version": self._state.version,
            "servers": len(self._state.ids()),
            "probe_cycles": self._probe_cycles,
            "last_probe_cycle_s": self._last_cycle_s,
            "probe_interval_s": self._config.probe_interval_s,
            "state_dir": self._config.state_dir,
            "incarnation": self._incarnation,
            "started_at": self._started_at,
        }

    async def _probe_loop(self) -> None:
        from registry.prober import probe_all

        assert self._session is not None and self._probe_now is not None
        while True:
            started = time.perf_counter()
            try:
                records = self._state.records()
                results = await probe_all(
                    self._session, records, timeout_s=self._config.probe_timeout_s, busy_ids=self._state.busy_ids()
                )
                for result in results:
                    self._state.record_probe(result)
                self._state.expire()
                self._after_change()
            except Exception:  # the prober must outlive any one bad cycle
                log.exception("probe cycle failed")
            self._probe_cycles += 1
            self._last_cycle_s = time.perf_counter() - started
            self._probe_now.clear()
            try:
                await asyncio.wait_for(
                    self._probe_now.wait(), max(0.0, self._config.probe_interval_s - self._last_cycle_s)
                )
            except TimeoutError:
                pass

    def _after_change(self) -> None:
        """Persist membership changes and wake long-polling snapshot readers."""
        data = self._state.to_json()
        comparable = {"servers": data["servers"]}
        if comparable != self._saved_json:
            self._store.save(data)
            self._saved_json = comparable
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

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
            capacity = await verify_server(self._session, server, timeout_s=self._config.check_timeout_s)
        else:
            from registry.adapters import adapter_for

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
        if known and self._probe_now is not None:
            self._probe_now.set()
        self._after_change()
        return known

    # ---- reads (open) -------------------------------------------------------------------------
    async def snapshot(self, since_version: int = -1, timeout_s: float = 0.0) -> PoolSnapshot:
        """The current snapshot, or after waiting up to `timeout_s` for one newer than `since_version`."""
        await self._ensure_started()
        if self._state.version <= since_version and timeout_s > 0 and self._changed is not None:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except TimeoutError:
                pass
        return self._state.snapshot()

    async def version(self) -> int:
        return self._state.version

    async def get(self, server_id: str) -> ServerEntry:
        await self._ensure_started()
        return self._state.get(server_id)


def create_registry_actor(config: RegistryConfig) -> ray.actor.ActorHandle:
    """Get the registry actor, creating it (detached, restartable) when it does not exist yet."""
    remote_cls = ray.remote(RegistryActor)
    return remote_cls.options(
        name=REGISTRY_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=3,
        num_cpus=0,
        max_concurrency=1000,
    ).remote(config.model_dump())


def get_registry_actor() -> ray.actor.ActorHandle:
    """The existing registry actor; raises ValueError when none runs in this Ray cluster."""
    return ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
