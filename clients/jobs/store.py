"""The jobs store: every job and its state in SQLite (WAL), its log beside its artifact."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fedpool.pipeline.ownership import private_dir

JobState = Literal["queued", "running", "done", "failed", "cancelled"]
FINAL_STATES = frozenset({"done", "failed", "cancelled"})


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
    wait_for_servers_s: float = Field(default=0.0, ge=0, le=86400, description=(
        "when no registered server serves the model, wait this long for one (at submission and at start) "
        "instead of refusing the job"))


class Job(BaseModel):
    """A job as the API shows it."""

    model_config = ConfigDict(frozen=True)

    id: str
    state: JobState
    name: str | None = None
    model: str
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    artifact_dir: str
    progress: dict[str, Any] = Field(default_factory=dict,
                                     description="benchmark -> {done, total, failed, retried, elapsed_s}")
    scores: dict[str, Any] = Field(default_factory=dict,
                                   description="benchmark -> {scores, records, failed, artifact_dir}")
    error: str | None = None
    starts: int = Field(default=0, description="how many times the job was started (restarts resume it)")
    request: JobRequest = Field(exclude=True)

    def as_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class JobList(BaseModel):
    jobs: list[Job]


class JobStore:
    """Jobs in SQLite (WAL, one connection per call: safe from worker threads). Synchronous: call it
    through asyncio.to_thread from async code."""

    def __init__(self, root: Path):
        self.root = private_dir(root)
        self.path = root / "jobs.sqlite"
        if not self.path.exists():  # created 0600 before SQLite opens it (its -wal and -shm files follow its mode)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        with self._db() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("""CREATE TABLE IF NOT EXISTS jobs (
                id TEXT PRIMARY KEY, state TEXT NOT NULL, request TEXT NOT NULL, created_at REAL NOT NULL,
                started_at REAL, finished_at REAL, out_dir TEXT NOT NULL, progress TEXT NOT NULL DEFAULT '{}',
                scores TEXT NOT NULL DEFAULT '{}', error TEXT, attempts INTEGER NOT NULL DEFAULT 0)""")

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
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
        out = private_dir(self.job_dir(job_id)) / "run"
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

    def requeue_interrupted(self) -> builtins.list[str]:  # `list` here is the method above
        """Jobs left running by a server that stopped: queued again (they resume from their artifact)."""
        with self._db() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE state = 'running'").fetchall()]
            db.execute("UPDATE jobs SET state = 'queued' WHERE state = 'running'")
        return ids

    def queued(self) -> builtins.list[str]:
        with self._db() as db:
            return [r[0] for r in db.execute("SELECT id FROM jobs WHERE state = 'queued' ORDER BY created_at")]

    def log(self, job_id: str, line: str) -> None:
        path = private_dir(self.job_dir(job_id)) / "job.log"
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n")

    def read_log(self, job_id: str) -> str:
        path = self.job_dir(job_id) / "job.log"
        return path.read_text(encoding="utf-8") if path.exists() else ""


def _job(row: tuple[Any, ...]) -> Job:
    job_id, state, request, created, started, finished, out, progress, scores, error, attempts = row
    req = JobRequest.model_validate_json(request)
    return Job(id=job_id, state=state, name=req.name, model=req.model, created_at=created, started_at=started,
               finished_at=finished, artifact_dir=out, progress=json.loads(progress), scores=json.loads(scores),
               error=error, starts=attempts, request=req)
