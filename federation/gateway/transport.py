"""The Transport over HTTP: how the dispatcher reaches a server, a plain answer end to end in this file.

A plain (unstreamed) answer goes over fedpool's own keep-alive HTTP/1.1 pool: asyncio protocols with httptools'
parser, one write of a prepared head and the body, four parser callbacks filling its answer. A connection is idle
in the pool or carries one request: `post` gives it back once, after a whole answer that allows another; anything
else closes it. 1xx answers are skipped; idle connections close after `idle_s`; a close before a whole answer is
classed by `_Connection._lost`. Streams, aborts, TLS and the rest go over aiohttp (unpooled.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import aiohttp
import httptools
import orjson

from fedpool.federation.core.errors import AttemptError, FailureKind
from fedpool.federation.core.types import TYPED_FIELDS, Completion, Endpoint, InferenceRequest, Timeouts
from fedpool.federation.gateway import unpooled
from fedpool.federation.gateway.answers import MAX_RESPONSE_BYTES, STREAM_USAGE, dumps, engine_times
from fedpool.federation.gateway.unpooled import (
    ABORTED_AFTER,
    MAX_ERROR_BODY_BYTES,
    STALE_CLOSE_S,
    Destination,
    http_error,
    plain_destination,
)

if TYPE_CHECKING:
    from fedpool.federation.core.types import StreamProgress, Target

log = logging.getLogger("fedpool.transport")

IDLE_S = 15.0  # aiohttp's keep-alive time too
MAX_TARGETS = 4096  # parsed URLs kept (servers × endpoints); cleared whole past it
SWEEP_SLACK_S = 0.001  # an idle connection this close to its time is closed by the sweep that is due now
_PARSER_ERRORS = (httptools.HttpParserError, httptools.HttpParserUpgrade)  # (a 101's switch: not HTTP any more)


class HttpTransport:
    """The Transport over one shared aiohttp session (no connection cap: admission windows bound the load). On an
    engine that aborts a request by id (`Target.abort_path`: SGLang, which notices a closed connection only at its
    next check), each attempt carries an id of its own (`rid`), and one cancelled before its answer is aborted."""

    def __init__(self, session: aiohttp.ClientSession, timeouts: Timeouts | None = None):
        self.session = session
        self.timeouts = timeouts or Timeouts()
        self._timeout = unpooled.client_timeout(self.timeouts)
        self._whole_timeout = unpooled.whole_answer_timeout(self.timeouts)
        self._whole_s = min(self.timeouts.first_byte_s, self.timeouts.total_s)
        self._keepalive = pool_of(session)
        self._destinations: dict[str, Destination] = {}  # URLs the pool serves, parsed (`_destination`)
        self._rid_prefix = f"fedpool-{secrets.token_hex(6)}-"  # ids unique across processes sharing an engine
        self._rids = itertools.count()
        self.aborts = unpooled.Aborts(session)  # abort calls to engines (`aborts.reached`: those that got there)

    async def complete(
        self, server: Target, request: InferenceRequest, progress: StreamProgress | None = None
    ) -> Completion:
        """POST the request; return the parsed completion (with the engine's bytes) or raise AttemptError. On a
        server whose engine is asked for streams, a request a stream can carry whole (`InferenceRequest.streamable`)
        is sent with stream=true and its events assembled into the completion. A plain answer goes over the
        keep-alive pool where the session has one and it serves the URL, over aiohttp's client otherwise."""
        if server.streamed and request.streamable:  # (the engine is asked for streams, and a stream carries it)
            return await self._assembled(server, request, progress)
        body = request_body(request)
        abort_path = server.abort_path
        rid = ""
        if abort_path is not None:
            body["rid"] = rid = f"{self._rid_prefix}{next(self._rids)}"
        try:
            data = orjson.dumps(body)
        except TypeError:  # what orjson refuses (integers past 64 bits, keys that are not strings)
            data = json.dumps(body).encode()
        url = server.url + request.endpoint
        pool = self._keepalive
        destination = self._destinations.get(url) or self._destination(url)
        try:
            if pool is None or destination is None:  # (no pool, or a URL it does not serve: TLS, credentials)
                raw = await unpooled.post_unpooled(self.session, url, data, self._whole_timeout, MAX_RESPONSE_BYTES)
            else:
                answer = await pool.post(destination, data, timeout_s=self._whole_s,
                                         connect_s=self.timeouts.connect_s, limit=MAX_RESPONSE_BYTES)
                if answer.status != 200:
                    raise http_error(answer.status, answer.body[:MAX_ERROR_BODY_BYTES])
                raw = answer.body
        except AttemptError as exc:
            if abort_path is not None and exc.kind in ABORTED_AFTER:  # (the engine may still be running it)
                self.aborts.start(server.url + abort_path, rid)
            raise
        except asyncio.CancelledError:
            if abort_path is not None:
                self.aborts.start(server.url + abort_path, rid)
            raise
        return parse_completion(raw, request.endpoint)

    def _destination(self, url: str) -> Destination | None:
        """The pool's destination for a URL it serves, kept here after the first ask (None: aiohttp's URL)."""
        destination = self._keepalive.destination(url) if self._keepalive is not None else None
        if destination is not None:
            if len(self._destinations) >= MAX_TARGETS:
                self._destinations.clear()
            self._destinations[url] = destination
        return destination

    async def settle(self) -> None:
        """Wait for the abort calls under way to end."""
        await self.aborts.settle()

    async def _assembled(
        self, server: Target, request: InferenceRequest, progress: StreamProgress | None
    ) -> Completion:
        body = request_body(request, stream=True)
        body["stream_options"] = STREAM_USAGE
        return await unpooled.post_assembled(self.session, server.url + request.endpoint, dumps(body), self._timeout,
                                    request.endpoint, progress)

    async def open_stream(self, server: Target, request: InferenceRequest) -> aiohttp.ClientResponse:
        return await unpooled.open_stream(self.session, server.url + request.endpoint.value,
                                 dumps(request_body(request, stream=True)), self._timeout, close=server.streamed)


def new_session(*, limit: int = 0, keepalive_pool: bool = True) -> aiohttp.ClientSession:
    """The one shared session a dispatcher uses (no global connection cap; windows bound the load). Its plain
    answers go over fedpool's keep-alive pool; with `keepalive_pool=False` (or a cap) every request is aiohttp's."""
    return aiohttp.ClientSession(
        connector=unpooled.PooledConnector(KeepAlivePool() if keepalive_pool and not limit else None, limit=limit,
                                  ttl_dns_cache=300),
        trace_configs=[unpooled.reuse_tracing()],
    )


async def post_completion(
    session: aiohttp.ClientSession, base_url: str, request: InferenceRequest, timeouts: Timeouts
) -> Completion:
    """POST the request to one server outside any dispatcher; the parsed completion, or AttemptError."""
    return await HttpTransport(session, timeouts).complete(unpooled.UrlTarget(base_url, base_url), request)


def request_body(request: InferenceRequest, stream: bool = False) -> dict[str, Any]:
    """The OpenAI body of a request: its generation fields (typed ones as set, the rest passed through as
    given), prompt or messages, model, stream."""
    params = request.params
    body: dict[str, Any] = dict(params.extra)
    for name in TYPED_FIELDS:
        value = getattr(params, name)
        if value is not None:
            body[name] = list(value) if name == "stop" else value
    prompt = request.prompt
    if prompt is not None:
        body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
    if request.messages is not None:
        body["messages"] = list(request.messages)
    body["model"] = request.model
    body["stream"] = stream
    return body


def parse_completion(raw: bytes, endpoint: Endpoint) -> Completion:
    """Read an OpenAI completion body; anything off-schema is a BAD_RESPONSE, never a crash. The body's bytes
    are kept on the completion (`raw`, with its `model`), for a proxy to pass through as they are."""
    try:
        body = orjson.loads(raw)  # (loads(), inlined: every answer passes here)
    except orjson.JSONDecodeError:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AttemptError(FailureKind.BAD_RESPONSE, f"body is not JSON ({exc.__class__.__name__})") from exc
    if not isinstance(body, dict):
        raise AttemptError(FailureKind.BAD_RESPONSE, "body is not a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise AttemptError(FailureKind.BAD_RESPONSE, "body has no choices")
    choice = choices[0]
    reasoning = None
    if endpoint is Endpoint.CHAT:
        message = choice.get("message")
        if not isinstance(message, dict):
            raise AttemptError(FailureKind.BAD_RESPONSE, "chat choice has no message")
        text = message.get("content")
        reasoning = message.get("reasoning_content")
        if text is None and isinstance(reasoning, str):
            text = ""
    else:
        text = choice.get("text")
    if not isinstance(text, str):
        raise AttemptError(FailureKind.BAD_RESPONSE, "choice has no text")
    usage = body.get("usage")
    prompt_tokens = completion_tokens = None
    if type(usage) is dict:
        prompt_tokens, completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if type(prompt_tokens) is not int:  # (bool is not int here: JSON's true is no count)
            prompt_tokens = None
        if type(completion_tokens) is not int:
            completion_tokens = None
    finish = choice.get("finish_reason")
    model = body.get("model")
    timings, metrics = body.get("timings"), body.get("metrics")
    return Completion(text, finish if type(finish) is str else None, prompt_tokens, completion_tokens,
                      reasoning if type(reasoning) is str else None, raw, model if type(model) is str else None,
                      None if timings is None and metrics is None else engine_times(timings, metrics))


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes  # past the limit: cut there, for a non-200 answer (its message is at the start)


class _Connection(asyncio.Protocol):
    """One TCP connection and its parser; carries one request at a time (`send`, then one outcome on its waiter:
    the answer or an AttemptError)."""

    __slots__ = ("began", "closed", "headers_done", "idle_since", "keep", "key", "limit", "parser", "parts", "pool",
                 "sent_at", "size", "transport", "used", "waiter")

    def __init__(self, pool: KeepAlivePool, key: tuple[str, int]):
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Answer] | None = None  # the request under way; None once it has its outcome
        self.parts: list[bytes] = []
        self.size = 0
        self.limit = 0
        self.sent_at = 0.0  # the loop's time the request was written
        self.began = False  # a byte of an answer (a 1xx's included) arrived: the server took the request
        self.headers_done = False  # the final answer's head is whole
        self.keep = False  # answered whole, open, and the answer allows another request: the pool may keep it
        self.used = False  # carried a request before (a kept connection)
        self.closed = False
        self.idle_since = 0.0

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not asyncio's subclasses)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except _PARSER_ERRORS as exc:  # (garbage with no request under way: closed all the same)
            self._fail(AttemptError(FailureKind.BAD_RESPONSE, f"malformed HTTP answer: {type(exc).__name__} {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.keep = False
        self.pool._forget(self)
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        # An answer without a length ends with the connection (llhttp still holds its head's flags: not keep-alive).
        # A body cut short under `Connection: close` or HTTP/1.0 reads as whole too: httptools cannot say whether
        # its head had a length (the parse of its JSON catches it).
        if self.headers_done and not self.parser.should_keep_alive():
            self.on_message_complete()
            return
        self.waiter = None
        waiter.set_exception(AttemptError(self._lost(), "server closed the connection"))

    # ---- httptools callbacks (the parser calls only those defined)
    def on_message_begin(self) -> None:
        if self.waiter is None:  # an answer nobody asked for (bytes after the last one): the state is unknown
            self.close()
        else:
            self.began = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)
        self.size += len(body)
        if self.size > self.limit:
            self._past_limit()

    def on_message_complete(self) -> None:
        waiter = self.waiter
        if waiter is None:  # the rest of an answer that already failed or was cut, or of one nobody asked for
            return
        status = self.parser.get_status_code()
        if status < 200:  # informational (100 Continue, 103 Early Hints): the answer follows
            self.headers_done = False
            return
        self.waiter = None
        self.keep = not self.closed and self.parser.should_keep_alive()
        parts = self.parts
        if not waiter.done():  # (cancelled: the caller is gone, the connection is still whole)
            waiter.set_result(Answer(status, parts[0] if len(parts) == 1 else b"".join(parts)))

    # ---- the pool's side
    def send(self, data: bytes, limit: int, waiter: asyncio.Future[Answer], now: float) -> None:
        """Write one request (at the loop's time `now`); its answer or failure goes to `waiter`."""
        assert self.waiter is None and self.transport is not None, "one request at a time"
        self.waiter = waiter
        self.parts = []
        self.size = 0
        self.limit = limit
        self.sent_at = now
        self.began = self.headers_done = self.keep = False
        self.transport.write(data)

    def end(self) -> None:
        """After a request that leaves the connection unkept: close it (at once if the request was cut short)."""
        cut = self.waiter is not None
        self.waiter = None
        self.close(abort=cut)

    def close(self, abort: bool = True) -> None:
        """Close at once (`abort`: mid-request, its state unknown) or after what is written."""
        self.keep = False
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                if abort:
                    self.transport.abort()
                else:
                    self.transport.close()

    def _fail(self, error: AttemptError) -> None:
        waiter = self.waiter
        self.waiter = None
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _past_limit(self) -> None:
        """The body passed `limit`: a 200 fails, an error answer is cut there (its message is at the start)."""
        waiter = self.waiter
        if waiter is None:
            return
        status = self.parser.get_status_code()
        if status == 200:
            self._fail(AttemptError(FailureKind.BAD_RESPONSE,
                                    f"response larger than {self.limit // (1024 * 1024)} MiB"))
            return
        self.waiter = None
        self.close()
        if not waiter.done():
            waiter.set_result(Answer(status, b"".join(self.parts)))

    def _lost(self) -> FailureKind:
        """How a close before a whole answer is classed: CONNECT on a fresh connection before any byte of an answer
        (nothing listening, or the server died); RESET on a kept one within STALE_CLOSE_S of the write (the server
        had closed it while idle: the request never reached it, as net/http's errServerClosedIdle); DROPPED later,
        or once the answer began (the server took the request and dropped it: counted against it)."""
        if self.began:
            return FailureKind.DROPPED
        if not self.used:
            return FailureKind.CONNECT
        held_s = asyncio.get_running_loop().time() - self.sent_at
        return FailureKind.RESET if held_s <= STALE_CLOSE_S else FailureKind.DROPPED


class KeepAlivePool:
    """POSTs over pooled keep-alive connections (no cap: the dispatcher's admission windows bound the load).
    Plain `http://` URLs without credentials only (`serves(url)`); the rest is aiohttp's."""

    def __init__(self, *, idle_s: float = IDLE_S):
        self._idle_s = idle_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}  # oldest first; each connection at most once
        self._busy: set[_Connection] = set()  # carrying a request (`post` holds them)
        self._targets: dict[str, Destination | None] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def serves(self, url: str) -> bool:
        return self.destination(url) is not None

    def destination(self, url: str) -> Destination | None:
        """What `post` needs of a URL, parsed once (None: not one this pool serves; aiohttp's then)."""
        if self.closed:
            return None
        try:
            return self._targets[url]
        except KeyError:
            pass
        target = plain_destination(url)
        if len(self._targets) >= MAX_TARGETS:
            self._targets.clear()
        self._targets[url] = target
        return target

    def connections(self) -> int:
        """Open connections, busy or idle."""
        return len(self._busy) + sum(len(c) for c in self._idle.values())

    async def post(self, url: str | Destination, body: bytes, *, timeout_s: float, connect_s: float,
                   limit: int) -> Answer:
        """POST `body` (JSON) to `url` (or its `destination`); the answer, its body up to `limit` bytes (a larger 200
        answer is a BAD_RESPONSE, a larger error answer is cut). Failures are AttemptError: TIMEOUT (no whole answer
        in `timeout_s`, connecting included), BAD_RESPONSE, or a close before a whole answer (`_Connection._lost`)."""
        target = self.destination(url) if isinstance(url, str) else url
        if target is None or self.closed:
            raise AttemptError(FailureKind.UNEXPECTED, f"not a plain http URL, or the pool is closed: {url}")
        loop = self._loop or self._bind()
        now = loop.time()
        key = target.key
        idle = self._idle.get(key)
        if idle:
            connection = idle.pop()  # the most recently used: the least likely to have been closed by the server
            if not idle:
                del self._idle[key]
        else:
            connection = await self._connect(key, min(connect_s, timeout_s))
        self._busy.add(connection)
        waiter: asyncio.Future[Answer] = loop.create_future()
        connection.send(b"%s%d\r\n\r\n%s" % (target.head, len(body), body), limit, waiter, now)
        timer = loop.call_at(now + timeout_s, _time_out, connection, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._busy.discard(connection)
            if connection.keep and not self.closed:  # (whole, open: also when the caller was cancelled meanwhile)
                connection.used = True
                connection.idle_since = loop.time()
                self._idle.setdefault(key, []).append(connection)
                if self._sweep is None:
                    self._sweep = loop.call_at(connection.idle_since + self._idle_s, self._expire)
            else:
                connection.end()

    def close(self) -> None:
        """Close every connection (a request under way fails: UNEXPECTED); later posts fail."""
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self._busy):
            connection._fail(AttemptError(FailureKind.UNEXPECTED, "the connection pool is closed"))
        for connection in [c for conns in self._idle.values() for c in conns]:
            connection.close()
        self._busy.clear()
        self._idle.clear()

    # ---- internals
    def _bind(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    async def _connect(self, key: tuple[str, int], connect_s: float) -> _Connection:
        loop = self._loop or self._bind()
        try:
            async with asyncio.timeout(connect_s):
                _, connection = await loop.create_connection(lambda: _Connection(self, key), key[0], key[1])
        except TimeoutError:
            raise AttemptError(FailureKind.TIMEOUT, "connect timed out") from None
        except OSError as exc:
            raise AttemptError(FailureKind.CONNECT, f"{type(exc).__name__}: {exc.strerror or exc}") from exc
        if self.closed:
            connection.close()
            raise AttemptError(FailureKind.UNEXPECTED, "the connection pool is closed")
        return connection

    def _forget(self, connection: _Connection) -> None:
        """A connection closed: out of the pool's books."""
        self._busy.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)
            if not idle:
                del self._idle[connection.key]

    def _expire(self) -> None:
        """The sweep: close the connections idle `idle_s`, and arm the next sweep for the oldest left."""
        self._sweep = None
        loop = self._loop or self._bind()
        # Due by the sum the timer was armed with (`now - idle_s` can round below it, and a timer may run as much
        # as the clock's resolution early): the next sweep is always ahead, never re-armed for this very moment.
        due = loop.time() + SWEEP_SLACK_S
        for key in list(self._idle):
            for connection in [c for c in self._idle.get(key, ()) if c.idle_since + self._idle_s <= due]:
                connection.close()
        if self._idle:
            oldest = min(c.idle_since for conns in self._idle.values() for c in conns)
            self._sweep = loop.call_at(oldest + self._idle_s, self._expire)


def _time_out(connection: _Connection, waiter: asyncio.Future[Answer]) -> None:
    if not waiter.done():
        connection._fail(AttemptError(FailureKind.TIMEOUT, "no whole answer in time"))


def pool_of(session: Any) -> KeepAlivePool | None:
    """The keep-alive pool a session's connector carries (federation.transport.new_session's), if any."""
    return getattr(getattr(session, "connector", None), "keepalive", None)
