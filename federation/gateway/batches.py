"""OpenAI's Batch API at the gateway's base URL, so a tool hands fedpool a whole workload at once:

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files   GET|DELETE /v1/files/{id}   GET .../content
    POST /v1/batches   GET /v1/batches (after, limit)   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

Objects, statuses and output lines are OpenAI's; a batch's run is the batch runner's (clients/batchrunner.py), told
of each new or cancelled batch through the callbacks given here. Every file and batch belongs to the client that
made it (the gateway's name for its caller: with API keys, the key's client) and no other client sees it. A bad
input is refused whole, in OpenAI's error shape with the line it is on (`line`, and in the message). At submit the
batch carries an estimate of when it ends (`fedpool.estimate`): a completion_window it cannot meet is said then,
not found at expiry."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from aiohttp import BodyPartReader, web

from fedpool.federation.core.dispatcher import Dispatcher
from fedpool.federation.gateway.answers import loads
from fedpool.federation.gateway.batchstore import (
    ENDPOINTS,
    FINAL,
    BatchStore,
    FileInUse,
    InputSummary,
    LineError,
    StoredBatch,
    StoredFile,
    scan_input,
)
from fedpool.federation.gateway.handlers import Gateway
from fedpool.federation.gateway.state import SHARED_CLIENT
from fedpool.registry import PoolSnapshot

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit on a batch input file
MAX_LINES = 50_000  # and on a batch's requests
MAX_WINDOW_S = 30 * 86_400
WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
CHUNK_BYTES = 1 << 16
DRAIN_BYTES = 1 << 30  # the most of a refused upload read on (so the caller sees the refusal, not a reset)


class BatchesApi:
    """The files and batches routes over one store. `started(batch_id)` and `cancelled(batch_id)` tell the runner."""

    def __init__(self, gateway: Gateway, dispatcher: Dispatcher, store: BatchStore,
                 snapshot: Callable[[], PoolSnapshot | None], *, started: Callable[[str], None],
                 cancelled: Callable[[str], None], max_file_bytes: int = MAX_FILE_BYTES, max_lines: int = MAX_LINES,
                 clock: Callable[[], float] = time.time):
        self._gateway, self._dispatcher, self.store, self._snapshot = gateway, dispatcher, store, snapshot
        self._started, self._cancelled = started, cancelled
        self.max_file_bytes, self.max_lines = max_file_bytes, max_lines
        self._clock = clock

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self._upload)
        app.router.add_get("/v1/files", self._list_files)
        app.router.add_get("/v1/files/{file_id}", self._get_file)
        app.router.add_delete("/v1/files/{file_id}", self._delete_file)
        app.router.add_get("/v1/files/{file_id}/content", self._content)
        app.router.add_post("/v1/batches", self._create)
        app.router.add_get("/v1/batches", self._list_batches)
        app.router.add_get("/v1/batches/{batch_id}", self._get_batch)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self._cancel)

    def _owner(self, request: web.Request) -> str | web.Response:
        """The caller's client name, or the refusal: no valid key (401), or no name of its own (past the gateway's
        cap on client ids, callers share one: their files would be each other's)."""
        owner = self._gateway.client_of(request)
        if owner == SHARED_CLIENT:
            return refuse(429, "the gateway tells too many clients apart to keep files for a new one; retry later, "
                          "or present an API key", "rate_limit_error", code="too_many_clients")
        return owner

    # ---- files ------------------------------------------------------------------------------------------------
    async def _upload(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        if isinstance(owner, web.Response):
            return owner
        received: Path | None = None
        try:
            form = await self._read_form(request)
            if isinstance(form, web.Response):
                return form
            purpose, filename, received = form
            summary = await asyncio.to_thread(scan_input, received, self.max_lines)
            stored = await asyncio.to_thread(self.store.add_file, owner, filename, purpose, received, summary,
                                             self._clock())
            received = None  # (moved into the store)
            return web.json_response(stored.as_json())
        except LineError as exc:
            return line_refusal(exc, "file")
        finally:
            if received is not None:
                await asyncio.to_thread(received.unlink, True)

    async def _read_form(self, request: web.Request) -> tuple[str, str, Path] | web.Response:
        """(Purpose, filename, where the file was received) of an upload, or the refusal (the file, if any was
        received, removed)."""
        try:
            reader = await request.multipart()
        except (AssertionError, ValueError, KeyError):
            return refuse(400, "expected multipart/form-data with the fields 'file' and 'purpose'", param="file")
        purpose: str | None = None
        filename, received = "", None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.text())[:64]
            elif part.name == "file" and received is None:
                filename = (part.filename or "batch.jsonl")[:256]
                got = await self._receive(part)
                if isinstance(got, web.Response):
                    return got
                received = got
            else:
                await part.release()
        problem = None if received is not None else refuse(400, "the field 'file' is required", param="file")
        if problem is None and purpose != "batch":
            problem = refuse(400, f"purpose must be 'batch' (this gateway keeps files for the Batch API only), not "
                             f"{purpose!r}", param="purpose", code="invalid_purpose")
        if problem is not None:
            if received is not None:
                await asyncio.to_thread(received.unlink, True)
            return problem
        assert received is not None and purpose is not None
        return purpose, filename, received

    async def _receive(self, part: BodyPartReader) -> Path | web.Response:
        """The file part written to the store's uploads (0600); past `max_file_bytes`, a 413 naming the line it was on
        (the rest is read and dropped, so the caller reads the refusal instead of a reset connection)."""
        path = self.store.upload_path()
        size = newlines = 0
        line: int | None = None
        try:
            with await asyncio.to_thread(_private_file, path) as fh:
                while chunk := await part.read_chunk(CHUNK_BYTES):
                    if size + len(chunk) > self.max_file_bytes:
                        line = newlines + chunk[:self.max_file_bytes - size].count(b"\n") + 1
                        break
                    size += len(chunk)
                    newlines += chunk.count(b"\n")
                    await asyncio.to_thread(fh.write, chunk)
        except BaseException:  # (the caller went away mid-upload: nothing of it is kept)
            await asyncio.to_thread(path.unlink, True)
            raise
        if line is None:
            return path
        await asyncio.to_thread(path.unlink, True)
        drained = 0
        while drained < DRAIN_BYTES and (chunk := await part.read_chunk(CHUNK_BYTES)):
            drained += len(chunk)
        return refuse(413, f"line {line}: the file is larger than {self.max_file_bytes} bytes, the most a batch input "
                      "file may be", param="file", code="file_too_large", line=line)

    async def _list_files(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        if isinstance(owner, web.Response):
            return owner
        limit = _limit(request, 10_000, 10_000)
        if isinstance(limit, web.Response):
            return limit
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            return refuse(400, f"order must be 'asc' or 'desc', not {order[:20]!r}", param="order")
        files, more = await asyncio.to_thread(self.store.files, owner, purpose=request.query.get("purpose"),
                                              after=request.query.get("after"), limit=limit,
                                              ascending=order == "asc")
        return _page([f.as_json() for f in files], more)

    async def _get_file(self, request: web.Request) -> web.Response:
        found = await self._file_of(request)
        return found if isinstance(found, web.Response) else web.json_response(found)

    async def _file_of(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The caller's file named in the path (OpenAI's File object), or the refusal."""
        owner = self._owner(request)
        if isinstance(owner, web.Response):
            return owner
        file_id = request.match_info["file_id"]
        stored = await asyncio.to_thread(self.store.file, file_id, owner)
        return stored.as_json() if stored is not None else _no_such("File", file_id)

    async def _content(self, request: web.Request) -> web.StreamResponse:
        found = await self._file_of(request)
        if isinstance(found, web.Response):
            return found
        return web.FileResponse(self.store.file_path(found["id"]),
                                headers={"Content-Type": "application/octet-stream"})

    async def _delete_file(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        if isinstance(owner, web.Response):
            return owner
        file_id = request.match_info["file_id"]
        try:
            gone = await asyncio.to_thread(self.store.delete_file, file_id, owner)
        except FileInUse as exc:
            return refuse(409, str(exc), param="file_id", code="file_in_use")
        if not gone:
            return _no_such("File", file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    # ---- batches ----------------------------------------------------------------------------------------------
    async def _create(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        if isinstance(owner, web.Response):
            return owner
        try:
            body = loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            return refuse(400, "request body is not valid JSON")
        asked = _batch_fields(body)
        if isinstance(asked, web.Response):
            return asked
        file_id, endpoint, window, metadata = asked
        source = await asyncio.to_thread(self.store.file, file_id, owner)
        if source is None:
            return _no_such("File", file_id, param="input_file_id")
        if source.purpose != "batch" or source.summary is None:
            return refuse(400, f"file {file_id} is not a batch input file (purpose {source.purpose!r})",
                          param="input_file_id", code="invalid_input_file")
        problem = self._unservable(source.summary, endpoint)
        if problem is not None:
            return problem
        estimate = await self.estimate(source.summary, window[1])
        # Kept and started together, even if the caller goes away meanwhile (its handler cancelled).
        batch = await asyncio.shield(self._keep(owner, source, endpoint, window, metadata, estimate))
        return web.json_response(batch.as_json())

    async def _keep(self, owner: str, source: StoredFile, endpoint: str, window: tuple[str, float],
                    metadata: dict[str, str] | None, estimate: dict[str, Any]) -> StoredBatch:
        """A new batch kept in the store, and its runner told."""
        batch = await asyncio.to_thread(self.store.create_batch, owner, source, endpoint, window, metadata, estimate,
                                        self._clock())
        self._started(batch.id)
        return batch

    def _unservable(self, summary: InputSummary, endpoint: str) -> web.Response | None:
        """The refusal of a batch whose lines ask another endpoint than the batch's, or a model the pool does not
        serve (None: it can run)."""
        for url, line in sorted(summary.urls.items(), key=lambda item: item[1]):
            if url != endpoint:
                return line_refusal(LineError(line, f"url {url} is not the batch's endpoint {endpoint}", param="url",
                                              code="mismatched_endpoint"), "batch")
        served = self._gateway.facts().served
        if summary.model not in served:
            first = min(summary.urls.values())
            return line_refusal(LineError(first, f"the model `{summary.model}` does not exist: no registered server "
                                          f"serves it (served: {', '.join(sorted(served)) or 'none'})",
                                          param="body.model", code="model_not_found"), "batch", status=404)
        return None

    async def estimate(self, summary: InputSummary, window_s: float) -> dict[str, Any]:
        """When a new batch of this shape would end: its work and that of the shorter batches before it (shortest
        first), at the rate the pool has served work so far (its answers' work per slot-second × the slots of the
        model's servers). None until the pool has answered something."""
        active = await asyncio.to_thread(self.store.active)
        mine = summary.lines * summary.work_each
        ahead = [b.left * b.work_each for b in active if b.model == summary.model and b.left * b.work_each <= mine]
        work, slot_s, _ = self._dispatcher.served_totals()
        slots = model_slots(self._snapshot(), summary.model)
        if work <= 0 or slot_s <= 0 or slots <= 0:
            return {"seconds": None, "meets_window": None, "shorter_batches_ahead": len(ahead),
                    "note": "no estimate yet: the pool has answered nothing to measure its rate by"}
        seconds = (mine + sum(ahead)) / (work / slot_s * slots)
        meets = seconds <= window_s
        note = (f"about {_duration(seconds)} at the pool's rate so far"
                + (f", after {len(ahead)} shorter batch(es)" if ahead else "")
                + ("" if meets else f": longer than its completion_window of {_duration(window_s)}; requests not "
                   "executed by then end in the error file as batch_expired"))
        return {"seconds": round(seconds, 1), "meets_window": meets, "shorter_batches_ahead": len(ahead),
                "note": note}

    async def _list_batches(self, request: web.Request) -> web.Response:
        owner = self._owner(request)
        if isinstance(owner, web.Response):
            return owner
        limit = _limit(request, 20, 100)
        if isinstance(limit, web.Response):
            return limit
        batches, more = await asyncio.to_thread(self.store.batches, owner, after=request.query.get("after"),
                                                limit=limit)
        return _page([b.as_json() for b in batches], more)

    async def _batch_of(self, request: web.Request) -> StoredBatch | web.Response:
        """The caller's batch named in the path, or the refusal."""
        owner = self._owner(request)
        if isinstance(owner, web.Response):
            return owner
        batch_id = request.match_info["batch_id"]
        batch = await asyncio.to_thread(self.store.batch, batch_id, owner)
        return batch if batch is not None else _no_such("Batch", batch_id, param="batch_id")

    async def _get_batch(self, request: web.Request) -> web.Response:
        batch = await self._batch_of(request)
        return batch if isinstance(batch, web.Response) else web.json_response(batch.as_json())

    async def _cancel(self, request: web.Request) -> web.Response:
        batch = await self._batch_of(request)
        if isinstance(batch, web.Response):
            return batch
        if batch.status in ("validating", "in_progress"):
            await asyncio.shield(self._cancel_run(batch.id))
            batch = await asyncio.to_thread(self.store.batch, batch.id, None) or batch
        if batch.status in FINAL or batch.status == "finalizing":
            return refuse(409, f"cannot cancel batch {batch.id}: its status is {batch.status!r}", param="batch_id",
                          code="batch_not_cancellable")
        return web.json_response(batch.as_json())

    async def _cancel_run(self, batch_id: str) -> None:
        """The batch set cancelling (if it still runs) and its runner told, together."""
        if await asyncio.to_thread(self.store.set_status, batch_id, "cancelling", self._clock(),
                                   ("validating", "in_progress")):
            self._cancelled(batch_id)


def _private_file(path: Path) -> BinaryIO:
    """A new file only this user may read (an upload carries the caller's prompts)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def model_slots(snapshot: PoolSnapshot | None, model: str) -> int:
    """The slots of the servers that serve `model` in the snapshot."""
    return sum(e.capacity for e in snapshot.entries if e.record.model == model) if snapshot is not None else 0


def _batch_fields(body: object) -> tuple[str, str, tuple[str, float], dict[str, str] | None] | web.Response:
    """(input_file_id, endpoint, (completion_window, its seconds), metadata) of a batch's creation, or the refusal."""
    if not isinstance(body, dict):
        return refuse(400, "request body must be a JSON object")
    file_id, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
    if not isinstance(file_id, str) or not file_id:
        return refuse(400, "'input_file_id' (a string) is required", param="input_file_id")
    if endpoint not in ENDPOINTS:
        return refuse(400, f"endpoint must be one of {', '.join(ENDPOINTS)} (what this gateway serves), not "
                      f"{str(endpoint)[:80]!r}", param="endpoint", code="invalid_endpoint")
    match = WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match.group(1)) * UNIT_S[match.group(2)] if match else 0
    if match is None or seconds > MAX_WINDOW_S:
        return refuse(400, f"completion_window must be a duration such as '24h' (a whole number of s, m, h or d, up "
                      f"to 30d), not {str(window)[:40]!r}", param="completion_window", code="invalid_window")
    metadata = body.get("metadata")
    if metadata is not None and not _good_metadata(metadata):
        return refuse(400, "metadata must be at most 16 string values, keys up to 64 characters and values up to 512",
                      param="metadata", code="invalid_metadata")
    return file_id, str(endpoint), (str(window), float(seconds)), metadata


def _good_metadata(metadata: object) -> bool:
    return isinstance(metadata, dict) and len(metadata) <= 16 and all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())


