"""The Batch API's durable state: uploaded files (their bytes on disk, their rows in SQLite) and batches, with one
result row per input line, written as each request ends. A batch resumes after a restart from the lines that have
no result yet, and its output and error files are written from the result rows, one line per input line, so each
`custom_id` appears in them exactly once whatever was in flight when the process died. Synchronous (SQLite in WAL,
one connection per call): call it through asyncio.to_thread from async code.

An input file is checked line by line when it is uploaded (`scan_input`): a line that is not a request this gateway
can serve refuses the whole file, naming the line, so nothing is half-accepted."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fedpool.federation.core.clientbook import CHARS_PER_TOKEN, DEFAULT_ANSWER_TOKENS, SERVED_DECODE_WEIGHT
from fedpool.federation.core.types import Endpoint, InferenceRequest

ENDPOINTS = tuple(e.value for e in Endpoint)
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a runner owes these work
FINAL = ("completed", "failed", "expired", "cancelled")
MAX_CUSTOM_ID_CHARS = 512
NOT_RUN = {"cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
           "expired": ("batch_expired", "This request could not be executed before the completion window expired.")}
_STAMPED = {"in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"}


class LineError(ValueError):
    """An input file that cannot be a batch: the line (1-based; None for the whole file) and what is wrong."""

    def __init__(self, line: int | None, message: str, *, param: str | None = None, code: str = "invalid_request"):
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.line, self.param, self.code = line, param, code


class FileInUse(Exception):
    """A file an unfinished batch reads."""


@dataclass(frozen=True, slots=True)
class RequestLine:
    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class InputSummary:
    """What the upload learnt of a batch input file: its requests, their one model, the first line of each url, and
    their mean shape (prompt tokens guessed from characters; the answer budget where the lines state one)."""

    lines: int
    model: str
    urls: Mapping[str, int]
    prompt_tokens: float
    max_tokens: float | None

    @property
    def work_each(self) -> float:
        """One request's work in the dispatcher's units (prompt + 2 × answer tokens)."""
        return self.prompt_tokens + SERVED_DECODE_WEIGHT * (self.max_tokens or DEFAULT_ANSWER_TOKENS)

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def loads(cls, text: str) -> InputSummary:
        return cls(**json.loads(text))


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(Line number, bytes) of every line that is not blank."""
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if raw.strip():
                yield number, raw


def parse_line(number: int, raw: bytes) -> RequestLine:
    """One request of an input file, or LineError naming what is wrong with it."""
    try:
        item = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise LineError(number, "not valid JSON", code="invalid_json_line") from None
    if not isinstance(item, dict):
        raise LineError(number, "a request must be a JSON object", code="invalid_json_line")
    custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError(number, f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters",
                        param="custom_id", code="invalid_custom_id")
    if item.get("method") != "POST":
        raise LineError(number, "'method' must be \"POST\"", param="method", code="invalid_method")
    if url not in ENDPOINTS:
        raise LineError(number, f"'url' must be one of {', '.join(ENDPOINTS)}, not {str(url)[:80]!r}", param="url",
                        code="invalid_url")
    if not isinstance(body, dict):
        raise LineError(number, "'body' must be a JSON object", param="body", code="invalid_body")
    _check_body(number, url, body)
    return RequestLine(number, custom_id, url, body)


