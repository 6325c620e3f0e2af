"""Keep-alive HTTP/1.1 connections for the dispatcher's plain (unstreamed) answers, on asyncio protocols with
httptools' parser (llhttp, the parser uvicorn uses).

A pass-through proxy built on aiohttp's client spends more than half its CPU a request in that client (its
request and response objects, header multidicts, the connector's bookkeeping and timers): measured with wrk
against nginx (benchmarks/results/gateway_capacity.md), an aiohttp server relaying through aiohttp's client used
136.6 µs of CPU a request, the same server relaying through this pool 67.9. A request
here is one write of a prepared head and the body, and the parser's callbacks filling one answer; everything
else (streams, aborts, TLS, proxies, a connection cap) stays on aiohttp.

Every connection is either carrying one request or idle in the pool: a request cancelled, timed out or failed
mid-way closes its connection (its state is unknown), an answer with `Connection: close` too; idle connections
are closed after `idle_s` (a sweep, armed only while any are idle), and a connection the server closes while
idle leaves the pool at once, so nothing is kept for a server that left."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

import httptools
import yarl

from fedpool.federation.core.errors import AttemptError, FailureKind

IDLE_S = 15.0  # aiohttp's keep-alive time too
MAX_TARGETS = 4096  # parsed URLs kept (servers × endpoints); cleared whole past it


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes  # past the limit: cut there, for a non-200 answer (its message is at the start)


@dataclass(frozen=True, slots=True)
class Destination:
    key: tuple[str, int]  # host, port: the connections' pool
    head: bytes  # b"POST <path> HTTP/1.1\r\nHost: ...\r\n...Content-Length: "


class _Connection(asyncio.Protocol):
    """One TCP connection and its parser; carries one request at a time."""

    __slots__ = ("closed", "framed", "headers_done", "idle_since", "key", "limit", "parser", "parts", "pool", "size",
                 "transport", "used", "waiter")

    def __init__(self, pool: KeepAlivePool, key: tuple[str, int]):
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Answer] | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.limit = 0
        self.framed = False  # the answer's length is known (Content-Length or chunked), not "until close"
        self.headers_done = False
        self.closed = False
        self.idle_since = 0.0
        self.used = False  # carried a request before: a reset on it is a stale keep-alive connection's

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not asyncio's subclasses)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: the connection's state is unknown
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(AttemptError(FailureKind.BAD_RESPONSE, f"malformed HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self.headers_done and not self.framed:  # an answer delimited by the connection's end: it is whole
            self._finish()
            return
        self.waiter = None
        # A reused connection closed under a request is one the server closed while idle (llama.cpp closes idle
        # keep-alive connections early): the request never reached it. On a fresh connection the server is gone.
        waiter.set_exception(AttemptError(FailureKind.RESET if self.used else FailureKind.CONNECT,
                                          "server closed the connection"))

    # ---- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.limit:
            if self.parser.get_status_code() != 200:  # an error's message: its first `limit` bytes suffice
                self.parts.append(body)
                self._finish(keep=False)
                return
            self._fail(AttemptError(FailureKind.BAD_RESPONSE,
                                    f"response larger than {self.limit // (1024 * 1024)} MiB"))
            return
        self.parts.append(body)

    def on_message_complete(self) -> None:
        self._finish(keep=self.parser.should_keep_alive())

    # ---- the pool's side
    def send(self, data: bytes, limit: int, waiter: asyncio.Future[Answer]) -> None:
        assert self.transport is not None
        self.waiter = waiter
        self.parts = []
        self.size = 0
        self.limit = limit
        self.framed = False
        self.headers_done = False
        self.transport.write(data)

    def _finish(self, keep: bool = False) -> None:
        waiter = self.waiter
        self.waiter = None
        parts = self.parts
        self.parts = []
        answer = Answer(self.parser.get_status_code(), parts[0] if len(parts) == 1 else b"".join(parts))
        self.used = True
        if keep and not self.closed and not self.pool.closed:
            self.pool._idle_again(self)
        else:
            self.close(abort=False)
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def _fail(self, error: AttemptError) -> None:
        waiter = self.waiter
        self.waiter = None
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def close(self, abort: bool = True) -> None:
        """Close at once (`abort`: mid-request, its state unknown) or after what is written (an answer read
        whole on a connection not kept)."""
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                if abort:
                    self.transport.abort()
                else:
                    self.transport.close()


class KeepAlivePool:
    """POSTs over pooled keep-alive connections (no cap: the dispatcher's admission windows bound the load).
    Plain `http://` URLs without credentials only (`serves(url)`); the rest is aiohttp's."""

    def __init__(self, *, idle_s: float = IDLE_S):
        self._idle_s = idle_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}  # oldest first
        self._busy: set[_Connection] = set()
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
        target = _parse(url)
        if len(self._targets) >= MAX_TARGETS:
            self._targets.clear()
        self._targets[url] = target
        return target

    def connections(self) -> int:
        """Open connections, busy or idle."""
        return len(self._busy) + sum(len(c) for c in self._idle.values())

    async def post(self, url: str | Destination, body: bytes, *, timeout_s: float, connect_s: float,
                   limit: int) -> Answer:
        """POST `body` (JSON) to `url` (or its `destination`); the answer, its body up to `limit` bytes (a larger
        200 answer is a BAD_RESPONSE; a larger error answer is cut). Failures are AttemptError: CONNECT (nothing
        listening, or a fresh connection closed), RESET (a reused one closed before its answer), TIMEOUT (no whole
        answer within `timeout_s`, connecting included), BAD_RESPONSE."""
        target = self.destination(url) if isinstance(url, str) else url
        if target is None or self.closed:
            raise AttemptError(FailureKind.UNEXPECTED, f"not a plain http URL, or the pool is closed: {url}")
        loop = self._loop or self._bind()
        deadline = loop.time() + timeout_s
        connection = self._take(target.key)
        if connection is None:
            connection = await self._connect(target.key, min(connect_s, timeout_s))
        self._busy.add(connection)
        waiter: asyncio.Future[Answer] = loop.create_future()
        connection.send(b"%s%d\r\n\r\n%s" % (target.head, len(body), body), limit, waiter)
        timer = loop.call_at(deadline, _time_out, connection, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            if connection.waiter is waiter:  # cancelled mid-way: the connection is spent
                connection.waiter = None
                connection.close()
            # (answered, it is idle already, or carrying the next request: busy again, and left so)

    def close(self) -> None:
        """Close every connection; later posts fail."""
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in [*self._busy, *(c for conns in self._idle.values() for c in conns)]:
            connection.close()
        self._busy.clear()
        self._idle.clear()

    # ---- internals
    def _bind(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to have been closed by the server
            if not idle:
                del self._idle[key]
            if not connection.closed:
                return connection
            idle = self._idle.get(key)
        return None

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

    def _idle_again(self, connection: _Connection) -> None:
        loop = self._loop or self._bind()
        connection.idle_since = loop.time()
        self._busy.discard(connection)
        self._idle.setdefault(connection.key, []).append(connection)
        if self._sweep is None:
            self._sweep = loop.call_later(self._idle_s, self._expire)

    def _forget(self, connection: _Connection) -> None:
        self._busy.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)
            if not idle:
                del self._idle[connection.key]

    def _expire(self) -> None:
        self._sweep = None
        loop = self._loop or self._bind()
        cutoff = loop.time() - self._idle_s
        for key in list(self._idle):
            for connection in [c for c in self._idle.get(key, ()) if c.idle_since <= cutoff]:
                connection.close()
        if self._idle:
            oldest = min(c.idle_since for conns in self._idle.values() for c in conns)
            self._sweep = loop.call_at(oldest + self._idle_s, self._expire)


def _time_out(connection: _Connection, waiter: asyncio.Future[Answer]) -> None:
    if not waiter.done():
        connection._fail(AttemptError(FailureKind.TIMEOUT, "no whole answer in time"))


def _parse(url: str) -> Destination | None:
    """The prepared head for a plain-http URL without credentials; None for the rest (https, a user, odd)."""
    try:
        parsed = yarl.URL(url)
    except (TypeError, ValueError):
        return None
    if parsed.scheme != "http" or parsed.raw_user or parsed.raw_password or not parsed.raw_host:
        return None
    port = parsed.port or 80
    host = parsed.host or parsed.raw_host
    authority = f"[{host}]" if ":" in host else host
    if parsed.explicit_port is not None:
        authority += f":{port}"
    path = parsed.raw_path_qs or "/"
    head = (f"POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n"
            f"Accept: application/json\r\nContent-Length: ").encode("ascii", "strict")
    return Destination((host, port), head)


def pool_of(session: Any) -> KeepAlivePool | None:
    """The keep-alive pool a session's connector carries (federation.transport.new_session's), if any."""
    return getattr(getattr(session, "connector", None), "keepalive", None)