def _limit(request: web.Request, default: int, most: int) -> int | web.Response:
    """The `limit` query parameter (1 to `most`), or the refusal."""
    raw = request.query.get("limit")
    try:
        limit = default if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        return refuse(400, f"limit must be a whole number from 1 to {most}, not {str(raw)[:20]!r}", param="limit")
    return limit


def _page(data: list[dict[str, Any]], more: bool) -> web.Response:
    """OpenAI's cursor page: the SDK asks for the next one `after` the last id while `has_more`."""
    return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": more})


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _no_such(kind: str, object_id: str, *, param: str | None = None) -> web.Response:
    return refuse(404, f"No such {kind} object: {object_id[:100]}", param=param or f"{kind.lower()}_id",
                  code=f"{kind.lower()}_not_found")


def line_refusal(exc: LineError, what: str, *, status: int = 400) -> web.Response:
    """A file or batch refused for one of its lines (or, line None, for the whole file)."""
    return refuse(status, f"the {what} is refused: {exc}", param=exc.param, code=exc.code, line=exc.line)


def refuse(status: int, message: str, kind: str = "invalid_request_error", *, param: str | None = None,
           code: str | None = None, line: int | None = None) -> web.Response:
    """OpenAI's error shape; with the input line the error is about, as OpenAI's batch errors name it."""
    error: Mapping[str, object] = {"message": message, "type": kind, "param": param, "code": code,
                                   **({"line": line} if line is not None else {})}
    return web.json_response({"error": error}, status=status)
