"""HTTP/1.1 conformance of the keep-alive pool (federation/gateway/transport.py): loopback servers on raw asyncio
sockets write exact bytes (1xx before the answer, chunked with trailers, HTTP/1.0 framings, bytes after an answer,
204/304, `Connection: close`, closes before and during an answer), and each case checks the answer, whether the
connection is used again, and how a failure is classed (CONNECT, RESET, DROPPED). Timed cases run on looptime's
virtual clock: the servers live in the test's own loop, so no real I/O is waited for."""

from __future__ import annotations

import asyncio

import pytest

from fedpool.federation.core.errors import AttemptError, FailureKind
from fedpool.federation.gateway.transport import KeepAlivePool
from fedpool.federation.gateway.unpooled import STALE_CLOSE_S
from tests.test_upstream import Handler, Seen, answer, post, read_request, server, until

Step = bytes | float | None  # bytes: written (and drained); a float: a pause of that long; None: close, unanswered


def scripted(*per_request: tuple[Step, ...]) -> Handler:
    """Answers the i-th request read on a connection with the i-th script (the last one again past the end); a
    script is a sequence of steps. The connection ends when the client closes it or a script says None."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
        served = 0
        while await read_request(reader, seen):
            for step in per_request[min(served, len(per_request) - 1)]:
                if step is None:
                    return
                if not isinstance(step, bytes):
                    await asyncio.sleep(step)
                    continue
                writer.write(step)
                await writer.drain()
            served += 1

    return handler


OK = answer(b'{"ok":1}')
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"


@pytest.mark.parametrize("informational", [CONTINUE, EARLY_HINTS, CONTINUE + EARLY_HINTS])
@pytest.mark.parametrize("segments", ["same", "separate"])
async def test_informational_answers_are_skipped_and_the_connection_is_kept_once(
        informational: bytes, segments: str) -> None:
    script = (informational + OK,) if segments == "same" else (informational, 0.01, OK)
    pool = KeepAlivePool()
    try:
        async with server(scripted(script)) as (url, seen):
            assert await post(pool, url) == (200, b'{"ok":1}')
            assert pool.connections() == 1  # idle once, not twice
            # Two at once: two connections, never one socket for both (a connection idle twice would be taken twice).
            assert [*await asyncio.gather(post(pool, url), post(pool, url))] == [(200, b'{"ok":1}')] * 2
            assert (seen.connections, len(seen.requests), pool.connections()) == (2, 3, 2)
    finally:
        pool.close()


async def test_a_close_after_an_informational_answer_is_a_drop_not_an_answer() -> None:
    pool = KeepAlivePool()
    try:
        async with server(scripted((CONTINUE, None))) as (url, _):
            with pytest.raises(AttemptError) as failed:
                await post(pool, url)
            assert failed.value.kind is FailureKind.DROPPED  # the server took the request (it said 100)
    finally:
        pool.close()


async def test_a_chunked_answer_with_trailers_is_whole_and_the_connection_kept() -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n"
               b"4\r\n{\"ok\r\n4;ext=1\r\n\":1}\r\n0\r\nX-Checksum: abc\r\n\r\n")
    pool = KeepAlivePool()
    try:
        async with server(scripted((chunked,))) as (url, seen):
            for _ in range(3):
                assert await post(pool, url) == (200, b'{"ok":1}')
            assert seen.connections == 1
    finally:
        pool.close()


@pytest.mark.parametrize("head", [
    b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n",  # 1.0, delimited by the close
    b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",  # 1.1 the same way
])
async def test_an_answer_delimited_by_the_close_is_whole_and_not_kept(head: bytes) -> None:
    pool = KeepAlivePool()
    try:
        async with server(scripted((head + b'{"ok":1}', None))) as (url, seen):
            for _ in range(2):
                assert await post(pool, url) == (200, b'{"ok":1}')
            assert seen.connections == 2
            await until(lambda: pool.connections() == 0)
    finally:
        pool.close()


@pytest.mark.parametrize("raw", [
    b"HTTP/1.0 200 OK\r\nContent-Length: 8\r\n\r\n{\"ok\":1}",  # 1.0 without keep-alive: the server may wait
    answer(b'{"ok":1}', close=True),  # `Connection: close`, the server keeps it open all the same
])
async def test_an_answer_without_keep_alive_is_read_by_its_length_and_the_connection_closed(raw: bytes) -> None:
    pool = KeepAlivePool()
    try:
        async with server(scripted((raw,))) as (url, seen):
            for _ in range(2):
                assert await post(pool, url) == (200, b'{"ok":1}')
            await until(lambda: seen.ended == 2)  # closed by the pool, each after its answer
            assert seen.connections == 2 and pool.connections() == 0
    finally:
        pool.close()


async def test_an_http_1_0_keep_alive_answer_is_kept() -> None:
    raw = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 8\r\n\r\n{\"ok\":1}"
    pool = KeepAlivePool()
    try:
        async with server(scripted((raw,))) as (url, seen):
            for _ in range(3):
                assert await post(pool, url) == (200, b'{"ok":1}')
            assert seen.connections == 1
    finally:
        pool.close()


@pytest.mark.parametrize("extra", [
    answer(b'{"other":2}'),  # a whole second answer nobody asked for
    b"HTTP/1.1 200 OK\r\nContent-Le",  # the start of one
    b"H",
    b"junk",
])
@pytest.mark.parametrize("segments", ["same", "separate"])
async def test_bytes_after_an_answer_are_never_the_next_answer(extra: bytes, segments: str) -> None:
    first = (OK + extra,) if segments == "same" else (OK, extra)
    pool = KeepAlivePool()
    try:
        async with server(scripted(first, (answer(b'{"next":3}'),))) as (url, seen):
            assert await post(pool, url) == (200, b'{"ok":1}')
            if segments == "separate":
                await until(lambda: seen.ended == 1)  # bytes on an idle connection: closed at once
            assert await post(pool, url) == (200, b'{"ok":1}')  # a new connection's first answer
            assert seen.connections == 2
    finally:
        pool.close()


async def test_blank_lines_between_answers_are_tolerated() -> None:
    """RFC 9112 2.2: a client ignores empty lines received before a status line."""
    pool = KeepAlivePool()
    try:
        async with server(scripted((OK + b"\r\n",))) as (url, seen):
            for _ in range(3):
                assert await post(pool, url) == (200, b'{"ok":1}')
            assert seen.connections == 1
    finally:
        pool.close()


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",  # its length is the resource's: no body follows
])
async def test_204_and_304_have_no_body_and_keep_the_connection(raw: bytes) -> None:
    status = int(raw.split(b" ")[1])
    pool = KeepAlivePool()
    try:
        async with server(scripted((raw,))) as (url, seen):
            for _ in range(3):
                assert await post(pool, url) == (status, b"")
            assert seen.connections == 1 and pool.connections() == 1
    finally:
        pool.close()


async def test_an_idle_connection_the_server_closes_leaves_the_pool_at_once() -> None:
    pool = KeepAlivePool()
    try:
        async with server(scripted((OK, None))) as (url, seen):
            assert await post(pool, url) == (200, b'{"ok":1}')
            await until(lambda: pool.connections() == 0)
            assert await post(pool, url) == (200, b'{"ok":1}')
            assert seen.connections == 2
    finally:
        pool.close()


async def test_a_switch_of_protocols_is_a_bad_response_and_closes_the_connection() -> None:
    switch = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x00"
    pool = KeepAlivePool()
    try:
        async with server(scripted((switch,))) as (url, seen):
            with pytest.raises(AttemptError) as failed:
                await post(pool, url)
            assert failed.value.kind is FailureKind.BAD_RESPONSE
            await until(lambda: seen.ended == 1)
            assert pool.connections() == 0
    finally:
        pool.close()


# ---- closes before a whole answer: CONNECT, RESET or DROPPED ------------------------------------------------------


@pytest.mark.looptime
async def test_a_fresh_connection_closed_before_any_answer_byte_is_connect() -> None:
    pool = KeepAlivePool()
    try:
        for pause in (0.0, 5.0):
            async with server(scripted((pause, None))) as (url, _):
                with pytest.raises(AttemptError) as failed:
                    await post(pool, url)
                assert failed.value.kind is FailureKind.CONNECT
    finally:
        pool.close()


@pytest.mark.looptime
async def test_a_kept_connection_closed_at_once_is_a_reset_closed_later_a_drop() -> None:
    """The close of a connection the server ended while idle crosses the request: it arrives within a round trip
    of the write (RESET: retried at once, not the server's fault). A close that comes later followed a request the
    server held: it took the request and dropped it (DROPPED: counted against it, retried elsewhere)."""
    pool = KeepAlivePool()
    try:
        for pause, kind in ((0.0, FailureKind.RESET), (STALE_CLOSE_S / 2, FailureKind.RESET),
                            (2 * STALE_CLOSE_S, FailureKind.DROPPED), (30.0, FailureKind.DROPPED)):
            async with server(scripted((OK,), (pause, None))) as (url, seen):
                assert await post(pool, url, timeout_s=60.0) == (200, b'{"ok":1}')
                with pytest.raises(AttemptError) as failed:
                    await post(pool, url, timeout_s=60.0)
                assert failed.value.kind is kind, pause
                assert len(seen.requests) == 2 and pool.connections() == 0
    finally:
        pool.close()


@pytest.mark.parametrize("cut", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n{\"ok\":",  # mid-body
    b"HTTP/1.1 200 OK\r\nContent-Le",  # mid-head
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"ok\r\n",  # between chunks
])
async def test_a_close_mid_answer_is_a_drop_on_any_connection(cut: bytes) -> None:
    pool = KeepAlivePool()
    try:
        async with server(scripted((cut, None))) as (url, _):
            with pytest.raises(AttemptError) as failed:
                await post(pool, url)
            assert failed.value.kind is FailureKind.DROPPED  # fresh: the server began its answer, so it took it
        async with server(scripted((OK,), (cut, None))) as (url, _):
            assert await post(pool, url) == (200, b'{"ok":1}')
            with pytest.raises(AttemptError) as failed:
                await post(pool, url)
            assert failed.value.kind is FailureKind.DROPPED  # reused, at once: the answer began all the same
    finally:
        pool.close()


def test_dropped_is_retried_after_a_backoff_and_counts_against_the_server() -> None:
    from fedpool.federation.core.errors import RetryState

    dropped = FailureKind.DROPPED
    assert dropped.retriable and dropped.counts_against_server
    assert FailureKind.RESET.retriable and not FailureKind.RESET.counts_against_server
    retry = RetryState()
    err = AttemptError(dropped, "server closed the connection")
    retry.record("s0", 0.0, 0.1, err)
    assert retry.retry_at_once("r", "s0", err, max_attempts=3) is False  # after a backoff, elsewhere if possible
    assert retry.tried == {"s0"} and retry.counted == 1 and retry.resets == 0
