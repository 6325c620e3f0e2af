"""In-process fakes of the interfaces fedpool reaches servers through, for tests in simulated time.

`FakeTransport` implements `federation.transport.Transport` (the dispatcher's one way to a server) over
`FakeServer`s. Each fake server runs the emulator's continuous-batching engine model
(`deploy.batching.BatchEngine`: a window of running sequences, a queue behind it, per-token prefill and decode
costs) on the running loop's clock, so its latencies are `asyncio.sleep`s: under the `looptime` plugin,
virtual seconds that pass at once and the same on every machine. It fails on demand: HTTP 500s and malformed
bodies (drawn from its own seeded rng), hangs, refused connections, a crash after N answers. Its answers and
failures go through the real transport's parsing and classification (`parse_completion`, `http_error`,
`transport_error`), so the dispatcher sees what it would see over HTTP.

`FakePool.dispatcher(...)` builds a real `Dispatcher` on that transport with the loop's (virtual) clock, a wall
clock on the same time line, a seeded rng and `asyncio.sleep`: nothing in it reads the machine's clock. It
refuses to run on a loop whose time is real, so a test that forgot `@pytest.mark.looptime` fails at once
instead of timing the machine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from fedpool.deploy.batching import BatchEngine
from fedpool.deploy.emulator import EmulatorProfile, Faults
from fedpool.federation import (
    AttemptError,
    Completion,
    DispatchConfig,
    Dispatcher,
    Endpoint,
    FailureKind,
    InferenceRequest,
    Policy,
    Timeouts,
    Transport,
)
from fedpool.federation.core.types import StreamProgress, Target
from fedpool.federation.gateway.transport import parse_completion, request_body
from fedpool.federation.gateway.unpooled import http_error, transport_error
from fedpool.registry import PoolSnapshot

WALL_EPOCH_S = 1_800_000_000.0  # the fake wall clock reads this plus the loop's time
_names = itertools.count()


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def wall_time() -> float:
    """The wall clock of a dispatcher built by FakePool (the loop's time on the wall's scale): what a registry
    scrape made "now" would carry as its observed_at."""
    return WALL_EPOCH_S + loop_time()


def require_virtual_time() -> asyncio.AbstractEventLoop:
    """The running loop, which must be on looptime's virtual clock (the test marked `@pytest.mark.looptime`)."""
    loop = asyncio.get_running_loop()
    if not getattr(loop, "looptime_on", False):
        raise RuntimeError("this test runs in simulated time: mark it @pytest.mark.looptime")
    return loop


