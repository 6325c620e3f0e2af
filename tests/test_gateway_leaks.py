"""No slot is ever stranded, state stays bounded, and each request is counted once: the dispatcher driven directly
and through the gateway, over real emulated servers (and a few purpose-built engines: real aiohttp apps) on
loopback. A request is cancelled after 0, 1, 2, ... turns of the event loop until one finishes before its
cancellation, so every await point on its way is a point it was cancelled at; after each, every slot is back.
The gateway and the engines share the test's loop, so turning it moves all of them."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from fedpool.deploy.emulator import Faults
from fedpool.federation import DispatchConfig, Dispatcher, InferenceRequest, RequestFailed, make_policy, new_session
from fedpool.federation.core.errors import FailureKind
from fedpool.federation.core.policy import Policy
from fedpool.federation.core.types import Endpoint, SamplingParams
from fedpool.federation.gateway.handlers import SHARED_CLIENT, Gateway, serving
from fedpool.federation.gateway.transport import HttpTransport
from fedpool.federation.gateway.unpooled import UrlTarget
from fedpool.federation.routing.policies import SampledPolicy
from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus
from tests.conftest import EmulatorFactory

MODEL = "emu-model"
REVISION = "r1"  # explicit: servers that share it are replicas (a stream may continue on one)
MAX_TURNS = 600  # loop turns a request takes here at most (it finishes in far fewer)


# ---- the rig: a dispatcher (and a gateway) over real servers, the snapshot in the test's hands ------------
@dataclass
class Rig:
    dispatcher: Dispatcher
    gateway: Gateway
    url: str
    entries: list[ServerEntry]
    snapshot: PoolSnapshot = field(init=False)

    def __post_init__(self) -> None:
        self.snapshot = PoolSnapshot(1, 0.0, tuple(self.entries))

    def set_servers(self, entries: Sequence[ServerEntry]) -> None:
        """A new snapshot (as the registry's watcher would deliver it)."""
        self.entries = list(entries)
        self.snapshot = PoolSnapshot(self.snapshot.version + 1, 0.0, tuple(entries))
        self.dispatcher.notify_snapshot()


def entry(server_id: str, url: str, *, model: str = MODEL, capacity: int = 4,
          engine: Engine = Engine.VLLM) -> ServerEntry:
    record = ServerRecord(id=server_id, url=url, engine=engine, model=model, revision=REVISION,
                          accelerator="cpu", capacity=capacity)
    return ServerEntry(record, ServerStatus.HEALTHY, capacity, 1.0)


@contextlib.asynccontextmanager
async def rig(entries: Sequence[ServerEntry], *, policy: str | Policy = "least_inflight",
              config: DispatchConfig | None = None, **gateway_options: Any) -> AsyncIterator[Rig]:
    async with new_session() as session:
        holder: list[Rig] = []
        config = config or DispatchConfig(no_server_timeout_s=2.0, backoff_base_s=0.01, backoff_max_s=0.02)
        dispatcher = Dispatcher(HttpTransport(session, config.timeouts), lambda: holder[0].snapshot if holder else None,
                                policy if isinstance(policy, Policy) else make_policy(policy), config=config)
        gateway = Gateway(dispatcher, lambda: holder[0].snapshot if holder else None, tune_gc=False,
                          **gateway_options)
        async with serving(gateway.app()) as url:
            holder.append(Rig(dispatcher, gateway, url, list(entries)))
            dispatcher.notify_snapshot()
            yield holder[0]


def request(prompt: str = "count", *, max_tokens: int = 4, client: str = "c", endpoint: Endpoint = Endpoint.COMPLETIONS,
            temperature: float = 0.0) -> InferenceRequest:
    chat = endpoint is Endpoint.CHAT
    return InferenceRequest(
        request_id=f"r-{prompt}", model=MODEL, endpoint=endpoint, prompt=None if chat else prompt,
        messages=({"role": "user", "content": prompt},) if chat else None,
        params=SamplingParams(max_tokens=max_tokens, temperature=temperature), client_id=client)


async def slots_back(dispatcher: Dispatcher, turns: int = 2000) -> dict[str, int]:
    """What is still in flight once it is nothing, or after `turns` turns of the loop (each at least 1 ms)."""
    for _ in range(turns):
        if not dispatcher.inflight():
            break
        await asyncio.sleep(0.001)
    return dispatcher.inflight()


async def in_flight(dispatcher: Dispatcher) -> None:
    """Until a request holds a slot."""
    for _ in range(5000):
        if dispatcher.inflight():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("no request took a slot")


async def cancel_at_every_step(start: Callable[[], Awaitable[object]], dispatcher: Dispatcher,
                               expected: tuple[type[BaseException], ...] = ()) -> int:
    """Start a fresh `start()` and cancel it after 0, 1, 2, ... loop turns, until one finishes before its
    cancellation (so every point on its way was a point it was cancelled at); after each, every slot must be
    back. Returns the number of points. `expected`: exceptions the finished run may end with."""
    for turns in range(MAX_TURNS):
        task = asyncio.ensure_future(start())
        for _ in range(turns):
            if task.done():
                break
            await asyncio.sleep(0)
        if task.done():
            try:
                await task
            except expected:
                pass
            assert await slots_back(dispatcher) == {}, "the finished run left a slot behind"
            return turns
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, *expected):
            await task
        left = await slots_back(dispatcher)
        assert left == {}, f"cancelled after {turns} loop turns, it left {left} behind"
    raise AssertionError(f"never finished within {MAX_TURNS} loop turns")


