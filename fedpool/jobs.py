"""Remote evaluation jobs: submitted over HTTP, kept in SQLite, run concurrently through one pool
connection (so every job's requests share every engine), and not lost on restart.

    POST   /jobs              an eval job (specs, model, ...)      -> 201 {"id": ...}
    GET    /jobs              every job, newest first
    GET    /jobs/{id}         state, progress, scores, artifact path
    DELETE /jobs/{id}         cancel (what was written stays in the artifact)
    GET    /jobs/{id}/logs    the job's log, text
    GET    /jobs/openapi.json this API, described

Every /jobs call needs `Authorization: Bearer TOKEN` (jobs carry dataset paths and scores), compared in
constant time. States: queued → running → done | failed | cancelled. A job that was running when the
server stopped is queued again at start and resumes from its artifact: records already written are
kept, each sample ends in the artifact exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedpool.clients import EvalProgress, EvalTarget, run_evals
from fedpool.federation import Dispatcher
from fedpool.pipeline import BenchmarkSpec, load_samples, load_spec, spec_from_dict
from fedpool.pipeline.errors import PipelineError
from fedpool.pipeline.yamlfile import field_problems

log = logging.getLogger("fedpool.jobs")

JobState = Literal["queued", "running", "done", "failed", "cancelled"]
FINAL_STATES = frozenset({"done", "failed", "cancelled"})
TOKEN_FILE = "jobs.token"
TOKEN_ENV = "FEDPOOL_JOBS_TOKEN"
MAX_REQUEST_BYTES = 4 * 1024 * 1024


class JobRequest(BaseModel):
    """What a client submits. Specs are given inline (the YAML's content as JSON, with absolute data
    paths) or as paths to spec files on the jobs server's machine."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    revision: str | None = None
    specs: list[dict[str, Any]] = Field(default_factory=list)
    spec_paths: list[str] = Field(default_factory=list)
    concurrency: int = Field(default=64, ge=1, le=4096)
    limit: int | None = Field(default=None, ge=1)
    name: str | None = Field(default=None, max_length=200)


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    state: str
    request: dict[str, Any]
    created_at: float
    started_at: float | None
    finished_at: float | None
    out_dir: str
    progress: dict[str, Any]
    scores: dict[str, Any]
    error: str | None
    attempts: int

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "name": self.request.get("name"),
                "model": self.request.get("model"), "created_at": self.created_at, "started_at": self.started_at,
                "finished_at": self.finished_at, "artifact_dir": self.out_dir, "progress": self.progress,
                "scores": self.scores, "error": self.error, "starts": self.attempts}


