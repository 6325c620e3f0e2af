"""The requests fedpool's keep-alive pool does not carry, over aiohttp's client: streams (opened for the gateway,
or assembled into one completion), a plain answer the pool cannot serve (TLS, credentials, a capped session),
abort calls; and aiohttp's failures classified into the core's FailureKinds (federation/gateway/transport.py sends
through these; it owns the pool)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import aiohttp
import yarl

from fedpool.federation.core.errors import AttemptError, FailureKind, kind_for_status
from fedpool.federation.core.types import Completion, Endpoint, StreamProgress, Timeouts
from fedpool.federation.gateway.answers import assemble_stream, dumps, upstream_message

log = logging.getLogger("fedpool.transport")

MAX_ERROR_BODY_BYTES = 64 * 1024  # of an error answer: the engine's message is in its first few hundred bytes
JSON_HEADERS = {"Content-Type": "application/json"}
ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5.0)  # an abort call to an engine (HttpTransport._abort)
# Failures after which the engine may still be running the request (so an engine that aborts by id is asked to)
ABORTED_AFTER = frozenset({FailureKind.TIMEOUT, FailureKind.RESET, FailureKind.CONNECT, FailureKind.DROPPED})


# A kept connection the server closed while idle (its keep-alive time ran out) is seen closed only once its close
# arrives; a request written to it meanwhile crosses that close, which reaches us within about a round trip of the
# write. A close later than this followed a request the server held: it took the request and dropped it. Generous
# for a round trip between a gateway and its engines, and for the loop's own lag.
STALE_CLOSE_S = 0.25


def client_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=timeouts.total_s, sock_connect=timeouts.connect_s,
                                 sock_read=timeouts.first_byte_s)


def whole_answer_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    """For an answer sent whole (not streamed): its first byte is its last, so the shorter of first byte and total
    bounds it, with no read timer besides. aiohttp re-arms a read timeout on every chunk it receives: two timer
    handles more a request, each a heap push on the loop."""
    return aiohttp.ClientTimeout(total=min(timeouts.first_byte_s, timeouts.total_s), sock_connect=timeouts.connect_s)


@dataclass(slots=True)
class AttemptTrace:
    """What aiohttp's connector said of one attempt's connection (`reuse_tracing`, through the request's
    `trace_request_ctx`): a kept connection, and since when, or a fresh one."""

    reused_at: float | None = None  # the loop's time the connector handed over a kept connection

    def failure(self, exc: BaseException) -> AttemptError:
        """`exc` as this attempt's AttemptError (a close on a kept connection: RESET or DROPPED by its timing)."""
        if self.reused_at is None:
            return transport_error(exc, False)
        return transport_error(exc, True, held_s=asyncio.get_running_loop().time() - self.reused_at)


async def _note_reuse(
    session: aiohttp.ClientSession, context: SimpleNamespace, params: aiohttp.TraceConnectionReuseconnParams
) -> None:
    attempt = context.trace_request_ctx
    if isinstance(attempt, AttemptTrace):
        attempt.reused_at = asyncio.get_running_loop().time()


def reuse_tracing() -> aiohttp.TraceConfig:
    """aiohttp's documented way to tell an attempt that its connection was a kept one: a TraceConfig whose
    `on_connection_reuseconn` marks the AttemptTrace passed as the request's `trace_request_ctx`. (Any trace
    config costs aiohttp's requests some CPU: only aiohttp's path pays it, the plain answers go over the pool.)"""
    config = aiohttp.TraceConfig()
    config.on_connection_reuseconn.append(_note_reuse)
    return config


class PooledConnector(aiohttp.TCPConnector):
    """aiohttp's connector, carrying the keep-alive pool that the plain answers go over instead
    (federation/gateway/transport.py), closed with it, so with the session. Without `keepalive`, or with a
    connection cap (which only aiohttp's connector keeps), every request is aiohttp's."""

    def __init__(self, keepalive: ClosingPool | None, **kwargs: Any):
        super().__init__(**kwargs)
        self.keepalive = keepalive

    async def close(self, *, abort_ssl: bool = False) -> None:
        if self.keepalive is not None:
            self.keepalive.close()
        await super().close(abort_ssl=abort_ssl)

@dataclass(frozen=True, slots=True)
class Destination:
    key: tuple[str, int]  # host, port: the connections' pool
    head: bytes  # b"POST <path> HTTP/1.1\r\nHost: ...\r\n...Content-Length: "


