"""The pool's HTTP service: the OpenAI-compatible gateway (`/v1`), the live pool page (`/`, with its data at
`/pool.json`), with a batches directory the Batch API (`/v1/files`, `/v1/batches`) and, with a job runner, the
jobs API (`/jobs`), in one aiohttp application over one pool connection, so jobs, batches and gateway clients share
every engine. It composes federation's gateway with the services that live here; `fedpool gateway`, `fedpool jobs
serve` and `fedpool up` serve it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import resource
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from fedpool.clients.batchrunner import ONLINE_RESERVE, BatchRunner, OnlineReserve
from fedpool.clients.jobs import JobRunner, JobsApi
from fedpool.federation import PoolConnection, PoolHolders
from fedpool.federation.gateway.auth import bearer, matches
from fedpool.federation.gateway.batches import MAX_FILE_BYTES, MAX_LINES, BatchesApi, model_slots
from fedpool.federation.gateway.batchstore import BatchStore, StoredBatch
from fedpool.federation.gateway.handlers import ApiKey, AppTask, Gateway, serving

HISTORY_PERIOD_S = 2.0
HISTORY_POINTS = 180  # six minutes at one point every two seconds
MAX_CHARTED_HOLDERS = 32  # holders the slots chart keeps labels for (the oldest label goes first beyond it)
WATCHED_S = 60.0  # who is on the pool is asked of the registry only while the page was read this recently
RESET = "reset"  # FailureKind.RESET: a stale keep-alive connection, retried at once (not the server's fault)


@dataclass(frozen=True, slots=True)
class _Point:
    at: float
    answered: dict[str, int]
    tokens: dict[str, int]
    running: dict[str, float | None]
    waiting: dict[str, float | None]
    held: dict[str, int]  # holder label -> slots it holds (every process on the pool, from the lease broker)


class PoolHistory(AppTask):
    """The last minutes of every server, for the pool page's charts: what this process's dispatcher answered
    (requests and tokens, as rates between points) and what the engines reported running and waiting,
    sampled every `period_s` from data the gateway already has. Bounded: `points` per server."""

    def __init__(self, pool: PoolConnection, *, period_s: float = HISTORY_PERIOD_S, points: int = HISTORY_POINTS,
                 clock: Callable[[], float] = time.time):
        self._pool = pool
        self.period_s = period_s
        self._points: deque[_Point] = deque(maxlen=points + 1)
        self._clock = clock
        self._labels: dict[str, str] = {}  # holder -> its label on the chart ("eval run 3"), oldest first
        self._numbered = 0
        self.holders: PoolHolders | None = None  # who is on the pool, as of the last sample (None: not known)
        self.watched_at = float("-inf")  # when the page's data was last read (`watched`)

    def watched(self) -> None:
        """The page's data was read: who is on the pool is sampled from now on (for WATCHED_S). A registry's view
        of every holder costs it O(holders × their servers): not asked for when nobody looks."""
        self.watched_at = self._clock()

    def label(self, holder: str, kind: str) -> str:
        """The holder's label on the page: its kind and the order this page first saw it in ("eval run 3"); says
        nothing of who it is, and stays the same while it is on the pool."""
        label = self._labels.get(holder)
        if label is None:
            self._numbered += 1
            label = self._labels[holder] = f"{kind} {self._numbered}"
            while len(self._labels) > MAX_CHARTED_HOLDERS:
                del self._labels[next(iter(self._labels))]
        return label

    def sample(self, holders: PoolHolders | None = None) -> None:
        stats = {s.server_id: s for s in self._pool.dispatcher.stats().servers}
        snap = self._pool.snapshot
        loads = {e.id: e.load for e in snap.entries} if snap else {}
        ids = sorted(set(stats) | set(loads))
        self.holders = holders
        self._points.append(_Point(
            self._clock(),
            {i: stats[i].answered if i in stats else 0 for i in ids},
            {i: stats[i].completion_tokens if i in stats else 0 for i in ids},
            {i: load.running if (load := loads.get(i)) else None for i in ids},
            {i: load.waiting if (load := loads.get(i)) else None for i in ids},
            {self.label(h.holder, h.kind): h.slots for h in holders.holders} if holders is not None else {},
        ))

    def series(self) -> dict[str, Any]:
        """{"t": [...], "servers": {id: {"requests_per_s", "tokens_per_s", "running", "waiting"}}}; rates are
        between consecutive points (None where a server was not there yet)."""
        points = list(self._points)
        out: dict[str, Any] = {"t": [p.at for p in points[1:]], "period_s": self.period_s, "servers": {}}
        ids = sorted({i for p in points for i in p.answered})
        for sid in ids:
            rps, tps, running, waiting = [], [], [], []
            for before, now in itertools.pairwise(points):
                dt = max(now.at - before.at, 1e-9)
                known = sid in before.answered and sid in now.answered
                rps.append(round((now.answered[sid] - before.answered[sid]) / dt, 3) if known else None)
                tps.append(round((now.tokens[sid] - before.tokens[sid]) / dt, 1) if known else None)
                running.append(now.running.get(sid))
                waiting.append(now.waiting.get(sid))
            out["servers"][sid] = {"requests_per_s": rps, "tokens_per_s": tps, "running": running,
                                   "waiting": waiting}
        labels = sorted({h for p in points[1:] for h in p.held})
        out["holders"] = {h: [p.held.get(h) for p in points[1:]] for h in labels}  # slots held (None: not there)
        return out

    task_name = "pool-history"

    async def _run(self) -> None:
        while True:
            holders = None
            if self._clock() - self.watched_at < WATCHED_S:
                try:
                    holders = await self._pool.holders(detail=False)  # (the page shows no holder's servers)
                except Exception:  # (the registry away or restarting: the page says "not known" until it is back)
                    holders = None
            self.sample(holders)
            await asyncio.sleep(self.period_s)


def pool_state(pool: PoolConnection, runner: JobRunner | None, jobs: list[Any] | None = None, *,
               details: bool = False, history: PoolHistory | None = None,
               batches: Sequence[StoredBatch] = (), holders: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the pool page shows: servers as the registry and this dispatcher see them, running evals
    with their progress, batches in progress, recent failures, and (`holders`, `holders_state`) everyone on the
    pool. No tokens. Error texts (they can name hosts and dataset paths) and whose batches are only with `details`,
    for a caller that presented a valid API key or the jobs token; otherwise counts only."""
    snapshot, dispatcher = pool.snapshot, pool.dispatcher
    stats = {s.server_id: s for s in dispatcher.stats().servers}
    servers = []
    failures = []
    for entry in snapshot.entries if snapshot else ():
        load = entry.load
        seen = stats.get(entry.id)
        servers.append({
            "id": entry.id, "status": entry.status.value, "engine": entry.engine.value,
            "accelerator": entry.record.accelerator, "gpus": entry.record.gpu_count, "model": entry.record.model,
            "capacity": entry.capacity, "running": load.running if load else None,
            "waiting": load.waiting if load else None,
            "kv_cache_usage": load.kv_cache_usage if load else None,
            "tokens_per_s": load.tokens_per_s if load else None,
            "inflight": seen.inflight if seen else 0, "window": seen.window if seen else 0,
            "answered": seen.answered if seen else 0,
            # Stale keep-alive connections the dispatcher retried at once are retries, not the server's errors.
            "errors": sum(n for k, n in seen.failures.items() if k != RESET) if seen else 0,
            "retried_resets": seen.failures.get(RESET, 0) if seen else 0,
            "probe_failures": entry.probe_failures_total, "last_error": entry.last_error if details else None,
        })
        server_failures = {k: n for k, n in seen.failures.items() if k != RESET} if seen else {}
        if entry.last_error or server_failures:
            failures.append({"server_id": entry.id, "status": entry.status.value,
                             "last_error": entry.last_error if details else None,
                             "request_failures": server_failures})
    evals = []
    for job_id, benches in (runner.live.items() if runner else ()):
        for bench, p in benches.items():
            evals.append({"job": job_id, "benchmark": bench, **p})
    recent_jobs = [{"id": j.id, "name": j.name, "state": j.state, "error": j.error if details else None}
                   for j in (jobs or [])[:20]]
    failures += [{"job": j["id"], "error": j["error"]} for j in recent_jobs if j["state"] == "failed"]
    totals = dispatcher.stats()
    return {"time": time.time(), "version": snapshot.version if snapshot else None, "servers": servers,
            "evals": evals, "jobs": recent_jobs, "failures": failures, "batches": batch_rows(batches, details),
            "dispatcher": {"submitted": totals.submitted, "completed": totals.completed, "failed": totals.failed,
                           "retries": totals.retries, "hedges": totals.hedges, "inflight": totals.inflight_total,
                           "keepalive_resets": sum(s.failures.get(RESET, 0) for s in totals.servers)},
            "history": history.series() if history is not None else None,
            **(holders or {"holders": None, "holders_state": "unknown"})}


