"""The jobs API: remote evaluation jobs, submitted over HTTP, kept in SQLite, run concurrently through one pool
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
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from fedpool.clients.jobs.runner import JobRunner, resolve_specs
from fedpool.clients.jobs.store import Job, JobList, JobRequest
from fedpool.federation.gateway.auth import bearer, matches
from fedpool.pipeline.errors import PipelineError
from fedpool.pipeline.ownership import private_dir
from fedpool.pipeline.yamlfile import field_problems

TOKEN_FILE = "jobs.token"
TOKEN_ENV = "FEDPOOL_JOBS_TOKEN"
MAX_REQUEST_BYTES = 4 * 1024 * 1024


MIN_TOKEN_CHARS = 16


def ensure_jobs_token(root: Path, token: str | None = None) -> str:
    """The token: given, from FEDPOOL_JOBS_TOKEN, saved in ROOT/jobs.token (0600), or a new one saved there.
    A token shorter than 16 characters is refused (it could be guessed)."""
    token = token or os.environ.get(TOKEN_ENV)
    path = root / TOKEN_FILE
    if token is None and path.exists():
        token = path.read_text(encoding="utf-8").strip()
        _check_length(token, str(path))
        return token
    if token is not None:
        _check_length(token, "the jobs token given")
    token = token or secrets.token_urlsafe(32)
    private_dir(root)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return token


def _check_length(token: str, where: str) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise PipelineError(f"{where}: a jobs token needs at least {MIN_TOKEN_CHARS} characters, this one has "
                            f"{len(token)}")


class ErrorDetail(BaseModel):
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


def _error(status: int, message: str) -> web.Response:
    return web.json_response(ErrorBody(error=ErrorDetail(message=message)).model_dump(), status=status)


# The routes, described once: the OpenAPI document below is generated from this table and the pydantic models.
ROUTES: tuple[tuple[str, str, str, type[BaseModel] | None, dict[int, type[BaseModel] | str]], ...] = (
    ("post", "/jobs", "submit an eval job", JobRequest, {201: Job, 400: ErrorBody, 401: ErrorBody, 413: ErrorBody}),
    ("get", "/jobs", "every job, newest first", None, {200: JobList, 401: ErrorBody}),
    ("get", "/jobs/{job_id}", "one job", None, {200: Job, 401: ErrorBody, 404: ErrorBody}),
    ("delete", "/jobs/{job_id}", "cancel a job (what was written stays in its artifact)", None,
     {200: Job, 401: ErrorBody, 404: ErrorBody, 409: ErrorBody}),
    ("get", "/jobs/{job_id}/logs", "the job's log", None, {200: "text/plain", 401: ErrorBody, 404: ErrorBody}),
)


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for the jobs API, generated from ROUTES and the models' own JSON schemas."""
    schemas: dict[str, Any] = {}

    def ref(model: type[BaseModel]) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, body, answers in ROUTES:
        operation: dict[str, Any] = {"summary": summary, "security": [{"bearer": []}], "responses": {}}
        if body is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(body)}}}
        for status, answer in answers.items():
            content = ({"text/plain": {"schema": {"type": "string"}}} if isinstance(answer, str)
                       else {"application/json": {"schema": ref(answer)}})
            operation["responses"][str(status)] = {"description": _REASONS.get(status, "answer"), "content": content}
        entry = paths.setdefault(path, {})
        if "{job_id}" in path:
            entry["parameters"] = [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}]
        entry[method] = operation
    return {"openapi": "3.1.0", "info": {"title": "fedpool jobs", "version": "1"},
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": schemas},
            "paths": paths}


_REASONS = {200: "OK", 201: "queued", 400: "bad request (the culprit named)", 401: "no or wrong bearer token",
            404: "no such job", 409: "already finished", 413: "too large"}


class JobsApi:
    """The /jobs routes. Mount with `add_routes(app)`; every call needs the bearer token."""

    def __init__(self, runner: JobRunner, token: str):
        self._runner = runner
        self._token = token.encode()
        self._document = openapi_document()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/jobs/openapi.json", self._openapi)
        app.router.add_post("/jobs", self._submit)
        app.router.add_get("/jobs", self._list)
        app.router.add_get("/jobs/{job_id}", self._show)
        app.router.add_delete("/jobs/{job_id}", self._cancel)
        app.router.add_get("/jobs/{job_id}/logs", self._logs)

    def _authorized(self, request: web.Request) -> bool:
        return matches(bearer(request), self._token)

    def _deny(self, request: web.Request) -> web.Response | None:
        if not self._authorized(request):
            return _error(401, "the jobs API needs `Authorization: Bearer TOKEN` (see the jobs server's jobs.token)")
        return None

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self._document)

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
            await asyncio.to_thread(resolve_specs, job_request, self._runner.roots)
            await self._runner.require_servers(job_request)
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
        return web.json_response({"jobs": [self._with_live(j) for j in jobs]})  # JobList

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