class ClosingPool(Protocol):
    """What the connector carries for the session's plain answers (transport.KeepAlivePool): closed with it."""

    def close(self) -> None: ...


# Engines whose answers are asked for as a stream and assembled into one completion. llama.cpp's server (this
# pool's build) runs a non-streamed request to its end after its client has gone, but stops a streamed one at its
# next token. Streamed, a request fedpool cancels (a hedge's losing copy, a slot given back to a shrunk lease, a
# gateway client that went away) frees the engine's slot, not only fedpool's count of it. vLLM aborts a request
# whose connection closed either way, SGLang at once by its id (`HttpTransport`, `Target.abort_path`); a server of
# unknown kind is asked for what its caller asked.
# llama.cpp's server also closes the connection after every stream though its head says keep-alive: a streamed
# request to these engines asks for `Connection: close`, so no pooled connection is reused after the engine closed
# it (the next request on it would fail as a reset).
STREAM_HEADERS = {**JSON_HEADERS, "Connection": "close"}



@dataclass(frozen=True, slots=True)
class UrlTarget:
    """A server known by its URL alone (outside a dispatcher), asked for streams or not."""

    id: str
    url: str
    streamed: bool = False
    abort_path: str | None = None


@contextlib.asynccontextmanager
async def _answered(session: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str],
                    read_timeout: aiohttp.ClientTimeout) -> AsyncIterator[aiohttp.ClientResponse]:
    """A POST's 200 answer, open to be read (a non-200 is an AttemptError with the engine's message); aiohttp's
    failures, sending or reading, are this attempt's (`AttemptTrace`: a kept connection's close by its timing)."""
    attempt = AttemptTrace()
    try:
        async with session.post(url, data=data, headers=headers, timeout=read_timeout,
                                trace_request_ctx=attempt) as resp:
            if resp.status != 200:
                raise http_error(resp.status, await read_body(resp, MAX_ERROR_BODY_BYTES, cut=True))
            yield resp
    except AttemptError:
        raise
    except Exception as exc:
        raise attempt.failure(exc) from exc


async def post_unpooled(
    session: aiohttp.ClientSession, url: str, data: bytes, read_timeout: aiohttp.ClientTimeout, limit: int,
) -> bytes:
    """POST `data` (JSON) over aiohttp's client; the body of a 200 answer (up to `limit` bytes), else AttemptError."""
    async with _answered(session, url, data, JSON_HEADERS, read_timeout) as resp:
        return await read_body(resp, limit)


async def post_assembled(
    session: aiohttp.ClientSession, url: str, data: bytes, read_timeout: aiohttp.ClientTimeout, endpoint: Endpoint,
    progress: StreamProgress | None,
) -> Completion:
    """POST a streamed request (`data`: its body, stream=true) and assemble its events into one completion."""
    async with _answered(session, url, data, STREAM_HEADERS, read_timeout) as resp:
        return await assemble_stream(resp.content, endpoint, progress)