class JobStore:
    """Jobs in SQLite (WAL, one connection per call: safe from worker threads). Synchronous: call it
    through asyncio.to_thread from async code."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / "jobs.sqlite"
        with self._db() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("""CREATE TABLE IF NOT EXISTS jobs (
                id TEXT PRIMARY KEY, state TEXT NOT NULL, request TEXT NOT NULL, created_at REAL NOT NULL,
                started_at REAL, finished_at REAL, out_dir TEXT NOT NULL, progress TEXT NOT NULL DEFAULT '{}',
                scores TEXT NOT NULL DEFAULT '{}', error TEXT, attempts INTEGER NOT NULL DEFAULT 0)""")

    @contextlib.contextmanager
    def _db(self):  # type: ignore[no-untyped-def]
        db = sqlite3.connect(self.path, timeout=30)
        try:
            with db:
                yield db
        finally:
            db.close()

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def create(self, request: JobRequest, now: float) -> Job:
        job_id = uuid.uuid4().hex[:12]
        out = self.job_dir(job_id) / "run"
        with self._db() as db:
            db.execute("INSERT INTO jobs (id, state, request, created_at, out_dir) VALUES (?, 'queued', ?, ?, ?)",
                       (job_id, request.model_dump_json(), now, str(out)))
        return self.get(job_id)  # type: ignore[return-value]

    def get(self, job_id: str) -> Job | None:
        with self._db() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    def list(self) -> list[Job]:
        with self._db() as db:
            rows = db.execute("SELECT * FROM jobs ORDER BY created_at DESC").fetchall()
        return [_job(r) for r in rows]

    def update(self, job_id: str, *, only_from: Iterable[str] | None = None, **fields: Any) -> bool:
        """Set fields; with `only_from`, only while the job's state is one of those (compare-and-set in one
        statement, so a cancel and a start racing each other cannot overwrite one another). True if set."""
        allowed = {"state", "started_at", "finished_at", "progress", "scores", "error", "attempts"}
        if not fields or set(fields) - allowed:
            raise ValueError(f"cannot update {sorted(set(fields) - allowed)}")
        values = [json.dumps(v) if k in ("progress", "scores") else v for k, v in fields.items()]
        sets = ", ".join(f"{k} = ?" for k in fields)
        where, params = "id = ?", [job_id]
        if only_from is not None:
            states = list(only_from)
            where += f" AND state IN ({', '.join('?' for _ in states)})"
            params += states
        with self._db() as db:  # column names are fixed above
            return db.execute(f"UPDATE jobs SET {sets} WHERE {where}", (*values, *params)).rowcount > 0

    def requeue_interrupted(self) -> list[str]:
        """Jobs left running by a server that stopped: queued again (they resume from their artifact)."""
        with self._db() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE state = 'running'").fetchall()]
            db.execute("UPDATE jobs SET state = 'queued' WHERE state = 'running'")
        return ids

    def queued(self) -> list[str]:
        with self._db() as db:
            return [r[0] for r in db.execute("SELECT id FROM jobs WHERE state = 'queued' ORDER BY created_at")]

    def log(self, job_id: str, line: str) -> None:
        path = self.job_dir(job_id) / "job.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n")

    def read_log(self, job_id: str) -> str:
        path = self.job_dir(job_id) / "job.log"
        return path.read_text(encoding="utf-8") if path.exists() else ""


def _job(row: tuple[Any, ...]) -> Job:
    job_id, state, request, created, started, finished, out, progress, scores, error, attempts = row
    return Job(job_id, state, json.loads(request), created, started, finished, out, json.loads(progress),
               json.loads(scores), error, attempts)


def resolve_specs(request: JobRequest) -> list[BenchmarkSpec]:
    """The job's specs, checked now (each spec and its dataset), so a bad job is refused at submission
    with the culprit named instead of failing later."""
    if not request.specs and not request.spec_paths:
        raise PipelineError("a job needs `specs` (inline) or `spec_paths`")
    specs = [spec_from_dict(raw, source=f"specs[{i}]") for i, raw in enumerate(request.specs)]
    specs += [load_spec(Path(p)) for p in request.spec_paths]
    for spec in specs:
        if not spec.data_path().is_absolute():
            raise PipelineError(f"benchmark {spec.name!r}: data.path {spec.data.path!r} must be absolute in an "
                                "inline spec (the jobs server has no spec file to resolve it against)")
    if request.limit is not None:
        specs = [s.model_copy(update={"data": s.data.model_copy(update={"limit": request.limit})}) for s in specs]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise PipelineError(f"benchmark names must be unique in a job: {names}")
    for spec in specs:
        load_samples(spec)  # raises DataError naming file and line
    return specs


class JobRunner:
    """Runs queued jobs, up to `max_running` at once, all through one dispatcher."""

    def __init__(self, store: JobStore, dispatcher: Dispatcher, *, max_running: int = 4,
                 verifier_factory: Callable[[], Any] | None = None, clock: Callable[[], float] = time.time):
        self.store = store
        self._dispatcher = dispatcher
        self._max = max_running
        self._verifier_factory = verifier_factory
        self._verifier: Any = None
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.live: dict[str, dict[str, Any]] = {}  # job id -> benchmark -> progress (not yet persisted)

    async def start(self) -> None:
        resumed = await asyncio.to_thread(self.store.requeue_interrupted)
        for job_id in resumed:
            await asyncio.to_thread(self.store.log, job_id, "server restarted: queued again, resumes from its artifact")
        self._loop_task = asyncio.get_running_loop().create_task(self._schedule(), name="jobs-scheduler")

    async def stop(self) -> None:
        """Stop scheduling; running jobs are cancelled but stay `running` in the store, so the next start
        resumes them (a restart is not a cancellation)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._verifier is not None:
            self._verifier.shutdown()

    def poke(self) -> None:
        self._wake.set()

    async def cancel(self, job_id: str) -> bool:
        job = await asyncio.to_thread(self.store.get, job_id)
        if job is None or job.state in FINAL_STATES:
            return False
        if not await asyncio.to_thread(self.store.update, job_id, only_from=("queued", "running"),
                                       state="cancelled", finished_at=self._clock()):
            return False  # it finished (or was cancelled) in the meantime
        await asyncio.to_thread(self.store.log, job_id, "cancelled by request")
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()
        return True

    async def _schedule(self) -> None:
        while True:
            for job_id in await asyncio.to_thread(self.store.queued):
                if len(self._tasks) >= self._max:
                    break
                if job_id not in self._tasks:
                    self._tasks[job_id] = asyncio.get_running_loop().create_task(self._run(job_id),
                                                                                name=f"job-{job_id}")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    async def _run(self, job_id: str) -> None:
        store = self.store
        try:
            job = await asyncio.to_thread(store.get, job_id)
            if job is None or job.state != "queued":
                return
            request = JobRequest.model_validate(job.request)
            if not await asyncio.to_thread(store.update, job_id, only_from=("queued",), state="running",
                                           started_at=job.started_at or self._clock(), attempts=job.attempts + 1,
                                           error=None):
                return  # cancelled between the read and the start
            await asyncio.to_thread(store.log, job_id, f"running (start {job.attempts + 1}) on model {request.model}")
            specs = await asyncio.to_thread(resolve_specs, request)
            verifier = None
            if any(s.verifier for s in specs):
                if self._verifier is None:
                    if self._verifier_factory is None:
                        raise PipelineError("a spec asks for the verifier but this jobs server has none configured")
                    self._verifier = self._verifier_factory()
                    await self._verifier.ready()
                verifier = self._verifier
            self.live[job_id] = {}
            saver = asyncio.get_running_loop().create_task(self._save_progress(job_id))
            try:
                summaries = await run_evals(
                    specs, self._dispatcher, Path(job.out_dir), EvalTarget(model=request.model,
                                                                            revision=request.revision),
                    concurrency=request.concurrency, run_info={"job_id": job_id},
                    on_progress=lambda p: self._progress(job_id, p), verifier=verifier)
            finally:
                saver.cancel()
            scores = {s.benchmark: {"scores": s.summary["scores"], "records": s.summary["records"],
                                    "failed": s.summary["failed"], "artifact_dir": str(s.artifact_dir)}
                      for s in summaries}
            if await asyncio.to_thread(store.update, job_id, only_from=("running",), state="done",
                                       finished_at=self._clock(), scores=scores,
                                       progress=self.live.get(job_id, {})):
                lines = [f"{b}: " + ", ".join(f"{x['metric']} {x['value']:.1f}" for x in v["scores"])
                         for b, v in scores.items()]
                await asyncio.to_thread(store.log, job_id, "done: " + "; ".join(lines))
        except asyncio.CancelledError:
            current = await asyncio.to_thread(store.get, job_id)
            if current is not None and current.state == "running":  # a server stop: resumed at next start
                await asyncio.to_thread(store.update, job_id, progress=self.live.get(job_id, {}))
            raise
        except (PipelineError, ValidationError, ValueError, OSError) as exc:
            message = f"{type(exc).__name__}: {exc}"
            await asyncio.to_thread(store.update, job_id, only_from=("queued", "running"), state="failed",
                                    finished_at=self._clock(), error=message)
            await asyncio.to_thread(store.log, job_id, f"failed: {message}")
        except Exception as exc:  # anything else: the job fails with the error, the server goes on
            log.exception("job %s failed", job_id)
            message = f"{type(exc).__name__}: {exc}"
            await asyncio.to_thread(store.update, job_id, only_from=("queued", "running"), state="failed",
                                    finished_at=self._clock(), error=message)
            await asyncio.to_thread(store.log, job_id, f"failed: {message}")
        finally:
            self._tasks.pop(job_id, None)
            self.live.pop(job_id, None)
            self.poke()

    def _progress(self, job_id: str, p: EvalProgress) -> None:
        self.live.setdefault(job_id, {})[p.benchmark] = {
            "done": p.done, "total": p.total, "failed": p.failed, "retried": p.retried,
            "elapsed_s": round(p.elapsed_s, 2)}

    async def _save_progress(self, job_id: str) -> None:
        while True:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(self.store.update, job_id, progress=self.live.get(job_id, {}))