class FakeServer:
    """One in-process OpenAI-compatible server: the emulator's engine model, its fault injection, no HTTP."""

    def __init__(self, *, model: str = "emu-model", max_running: int = 4, decode_s: float = 0.002,
                 prefill_s: float = 0.0, faults: Faults | None = None, seed: int = 0,
                 profile: EmulatorProfile | None = None):
        self.name = f"fake-{next(_names)}"
        self.url = f"http://{self.name}.invalid"
        self.model = model
        self.faults = faults or Faults()
        self.engine = BatchEngine(profile or EmulatorProfile(max_running=max_running, decode_s_per_token=decode_s,
                                                             prefill_s_per_token=prefill_s), clock=loop_time)
        self.accepting = True  # False: connections are refused (stopped, or crashed)
        self._rng = random.Random(seed)
        self._hung: list[asyncio.Future[None]] = []
        self._closing: asyncio.Task[None] | None = None
        self.inflight = 0  # requests at this server now (its HTTP connections, were it real)
        self.peak = 0  # the most it ever had at once
        self.received = 0  # requests that reached the engine's queue
        self.completed = 0
        self.cancelled = 0  # requests whose client went away before the answer (the engine dropped them)

    @property
    def profile(self) -> EmulatorProfile:
        profile = self.engine.profile
        assert isinstance(profile, EmulatorProfile)
        return profile

    @profile.setter
    def profile(self, profile: EmulatorProfile) -> None:
        """Change the engine's speed while it runs."""
        self.engine.profile = profile

    def slow_down(self, factor: float) -> None:
        self.profile = replace(self.profile, decode_s_per_token=self.profile.decode_s_per_token * factor,
                               prefill_s_per_token=self.profile.prefill_s_per_token * factor)

    @property
    def running(self) -> int:
        return self.engine.running

    @property
    def waiting(self) -> int:
        return self.engine.waiting

    def stop(self) -> None:
        """The server goes away: requests in flight fail as a dropped connection, new ones are refused."""
        self.accepting = False
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self.engine.close())
        for fut in self._hung:
            if not fut.done():
                fut.cancel()

    async def close(self) -> None:
        self.accepting = False
        await self.engine.close()
        if self._closing is not None:
            await self._closing

    async def complete(self, request: InferenceRequest, rid: str | None = None,
                       progress: StreamProgress | None = None) -> Completion:
        """What the emulator's HTTP handler does with the request, as the transport would parse it (`rid`: the id
        an SGLang-like engine may abort it by; `progress`: marked decoding at its first token, as the transport
        marks a streamed attempt at its first bytes)."""
        if not self.accepting:
            raise AttemptError(FailureKind.CONNECT, "ClientConnectorError")
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            return await self._serve(request, rid, progress)
        finally:
            self.inflight -= 1

    async def _serve(self, request: InferenceRequest, rid: str | None, progress: StreamProgress | None) -> Completion:
        body = request_body(request)
        if request.model != self.model:
            raise http_error(404, _error(f"model must be {self.model!r}"))
        max_tokens = body.get("max_tokens", self.profile.default_output_tokens)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise http_error(400, _error("max_tokens must be at least 1"))
        if self.faults.hang:
            hung = asyncio.get_running_loop().create_future()
            self._hung.append(hung)
            try:
                await hung
            except asyncio.CancelledError:
                self._dropped_or_raise()
                raise
            finally:
                self._hung.remove(hung)
        roll = self._rng.random()
        if roll < self.faults.error_rate:
            raise http_error(500, _error("injected failure"))
        prompt = body.get("prompt") if request.endpoint is Endpoint.COMPLETIONS else json.dumps(body["messages"])
        prompt_tokens = max(1, len(str(prompt).split()))
        # As the emulator (deploy.emulator.request_shape): max_tokens long with ignore_eos, else where it stops.
        stops_at = self.profile.default_output_tokens
        out_tokens = max_tokens if body.get("ignore_eos") is True else min(max_tokens, stops_at)
        self.received += 1
        try:
            first_token = None if progress is None else progress.mark
            generation = await self.engine.generate(prompt_tokens, out_tokens, (), rid, first_token)
        except asyncio.CancelledError:
            self._dropped_or_raise()
            raise
        if roll < self.faults.error_rate + self.faults.malformed_rate:
            return parse_completion(b'{"choices": [{"text": ', request.endpoint)  # raises BAD_RESPONSE
        self.completed += 1
        if self.faults.crash_after is not None and self.completed >= self.faults.crash_after:
            self.stop()  # this answer still goes out; the listener closes behind it
        text = " ".join(f"w{i}" for i in range(generation.output_tokens))
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": "length"} if request.endpoint is Endpoint.CHAT
                                  else {"index": 0, "text": text, "finish_reason": "length"})
        answer = {"id": f"cmpl-{self.name}-{self.completed}", "model": self.model, "choices": [choice],
                  "usage": {"prompt_tokens": generation.prompt_tokens, "completion_tokens": generation.output_tokens,
                            "total_tokens": generation.prompt_tokens + generation.output_tokens}}
        return parse_completion(json.dumps(answer).encode(), request.endpoint)

    def _dropped_or_raise(self) -> None:
        """A cancellation inside the server: ours (it stopped: the connection dropped) or the client's."""
        task = asyncio.current_task()
        if not self.accepting and task is not None and not task.cancelling():
            raise AttemptError(FailureKind.CONNECT, "ServerDisconnectedError")
        self.cancelled += 1


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message}}).encode()


