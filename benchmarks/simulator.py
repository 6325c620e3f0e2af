"""The scheduler in simulated time: the real dispatchers and policies against modelled engines, in one process.

Every server is the emulator's continuous-batching engine (`deploy/batching.BatchEngine` with one of the
emulator's profiles, its request handling `deploy/emulator.request_shape`), reached through an in-process
`Transport` (`SimTransport`) instead of HTTP. The event loop runs on a virtual clock (the `looptime`
package: when nothing is ready, time jumps to the next timer), and every dispatcher gets that clock, so an
hour of a 10,000-server pool takes what its Python work takes, and the machine's cores do not shape the
schedule. CPU per decision is measured separately (process time inside the grant step).

What runs is not a re-implementation: `Dispatcher`, the policies, admission windows, learning, the planner and
(with `leases`) the registry's lease broker are the product's own classes. What is modelled: the engines (the
emulator's step model), the network (no latency; a killed server refuses at once), and the registry's
snapshots (handed to the dispatchers directly, like a long poll that answers at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import looptime
from aiohttp import streams, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from fedpool.clients.delegate import DelegatingDispatcher, Sender
from fedpool.deploy.batching import BatchEngine, PromptTooLong, prompt_blocks
from fedpool.deploy.emulator import EmulatorProfile, request_shape
from fedpool.federation import (
    AttemptError,
    Completion,
    DispatchConfig,
    Dispatcher,
    Endpoint,
    FailureKind,
    InferenceRequest,
    Policy,
)
from fedpool.federation.core.types import EngineTimes, StreamProgress, Target
from fedpool.federation.gateway.handlers import Gateway
from fedpool.federation.gateway.leases import LeaseClient
from fedpool.federation.gateway.transport import request_body
from fedpool.federation.gateway.unpooled import UrlTarget
from fedpool.federation.routing.horizon import kind_costs
from fedpool.registry import (
    DemandReport,
    Engine,
    Lease,
    LeaseBroker,
    LeaseServer,
    LeaseService,
    LoadSample,
    PoolSnapshot,
    ServerEntry,
    ServerRecord,
    ServerStatus,
    prior_weight,
)
from fedpool.registry.leases import PLACEMENT

TIMED_ENGINES = (Engine.VLLM, Engine.LLAMACPP)  # engines whose answers can carry their own times
MODEL = "sim-7b"
PROBE_S = 2.0  # the registry's default probe interval: each engine's load is scraped this often


@dataclass(frozen=True, slots=True)
class Kind:
    """A kind of server in a simulated pool: an emulator profile on an accelerator, and its share of the pool."""

    profile: str  # a name in deploy.emulator.PROFILES
    accelerator: str
    engine: Engine
    share: float


@dataclass
class SimServer:
    id: str
    kind: str
    profile: EmulatorProfile
    record: ServerRecord
    engine: BatchEngine
    alive: bool = True
    load: LoadSample | None = None  # the latest scrape
    answered_by: Counter[str] = field(default_factory=Counter)  # client -> requests it answered
    last_answer_s: float = 0.0  # when it answered its last request (simulated seconds)

    def healthy_entry(self) -> ServerEntry:
        """The server as the registry lists it while healthy, at its prior weight (what routing knows up front)."""
        return ServerEntry(self.record, ServerStatus.HEALTHY, self.profile.max_running, prior_weight(self.record))


class SimTransport:
    """The dispatcher's `Transport`, in process: a request goes straight to its server's engine model."""

    def __init__(self, servers: Mapping[str, SimServer], *, engine_times: bool = False):
        self.servers = servers
        self.attempts = 0
        # Answers carry their own engine times where the engine reports them: vLLM with `--enable-per-request-metrics`
        # and llama.cpp (`timings`); SGLang's do not.
        self.engine_times = engine_times
        # Told of each answer's own engine times (server id, prompt and output tokens, prefill seconds — from its
        # admission to its first token — and decode seconds), as llama.cpp's `timings` report them; None: not asked.
        self.on_timing: Callable[[str, int, int, float, float], None] | None = None

    async def complete(self, server: Target, request: InferenceRequest,
                       progress: StreamProgress | None = None) -> Completion:
        self.attempts += 1
        sim = self.servers.get(server.id)
        if sim is None or not sim.alive:
            raise AttemptError(FailureKind.CONNECT, "connection refused (server down)")
        body = request_body(request)
        _, words, prompt_tokens, out_tokens = request_shape(body, request.endpoint is Endpoint.CHAT, sim.profile, 0)
        blocks = prompt_blocks(words) if sim.profile.prefix_cache else ()
        # On an engine that aborts by id (SGLang), the attempt carries one and a cancel aborts it at once, as the
        # HTTP transport does.
        rid = f"sim-{self.attempts}" if server.abort_path is not None else None
        loop = asyncio.get_running_loop()
        asked, began = self.on_timing, loop.time()
        timed = asked is not None or self.engine_times
        first: list[float] = []  # when its first token came (timed only)

        def first_token() -> None:
            first.append(loop.time())

        try:
            generation = await sim.engine.generate(prompt_tokens, out_tokens, blocks, rid,
                                                   first_token if timed else None)
        except PromptTooLong as exc:
            raise AttemptError(FailureKind.REQUEST_ERROR, "HTTP 400", status=400, upstream_message=str(exc)) from None
        except asyncio.CancelledError:
            if rid is not None:
                sim.engine.abort(rid)
            task = asyncio.current_task()
            if not sim.alive and task is not None and not task.cancelling():
                raise AttemptError(FailureKind.CONNECT, "server died mid-request") from None
            raise
        if not sim.alive:
            raise AttemptError(FailureKind.CONNECT, "server died mid-request")
        sim.answered_by[request.client_id] += 1
        sim.last_answer_s = ended = loop.time()
        times = None
        if timed and first:
            prefill_s, decode_s = first[0] - began - generation.queued_s, ended - first[0]
            if asked is not None:
                asked(sim.id, generation.prompt_tokens, generation.output_tokens, prefill_s, decode_s)
            if self.engine_times and sim.record.engine in TIMED_ENGINES:
                times = EngineTimes(prefill_s, decode_s, generation.prompt_tokens)
        return Completion(text=" x" * out_tokens, finish_reason="length", prompt_tokens=prompt_tokens,
                          completion_tokens=out_tokens, engine_times=times)

    async def open_stream(self, server: Target, request: InferenceRequest) -> Any:
        raise NotImplementedError("streams are not simulated")


@dataclass
class World:
    """A simulated pool: servers (by id), the current snapshot, and what changes it."""

    servers: dict[str, SimServer]
    snapshot: PoolSnapshot
    clock: Callable[[], float]
    listeners: list[Callable[[], None]] = field(default_factory=list)

    @property
    def entries(self) -> tuple[ServerEntry, ...]:
        return self.snapshot.entries

    def publish(self, *, scrape: bool = False) -> None:
        """A new snapshot (membership or status changed, or a probe cycle's scrape of every engine's load: what
        the registry's prober reads from each engine's metrics): every dispatcher hears of it at once."""
        entries = []
        now = self.clock()
        for sim in self.servers.values():
            status = ServerStatus.HEALTHY if sim.alive else ServerStatus.DOWN
            load = sim.load
            if scrape and sim.alive:
                load = sim.load = LoadSample(running=float(sim.engine.running), waiting=float(sim.engine.waiting),
                                             observed_at=now, kv_cache_usage=sim.engine.kv_usage)
            entries.append(ServerEntry(record=sim.record, status=status, capacity=sim.profile.max_running,
                                       weight=prior_weight(sim.record), load=load))
        self.snapshot = PoolSnapshot(version=self.snapshot.version + 1, taken_at=self.clock(), entries=tuple(entries))
        for listener in self.listeners:
            listener()

    async def kill(self, server_id: str, *, announce_after_s: float = 2.0) -> None:
        """The server dies: its requests fail at once, the registry marks it down a probe cycle later."""
        sim = self.servers[server_id]
        sim.alive = False
        await sim.engine.close()
        await asyncio.sleep(announce_after_s)
        self.publish()

    def revive(self, server_id: str) -> None:
        sim = self.servers[server_id]
        sim.alive = True
        sim.engine = BatchEngine(sim.profile, clock=self.clock)
        self.publish()

    def add(self, kind_name: str, kind: Kind, profile: EmulatorProfile) -> str:
        server_id = f"{kind_name}-joined-{self.snapshot.version}"
        self.servers[server_id] = _make_server(server_id, kind_name, kind, profile, self.clock)
        self.publish()
        return server_id

    def remove(self, server_id: str) -> None:
        """Deregistered (drained away): leaves the snapshot; what it runs finishes."""
        del self.servers[server_id]
        self.publish()

    async def close(self) -> None:
        for sim in self.servers.values():
            await sim.engine.close()


async def _probe(world: World, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        world.publish(scrape=True)


def _make_server(server_id: str, kind_name: str, kind: Kind, profile: EmulatorProfile,
                 clock: Callable[[], float]) -> SimServer:
    record = ServerRecord(id=server_id, url=f"http://{server_id}.sim:80", engine=kind.engine, model=MODEL,
                          revision="r1", accelerator=kind.accelerator, gpu_count=1, capacity=profile.max_running)
    return SimServer(server_id, kind_name, profile, record, BatchEngine(profile, clock=clock))


def build_world(kinds: Mapping[str, Kind], profiles: Mapping[str, EmulatorProfile], servers: int,
                clock: Callable[[], float]) -> World:
    counts = kind_counts(kinds, servers)
    sims: dict[str, SimServer] = {}
    for name, n in counts.items():
        for _ in range(n):
            server_id = f"{name}-{len(sims)}"
            sims[server_id] = _make_server(server_id, name, kinds[name], profiles[name], clock)
    world = World(sims, PoolSnapshot(version=0, taken_at=clock(), entries=()), clock)
    world.publish()
    return world


def kind_counts(kinds: Mapping[str, Kind], servers: int) -> dict[str, int]:
    """Servers per kind: the shares rounded, the rounding left-over on the largest kind."""
    counts = {name: max(1, int(servers * k.share)) for name, k in kinds.items()}
    largest = max(kinds, key=lambda n: kinds[n].share)
    counts[largest] += servers - sum(counts.values())
    return counts


@dataclass(frozen=True, slots=True)
class Eval:
    """One eval: `size` requests of one shape, sent `concurrency` at a time by the client process `process`."""

    name: str
    prompt_tokens: int
    answer_tokens: int
    size: int
    concurrency: int = 64
    process: int = 0
    start_s: float = 0.0
    exact_answers: bool = True  # answers exactly answer_tokens long (ignore_eos); else the engine's own stop


@dataclass
class EvalOutcome:
    started_s: float = 0.0
    finished_s: float = 0.0
    answered: int = 0
    failed: int = 0


_BODY = " ".join(f"w{i % 4096}" for i in range(65536))  # the words every prompt continues with
_ENDS = [i for i, ch in enumerate(_BODY) if ch == " "] + [len(_BODY)]


def prompt_of(eval_: Eval, k: int) -> str:
    """A prompt of exactly `prompt_tokens` words (the emulator's tokens), different per request from its first
    word on (so the engines' prefix caches find nothing to share between requests)."""
    return f"{eval_.name}/{k} " + _BODY[:_ENDS[max(0, eval_.prompt_tokens - 2)]]


async def run_eval(dispatcher: Sender, eval_: Eval, clock: Callable[[], float],
                   outcome: EvalOutcome) -> None:
    """What an EvalRun does: report the work left, keep `concurrency` requests in flight, say when done."""
    if eval_.start_s > clock():
        await asyncio.sleep(eval_.start_s - clock())
    outcome.started_s = clock()
    pending = list(range(eval_.size - 1, -1, -1))
    per_request = float(eval_.prompt_tokens + eval_.answer_tokens)
    dispatcher.set_client_remaining(eval_.name, per_request * eval_.size, eval_.size)
    dispatcher.set_client_shape(eval_.name, eval_.prompt_tokens, eval_.answer_tokens)
    left = [eval_.size]

    async def worker() -> None:
        while pending:
            k = pending.pop()
            if not pending:
                dispatcher.client_done_sending(eval_.name)
            request = InferenceRequest.from_body(
                {"prompt": prompt_of(eval_, k), "max_tokens": eval_.answer_tokens, "temperature": 0,
                 "ignore_eos": eval_.exact_answers},
                request_id=f"{eval_.name}/{k}", model=MODEL, endpoint=Endpoint.COMPLETIONS, client_id=eval_.name)
            try:
                await dispatcher.submit(request)
                outcome.answered += 1
            except Exception:
                outcome.failed += 1
            left[0] -= 1
            dispatcher.set_client_remaining(eval_.name, per_request * left[0], left[0])

    await asyncio.gather(*(worker() for _ in range(min(eval_.concurrency, eval_.size))))
    outcome.finished_s = clock()


@dataclass(frozen=True, slots=True)
class ServerOutcome:
    """What one server of the pool at the end did: its requests answered per client, and when its last one was."""

    id: str
    kind: str
    answered_by: Mapping[str, int]
    last_answer_s: float
    busy_s: float


@dataclass
class SimResult:
    makespan_s: float
    outcomes: dict[str, EvalOutcome]
    decisions: int
    decision_cpu_s: float
    process_cpu_s: float
    wall_s: float
    inflight_end: int
    completed: int
    failed: int
    attempts: int
    servers: tuple[ServerOutcome, ...] = ()  # the pool at the end, server by server
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def busy_s(self) -> dict[str, float]:
        """Server kind -> its engines' busy seconds."""
        busy: dict[str, float] = {}
        for server in self.servers:
            busy[server.kind] = busy.get(server.kind, 0.0) + server.busy_s
        return busy


def make_dispatcher(transport: SimTransport, world: World, policy: Policy, config: DispatchConfig,
                    clock: Callable[[], float], seed: int) -> Dispatcher:
    dispatcher = Dispatcher(transport, lambda: world.snapshot, policy, config=config, clock=clock, wall_clock=clock,
                            rng=random.Random(seed), price_kinds=kind_costs)  # (as PoolConnection makes it)
    world.listeners.append(dispatcher.notify_snapshot)
    return dispatcher


def simulate(world_of: Callable[[Callable[[], float]], World], evals: Sequence[Eval],
             dispatchers_of: Callable[[SimTransport, World, Callable[[], float]], Sequence[Dispatcher]],
             events: Callable[[World], Coroutine[Any, Any, None]] | None = None,
             setup: Callable[[World, Sequence[Dispatcher]], contextlib.AbstractAsyncContextManager[Any]] | None = None,
             probe_s: float | None = PROBE_S,
             senders_of: Callable[[World, Sequence[Dispatcher]], Sequence[Sender]] | None = None) -> SimResult:
    """Run the evals to the end in simulated time. `dispatchers_of` makes one dispatcher per client process;
    `events` (a coroutine on the world) kills, revives, adds and removes servers as the run goes; `setup` wraps
    the run (e.g. lease clients around each dispatcher); every `probe_s` the engines' load is scraped into a new
    snapshot, as the registry's prober does (None: never). `senders_of`: what each client process's evals send
    through, where it is not its own dispatcher (`delegating`: every process through one gateway)."""
    loop = looptime.new_event_loop(start=0.0)
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(_simulate(loop.time, world_of, evals, dispatchers_of, events, setup,
                                                 probe_s, senders_of))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


async def _simulate(clock: Callable[[], float], world_of: Callable[[Callable[[], float]], World],
                    evals: Sequence[Eval],
                    dispatchers_of: Callable[[SimTransport, World, Callable[[], float]], Sequence[Dispatcher]],
                    events: Callable[[World], Coroutine[Any, Any, None]] | None,
                    setup: Callable[[World, Sequence[Dispatcher]], contextlib.AbstractAsyncContextManager[Any]] | None,
                    probe_s: float | None = None,
                    senders_of: Callable[[World, Sequence[Dispatcher]], Sequence[Sender]] | None = None) -> SimResult:
    world = world_of(clock)
    transport = SimTransport(world.servers)
    dispatchers = dispatchers_of(transport, world, clock)
    senders: Sequence[Sender] = dispatchers if senders_of is None else senders_of(world, dispatchers)
    outcomes = {e.name: EvalOutcome() for e in evals}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with setup(world, dispatchers) if setup is not None else contextlib.nullcontext():
        background = [asyncio.create_task(events(world))] if events is not None else []
        if probe_s is not None:
            background.append(asyncio.create_task(_probe(world, probe_s)))
        await asyncio.gather(*(run_eval(senders[e.process], e, clock, outcomes[e.name]) for e in evals))
        # The makespan ends with the last eval's last answer: what comes after (the lease clients' farewells, one
        # process after another here, where each real process says its own as it exits) is no eval's time.
        makespan = clock()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    teardown = clock() - makespan
    stats = [d.stats() for d in dispatchers]
    result = SimResult(
        makespan_s=makespan, outcomes=outcomes, decisions=sum(s.decisions for s in stats),
        decision_cpu_s=sum(s.decision_s for s in stats), process_cpu_s=time.process_time() - cpu0,
        wall_s=time.perf_counter() - wall0, inflight_end=sum(s.inflight_total for s in stats),
        completed=sum(s.completed for s in stats), failed=sum(s.failed for s in stats),
        attempts=transport.attempts, servers=server_outcomes(world),
        extra={"preempted": sum(s.preempted for s in stats), "teardown_s": teardown,
               "waves": [w for d in dispatchers if (w := (d.policy_state() or {}).get("waves"))]})
    await world.close()
    return result


def server_outcomes(world: World) -> tuple[ServerOutcome, ...]:
    return tuple(ServerOutcome(sim.id, sim.kind, dict(sim.answered_by), sim.last_answer_s, sim.engine.counters.busy_s)
                 for sim in world.servers.values())


def least_work_baseline(world_of: Callable[[Callable[[], float]], World], evals: Sequence[Eval],
                        price: Callable[[SimServer, int, int], float]) -> SimResult:
    """The best simple baseline: a router that sends every request at once (the engines queue) to the server
    with the least outstanding work per unit of speed, the request's own work included, where a request's work
    on a server is `price(server, prompt tokens, answer tokens)` in that server's seconds (no admission windows,
    no learning, no client order: requests in arrival order)."""
    loop = looptime.new_event_loop(start=0.0)
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(_least_work(loop.time, world_of, evals, price))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


async def _least_work(clock: Callable[[], float], world_of: Callable[[Callable[[], float]], World],
                      evals: Sequence[Eval], price: Callable[[SimServer, int, int], float]) -> SimResult:
    world = world_of(clock)
    transport = SimTransport(world.servers)
    outstanding = dict.fromkeys(world.servers, 0.0)
    servers = list(world.servers.values())
    outcomes = {e.name: EvalOutcome() for e in evals}
    cpu0, wall0 = time.process_time(), time.perf_counter()

    async def one(eval_: Eval, k: int) -> None:
        best, best_finish, best_work = servers[0], float("inf"), 0.0
        for sim in servers:
            work = price(sim, eval_.prompt_tokens, eval_.answer_tokens)
            finish = outstanding[sim.id] + work
            if finish < best_finish:
                best, best_finish, best_work = sim, finish, work
        outstanding[best.id] += best_work
        request = InferenceRequest.from_body(
            {"prompt": prompt_of(eval_, k), "max_tokens": eval_.answer_tokens, "ignore_eos": True},
            request_id=f"{eval_.name}/{k}", model=MODEL, endpoint=Endpoint.COMPLETIONS, client_id=eval_.name)
        try:
            await transport.complete(UrlTarget(best.id, best.record.url), request)
            outcomes[eval_.name].answered += 1
        finally:
            outstanding[best.id] -= best_work

    async def run(eval_: Eval) -> None:
        outcomes[eval_.name].started_s = clock()
        await asyncio.gather(*(one(eval_, k) for k in range(eval_.size)))
        outcomes[eval_.name].finished_s = clock()

    await asyncio.gather(*(run(e) for e in evals))
    result = SimResult(makespan_s=clock(), outcomes=outcomes, decisions=0, decision_cpu_s=0.0,
                       process_cpu_s=time.process_time() - cpu0, wall_s=time.perf_counter() - wall0, inflight_end=0,
                       completed=sum(o.answered for o in outcomes.values()), failed=0, attempts=transport.attempts,
                       servers=server_outcomes(world))
    await world.close()
    return result


class SimRegistry:
    """The registry's capacity leases in process (the same LeaseService the registry actor runs), for the
    simulated dispatchers' LeaseClients; `rpc_s` models a call's round trip."""

    def __init__(self, world: World, clock: Callable[[], float], *, rpc_s: float = 0.001, ttl_s: float = 3.0,
                 placement: str = PLACEMENT):
        self.service = LeaseService(LeaseBroker(clock, ttl_s=ttl_s, restarted=False, placement=placement))
        self._world = world
        self._rpc_s = rpc_s
        self._servers()
        world.listeners.append(self._servers)

    def _servers(self) -> None:
        self.service.set_servers(LeaseServer(sim.id, MODEL, sim.profile.max_running if sim.alive else 0,
                                             sim.healthy_entry().kind)
                                 for sim in self._world.servers.values())

    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease:
        await asyncio.sleep(self._rpc_s / 2)
        lease = await self.service.lease(report, known_version, wait_s)
        await asyncio.sleep(self._rpc_s / 2)
        return lease

    async def release_lease(self, holder: str) -> None:
        await self.service.release(holder)


@contextlib.asynccontextmanager
async def leasing(world: World, dispatchers: Sequence[Dispatcher], placement: str = PLACEMENT
                  ) -> AsyncIterator[SimRegistry]:
    """Every dispatcher leases its slots from one in-process registry, as separate processes would (`placement`:
    how the broker shares slots over server kinds, registry/leases.py PLACEMENTS)."""
    registry = SimRegistry(world, asyncio.get_running_loop().time, placement=placement)
    clients = [LeaseClient(registry, d, holder=f"process-{i}", clock=asyncio.get_running_loop().time)
               for i, d in enumerate(dispatchers)]
    for client in clients:
        await client.start()
    try:
        yield registry
    finally:
        for client in clients:
            await client.stop()


GATEWAY_HOP_S = 0.0005  # one way between an eval process and the gateway: a request and its answer each cross once
# (the gateway adds 0.78 ms at the median to a request it relays, benchmarks/results/overhead.md)


class _Transport:
    """What a request reads of its connection (aiohttp's test request would make mocks: most of the run's time)."""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 0) if name == "peername" else default


class _Protocol:
    transport = _Transport()
    writer = None
    peername = ("127.0.0.1", 0)
    sockname = None
    ssl_context = None
    max_field_size = max_line_length = 8190
    max_headers = 128


_PROTOCOL, _TRANSPORT = _Protocol(), _Protocol.transport


class InProcessGateway:
    """A `GatewayPost` to the real gateway app (`federation/gateway/handlers.Gateway`) in this process: each request
    is the gateway's own handler run on a request object instead of a socket, `hop_s` each way for the network."""

    def __init__(self, gateway: Gateway, hop_s: float = GATEWAY_HOP_S):
        self.gateway = gateway
        self._app = gateway.app()
        self._app.freeze()
        self._hop_s = hop_s

    async def __call__(self, path: str, headers: Mapping[str, str], body: bytes
                       ) -> tuple[int, Mapping[str, str], bytes]:
        await asyncio.sleep(self._hop_s)
        loop = asyncio.get_running_loop()
        payload = streams.StreamReader(BaseProtocol(loop), 2 ** 16, loop=loop)  # (no transport: never paused)
        payload.feed_data(body)
        payload.feed_eof()
        request = make_mocked_request("POST", path, headers=CIMultiDict(headers), payload=payload, app=self._app,
                                      writer=None, protocol=_PROTOCOL, transport=_TRANSPORT, loop=loop)
        response = await self._app._handle(request)
        await asyncio.sleep(self._hop_s)
        assert isinstance(response, web.Response)  # (a relayed stream would be a StreamResponse: none is asked for)
        return response.status, response.headers, response.body if isinstance(response.body, bytes) else b""


def delegating(processes: int, *, max_inflight: int | None = None, hop_s: float = GATEWAY_HOP_S
               ) -> Callable[[World, Sequence[Dispatcher]], list[Sender]]:
    """`senders_of` for processes that hand their placement to one gateway (`eval run --gateway`): the one
    dispatcher (the gateway's) behind the real gateway app, each process's evals sending through a
    `DelegatingDispatcher` of its own. `max_inflight`: the gateway's `--max-inflight`."""

    def senders(world: World, dispatchers: Sequence[Dispatcher]) -> list[Sender]:
        (dispatcher,) = dispatchers
        gateway = InProcessGateway(Gateway(dispatcher, lambda: world.snapshot, max_inflight=max_inflight,
                                           tune_gc=False, clock=asyncio.get_running_loop().time), hop_s)
        clock = asyncio.get_running_loop().time
        return [DelegatingDispatcher(gateway, clock=clock, where="the gateway") for _ in range(processes)]

    return senders