def ensure_jobs_token(root: Path, token: str | None = None) -> str:
    """The token: given, from FEDPOOL_JOBS_TOKEN, saved in ROOT/jobs.token (0600), or a new one saved there."""
    token = token or os.environ.get(TOKEN_ENV)
    path = root / TOKEN_FILE
    if token is None and path.exists():
        return path.read_text(encoding="utf-8").strip()
    token = token or secrets.token_urlsafe(32)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return token


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class JobsApi:
    """The /jobs routes. Mount with `add_routes(app)`; every call needs the bearer token."""

    def __init__(self, runner: JobRunner, token: str):
        self._runner = runner
        self._token = token.encode()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/jobs/openapi.json", self._openapi)
        app.router.add_post("/jobs", self._submit)
        app.router.add_get("/jobs", self._list)
        app.router.add_get("/jobs/{job_id}", self._show)
        app.router.add_delete("/jobs/{job_id}", self._cancel)
        app.router.add_get("/jobs/{job_id}/logs", self._logs)

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        given = header.removeprefix("Bearer ").encode() if header.startswith("Bearer ") else b""
        return hmac.compare_digest(given, self._token)

    def _deny(self, request: web.Request) -> web.Response | None:
        if not self._authorized(request):
            return _error(401, "the jobs API needs `Authorization: Bearer TOKEN` (see the jobs server's jobs.token)")
        return None

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)

    async def _submit(self, request: web.Request) -> web.Response:
        if (denied := self._deny(request)) is not None:
            return denied
        if request.content_length is not None and request.content_length > MAX_REQUEST_BYTES:
            return _error(413, f"a job description is limited to {MAX_REQUEST_BYTES} bytes")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not JSON")
        try:
            job_request = JobRequest.model_validate(body)
        except ValidationError as exc:
            return _error(400, field_problems(exc))
        try:
            await asyncio.to_thread(resolve_specs, job_request)
        except PipelineError as exc:
            return _error(400, str(exc))
        store = self._runner.store
        job = await asyncio.to_thread(store.create, job_request, time.time())
        await asyncio.to_thread(store.log, job.id, f"queued: {len(job_request.specs) + len(job_request.spec_paths)} "
                                f"benchmark(s) on model {job_request.model}")
        self._runner.poke()
        return web.json_response(job.as_json(), status=201)

    async def _list(self, request: web.Request) -> web.Response:
        if (denied := self._deny(request)) is not None:
            return denied
        jobs = await asyncio.to_thread(self._runner.store.list)
        return web.json_response({"jobs": [self._with_live(j) for j in jobs]})

    async def _show(self, request: web.Request) -> web.Response:
        if (denied := self._deny(request)) is not None:
            return denied
        job = await asyncio.to_thread(self._runner.store.get, request.match_info["job_id"])
        if job is None:
            return _error(404, f"no job {request.match_info['job_id']!r}")
        return web.json_response(self._with_live(job))

    async def _cancel(self, request: web.Request) -> web.Response:
        if (denied := self._deny(request)) is not None:
            return denied
        job_id = request.match_info["job_id"]
        job = await asyncio.to_thread(self._runner.store.get, job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        if not await self._runner.cancel(job_id):
            return _error(409, f"job {job_id} is already {job.state}")
        return web.json_response(self._with_live(await asyncio.to_thread(self._runner.store.get, job_id)))

    async def _logs(self, request: web.Request) -> web.Response:
        if (denied := self._deny(request)) is not None:
            return denied
        job_id = request.match_info["job_id"]
        if await asyncio.to_thread(self._runner.store.get, job_id) is None:
            return _error(404, f"no job {job_id!r}")
        return web.Response(text=await asyncio.to_thread(self._runner.store.read_log, job_id))

    def _with_live(self, job: Job | None) -> dict[str, Any]:
        assert job is not None
        data = job.as_json()
        if job.id in self._runner.live:
            data["progress"] = self._runner.live[job.id]
        return data


_JOB_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string"}, "state": {"enum": ["queued", "running", "done", "failed", "cancelled"]},
        "name": {"type": ["string", "null"]}, "model": {"type": "string"},
        "created_at": {"type": "number"}, "started_at": {"type": ["number", "null"]},
        "finished_at": {"type": ["number", "null"]}, "artifact_dir": {"type": "string"},
        "progress": {"type": "object", "description": "benchmark -> {done, total, failed, retried, elapsed_s}"},
        "scores": {"type": "object", "description": "benchmark -> {scores, records, failed, artifact_dir}"},
        "error": {"type": ["string", "null"]}, "starts": {"type": "integer"},
    },
}
_ERROR = {"description": "error", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "object", "properties": {"message": {"type": "string"}}}}}}}}
_AUTH = [{"bearer": []}]
OPENAPI: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "fedpool jobs", "version": "1"},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                   "schemas": {"Job": _JOB_SCHEMA, "JobRequest": JobRequest.model_json_schema()}},
    "paths": {
        "/jobs": {
            "post": {"summary": "submit an eval job", "security": _AUTH,
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": "#/components/schemas/JobRequest"}}}},
                     "responses": {"201": {"description": "queued", "content": {"application/json": {
                         "schema": {"$ref": "#/components/schemas/Job"}}}}, "400": _ERROR, "401": _ERROR}},
            "get": {"summary": "every job, newest first", "security": _AUTH,
                    "responses": {"200": {"description": "jobs"}, "401": _ERROR}},
        },
        "/jobs/{job_id}": {
            "parameters": [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "get": {"summary": "one job", "security": _AUTH, "responses": {
                "200": {"description": "the job", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Job"}}}}, "404": _ERROR}},
            "delete": {"summary": "cancel", "security": _AUTH,
                       "responses": {"200": {"description": "cancelled"}, "404": _ERROR, "409": _ERROR}},
        },
        "/jobs/{job_id}/logs": {
            "parameters": [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "get": {"summary": "the job's log", "security": _AUTH,
                    "responses": {"200": {"description": "text/plain log"}, "404": _ERROR}},
        },
    },
}
