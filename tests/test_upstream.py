"""The keep-alive pool the dispatcher's plain answers go over (federation/gateway/transport.py), against real sockets on
loopback: purpose-built servers (asyncio streams writing exact bytes) for the framings, failures and closes an
engine can produce; the dispatcher's transport over it against a real emulated engine. Timeouts and the idle
sweep run on looptime's virtual clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from fedpool.federation import new_session
from fedpool.federation.core.errors import AttemptError, FailureKind
from fedpool.federation.core.types import Endpoint, InferenceRequest
from fedpool.federation.gateway.transport import HttpTransport, KeepAlivePool, pool_of
from fedpool.federation.gateway.unpooled import STALE_CLOSE_S, AttemptTrace, UrlTarget
from tests.conftest import EmulatorFactory

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Seen"], Awaitable[None]]


class Seen:
    """What the server saw: connections accepted, requests read (head and body), connections that ended."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.ended = 0


async def read_request(reader: asyncio.StreamReader, seen: Seen) -> bool:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    seen.requests.append((head, await reader.readexactly(length)))
    return True


def answer(body: bytes, *, status: str = "200 OK", close: bool = False, chunked: bool = False) -> bytes:
    connection = b"Connection: close\r\n" if close else b""
    if chunked:
        half = len(body) // 2
        framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:]) if p) + b"0\r\n\r\n"
        return b"HTTP/1.1 %s\r\n%sTransfer-Encoding: chunked\r\n\r\n%s" % (status.encode(), connection, framed)
    return b"HTTP/1.1 %s\r\n%sContent-Length: %d\r\n\r\n%s" % (status.encode(), connection, len(body), body)


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, Seen]]:
    """A server on loopback running `handler` per connection; on leaving, every connection still open is closed
    and its handler ended."""
    seen = Seen()
    handlers: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await handler(reader, writer, seen)
        finally:
            seen.ended += 1
            writer.close()
            handlers.discard(task)

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/completions", seen
    finally:
        srv.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await srv.wait_closed()