async def read_stream(dispatcher: Dispatcher, req: InferenceRequest) -> None:
    async with dispatcher.stream(req) as upstream:
        while await upstream.response.content.readline():
            pass
    dispatcher.stream_ended(ok=True)


# ---- engines that misbehave in one precise way (real aiohttp apps on loopback) ----------------------------
class OddEngine:
    """An OpenAI-compatible engine that answers streams with `chunks` chunks and then, per `ending`: finishes
    (`finish`), drops the connection (`drop`), or drops it after the head before any event (`drop_at_head`).
    Non-streamed requests get `body` as is."""

    def __init__(self, *, ending: str = "finish", chunks: int = 3, body: bytes | None = None, model: str = MODEL,
                 pause_s: float = 0.0):
        self.ending, self.chunks, self.model, self.pause_s = ending, chunks, model, pause_s
        self.body = body
        self.requests = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._serve)
        app.router.add_post("/v1/chat/completions", self._serve)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=self.body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.ending == "drop_at_head":
            assert request.transport is not None
            request.transport.close()
            return response
        for i in range(self.chunks):
            chunk = {"id": "odd-1", "object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(self.pause_s)
        if self.ending == "drop":
            await asyncio.sleep(0.05)  # the chunks reach the gateway before the connection goes
            assert request.transport is not None
            request.transport.close()
            return response
        last = {"id": "odd-1", "object": "text_completion", "model": self.model,
                "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}
        await response.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def odd_engines() -> AsyncIterator[list[OddEngine]]:
    made: list[OddEngine] = []
    yield made
    for engine in made:
        await engine.stop()


async def odd(made: list[OddEngine], **kwargs: Any) -> OddEngine:
    engine = OddEngine(**kwargs)
    await engine.start()
    made.append(engine)
    return engine


# ---- the dispatcher, directly ------------------------------------------------------------------------------
async def test_submit_cancelled_at_every_step_gives_its_slot_back(emulators: EmulatorFactory) -> None:
    fast = await emulators.start(decode_s=0.0)
    failing = await emulators.start(decode_s=0.0, faults=Faults(error_rate=1.0))
    async with rig([entry("fast", fast.url)]) as one:
        points = await cancel_at_every_step(lambda: one.dispatcher.submit(request()), one.dispatcher)
        assert points > 3
        assert one.dispatcher.stats().inflight_total == 0
    # A first attempt that fails (HTTP 500), a retry after a backoff elsewhere: every step of that path too.
    async with rig([entry("failing", failing.url), entry("fast", fast.url)], policy="round_robin") as two:
        points = await cancel_at_every_step(lambda: two.dispatcher.submit(request()), two.dispatcher,
                                            expected=(RequestFailed,))
        assert points > 3
    # An engine of llama.cpp's kind is asked for a stream that the transport assembles: every step of that too.
    async with rig([entry("streamed", fast.url, engine=Engine.LLAMACPP)]) as streamed:
        points = await cancel_at_every_step(lambda: streamed.dispatcher.submit(request()), streamed.dispatcher)
        assert points > 3 and streamed.dispatcher.stats().inflight_total == 0


async def test_stream_cancelled_at_every_step_gives_its_slot_back(emulators: EmulatorFactory,
                                                                  odd_engines: list[OddEngine]) -> None:
    fast = await emulators.start(decode_s=0.0)
    async with rig([entry("fast", fast.url)]) as one:
        assert await cancel_at_every_step(lambda: read_stream(one.dispatcher, request()), one.dispatcher) > 3
    # An engine that fails before its head reaches us (HTTP 500): retried elsewhere, every step of it.
    failing = await emulators.start(decode_s=0.0, faults=Faults(error_rate=1.0))
    async with rig([entry("failing", failing.url), entry("fast", fast.url)], policy="round_robin") as two:
        assert await cancel_at_every_step(lambda: read_stream(two.dispatcher, request()), two.dispatcher,
                                          expected=(RequestFailed,)) > 3


async def test_stream_cancelled_while_the_engine_holds_its_head_gives_the_slot_back(
        emulators: EmulatorFactory) -> None:
    """The engine accepts the request and never answers: the caller gives up while the dispatcher waits for
    the response head (the slot used to stay taken for good)."""
    hung = await emulators.start(faults=Faults(hang=True))
    async with rig([entry("hung", hung.url)]) as one:
        for kind in ("stream", "submit"):
            task = asyncio.ensure_future(read_stream(one.dispatcher, request()) if kind == "stream"
                                         else one.dispatcher.submit(request()))
            await in_flight(one.dispatcher)
            await asyncio.sleep(0.05)  # well into the wait for the head
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert one.dispatcher.inflight() == {}, kind


async def test_hedged_requests_cancelled_at_any_time_give_every_slot_back(emulators: EmulatorFactory) -> None:
    """At a client's tail a straggler is copied onto a replica; cancelled at any moment (before, during and
    after the copy), the request gives back its slot and its copy's."""
    a = await emulators.start(decode_s=0.001)
    b = await emulators.start(decode_s=0.001)
    config = DispatchConfig(hedge_min_delay_s=0.02, hedge_factor=1.0, no_server_timeout_s=2.0)
    async with rig([entry("a", a.url), entry("b", b.url)], config=config) as pool:
        dispatcher = pool.dispatcher
        for i in range(12):  # the model's median latency, learned
            await dispatcher.submit(request(f"warm {i}"))
        dispatcher.client_done_sending("c")
        b.faults = Faults(hang=True)  # b's requests straggle from now on; a copy on a answers them
        copies_before = dispatcher.stats().hedges
        for delay_ms in [*range(0, 60, 3), None]:
            first = asyncio.ensure_future(dispatcher.submit(request(f"x{delay_ms}")))
            second = asyncio.ensure_future(dispatcher.submit(request(f"y{delay_ms}")))  # one lands on b
            if delay_ms is not None:
                await asyncio.sleep(delay_ms / 1000)
                first.cancel()
                second.cancel()
            results = await asyncio.gather(first, second, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) or not isinstance(r, BaseException) for r in results)
            assert await slots_back(dispatcher) == {}, f"cancelled after {delay_ms} ms"
        assert dispatcher.stats().hedges > copies_before  # copies did run (and were cancelled with the rest)


# ---- through the gateway -----------------------------------------------------------------------------------
async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.read()


async def post_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], lines: int | None = None
                      ) -> list[bytes]:
    """The stream's lines (all of them, or the first `lines`, then the connection is dropped)."""
    out: list[bytes] = []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        while lines is None or len(out) < lines:
            line = await resp.content.readline()
            if not line:
                break
            if line.strip():
                out.append(line.strip())
        if lines is not None:
            resp.close()  # the client goes away mid-stream
    return out


