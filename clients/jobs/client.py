"""Python clients of the jobs API (`fedpool.clients.jobs.api`): `JobsClient` (blocking, standard library only) and
`AsyncJobsClient` (aiohttp). Both raise `JobsApiError` with the server's message and HTTP status. And the text
`fedpool jobs` prints of jobs."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

TERMINAL = ("done", "failed", "cancelled")


class JobsApiError(Exception):
    """The jobs server's refusal: its HTTP status and message. `kind`: "input" (the request is at fault: a 400) or
    "refused" (an unknown job, one that has ended, a wrong token)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"jobs server: {message}")
        self.status = status
        self.message = message
        self.kind = "input" if status == 400 else "refused"


class JobsUnreachable(ConnectionError):
    """No jobs server answered at the URL."""


def job_body(model: str, *, specs: list[dict[str, Any]] | None = None, spec_paths: list[str | Path] | None = None,
             revision: str | None = None, concurrency: int = 64, limit: int | None = None,
             name: str | None = None) -> dict[str, Any]:
    return {"model": model, "revision": revision, "specs": specs or [],
            "spec_paths": [str(p) for p in spec_paths or []], "concurrency": concurrency, "limit": limit,
            "name": name}


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500]


class JobsClient:
    """`JobsClient("http://host:8090", token).submit("model", spec_paths=[...])`."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0):
        self._url = url.rstrip("/")
        self._token = token
        self._timeout = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self._url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self._token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                raw = resp.read()
                return json.loads(raw) if resp.headers.get_content_type() == "application/json" else raw.decode()
        except urllib.error.HTTPError as exc:
            raise JobsApiError(exc.code, _message(exc.read())) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise JobsUnreachable(f"cannot reach the jobs server at {self._url} ({reason}); start it with `fedpool "
                                  "jobs serve`") from None

    def submit(self, model: str, **kwargs: Any) -> dict[str, Any]:
        return self._call("POST", "/jobs", job_body(model, **kwargs))

    def list(self) -> list[dict[str, Any]]:
        return self._call("GET", "/jobs")["jobs"]

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/jobs/{job_id}")

    def logs(self, job_id: str) -> str:
        return self._call("GET", f"/jobs/{job_id}/logs")

    def wait(self, job_id: str, *, timeout_s: float = 3600.0, poll_s: float = 1.0,
             on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """The job once it is done, failed or cancelled (TimeoutError after `timeout_s`); `on_progress` is given
        the job whenever its state or progress moved."""
        deadline = time.monotonic() + timeout_s
        seen = None
        while True:
            job = self.get(job_id)
            if on_progress is not None and (job["state"], job["progress"]) != seen:
                seen = (job["state"], job["progress"])
                on_progress(job)
            if job["state"] in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout_s:g}s")
            time.sleep(poll_s)


class AsyncJobsClient:
    """`async with AsyncJobsClient(url, token) as jobs: await jobs.submit(...)`."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0):
        self._url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncJobsClient:
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        assert self._session is not None, "use `async with AsyncJobsClient(...)`"
        async with self._session.request(method, self._url + path, json=body) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise JobsApiError(resp.status, _message(raw))
            return json.loads(raw) if resp.content_type == "application/json" else raw.decode()

    async def submit(self, model: str, **kwargs: Any) -> dict[str, Any]:
        return await self._call("POST", "/jobs", job_body(model, **kwargs))

    async def list(self) -> list[dict[str, Any]]:
        return (await self._call("GET", "/jobs"))["jobs"]

    async def get(self, job_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/jobs/{job_id}")

    async def cancel(self, job_id: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/jobs/{job_id}")

    async def logs(self, job_id: str) -> str:
        return await self._call("GET", f"/jobs/{job_id}/logs")

    async def wait(self, job_id: str, *, timeout_s: float = 3600.0, poll_s: float = 1.0) -> dict[str, Any]:
        """The job once it is done, failed or cancelled (TimeoutError after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = await self.get(job_id)
            if job["state"] in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout_s:g}s")
            await asyncio.sleep(poll_s)


JOBS_HEADER = f"{'ID':<12}  {'STATE':<9}  {'DONE/TOTAL':>11}  MODEL  NAME"


def job_line(job: dict[str, Any]) -> str:
    done = sum(p.get("done", 0) for p in job["progress"].values())
    total = sum(p.get("total", 0) for p in job["progress"].values())
    progress = f"{done}/{total}" if total else "-"
    return f"{job['id']}  {job['state']:<9}  {progress:>11}  {job['model']}  {job.get('name') or ''}".rstrip()


def job_text(job: dict[str, Any]) -> str:
    lines = [job_line(job), f"  artifacts: {job['artifact_dir']}"]
    for bench, p in job["progress"].items():
        lines.append(f"  {bench}: {p.get('done')}/{p.get('total')} done, {p.get('failed')} failed")
    for bench, s in job["scores"].items():
        lines.append(f"  {bench}: " + ", ".join(f"{x['metric']} {x['value']:.1f} [{x['ci_low']:.1f}, "
                                                 f"{x['ci_high']:.1f}]" for x in s["scores"]))
    if job.get("error"):
        lines.append(f"  error: {job['error']}")
    return "\n".join(lines)


def jobs_text(listed: dict[str, Any]) -> str:
    """`fedpool jobs list`'s table of {"jobs": [...]}."""
    jobs = listed["jobs"]
    if not jobs:
        return "(no jobs; submit one with `fedpool jobs submit`)"
    return "\n".join([JOBS_HEADER, *map(job_line, jobs)])