def holders_state(history: PoolHistory, gateway: Gateway, presented: bytes | None) -> dict[str, Any]:
    """Everyone on the pool for the page, as the caller may see it (`Gateway.visible_holders`): `holders` (each
    with its chart label), `finished`, and `holders_state` — "ok", "unknown" (the registry did not say) or "key"
    (a gateway with API keys shows it to a key's holder only)."""
    view = history.holders
    if view is None:
        return {"holders": None, "holders_state": "unknown"}
    shown = gateway.visible_holders(view, presented)
    if shown is None:
        return {"holders": None, "holders_state": "key"}
    rows = []
    for raw, h in zip(view.holders, shown.holders, strict=True):  # (the same holders in the same order)
        rows.append({**h.model_dump(mode="json", exclude={"servers"}), "label": history.label(raw.holder, raw.kind)})
    return {"holders": rows, "finished": shown.model_dump(mode="json")["finished"], "holders_state": "ok",
            "names_hidden": shown.names_hidden}


def batch_rows(active: Sequence[StoredBatch], details: bool) -> list[dict[str, Any]]:
    """The unfinished batches as the pool page shows them, oldest first; whose they are only with `details`."""
    return [{"id": b.id, "status": b.status, "model": b.model, "endpoint": b.endpoint, "total": b.total,
             "completed": b.completed, "failed": b.failed, "created_at": b.created_at,
             "in_progress_at": b.in_progress_at, "owner": b.owner if details else None} for b in active]