class Aborts:
    """Abort calls to engines (`start`), each a task of its own off the caller's path, held until it ends; a failure
    is only logged (the engine's own check of the closed connection remains)."""

    def __init__(self, session: aiohttp.ClientSession):
        self._session = session
        self._tasks: set[asyncio.Task[None]] = set()
        self.reached = 0  # abort calls that reached the engine

    def start(self, url: str, rid: str) -> None:
        """Ask the engine at `url` to abort the request `rid`."""
        task = asyncio.get_running_loop().create_task(self._call(url, rid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self) -> None:
        """Wait for the calls under way to end."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _call(self, url: str, rid: str) -> None:
        if await post_abort(self._session, url, rid):
            self.reached += 1


async def post_abort(session: aiohttp.ClientSession, url: str, rid: str) -> bool:
    """Ask an engine to abort the request `rid`; whether the call reached it (a failure is only logged: the
    engine's own check of the closed connection remains)."""
    try:
        async with session.post(url, data=dumps({"rid": rid}), headers=JSON_HEADERS, timeout=ABORT_TIMEOUT) as resp:
            await resp.read()
            if resp.status == 200:
                return True
            log.debug("abort of %s at %s: HTTP %s", rid, url, resp.status)
    except Exception as exc:  # the session closing, the server gone: nothing is left to abort there
        log.debug("abort of %s at %s failed: %r", rid, url, exc)
    return False


def transport_error(exc: BaseException, reused_connection: bool, *, held_s: float = 0.0) -> AttemptError:
    """An aiohttp failure as an AttemptError (`classify_exception`)."""
    kind = classify_exception(exc, reused_connection=reused_connection, held_s=held_s)
    if kind is FailureKind.UNEXPECTED:
        log.warning("unexpected %s on the request path: %s", type(exc).__name__, str(exc)[:300])
        return AttemptError(kind, f"{type(exc).__name__}: {str(exc)[:300]}")
    return AttemptError(kind, type(exc).__name__)


def http_error(status: int, raw: bytes) -> AttemptError:
    """A non-200 answer as an AttemptError carrying the engine's own message (vLLM, SGLang and llama.cpp put
    it in `{"error": {"message": ...}}`, older SGLang in `{"message": ...}`; otherwise the body's text)."""
    return AttemptError(
        kind_for_status(status), f"HTTP {status}", status=status, upstream_message=upstream_message(raw)
    )


async def open_stream(
    session: aiohttp.ClientSession, url: str, data: bytes, read_timeout: aiohttp.ClientTimeout, *, close: bool = False,
) -> aiohttp.ClientResponse:
    """POST a streamed request (`data`: its body, stream=true); the open response once its head says 200 (the
    caller reads and releases it), or AttemptError. Nothing has reached the caller's client yet, so a failure here
    can still be retried elsewhere. Cancelled while it waits for the head, the connection is closed (aiohttp's own
    handling). `close`: the engine closes the connection after a stream, so it is not kept for another request."""
    attempt = AttemptTrace()
    try:
        resp = await session.post(url, data=data, headers=STREAM_HEADERS if close else JSON_HEADERS,
                                  timeout=read_timeout, trace_request_ctx=attempt)
    except Exception as exc:
        raise attempt.failure(exc) from exc
    if resp.status != 200:
        try:
            raw = await read_body(resp, MAX_ERROR_BODY_BYTES, cut=True)
        except Exception:  # the body of an error is a courtesy; the status decides
            raw = b""
        finally:
            resp.release()
        raise http_error(resp.status, raw)
    return resp


async def read_body(resp: aiohttp.ClientResponse, limit: int, *, cut: bool = False) -> bytes:
    """The whole body, up to `limit` bytes: past it, AttemptError (BAD_RESPONSE), or with `cut` its first
    `limit` bytes. (`content.read(n)` alone returns what has arrived so far, which is not the whole body.)"""
    length = resp.content_length
    if length is not None and length <= limit:
        return await resp.read()
    if length is not None and not cut:
        raise AttemptError(FailureKind.BAD_RESPONSE, f"response larger than {limit // (1024 * 1024)} MiB")
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            if cut:
                break
            raise AttemptError(FailureKind.BAD_RESPONSE, f"response larger than {limit // (1024 * 1024)} MiB")
    return b"".join(parts)[:limit]


def classify_exception(exc: BaseException, *, reused_connection: bool, held_s: float = 0.0) -> FailureKind:
    """Map a transport exception to a FailureKind. Order matters: subclasses before their bases. `held_s`: how long
    a kept connection had carried the request when it failed (the pool's rule: `KeepAlivePool.post`)."""
    if isinstance(exc, AttemptError):
        return exc.kind
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return FailureKind.TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError):
        return FailureKind.CONNECT
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
        # llama.cpp's server closes idle keep-alive connections early; a request written to such a socket fails,
        # within a round trip, before the server ever saw it. Later, the server held the request and dropped it.
        # On a fresh connection the same error means the server died.
        if not reused_connection:
            return FailureKind.CONNECT
        return FailureKind.RESET if held_s <= STALE_CLOSE_S else FailureKind.DROPPED
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ContentTypeError, ValueError)):
        return FailureKind.BAD_RESPONSE
    if isinstance(exc, aiohttp.ClientResponseError):
        return kind_for_status(exc.status)
    if isinstance(exc, aiohttp.ClientError):
        return FailureKind.CONNECT  # the remaining transport failures (invalid URL, TLS, proxy) are the link's
    return FailureKind.UNEXPECTED


def plain_destination(url: str) -> Destination | None:
    """Where the keep-alive pool sends a plain-http URL without credentials (its connections' host and port, and the
    prepared head); None for the rest (https, a user, odd), which go over aiohttp."""
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
