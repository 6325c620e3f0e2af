"""A blocking client of the gateway's Batch API (federation/gateway/batches.py) for `fedpool batch`: submit (upload
and create), list, show, cancel, wait with a progress bar and an ETA, download the output and error files; and the
text those commands print. Standard library only, as the jobs client. It presents the same identity every time:
the API key when it has one, else `X-Fedpool-Client: NAME`, so a gateway without keys knows its batches as one
caller's. A refusal is a BatchError with the gateway's message (it names the input line); a gateway that does not
answer is GatewayUnreachable."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Literal, TextIO

FINAL = ("completed", "failed", "expired", "cancelled")
CLIENT_HEADER = "X-Fedpool-Client"  # the gateway's name for a caller without a key (federation/gateway CLIENT_HEADER)
NOT_FOUND_CODES = ("file_not_found", "batch_not_found", "model_not_found")
CHUNK_BYTES = 1 << 16
BAR_WIDTH = 24
POLL_S = 1.0
Kind = Literal["input", "unavailable", "refused"]


class BatchError(Exception):
    """A refusal: the gateway's (with its HTTP status), or a bad argument found before asking it. `kind`: "input"
    (the caller's file or arguments are at fault: the gateway's 400 and 413), "unavailable" (the pool serves no
    Batch API, or not the file's model) or "refused" (an unknown id, a batch that has ended, a wrong key)."""

    def __init__(self, message: str, *, status: int | None = None, kind: Kind = "refused"):
        super().__init__(message)
        self.status, self.kind = status, kind


class GatewayUnreachable(ConnectionError):
    """No gateway answered at the URL."""


class BatchClient:
    """`BatchClient("http://127.0.0.1:8080", api_key=None, client_name="me").submit(path, "/v1/completions")`."""

    def __init__(self, url: str, *, api_key: str | None = None, client_name: str = "fedpool-cli",
                 timeout_s: float = 60.0):
        self.url = url.rstrip("/").removesuffix("/v1")  # the base URL, given with or without its /v1
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {CLIENT_HEADER: client_name}
        self._timeout_s = timeout_s

    @contextlib.contextmanager
    def _open(self, method: str, path: str, data: bytes | Iterator[bytes] | None = None,
              headers: dict[str, str] | None = None) -> Iterator[IO[bytes]]:
        """The gateway's answer to one call, open; BatchError for a refusal, GatewayUnreachable when none came."""
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={**self._headers, **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                yield response
        except urllib.error.HTTPError as exc:
            raise refusal(exc.code, exc.read(), f"{method} {path}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise GatewayUnreachable(f"cannot reach the gateway at {self.url} ({reason}); is its pool up? (`fedpool "
                                     "up`, or `fedpool gateway --batches-dir DIR`)") from None

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        with self._open(method, path, data, {"Content-Type": "application/json"} if data else None) as response:
            answer: dict[str, Any] = json.loads(response.read())
        return answer

    def upload(self, path: Path) -> dict[str, Any]:
        """The file, uploaded for a batch (OpenAI's File object)."""
        boundary = f"fedpool-{secrets.token_hex(12)}"
        name = path.name.replace('"', "_").replace("\r", "_").replace("\n", "_")
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
                f'Content-Disposition: form-data; name="file"; filename="{name}"\r\n'
                "Content-Type: application/jsonl\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        with path.open("rb") as fh:  # (a missing or unreadable file is said before the gateway is asked)
            size = os.fstat(fh.fileno()).st_size
            headers = {"Content-Type": f"multipart/form-data; boundary={boundary}",
                       "Content-Length": str(len(head) + size + len(tail))}
            with self._open("POST", "/v1/files", _streamed(head, fh, tail), headers) as response:
                answer: dict[str, Any] = json.loads(response.read())
        return answer

    def submit(self, path: Path, endpoint: str, window: str = "24h",
               metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """A new batch of the requests in `path` (its Batch object). The upload is deleted again if the batch is
        refused, so nothing is left half-accepted."""
        uploaded = self.upload(path)
        try:
            return self._json("POST", "/v1/batches", {"input_file_id": uploaded["id"], "endpoint": endpoint,
                                                      "completion_window": window, "metadata": metadata or None})
        except BatchError:
            with contextlib.suppress(BatchError, GatewayUnreachable):
                self._json("DELETE", f"/v1/files/{uploaded['id']}")
            raise

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/batches/{_quoted(batch_id)}")

    def page(self, *, after: str | None = None, limit: int = 100) -> dict[str, Any]:
        """A page of this caller's batches, newest first (`data`, `has_more`, `last_id`)."""
        query = urllib.parse.urlencode({"limit": limit, **({"after": after} if after else {})})
        return self._json("GET", f"/v1/batches?{query}")

    def every(self) -> list[dict[str, Any]]:
        """All this caller's batches, newest first, page after page."""
        batches: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            got = self.page(after=after)
            batches += got["data"]
            if not got.get("has_more") or not got["data"]:
                return batches
            after = got["last_id"]

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/batches/{_quoted(batch_id)}/cancel")

    def wait(self, batch_id: str, on_progress: Callable[[dict[str, Any]], None] | None = None, *,
             poll_s: float = POLL_S, sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
        """The batch once it has ended; `on_progress` is given it at every poll."""
        while True:
            batch = self.get(batch_id)
            if on_progress is not None:
                on_progress(batch)
            if batch["status"] in FINAL:
                return batch
            sleep(poll_s)

    def download(self, batch_id: str, out_dir: Path) -> dict[str, str]:
        """The batch's output and error files written to `out_dir` (BATCH_ID.output.jsonl, BATCH_ID.errors.jsonl):
        {"output": path, "errors": path} for those it has. BatchError while it has not ended."""
        batch = self.get(batch_id)
        if batch["status"] not in FINAL:
            raise BatchError(f"batch {batch_id} is {batch['status']}: its output and error files are written when "
                             f"it ends (`fedpool batch submit --wait`, or `fedpool batch show {batch_id}`)")
        written = {}
        for kind, file_id in (("output", batch.get("output_file_id")), ("errors", batch.get("error_file_id"))):
            if file_id:
                written[kind] = str(self._save(file_id, out_dir / f"{batch_id}.{kind}.jsonl"))
        return written

    def _save(self, file_id: str, path: Path) -> Path:
        """A file's content written to `path` whole (a partial download leaves nothing there)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.part")
        try:
            with self._open("GET", f"/v1/files/{_quoted(file_id)}/content") as response, part.open("wb") as fh:
                while chunk := response.read(CHUNK_BYTES):
                    fh.write(chunk)
            part.replace(path)
        finally:
            part.unlink(missing_ok=True)
        return path


def _streamed(head: bytes, fh: IO[bytes], tail: bytes) -> Iterator[bytes]:
    """A multipart body read from the file as it is sent."""
    yield head
    while chunk := fh.read(CHUNK_BYTES):
        yield chunk
    yield tail


def _quoted(object_id: str) -> str:
    return urllib.parse.quote(object_id, safe="")


def refusal(status: int, raw: bytes, call: str) -> BatchError:
    """The gateway's refusal as a BatchError: its OpenAI-shaped message, or, for a route it does not have, that it
    serves no Batch API."""
    try:
        error = json.loads(raw)["error"]
        message, code = str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = raw.decode("utf-8", "replace")[:500] or f"HTTP {status}", None
    if status in (404, 405) and code not in NOT_FOUND_CODES:
        return BatchError(f"the gateway serves no Batch API ({call}: {message}); serve one with `fedpool up`, or "
                          "`fedpool gateway --batches-dir DIR`", status=status, kind="unavailable")
    kind: Kind = "input" if status in (400, 413) else "unavailable" if code == "model_not_found" else "refused"
    return BatchError(f"gateway: {message}", status=status, kind=kind)


def key_values(items: Sequence[str]) -> dict[str, str]:
    """KEY=VALUE items (`--metadata`) as a mapping; BatchError naming the first that is not one."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BatchError(f"--metadata: expected KEY=VALUE, got {item!r}", kind="input")
        out[key] = value
    return out


# ---- what the commands print -----------------------------------------------------------------------------------
HEADER = f"{'ID':<32}  {'STATUS':<11}  {'DONE/TOTAL':>11}  {'FAILED':>6}  {'ENDPOINT':<20}  MODEL"


def counts(batch: dict[str, Any]) -> tuple[int, int, int]:
    """(Completed, failed, total) requests."""
    c = batch.get("request_counts") or {}
    return int(c.get("completed", 0)), int(c.get("failed", 0)), int(c.get("total", 0))


def batch_line(batch: dict[str, Any]) -> str:
    done, failed, total = counts(batch)
    return (f"{batch['id']:<32}  {batch['status']:<11}  {f'{done + failed}/{total}':>11}  {failed:>6}  "
            f"{batch['endpoint']:<20}  {batch.get('model') or ''}").rstrip()


def batch_text(batch: dict[str, Any]) -> str:
    """One batch as `batch show` prints it: its line, its files, its estimate and what went wrong."""
    lines = [HEADER, batch_line(batch), f"  input file: {batch['input_file_id']}; completion window "
             f"{batch['completion_window']}; created {_when(batch['created_at'])}"]
    if batch.get("output_file_id") or batch.get("error_file_id"):
        lines.append(f"  output file: {batch.get('output_file_id') or '-'}; error file: "
                     f"{batch.get('error_file_id') or '-'} (`fedpool batch download {batch['id']}`)")
    estimate = (batch.get("fedpool") or {}).get("estimate") or {}
    if estimate.get("note") and batch["status"] not in FINAL:
        lines.append(f"  estimate: {estimate['note']}")
    if batch.get("metadata"):
        lines.append("  metadata: " + ", ".join(f"{k}={v}" for k, v in batch["metadata"].items()))
    lines += [f"  error: {e.get('message')}" for e in ((batch.get("errors") or {}).get("data") or [])]
    return "\n".join(lines)


def list_text(listed: dict[str, Any]) -> str:
    """The batches as `batch list` prints them."""
    if not listed["batches"]:
        return "(no batches; submit one with `fedpool batch submit FILE --endpoint /v1/chat/completions`)"
    return "\n".join([HEADER, *map(batch_line, listed["batches"])])


def submit_notes(batch: dict[str, Any], waiting: bool) -> list[str]:
    """What `batch submit` says on stderr: the estimate of a batch that will not end within its completion window
    (said now, not found at expiry), and what --wait waits for."""
    estimate = (batch.get("fedpool") or {}).get("estimate") or {}
    notes = [estimate["note"]] if estimate.get("meets_window") is False else []
    if waiting:
        notes.append(f"{batch['id']}: {counts(batch)[2]} requests; waiting (Ctrl-C stops the waiting, not the batch)")
    return notes


def outcome(batch: dict[str, Any]) -> str:
    """Where a batch is: "running" (it has not ended), "completed" (every request answered), "incomplete"
    (completed, some requests failed: their errors are in its error file), or failed, expired or cancelled."""
    if batch["status"] not in FINAL:
        return "running"
    return "incomplete" if batch["status"] == "completed" and counts(batch)[1] else str(batch["status"])


def _when(stamp: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp else "-"


class ProgressBar:
    """`--wait`'s display of a batch: a bar, done/total, the rate and an ETA, redrawn in place on a terminal and a
    line at each change otherwise (a log, a pipe)."""

    def __init__(self, out: TextIO = sys.stderr, clock: Callable[[], float] = time.time):
        self._out, self._clock = out, clock
        self._live = out.isatty()
        self._last = ""

    def __call__(self, batch: dict[str, Any]) -> None:
        line = self.line(batch)
        if self._live:
            end = "\n" if batch["status"] in FINAL else ""
            print(f"\r{line:<{len(self._last)}}", end=end, file=self._out, flush=True)
        elif line.split(" ETA")[0] != self._last.split(" ETA")[0]:
            print(line, file=self._out, flush=True)
        self._last = line

    def line(self, batch: dict[str, Any]) -> str:
        done, failed, total = counts(batch)
        ended = done + failed
        filled = round(BAR_WIDTH * ended / total) if total else 0
        started = batch.get("in_progress_at")
        elapsed = self._clock() - started if started else 0.0
        rate = ended / elapsed if ended and elapsed > 0 else None
        if batch["status"] in FINAL:
            eta = "done"
        elif rate is not None:
            eta = f"ETA {_seconds((total - ended) / rate)}"
        else:
            estimate = ((batch.get("fedpool") or {}).get("estimate") or {}).get("seconds")
            eta = f"ETA ~{_seconds(estimate)} (estimate)" if estimate is not None else "ETA -"
        return (f"{batch['id']} {batch['status']:<11} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                f"{ended}/{total} ({failed} failed) {f'{rate:.1f}/s' if rate is not None else '-/s'} {eta}")


def _seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