def build_app(gateway: Gateway, pool: PoolConnection, page: str, *, runner: JobRunner | None = None,
              jobs_token: str | None = None, batches: BatchesApi | None = None) -> web.Application:
    """The gateway's routes, the pool page (`page`, its HTML) and its data, (with `batches`) the Batch API's and
    (with a jobs runner) the jobs API."""
    app = gateway.app()
    history = PoolHistory(pool)
    app.on_startup.append(history.start)
    app.on_cleanup.append(history.stop)

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    async def state(request: web.Request) -> web.Response:
        jobs = await asyncio.to_thread(runner.store.list) if runner is not None else None
        active = await asyncio.to_thread(batches.store.active) if batches is not None else []
        presented = bearer(request)
        history.watched()
        details = gateway.knows(presented) or (jobs_token is not None and matches(presented, jobs_token.encode()))
        return web.json_response(pool_state(pool, runner, jobs, details=details, history=history, batches=active,
                                            holders=holders_state(history, gateway, presented)),
                                 headers={"Cache-Control": "no-store"})

    app.router.add_get("/", index)
    app.router.add_get("/pool.json", state)
    if batches is not None:
        batches.add_routes(app)
    if runner is not None:
        assert jobs_token is not None
        JobsApi(runner, jobs_token).add_routes(app)
    return app


@contextlib.asynccontextmanager
async def serving_pool(pool: PoolConnection, page: str, host: str, port: int, *, api_keys: list[ApiKey] | None = None,
                       max_inflight: int | None = None, runner: JobRunner | None = None,
                       jobs_token: str | None = None, reuse_port: bool | None = None,
                       backlog: int = 128, batches_dir: Path | None = None,
                       online_reserve: int = ONLINE_RESERVE) -> AsyncIterator[str]:
    """The gateway over `pool`, the pool page, (with `batches_dir`) the Batch API over the batches kept there and
    (with `runner`) the jobs API, served on host:port for the block; yields the base URL. The runners start first,
    so a directory another server owns is refused (OwnershipError) before anything listens, and they stop before the
    listener closes."""
    gateway = Gateway(pool.dispatcher, lambda: pool.snapshot, api_keys=api_keys, max_inflight=max_inflight,
                      holders=pool.holders)
    batch_runner, batches = (await batch_service(gateway, pool, batches_dir, online_reserve=online_reserve)
                             if batches_dir else (None, None))
    try:
        if runner is not None:
            await runner.start()
        app = build_app(gateway, pool, page, runner=runner, jobs_token=jobs_token, batches=batches)
        async with serving(app, host, port, reuse_port=reuse_port, backlog=backlog) as base:
            try:
                yield base
            finally:
                if runner is not None:
                    await runner.stop()
                if batch_runner is not None:
                    await batch_runner.stop()
                    batch_runner = None
    finally:
        if batch_runner is not None:  # (the jobs runner or the listener did not start)
            await batch_runner.stop()


async def batch_service(gateway: Gateway, pool: PoolConnection, root: Path, *, max_file_bytes: int = MAX_FILE_BYTES,
                        max_lines: int = MAX_LINES,
                        online_reserve: int = ONLINE_RESERVE) -> tuple[BatchRunner, BatchesApi]:
    """The Batch API over the batches kept in `root` (input files up to `max_file_bytes` and `max_lines` requests),
    and its runner, started: the batches a stopped server left unfinished go on now. `online_reserve`: servers of
    each model batches leave to online callers while they are about (`OnlineReserve`)."""
    store = await asyncio.to_thread(BatchStore, root)
    reserve = OnlineReserve(online_reserve, pool.dispatcher, lambda: pool.snapshot) if online_reserve else None
    batch_runner = BatchRunner(store, pool.dispatcher, lambda model: model_slots(pool.snapshot, model),
                               reserve=reserve)
    gateway.steer = reserve.online if reserve is not None else None  # (online requests to the servers held)
    await batch_runner.start()
    api = BatchesApi(gateway, pool.dispatcher, store, lambda: pool.snapshot, started=batch_runner.started,
                     cancelled=batch_runner.cancelled, max_file_bytes=max_file_bytes,
                     max_lines=max_lines)
    return batch_runner, api


def raise_open_files_limit() -> None:
    """A gateway holds two sockets per request in flight (caller and engine): the soft limit on open files
    (often 1,024) is raised to the hard one, as servers do; the in-flight cap keeps the count below it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