def _check_body(number: int, url: str, body: dict[str, Any]) -> None:
    """The checks the gateway makes of an online request's body, and no streaming (a batch has no one to stream to)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise LineError(number, "'body.model' (a string) is required", param="body.model", code="invalid_body")
    needed = "prompt" if url == Endpoint.COMPLETIONS else "messages"
    if needed not in body:
        raise LineError(number, f"'body.{needed}' is required for {url}", param=f"body.{needed}",
                        code="invalid_body")
    if body.get("stream"):
        raise LineError(number, "'body.stream' cannot be true in a batch", param="body.stream", code="invalid_body")
    try:
        InferenceRequest.from_body(body, request_id="check", model=model, endpoint=Endpoint(url))
    except ValueError as exc:
        raise LineError(number, f"body: {exc}", param="body", code="invalid_body") from None


def answer_budget(body: Mapping[str, Any]) -> int | None:
    """The answer tokens a body asks for at most (max_tokens, or chat's max_completion_tokens), if it says."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def scan_input(path: Path, max_lines: int) -> InputSummary:
    """Check every line of an uploaded batch input (`parse_line`, one model, no duplicate custom_id, at most
    `max_lines` requests) and summarize it; LineError at the first line that fails."""
    seen: dict[str, int] = {}
    urls: dict[str, int] = {}
    model: tuple[str, int] | None = None
    chars = budget = budgets = 0
    for number, raw in iter_lines(path):
        if len(seen) >= max_lines:
            raise LineError(number, f"a batch holds at most {max_lines} requests", code="too_many_requests")
        line = parse_line(number, raw)
        if line.custom_id in seen:
            raise LineError(number, f"custom_id {line.custom_id[:80]!r} is already on line {seen[line.custom_id]}",
                            param="custom_id", code="duplicate_custom_id")
        seen[line.custom_id] = number
        urls.setdefault(line.url, number)
        name = line.body["model"]
        if model is None:
            model = (name, number)
        elif name != model[0]:
            raise LineError(number, f"model {name[:80]!r} is not line {model[1]}'s {model[0][:80]!r}: every request of "
                            "a batch is for one model", param="body.model", code="mismatched_model")
        request = InferenceRequest.from_body(line.body, request_id="scan", model=name, endpoint=Endpoint(line.url))
        chars += request.prompt_chars()
        asked = answer_budget(line.body)
        if asked is not None:
            budget, budgets = budget + asked, budgets + 1
    if model is None:
        raise LineError(None, "the file has no requests", code="empty_file")
    n = len(seen)
    return InputSummary(n, model[0], urls, chars / CHARS_PER_TOKEN / n, budget / budgets if budgets else None)


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    summary: InputSummary | None = field(default=None, compare=False)

    def as_json(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


_BATCHES = """CREATE TABLE IF NOT EXISTS batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,
    owner TEXT NOT NULL, status TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, model TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT,
    total INTEGER NOT NULL, completed INTEGER NOT NULL, failed INTEGER NOT NULL, errors TEXT,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, work_each REAL NOT NULL, estimate TEXT)"""


@dataclass(frozen=True, slots=True)
class StoredBatch:
    row: Mapping[str, Any]  # the batches table's columns by name

    def __getattr__(self, name: str) -> Any:
        try:
            return self.row[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def left(self) -> int:
        """Lines without a result yet."""
        return int(self.row["total"] - self.row["completed"] - self.row["failed"])

    def as_json(self) -> dict[str, Any]:
        """OpenAI's Batch object, with fedpool's estimate of its run (`fedpool`) beside OpenAI's fields."""
        r = self.row
        out: dict[str, Any] = {"id": r["id"], "object": "batch", "endpoint": r["endpoint"],
                               "errors": json.loads(r["errors"]) if r["errors"] else None}
        for name in ("input_file_id", "completion_window", "status", "output_file_id", "error_file_id", "created_at",
                     "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                     "cancelling_at", "cancelled_at"):
            out[name] = r[name]
        out["request_counts"] = {"total": r["total"], "completed": r["completed"], "failed": r["failed"]}
        out["metadata"] = json.loads(r["metadata"]) if r["metadata"] else None
        out["model"] = r["model"]
        out["usage"] = {"input_tokens": r["input_tokens"], "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens": r["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": r["input_tokens"] + r["output_tokens"]}
        out["fedpool"] = {"estimate": json.loads(r["estimate"]) if r["estimate"] else None}
        return out


@dataclass(frozen=True, slots=True)
class LineResult:
    """A request's end: its output or error line as it will be written, and the tokens its answer used."""

    line: int
    custom_id: str
    ok: bool
    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class BatchStore:
    """Files under ROOT/files, their rows and the batches in ROOT/batches.sqlite."""

    def __init__(self, root: Path):
        self.root = _private_dir(root)
        self.files_dir = _private_dir(root / "files")
        self.uploads_dir = _private_dir(root / "uploads")
        for stale in self.uploads_dir.glob("*.part"):  # uploads a stopped process left unfinished
            stale.unlink(missing_ok=True)
        self.path = root / "batches.sqlite"
        if not self.path.exists():
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        with self._db() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("""CREATE TABLE IF NOT EXISTS files (seq INTEGER PRIMARY KEY AUTOINCREMENT,
                id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
                bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, summary TEXT)""")
            db.execute(_BATCHES)
            db.execute("""CREATE TABLE IF NOT EXISTS results (batch_id TEXT NOT NULL, line INTEGER NOT NULL,
                custom_id TEXT NOT NULL, ok INTEGER NOT NULL, text TEXT NOT NULL, PRIMARY KEY (batch_id, line))
                WITHOUT ROWID""")

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA synchronous=NORMAL")  # (WAL: a process killed loses nothing committed)
        try:
            with db:
                yield db
        finally:
            db.close()

    # ---- files ------------------------------------------------------------------------------------------------
    def upload_path(self) -> Path:
        """A new path for an upload being received (removed if it is refused, moved in if it is kept)."""
        return self.uploads_dir / f"{secrets.token_hex(8)}.part"

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def add_file(self, owner: str, filename: str, purpose: str, received: Path, summary: InputSummary | None,
                 now: float) -> StoredFile:
        """Keep a received upload as a new file of `owner`'s."""
        file_id = new_id("file-")
        size = received.stat().st_size
        os.replace(received, self.file_path(file_id))
        with self._db() as db:
            db.execute("INSERT INTO files (id, owner, filename, purpose, bytes, created_at, summary) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)", (file_id, owner, filename, purpose, size, int(now),
                                                        summary.dumps() if summary is not None else None))
        return StoredFile(file_id, owner, filename, purpose, size, int(now), summary)

    def file(self, file_id: str, owner: str | None) -> StoredFile | None:
        """The file, if it exists and (`owner` given) is that owner's."""
        with self._db() as db:
            row = db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return _file(row) if row is not None and owner in (None, row["owner"]) else None

    def files(self, owner: str, *, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
              ascending: bool = False) -> tuple[list[StoredFile], bool]:
        """A page of the owner's files (newest first unless `ascending`) after the file `after`; whether more follow."""
        rows = self._page("files", owner, after, limit, ascending, ("purpose", purpose) if purpose else None)
        return [_file(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str) -> bool:
        """Delete the owner's file (FileInUse while an unfinished batch reads it); whether it existed."""
        with self._db() as db:
            using = db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({_marks(ACTIVE)})",
                               (file_id, *ACTIVE)).fetchone()
            if using is not None:
                raise FileInUse(f"file {file_id} is the input of batch {using['id']}, which has not finished")
            gone = db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0
        if gone:
            self.file_path(file_id).unlink(missing_ok=True)
        return gone

    # ---- batches ----------------------------------------------------------------------------------------------
    def create_batch(self, owner: str, source: StoredFile, endpoint: str, window: tuple[str, float],
                     metadata: Mapping[str, str] | None, estimate: Mapping[str, Any] | None,
                     now: float) -> StoredBatch:
        """A new batch of the owner's over `source`'s requests, validating (a runner takes it on from there)."""
        assert source.summary is not None
        batch_id = new_id("batch_")
        values = {"id": batch_id, "owner": owner, "status": "validating", "endpoint": endpoint,
                  "input_file_id": source.id, "completion_window": window[0],
                  "metadata": json.dumps(dict(metadata)) if metadata else None, "model": source.summary.model,
                  "created_at": int(now), "expires_at": int(now + window[1]), "total": source.summary.lines,
                  "completed": 0, "failed": 0, "input_tokens": 0, "output_tokens": 0,
                  "work_each": source.summary.work_each, "estimate": json.dumps(estimate) if estimate else None}
        with self._db() as db:
            db.execute(f"INSERT INTO batches ({', '.join(values)}) VALUES ({_marks(values)})", tuple(values.values()))
        return self.batch(batch_id, None)  # type: ignore[return-value]

    def batch(self, batch_id: str, owner: str | None) -> StoredBatch | None:
        """The batch, if it exists and (`owner` given) is that owner's."""
        with self._db() as db:
            row = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return StoredBatch(dict(row)) if row is not None and owner in (None, row["owner"]) else None

    def batches(self, owner: str, *, after: str | None = None, limit: int = 20) -> tuple[list[StoredBatch], bool]:
        """A page of the owner's batches, newest first, after the batch `after`; whether more follow."""
        rows = self._page("batches", owner, after, limit, False, None)
        return [StoredBatch(dict(r)) for r in rows[:limit]], len(rows) > limit

    def active(self) -> list[StoredBatch]:
        """Every batch a runner owes work, oldest first."""
        with self._db() as db:
            rows = db.execute(f"SELECT * FROM batches WHERE status IN ({_marks(ACTIVE)}) ORDER BY seq",
                              ACTIVE).fetchall()
        return [StoredBatch(dict(r)) for r in rows]

    def set_status(self, batch_id: str, status: str, now: float, only_from: Iterable[str]) -> bool:
        """Move the batch to `status` (stamping its time) if its status is one of `only_from`, in one statement, so a
        cancel and the runner's own moves cannot overwrite each other. Whether it moved."""
        states = tuple(only_from)
        stamp = f", {status}_at = ?" if status in _STAMPED else ""
        values = (status, *((int(now),) if stamp else ()), batch_id, *states)
        with self._db() as db:  # (column names from _STAMPED only)
            return db.execute(f"UPDATE batches SET status = ?{stamp} WHERE id = ? AND status IN ({_marks(states)})",
                              values).rowcount > 0

    def fail(self, batch_id: str, code: str, message: str, now: float) -> None:
        """A batch that cannot run any more (its input gone): failed, saying why in its `errors`."""
        errors = json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                         "line": None}]})
        with self._db() as db:
            db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ?",
                       (int(now), errors, batch_id))

    # ---- results ----------------------------------------------------------------------------------------------
    def record(self, batch_id: str, results: Iterable[LineResult]) -> int:
        """Keep the results of lines that have none yet (a line run again after a restart keeps its first), and
        count them into the batch's request_counts and usage, in one transaction. How many were new."""
        added = completed = failed = prompt = answer = 0
        with self._db() as db:
            for r in results:
                if db.execute("INSERT OR IGNORE INTO results (batch_id, line, custom_id, ok, text) VALUES "
                              "(?, ?, ?, ?, ?)", (batch_id, r.line, r.custom_id, int(r.ok), r.text)).rowcount:
                    added += 1
                    completed, failed = completed + r.ok, failed + (not r.ok)
                    prompt, answer = prompt + r.prompt_tokens, answer + r.completion_tokens
            db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, input_tokens = "
                       "input_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                       (completed, failed, prompt, answer, batch_id))
        return added

    def done_lines(self, batch_id: str) -> set[int]:
        """The lines of the batch that have a result."""
        with self._db() as db:
            return {r[0] for r in db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def finalize(self, batch_id: str, status: str, now: float, only_from: Iterable[str]) -> bool:
        """Write the batch's output and error files (input order; a line without a result, in a batch cancelled or
        expired, goes to the error file saying so) and end it `status`, if its status is one of `only_from`. The
        files' ids follow from the batch's, so finalizing again after a restart rewrites the same files."""
        batch, states = self.batch(batch_id, None), tuple(only_from)
        if batch is None or batch.status not in states:
            return False  # (ended already: its results are gone, its files must stay as they are)
        stem = batch_id.removeprefix("batch_")
        out_id, err_id = f"file-{stem}-output", f"file-{stem}-errors"
        with self._db() as db:
            outputs, errors = self._write_outputs(db, batch, status, out_id, err_id)
            moved = db.execute(
                f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, error_file_id = ? "
                f"WHERE id = ? AND status IN ({_marks(states)})",
                (status, int(now), out_id if outputs else None, err_id if errors else None, batch_id, *states),
            ).rowcount > 0
            if not moved:
                return False
            for file_id, lines in ((out_id, outputs), (err_id, errors)):
                if lines:
                    db.execute("INSERT OR REPLACE INTO files (id, owner, filename, purpose, bytes, created_at) "
                               "VALUES (?, ?, ?, 'batch_output', ?, ?)", (file_id, batch.owner, f"{file_id}.jsonl",
                                                                          self.file_path(file_id).stat().st_size,
                                                                          int(now)))
            db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
        return True

    def _write_outputs(self, db: sqlite3.Connection, batch: StoredBatch, status: str, out_id: str,
                       err_id: str) -> tuple[int, int]:
        """The output and error files' lines written (each file only where it has some); how many of each."""
        rows = db.execute("SELECT line, ok, text FROM results WHERE batch_id = ? ORDER BY line", (batch.id,))
        not_run = NOT_RUN.get(status)
        paths = {True: self.file_path(out_id), False: self.file_path(err_id)}
        counts = {True: 0, False: 0}
        with contextlib.ExitStack() as stack:
            sinks: dict[bool, IO[str]] = {}  # each file opened (0600, in place of an earlier one) at its first line
            pending = next(rows, None)
            for number, raw in iter_lines(self.file_path(batch.input_file_id)):
                while pending is not None and pending[0] < number:
                    pending = next(rows, None)
                if pending is not None and pending[0] == number:
                    ok, text = bool(pending[1]), pending[2]
                elif not_run is not None:
                    ok, text = False, not_run_line(parse_line(number, raw).custom_id, *not_run)
                else:
                    continue
                if ok not in sinks:
                    fd = os.open(paths[ok], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    sinks[ok] = stack.enter_context(os.fdopen(fd, "w", encoding="utf-8"))
                sinks[ok].write(text + "\n")
                counts[ok] += 1
        return counts[True], counts[False]

    def _page(self, table: str, owner: str, after: str | None, limit: int, ascending: bool,
              where: tuple[str, str] | None) -> list[sqlite3.Row]:
        """Up to limit + 1 of the owner's rows of `table` in `seq` order, after the row whose id is `after`."""
        sql, values = f"SELECT * FROM {table} WHERE owner = ?", [owner]
        if where is not None:
            sql, values = sql + f" AND {where[0]} = ?", [*values, where[1]]
        if after is not None:
            sql += f" AND seq {'>' if ascending else '<'} (SELECT seq FROM {table} WHERE id = ? AND owner = ?)"
            values += [after, owner]
        sql += f" ORDER BY seq {'ASC' if ascending else 'DESC'} LIMIT ?"
        with self._db() as db:  # (table and column names are this module's own)
            return db.execute(sql, (*values, limit + 1)).fetchall()


def not_run_line(custom_id: str, code: str, message: str) -> str:
    """An error-file line for a request that was never executed."""
    return json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}})


def _file(row: sqlite3.Row) -> StoredFile:
    return StoredFile(row["id"], row["owner"], row["filename"], row["purpose"], row["bytes"], row["created_at"],
                      InputSummary.loads(row["summary"]) if row["summary"] else None)


def _marks(values: Iterable[object]) -> str:
    return ", ".join("?" for _ in values)


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
