"""The pool's HTTP face: the OpenAI-compatible gateway (`/v1`), the live pool page (`/`, with its data at
`/pool.json`) and, when a jobs directory is given, the jobs API (`/jobs`), in one aiohttp application
over one pool connection, so jobs and gateway clients share every engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from aiohttp import web

from fedpool.clients.jobs import JobRunner, JobsApi
from fedpool.federation import Dispatcher
from fedpool.federation.gateway import Gateway
from fedpool.federation.httpauth import bearer, matches
from fedpool.registry import PoolSnapshot


def pool_state(snapshot: PoolSnapshot | None, dispatcher: Dispatcher, runner: JobRunner | None,
               jobs: list[Any] | None = None, *, details: bool = False) -> dict[str, Any]:
    """What the pool page shows: servers as the registry and this dispatcher see them, running evals
    with their progress, recent failures. No tokens. Error texts (they can name hosts and dataset paths) only
    with `details`, for a caller that presented a valid API key or the jobs token; otherwise counts only."""
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
            "errors": sum(seen.failures.values()) if seen else 0,
            "probe_failures": entry.probe_failures_total, "last_error": entry.last_error if details else None,
        })
        if entry.last_error or (seen and seen.failures):
            failures.append({"server_id": entry.id, "status": entry.status.value,
                             "last_error": entry.last_error if details else None,
                             "request_failures": dict(seen.failures) if seen else {}})
    evals = []
    for job_id, benches in (runner.live.items() if runner else ()):
        for bench, p in benches.items():
            evals.append({"job": job_id, "benchmark": bench, **p})
    recent_jobs = [{"id": j.id, "name": j.name, "state": j.state, "error": j.error if details else None}
                   for j in (jobs or [])[:20]]
    failures += [{"job": j["id"], "error": j["error"]} for j in recent_jobs if j["state"] == "failed"]
    totals = dispatcher.stats()
    return {"time": time.time(), "version": snapshot.version if snapshot else None, "servers": servers,
            "evals": evals, "jobs": recent_jobs, "failures": failures,
            "dispatcher": {"submitted": totals.submitted, "completed": totals.completed, "failed": totals.failed,
                           "retries": totals.retries, "hedges": totals.hedges, "inflight": totals.inflight_total}}


def build_app(gateway: Gateway, dispatcher: Dispatcher, snapshot: Callable[[], PoolSnapshot | None], *,
              runner: JobRunner | None = None, jobs_token: str | None = None) -> web.Application:
    """The gateway's routes, the pool page and its data, and (with a jobs runner) the jobs API."""
    app = gateway.app()
    page = resources.files("fedpool").joinpath("static/pool.html").read_text(encoding="utf-8")

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    async def state(request: web.Request) -> web.Response:
        jobs = await asyncio.to_thread(runner.store.list) if runner is not None else None
        presented = bearer(request)
        details = gateway.knows(presented) or (jobs_token is not None and matches(presented, jobs_token.encode()))
        return web.json_response(pool_state(snapshot(), dispatcher, runner, jobs, details=details),
                                 headers={"Cache-Control": "no-store"})

    app.router.add_get("/", index)
    app.router.add_get("/pool.json", state)
    if runner is not None:
        assert jobs_token is not None
        JobsApi(runner, jobs_token).add_routes(app)
    return app