class FakeStream:
    """An opened stream of a fake server: its answer as server-sent events, one word a chunk, then [DONE]."""

    def __init__(self, completion: Completion):
        self.headers = {"Content-Type": "text/event-stream"}
        words = completion.text.split(" ")
        events = [json.dumps({"choices": [{"index": 0, "text": (" " if i else "") + word,
                                           "finish_reason": "length" if i == len(words) - 1 else None}]})
                  for i, word in enumerate(words)]
        self._lines = [f"data: {event}\n".encode() for event in [*events, "[DONE]"]]
        self.content = self
        self.released = False

    async def readline(self) -> bytes:
        await asyncio.sleep(0)
        return self._lines.pop(0) if self._lines and not self.released else b""

    def release(self) -> None:
        self.released = True


class FakeTransport(Transport):
    """The dispatcher's Transport over fake servers, found by URL; `timeouts` as the HTTP transport applies them
    (a non-streamed answer's first byte is its last: the shorter of first-byte and total)."""

    def __init__(self, servers: Sequence[FakeServer], timeouts: Timeouts | None = None):
        self.servers = {server.url: server for server in servers}
        self.timeouts = timeouts or Timeouts()
        self.attempts = 0

    async def complete(self, server: Target, request: InferenceRequest,
                       progress: StreamProgress | None = None) -> Completion:
        self.attempts += 1
        fake = self.servers.get(server.url)
        if fake is None:
            raise AttemptError(FailureKind.CONNECT, "ClientConnectorError")
        # On an engine that aborts by id (SGLang), the attempt carries one and a cancel aborts it at once, as the
        # HTTP transport does.
        rid = f"fake-{self.attempts}" if server.abort_path is not None else None
        progress = progress if server.streamed and request.streamable else None
        try:
            async with asyncio.timeout(min(self.timeouts.first_byte_s, self.timeouts.total_s)):
                return await fake.complete(request, rid, progress)
        except TimeoutError as exc:
            if rid is not None:
                fake.engine.abort(rid)
            raise transport_error(exc, reused_connection=False) from exc
        except asyncio.CancelledError:
            if rid is not None:
                fake.engine.abort(rid)
            raise

    async def open_stream(self, server: Target, request: InferenceRequest) -> FakeStream:
        """The stream's head comes once the whole answer is ready (no per-token timing)."""
        return FakeStream(await self.complete(server, request))


class FakePool:
    """Fake servers for one test (the `fakes` fixture closes them) and virtual-time dispatchers over them."""

    def __init__(self) -> None:
        self.servers: list[FakeServer] = []

    def start(self, model: str = "emu-model", *, max_running: int = 4, decode_s: float = 0.002,
              faults: Faults | None = None, seed: int = 0, prefill_s: float = 0.0) -> FakeServer:
        """A fake server (the signature of the `emulators` fixture's start, in process)."""
        server = FakeServer(model=model, max_running=max_running, decode_s=decode_s, prefill_s=prefill_s,
                            faults=faults, seed=seed)
        self.servers.append(server)
        return server

    def dispatcher(self, snapshots: Callable[[], PoolSnapshot | None], policy: Policy, *,
                   config: DispatchConfig | None = None, seed: int = 0,
                   on_failure: Callable[[str, FailureKind], None] | None = None) -> Dispatcher:
        """A real Dispatcher over these servers on the loop's virtual clock, with a seeded rng."""
        loop = require_virtual_time()
        config = config or DispatchConfig()
        return Dispatcher(FakeTransport(self.servers, config.timeouts), snapshots, policy, config=config,
                          clock=loop.time, wall_clock=wall_time, rng=random.Random(seed), sleep=asyncio.sleep,
                          on_failure=on_failure)

    async def close(self) -> None:
        for server in self.servers:
            await server.close()
