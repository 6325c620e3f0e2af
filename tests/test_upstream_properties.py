"""A property of the keep-alive pool (federation/gateway/transport.py): over random sequences of server behaviours
and concurrent posts, every post gets its own answer or the failure its behaviour calls for, exactly once, and the
pool's books stay sound at every step (no connection idle twice, none idle and busy, every idle one open and
quiet). White-box: the checks read the pool's private books. Each example runs on a fresh looptime loop (the
server is in that loop: no real I/O is waited for, and the slow behaviours cost no real time)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import looptime
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpool.federation.core.errors import AttemptError, FailureKind
from fedpool.federation.gateway.transport import KeepAlivePool
from tests.test_upstream import answer

TIMEOUT_S = 5.0  # each post's
CANCEL_AFTER_S = 0.5  # a "cancel" post is cancelled by its caller this long after it started
IDLE_S = 15.0

# behaviour -> what the post may end with: an answer (its own id echoed) or these failures
EXPECTED: dict[str, frozenset[object]] = {
    "answer": frozenset({"ok"}),  # keep-alive answer
    "close_after": frozenset({"ok"}),  # answer with `Connection: close`, then the server closes
    "informational": frozenset({"ok"}),  # 100 Continue, a pause, then the answer
    "extra": frozenset({"ok"}),  # the answer, and the start of another nobody asked for
    "slow": frozenset({"ok"}),  # the answer after a pause within the timeout
    "drop": frozenset({FailureKind.CONNECT, FailureKind.RESET}),  # closed at once, unanswered
    "drop_late": frozenset({FailureKind.CONNECT, FailureKind.DROPPED}),  # held a while, then closed unanswered
    "cut": frozenset({FailureKind.DROPPED}),  # half an answer, then closed
    "timeout": frozenset({FailureKind.TIMEOUT}),  # answers after the caller's timeout
    "cancel": frozenset({"cancelled"}),  # the caller cancels before the answer
}
BEHAVIOURS = sorted(EXPECTED)


def check_books(pool: KeepAlivePool) -> None:
    """The pool's invariants, at any moment."""
    idle = [c for conns in pool._idle.values() for c in conns]
    assert len({id(c) for c in idle}) == len(idle), "a connection idle twice"
    assert not {id(c) for c in idle} & {id(c) for c in pool._busy}, "a connection idle and busy"
    for key, conns in pool._idle.items():
        assert conns, "an empty idle list kept"
        for c in conns:
            assert c.key == key and not c.closed and c.waiter is None and c.keep, "an idle connection not fit"
    for c in pool._busy:
        assert not (c.closed and c.keep)


@dataclass
class Server:
    """Acts out the behaviour each request names (its JSON body: {"id": n, "do": behaviour})."""

    check: Callable[[], None]
    requests: int = 0
    open_connections: int = 0
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while (request := await self._read(reader)) is not None:
                self.requests += 1
                self.check()
                if not await self._act(request["do"], str(request["id"]).encode(), writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self.open_connections -= 1
            self.handlers.discard(task)
            writer.close()

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> dict[str, object] | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        parsed: dict[str, object] = json.loads(await reader.readexactly(length))
        return parsed

    @staticmethod
    async def _act(do: object, ident: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer (or not) one request; False: the connection ends."""
        pauses = {"slow": 0.5, "timeout": TIMEOUT_S + 1.0, "cancel": 2 * CANCEL_AFTER_S, "drop_late": 1.0}
        if do in pauses:
            await asyncio.sleep(pauses[str(do)])
        if do in ("drop", "drop_late"):
            return False
        if do == "cut":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{\"id\":")
            await writer.drain()
            return False
        if do == "informational":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
        extra = b"HTTP/1.1 200 OK\r\nContent-Le" if do == "extra" else b""
        writer.write(answer(ident, close=do == "close_after") + extra)
        await writer.drain()
        return do != "close_after"


async def post_one(pool: KeepAlivePool, url: str, ident: int, do: str) -> object:
    """One post's outcome: "ok" (its own answer), a FailureKind, or "cancelled"."""
    body = json.dumps({"id": ident, "do": do}).encode()
    try:
        got = await pool.post(url, body, timeout_s=TIMEOUT_S, connect_s=1.0, limit=1 << 16)
    except AttemptError as exc:
        return exc.kind
    except asyncio.CancelledError:
        return "cancelled"
    assert (got.status, got.body) == (200, str(ident).encode()), (do, got)  # its own answer, never another's
    return "ok"


async def run_scenario(waves: list[tuple[list[str], float]]) -> None:
    pool = KeepAlivePool(idle_s=IDLE_S)
    srv = Server(lambda: check_books(pool))
    listener = await asyncio.start_server(srv.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}/v1/completions"
    loop = asyncio.get_running_loop()
    ident = 0
    try:
        for behaviours, pause in waves:
            tasks = []
            for do in behaviours:
                ident += 1
                task = asyncio.create_task(post_one(pool, url, ident, do))
                task.add_done_callback(lambda _: check_books(pool))
                if do == "cancel":
                    loop.call_later(CANCEL_AFTER_S, task.cancel)
                tasks.append(task)
            outcomes = await asyncio.gather(*tasks)
            for do, outcome in zip(behaviours, outcomes, strict=True):
                assert outcome in EXPECTED[do], (do, outcome)
            check_books(pool)
            await asyncio.sleep(pause)  # idle connections the server closed leave; past IDLE_S, the sweep's
            check_books(pool)
    finally:
        pool.close()
        assert pool.connections() == 0
        for _ in range(1000):  # the server sees every connection end (its slowest behaviour ends in TIMEOUT_S + 1)
            if srv.open_connections == 0:
                break
            await asyncio.sleep(0.01)
        await asyncio.gather(*srv.handlers, return_exceptions=True)
        listener.close()
        await listener.wait_closed()
    assert srv.open_connections == 0
    assert srv.requests == ident  # every post reached the server once (nothing lost, nothing sent twice)


waves_strategy = st.lists(
    st.tuples(st.lists(st.sampled_from(BEHAVIOURS), min_size=1, max_size=4),
              st.sampled_from([0.0, 0.001, 0.2, IDLE_S + 1.0])),
    min_size=1, max_size=6,
)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(waves=waves_strategy)
def test_the_pools_books_hold_and_every_post_ends_once_as_its_server_behaved(
        waves: list[tuple[list[str], float]]) -> None:
    loop = looptime.new_event_loop(start=0.0)
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))  # a waiter set twice would land here
    try:
        loop.run_until_complete(asyncio.wait_for(run_scenario(waves), 3600.0))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    assert not errors, errors