async def test_gateway_requests_dropped_by_their_client_at_every_step_give_the_slot_back(
        emulators: EmulatorFactory) -> None:
    fast = await emulators.start(decode_s=0.0)
    body = {"model": MODEL, "prompt": "count", "max_tokens": 4}
    async with rig([entry("fast", fast.url)]) as one:
        for streaming in (False, True):
            async def once(streaming: bool = streaming) -> object:
                # A session per attempt: cancelling it closes its connection, as a client going away does.
                async with aiohttp.ClientSession() as session:
                    if streaming:
                        return await post_stream(session, one.url, body)
                    return await post(session, one.url, body)

            assert await cancel_at_every_step(once, one.dispatcher) > 3
        stats = one.dispatcher.stats()
        assert stats.failed == 0 and stats.inflight_total == 0  # a client going away is no failure


async def test_gateway_client_gone_while_the_engine_holds_the_answer_gives_the_slot_back(
        emulators: EmulatorFactory) -> None:
    """The engine never answers; the client hangs up. With handler cancellation the gateway gives the slot
    back at once (without it, it waited for an answer that would never come)."""
    hung = await emulators.start(faults=Faults(hang=True))
    async with rig([entry("hung", hung.url)]) as one, aiohttp.ClientSession() as session:
        for streaming in (False, True):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": streaming}
            task = asyncio.ensure_future(post(session, one.url, body))
            await in_flight(one.dispatcher)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert await slots_back(one.dispatcher) == {}, f"streaming={streaming}"
        assert one.dispatcher.stats().failed == 0
        metrics = await scrape(session, one.url)
        assert metrics[("fedpool_gateway_requests_total", (("endpoint", "/v1/completions"),
                                                           ("status", "client_closed")))] == 2