def keep_alive(body: bytes, *, status: str = "200 OK", close: bool = False, chunked: bool = False) -> Handler:
    """Answers every request on a connection with `body` (with `close`: the first one, then closes)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
        while await read_request(reader, seen):
            writer.write(answer(body, status=status, close=close, chunked=chunked))
            await writer.drain()
            if close:
                return
    return handler


async def post(pool: KeepAlivePool, url: str, body: bytes = b'{"prompt":"x"}', *, timeout_s: float = 30.0,
               limit: int = 1 << 20) -> tuple[int, bytes]:
    got = await pool.post(url, body, timeout_s=timeout_s, connect_s=5.0, limit=limit)
    return got.status, got.body


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


async def test_answers_in_every_framing_and_the_head_sent() -> None:
    pool = KeepAlivePool()
    try:
        for chunked in (False, True):
            async with server(keep_alive(b'{"ok":1}', chunked=chunked)) as (url, seen):
                assert await post(pool, url, b'{"a":2}') == (200, b'{"ok":1}')
                head, body = seen.requests[0]
                assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
                assert b"\r\nHost: 127.0.0.1:" in head and b"\r\nContent-Type: application/json\r\n" in head
                assert body == b'{"a":2}'

        async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
            await read_request(reader, seen)  # no length, no chunks: the answer ends with the connection
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{\"whole\":true}")
            await writer.drain()

        async with server(until_close) as (url, seen):
            assert await post(pool, url) == (200, b'{"whole":true}')
        await until(lambda: pool.connections() == 0)  # the servers closed the kept ones on leaving
    finally:
        pool.close()


async def test_one_connection_carries_sequential_requests_and_a_close_answer_is_not_kept() -> None:
    pool = KeepAlivePool()
    try:
        async with server(keep_alive(b"{}")) as (url, seen):
            for _ in range(5):
                assert await post(pool, url) == (200, b"{}")
            assert (seen.connections, len(seen.requests), pool.connections()) == (1, 5, 1)
            await asyncio.gather(*(post(pool, url) for _ in range(3)))  # at once: one connection each
            assert seen.connections == 3 and pool.connections() == 3
        async with server(keep_alive(b"{}", close=True)) as (url, seen):
            for _ in range(3):
                assert await post(pool, url) == (200, b"{}")
            await until(lambda: seen.ended == 3)
            assert seen.connections == 3
    finally:
        pool.close()
    assert pool.connections() == 0


async def test_failures_are_typed() -> None:
    pool = KeepAlivePool()
    try:
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # a port nothing will listen on
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        with pytest.raises(AttemptError) as failed:
            await post(pool, f"http://127.0.0.1:{port}/v1/completions")
        assert failed.value.kind is FailureKind.CONNECT

        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
            await read_request(reader, seen)  # read, then closed unanswered: a server that died on it

        async with server(drop) as (url, _):
            with pytest.raises(AttemptError) as failed:
                await post(pool, url)
            assert failed.value.kind is FailureKind.CONNECT  # a fresh connection: the server's failure

        async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
            await read_request(reader, seen)
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            await reader.read()

        async with server(garbage) as (url, _):
            with pytest.raises(AttemptError) as failed:
                await post(pool, url)
            assert failed.value.kind is FailureKind.BAD_RESPONSE

        async with server(keep_alive(b"x" * 5000)) as (url, _):
            with pytest.raises(AttemptError) as failed:
                await post(pool, url, limit=4096)
            assert failed.value.kind is FailureKind.BAD_RESPONSE and "larger" in str(failed.value)
        async with server(keep_alive(b"e" * 5000, status="500 Internal Server Error")) as (url, _):
            assert await post(pool, url, limit=4096) == (500, b"e" * 5000)  # an error's body: kept up to the cut
        assert pool.connections() == 0  # every failed or cut connection closed
    finally:
        pool.close()


async def test_a_kept_connection_the_server_closed_is_a_reset_and_leaves_the_pool() -> None:
    pool = KeepAlivePool()
    try:
        async def one_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
            await read_request(reader, seen)
            writer.write(answer(b"{}"))  # keep-alive answer, then the next request is read and dropped
            await writer.drain()
            await read_request(reader, seen)

        async with server(one_then_drop) as (url, seen):
            assert await post(pool, url) == (200, b"{}")
            with pytest.raises(AttemptError) as failed:
                await post(pool, url)
            assert failed.value.kind is FailureKind.RESET  # reused: not the server's fault, retried at once
            assert pool.connections() == 0

        async def close_when_idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
            await read_request(reader, seen)
            writer.write(answer(b"{}"))  # then the server closes the idle connection (llama.cpp does, early)
            await writer.drain()

        async with server(close_when_idle) as (url, seen):
            assert await post(pool, url) == (200, b"{}")
            await until(lambda: pool.connections() == 0)  # gone from the pool as soon as the server closed it
            assert await post(pool, url) == (200, b"{}")  # on a new connection
            assert seen.connections == 2
    finally:
        pool.close()


@pytest.mark.looptime
async def test_a_silent_server_times_out_and_a_cancelled_request_closes_its_connection() -> None:
    pool = KeepAlivePool()
    try:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
            await read_request(reader, seen)
            await reader.read()  # never answers; returns when the client closes

        async with server(silent) as (url, seen):
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(AttemptError) as failed:
                await post(pool, url, timeout_s=30.0)
            assert failed.value.kind is FailureKind.TIMEOUT and loop.time() - start == pytest.approx(30.0)
            await until(lambda: seen.ended == 1)  # the connection was closed, not kept

            task = asyncio.create_task(post(pool, url))
            await until(lambda: len(seen.requests) == 2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: seen.ended == 2)
            assert pool.connections() == 0
    finally:
        pool.close()


@pytest.mark.looptime
async def test_idle_connections_are_closed_after_their_time() -> None:
    pool = KeepAlivePool(idle_s=15.0)
    try:
        async with server(keep_alive(b"{}")) as (url_a, seen_a), server(keep_alive(b"{}")) as (url_b, seen_b):
            await asyncio.gather(post(pool, url_a), post(pool, url_a))
            await asyncio.sleep(10.0)
            await post(pool, url_b)
            assert pool.connections() == 3
            await asyncio.sleep(6.0)  # a's two are 16 s idle, b's 6 s
            await until(lambda: seen_a.ended == 2)
            assert pool.connections() == 1 and seen_b.ended == 0
            await asyncio.sleep(10.0)
            await until(lambda: seen_b.ended == 1)
            assert pool.connections() == 0
    finally:
        pool.close()


async def test_closing_the_pool_closes_everything_and_refuses_more() -> None:
    pool = KeepAlivePool()
    async with server(keep_alive(b"{}")) as (url, seen):
        await asyncio.gather(post(pool, url), post(pool, url))
        pool.close()
        await until(lambda: seen.ended == 2)
        assert pool.connections() == 0 and not pool.serves(url)
        with pytest.raises(AttemptError):
            await post(pool, url)


async def test_closing_under_load_closes_every_connection_even_one_just_passed_on() -> None:
    """Workers post back to back, so an answered connection is often taken by the next request before the task it
    answered resumes; closing the pool then must still reach it (it is busy again, not forgotten)."""
    pool = KeepAlivePool()
    async with server(keep_alive(b"{}")) as (url, seen):
        async def worker() -> int:
            done = 0
            while True:
                try:
                    await post(pool, url)
                except AttemptError:
                    return done
                done += 1

        workers = [asyncio.create_task(worker()) for _ in range(8)]
        await until(lambda: len(seen.requests) >= 400)
        sent = len(seen.requests)
        pool.close()
        counts = await asyncio.gather(*workers)
        assert sent - len(workers) <= sum(counts) <= sent  # every one answered but those in flight at the close
        await until(lambda: seen.ended == seen.connections)  # nothing left open
        assert pool.connections() == 0


def test_only_plain_http_urls_without_credentials_are_served() -> None:
    pool = KeepAlivePool()
    assert pool.serves("http://127.0.0.1:8000/v1/completions")
    assert pool.serves("http://[::1]:8000/v1/completions")
    assert pool.serves("http://gpu-7/prefix/v1/completions")
    assert not pool.serves("https://gpu-7/v1/completions")  # TLS: aiohttp's
    assert not pool.serves("http://user:secret@gpu-7/v1/completions")  # credentials: aiohttp's


async def test_the_dispatchers_transport_uses_the_pool_and_the_session_closes_it(
        emulators: EmulatorFactory) -> None:
    engine = await emulators.start(max_running=4)
    request = InferenceRequest.from_body({"prompt": "hello", "max_tokens": 3}, request_id="r", model="emu-model",
                                         endpoint=Endpoint.COMPLETIONS)
    async with new_session() as session:
        pool = pool_of(session)
        assert pool is not None
        transport = HttpTransport(session)
        answers = await asyncio.gather(*(transport.complete(UrlTarget("s", engine.url), request) for _ in range(4)))
        assert all(a.completion_tokens == 3 and a.raw for a in answers)
        assert pool.connections() == 4  # the answers came over the pool's connections, kept for the next
    assert pool.connections() == 0 and pool.closed
    async with new_session(limit=2) as capped:
        assert pool_of(capped) is None  # a connection cap is aiohttp's to keep


@pytest.mark.looptime
@pytest.mark.timeout(60)
async def test_the_idle_sweep_never_spins_on_a_deadline_that_rounds_below_now() -> None:
    """22.702 + 15 - 15 < 22.702 in floats: a sweep that compared `idle_since <= now - idle_s` found the connection
    not yet due at its own deadline and re-armed itself for that same moment, forever (the loop's clock stuck)."""
    pool = KeepAlivePool(idle_s=15.0)
    try:
        async with server(keep_alive(b"{}")) as (url, seen):
            loop = asyncio.get_running_loop()
            await asyncio.sleep(22.702 - loop.time())
            await post(pool, url)
            await asyncio.sleep(15.5)
            await until(lambda: seen.ended == 1)
            assert pool.connections() == 0
    finally:
        pool.close()


COMPLETION = (b'{"choices":[{"text":"ok","finish_reason":"stop"}],"model":"m",'
              b'"usage":{"prompt_tokens":1,"completion_tokens":1}}')


def request() -> InferenceRequest:
    return InferenceRequest.from_body({"prompt": "hello", "max_tokens": 1}, request_id="r", model="m",
                                      endpoint=Endpoint.COMPLETIONS)


async def test_with_the_pool_off_every_request_is_aiohttps() -> None:
    async with server(keep_alive(COMPLETION)) as (url, seen), new_session(keepalive_pool=False) as session:
        assert pool_of(session) is None
        transport = HttpTransport(session)
        base = url.removesuffix("/v1/completions")
        for _ in range(2):
            assert (await transport.complete(UrlTarget("s", base), request())).text == "ok"
        assert len(seen.requests) == 2 and seen.connections == 1  # aiohttp's own keep-alive
        assert all(b"aiohttp" in head for head, _ in seen.requests)  # its User-Agent: not the pool's head
    async with server(keep_alive(COMPLETION)) as (url, seen), new_session() as session:
        assert (await HttpTransport(session).complete(UrlTarget("s", url.removesuffix("/v1/completions")),
                                                      request())).text == "ok"
        assert b"aiohttp" not in seen.requests[0][0]  # (the pool's own head, for contrast)


async def test_aiohttps_attempts_learn_of_a_kept_connection_through_their_trace_context() -> None:
    async with server(keep_alive(b"{}")) as (url, _), new_session(keepalive_pool=False) as session:
        attempts = [AttemptTrace(), AttemptTrace()]
        for attempt in attempts:
            async with session.post(url, data=b"{}", trace_request_ctx=attempt) as resp:
                assert await resp.read() == b"{}"
        assert attempts[0].reused_at is None and attempts[1].reused_at is not None


@pytest.mark.looptime
async def test_aiohttps_closes_on_a_kept_connection_are_reset_at_once_and_dropped_later() -> None:
    for pause, kind in ((0.0, FailureKind.RESET), (2 * STALE_CLOSE_S, FailureKind.DROPPED)):
        async def answer_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen,
                                   pause: float = pause) -> None:
            await read_request(reader, seen)
            writer.write(answer(COMPLETION))
            await writer.drain()
            await read_request(reader, seen)
            await asyncio.sleep(pause)  # then closed, unanswered

        async with server(answer_then_drop) as (url, seen), new_session(keepalive_pool=False) as session:
            transport = HttpTransport(session)
            target = UrlTarget("s", url.removesuffix("/v1/completions"))
            assert (await transport.complete(target, request())).text == "ok"
            with pytest.raises(AttemptError) as failed:
                await transport.complete(target, request())
            assert failed.value.kind is kind and seen.connections == 1