async def test_a_stream_whose_client_leaves_mid_way_is_not_a_failure(odd_engines: list[OddEngine]) -> None:
    slow = await odd(odd_engines, chunks=100, pause_s=0.01)
    async with rig([entry("slow", slow.url)]) as one, aiohttp.ClientSession() as session:
        got = await post_stream(session, one.url, {"model": MODEL, "prompt": "a long one", "max_tokens": 64}, lines=2)
        assert len(got) == 2
        assert await slots_back(one.dispatcher) == {}
        stats = one.dispatcher.stats()
        assert stats.submitted == 1 and stats.failed == 0 and stats.completed == 0


async def test_a_stream_migrated_mid_way_is_one_request_and_gives_back_both_slots(
        emulators: EmulatorFactory, odd_engines: list[OddEngine]) -> None:
    dying = await odd(odd_engines, ending="drop", chunks=3)
    healthy = await emulators.start(decode_s=0.0)
    async with rig([entry("dying", dying.url), entry("healthy", healthy.url)],
                   policy=PreferFirst("dying")) as pool, aiohttp.ClientSession() as session:
        lines = await post_stream(session, pool.url, {"model": MODEL, "prompt": "go on", "max_tokens": 8})
        texts = [json.loads(line[5:])["choices"][0]["text"] for line in lines if line != b"data: [DONE]"]
        assert texts[:3] == [" w0", " w1", " w2"] and len(texts) > 3 and lines[-1] == b"data: [DONE]"
        assert {json.loads(line[5:])["id"] for line in lines[:-1]} == {"odd-1"}  # one stream to the client
        assert await slots_back(pool.dispatcher) == {}
        stats = pool.dispatcher.stats()
        assert (stats.submitted, stats.completed, stats.failed) == (1, 1, 0)  # a continuation is no new request
        metrics = await scrape(session, pool.url)
        assert metrics[("fedpool_gateway_stream_migrations_total", ())] == 1


async def test_a_stream_that_breaks_before_its_first_event_is_retried_elsewhere_unseen(
        emulators: EmulatorFactory, odd_engines: list[OddEngine]) -> None:
    broken = await odd(odd_engines, ending="drop_at_head")
    healthy = await emulators.start(decode_s=0.0)
    async with rig([entry("broken", broken.url), entry("healthy", healthy.url)],
                   policy=PreferFirst("broken")) as pool, aiohttp.ClientSession() as session:
        async with session.post(pool.url + "/v1/completions",
                                json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}) as resp:
            assert resp.status == 200 and resp.headers["X-Fedpool-Server"] == "healthy"
            text = await resp.text()
        assert broken.requests == 1 and text.rstrip().endswith("data: [DONE]")
        assert await slots_back(pool.dispatcher) == {}
        stats = pool.dispatcher.stats()
        assert (stats.submitted, stats.completed, stats.failed) == (1, 1, 0)


async def test_the_engines_bytes_pass_through_and_only_a_differing_model_is_rewritten(
        odd_engines: list[OddEngine]) -> None:
    """The answer is the engine's body byte for byte (its spacing, key order, escapes, a 2 MB text that arrives
    in many reads); an engine that names its model otherwise has only `model` rewritten."""
    text = "é \\u00e9 " + "x" * 2_000_000
    raw = ('{"id":"a", "model" : "emu-model","object":"text_completion","created":1,"choices":[{"index":0,'
           f'"text":{json.dumps(text)},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":1,"completion_tokens":2}}}}')
    same = await odd(odd_engines, body=raw.encode())
    other = await odd(odd_engines, body=raw.replace('"model" : "emu-model"', '"model":"/weights/x.gguf"').encode())
    async with rig([entry("same", same.url)]) as one, aiohttp.ClientSession() as session:
        status, body = await post(session, one.url, {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert status == 200 and body == raw.encode()
        one.set_servers([entry("other", other.url)])
        status, body = await post(session, one.url, {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert status == 200 and json.loads(body) == json.loads(raw)


async def test_a_reset_on_a_reused_keepalive_connection_is_told_from_a_fresh_one() -> None:
    """An engine that closes idle keep-alive connections without saying so: the next request on the pooled
    connection finds it closed (a RESET: retried at once, not the server's fault); on a fresh connection the
    same failure is the server's."""
    answered = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            if answered[0]:
                break  # every request after the first: dropped unanswered, the connection closed
            answered[0] += 1
            body = (b'{"choices":[{"text":"ok","finish_reason":"stop"}],"model":"emu-model",'
                    b'"usage":{"prompt_tokens":1,"completion_tokens":1}}')
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    target = UrlTarget("s", url)
    try:
        async with new_session() as session:
            transport = HttpTransport(session)
            assert (await transport.complete(target, request())).text == "ok"
            kinds = []  # the second request goes on the pooled connection, the third on a new one
            for _ in range(2):
                try:
                    await transport.complete(target, request())
                except Exception as exc:
                    kinds.append(getattr(exc, "kind", None))
        assert kinds == [FailureKind.RESET, FailureKind.CONNECT], kinds
    finally:
        server.close()
        await server.wait_closed()


class PreferFirst(SampledPolicy):
    """Least in flight, but `first` whenever it has room (tests need the broken engine picked first)."""

    def __init__(self, first: str):
        super().__init__(_First(first))


class _First:
    def __init__(self, first: str):
        self.first = first

    def pick(self, candidates: Sequence[Any], request: InferenceRequest) -> Any:
        for candidate in candidates:
            if candidate.id == self.first:
                return candidate
        return min(candidates, key=lambda c: c.inflight)

    def forget_server(self, server_id: str) -> None:
        return None


class Stray(SampledPolicy):
    """Answers its first placement with a server of another route (a policy bug); fine afterwards."""

    def __init__(self) -> None:
        super().__init__(_First(""))
        self.seen: dict[str, Any] = {}
        self.strays = 0

    def place(self, route: Any, request: InferenceRequest, tried: set[str]) -> Any:
        for server in route.servers:
            self.seen[server.id] = server
        foreign = [s for s in self.seen.values() if s not in route.servers]
        if foreign and not self.strays:
            self.strays += 1
            return foreign[0]
        return super().place(route, request, tried)


class Failing(SampledPolicy):
    """Raises on its first placement (a policy bug); fine afterwards."""

    def __init__(self) -> None:
        super().__init__(_First(""))
        self.raised = False

    def place(self, route: Any, request: InferenceRequest, tried: set[str]) -> Any:
        if not self.raised:
            self.raised = True
            raise RuntimeError("a bug in a policy")
        return super().place(route, request, tried)


async def test_a_policy_that_strays_outside_the_route_or_raises_does_not_stall_the_grant_passes(
        emulators: EmulatorFactory) -> None:
    """A policy's bad answer (a server of another model; an exception) costs that one decision, not the grant
    pass: requests after it are still served, and none is sent to a server outside its route."""
    ours = await emulators.start(decode_s=0.0)
    theirs = await emulators.start(model="other-model", decode_s=0.0)
    for policy in (Stray(), Failing()):
        async with rig([entry("ours", ours.url), entry("theirs", theirs.url, model="other-model")],
                       policy=policy) as pool:
            other = InferenceRequest(request_id="o", model="other-model", endpoint=Endpoint.COMPLETIONS,
                                     prompt="x", params=SamplingParams(max_tokens=2), client_id="c")
            await asyncio.wait_for(pool.dispatcher.submit(other), 10)  # the policy has seen the other route
            results = await asyncio.wait_for(asyncio.gather(
                *(pool.dispatcher.submit(request(f"q{i}")) for i in range(3)), return_exceptions=True), 10)
            assert all(not isinstance(r, BaseException) and r.server_id == "ours" for r in results), results
            assert await slots_back(pool.dispatcher) == {}


# ---- bounded state -----------------------------------------------------------------------------------------
async def test_distinct_client_ids_are_capped(emulators: EmulatorFactory) -> None:
    fast = await emulators.start(decode_s=0.0, max_running=64)
    async with rig([entry("fast", fast.url, capacity=64)], max_client_ids=8) as pool, \
            aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        statuses = await asyncio.gather(*(post(session, pool.url, body, {"X-Fedpool-Client": f"caller-{i}"})
                                          for i in range(40)))
        assert {status for status, _ in statuses} == {200}  # past the cap, served (in one shared bucket)
        assert len(pool.gateway.client_ids) == 8 and pool.gateway.client_ids.shared == 32
        assert pool.dispatcher.forget_idle_clients(0.0) == 9  # the dispatcher knew 8 ids and the shared bucket


async def test_idle_client_ids_are_forgotten_with_nothing_waiting(emulators: EmulatorFactory) -> None:
    """Forgotten after their TTL here and in the dispatcher (whose own sweep runs only while requests wait)."""
    fast = await emulators.start(decode_s=0.0, max_running=64)
    async with rig([entry("fast", fast.url, capacity=64)], client_ttl_s=0.5) as pool, \
            aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        for i in range(5):
            assert (await post(session, pool.url, body, {"X-Fedpool-Client": f"caller-{i}"}))[0] == 200
        for _ in range(500):  # nothing waits in the dispatcher now; the ids go all the same
            if not len(pool.gateway.client_ids):
                break
            await asyncio.sleep(0.01)
        assert len(pool.gateway.client_ids) == 0
        await asyncio.sleep(0.6)  # a sweep after the ids' TTL has passed in the dispatcher's clock too
        assert pool.dispatcher.forget_idle_clients(0.0) == 0  # the gateway's sweeps left nothing to forget


async def test_metric_series_of_servers_that_left_the_pool_are_removed(emulators: EmulatorFactory) -> None:
    a = await emulators.start(decode_s=0.0)
    b = await emulators.start(decode_s=0.0)
    async with rig([entry("a", a.url), entry("b", b.url)]) as pool, aiohttp.ClientSession() as session:
        for _ in range(4):
            await post(session, pool.url, {"model": MODEL, "prompt": "x", "max_tokens": 1})

        def servers(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
            return {dict(labels)["server_id"] for name, labels in metrics if name == "fedpool_gateway_server_window"}

        assert servers(await scrape(session, pool.url)) == {"a", "b"}
        pool.set_servers([entry("a", a.url)])
        assert servers(await scrape(session, pool.url)) == {"a"}


async def test_the_gateway_refuses_while_its_loop_is_behind_and_recovers(emulators: EmulatorFactory) -> None:
    """The dispatcher's grant passes run late (here: the loop blocked 150 ms right after requests arrive, as a
    CPU-bound gateway's is): new requests are refused at once (503, Retry-After) rather than queued; once the
    loop keeps up, with no request to measure it, the measure fades and requests are served again."""
    import time

    fast = await emulators.start(decode_s=0.0, max_running=64)
    async with rig([entry("fast", fast.url, capacity=64)]) as pool, aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "q", "max_tokens": 1}
        assert (await post(session, pool.url, body))[0] == 200
        for _ in range(40):
            task = asyncio.ensure_future(pool.dispatcher.submit(request("load")))
            await asyncio.sleep(0)  # submitted: its grant pass is due on the next turn ...
            time.sleep(0.15)  # noqa: ASYNC251 - ... and runs 150 ms late
            await task
            if pool.gateway.overload.check():
                break
        status, payload = await post(session, pool.url, body)
        assert status == 503 and json.loads(payload)["error"]["code"] == "gateway_overloaded"
        for _ in range(400):  # idle: the measure fades, requests are served again
            await asyncio.sleep(0.02)
            if (await post(session, pool.url, body))[0] == 200:
                break
        else:
            raise AssertionError("the gateway kept refusing after its loop caught up")
        for _ in range(10):  # and keeps serving: the stale measure does not come back with the next grant pass
            assert (await post(session, pool.url, body))[0] == 200


async def test_the_gateway_settles_the_collector_on_startup(emulators: EmulatorFactory) -> None:
    """Objects alive at startup are frozen out of full collections (which walked all of them, ~100-300 ms,
    every few seconds under load) and young collections are rarer."""
    fast = await emulators.start(decode_s=0.0)
    before = gc.get_threshold()
    try:
        async with new_session() as session:
            snapshot = PoolSnapshot(1, 0.0, (entry("fast", fast.url),))
            dispatcher = Dispatcher(HttpTransport(session), lambda: snapshot, make_policy("least_inflight"))
            async with serving(Gateway(dispatcher, lambda: snapshot).app()):
                assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] >= 20_000
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_shared_bucket_is_no_name_a_client_can_give() -> None:
    from fedpool.federation.gateway.handlers import CLIENT_NAME

    assert CLIENT_NAME.sub("_", SHARED_CLIENT) != SHARED_CLIENT

