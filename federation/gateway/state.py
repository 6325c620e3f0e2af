"""What a gateway keeps between requests, each thing bounded: the facts it reads of the current snapshot (computed
once per snapshot), the client ids it tells apart (capped, forgotten when idle, here and in the dispatcher), the
runs callers declared the size of (`DeclaredRuns`, forgotten with their ids), whether
its loop is overloaded (the dispatcher's own measure of its lag, no timer), its metrics (a server that left the
pool loses its series), and where online requests go first (`Steer`: the Batch API's online reserve,
clients/batchrunner.py `OnlineReserve`, names the servers an online request is answered on while batches run; the
request is pinned to them, and a failure another server could answer sends it once more without them, so a
preference never costs an online caller an answer the pool could give)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass, replace

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from fedpool.federation.core.dispatcher import Dispatcher
from fedpool.federation.core.errors import FailureKind, NoServerError, RequestFailed
from fedpool.federation.core.types import InferenceRequest, InferenceResult
from fedpool.registry import PoolSnapshot

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LAG_LIMIT_S = 0.1  # event-loop lag (the dispatcher's smoothed measure) above which new requests are refused at once
LAG_STALE_S = 1.0  # a lag measured longer ago than this (no grant pass since) fades ...
LAG_HALF_LIFE_S = 0.5  # ... by half every this many seconds beyond it, so a gateway refusing everything recovers
MAX_CLIENT_IDS = 10_000  # client ids told apart at once; past it, new ids share one bucket until old ones expire
CLIENT_TTL_S = 600.0  # a client id with no request for this long is forgotten (here and in the dispatcher)
SHARED_CLIENT = "~shared"  # the bucket past the cap: '~' is in no client name (CLIENT_NAME), so nobody claims it


class AppTask:
    """One background coroutine (`_run`) for an aiohttp app's life: `start` and `stop` fit on_startup and
    on_cleanup; stop cancels it and waits for it."""

    task_name = "app-task"
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    async def start(self, _app: web.Application | None = None) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class Overload:
    """Overload seen where it happens: the gateway's own event loop falling behind. The dispatcher measures how
    late its grant passes run (`loop_lag_s`, smoothed, last sampled at `loop_lag_at`); above `limit_s` requests
    arrive faster than this process can handle them, and new ones are refused at once (503, Retry-After) until
    the lag is back under half the limit. A measure older than LAG_STALE_S fades (half-life `half_life_s`): a
    gateway that refuses everything runs no grant passes, and must still recover. Without this a CPU-bound
    gateway queued every request, its latency grew without bound, clients timed out and retried, and goodput
    collapsed (the in-flight cap cannot see it: with fast engines few requests are in flight, they are late)."""

    def __init__(self, dispatcher: Dispatcher, limit_s: float = LAG_LIMIT_S, half_life_s: float = LAG_HALF_LIFE_S):
        self._dispatcher = dispatcher
        self.limit_s = limit_s
        self.half_life_s = half_life_s
        self.overloaded = False

    def lag_s(self) -> float:
        """The loop's lag as last measured, decayed by that measurement's age."""
        dispatcher = self._dispatcher
        age = asyncio.get_running_loop().time() - dispatcher.loop_lag_at
        return dispatcher.loop_lag_s * 0.5 ** (max(0.0, age - LAG_STALE_S) / self.half_life_s)

    def check(self) -> bool:
        """Whether to refuse a request now."""
        if self._dispatcher.loop_lag_s <= self.limit_s / 2:  # the common case: decaying it cannot matter
            self.overloaded = False
            return False
        self.overloaded = self.lag_s() > (self.limit_s / 2 if self.overloaded else self.limit_s)
        return self.overloaded


@dataclass(frozen=True, slots=True)
class PoolFacts:
    """What requests read of a snapshot, computed once per snapshot (a request never walks the servers)."""

    served: Mapping[str, int]  # every model a registered server serves (routable or not) -> earliest registration
    capacity: int  # every server's capacity, summed

    @classmethod
    def of(cls, snapshot: PoolSnapshot | None) -> PoolFacts:
        served: dict[str, int] = {}
        for entry in snapshot.entries if snapshot is not None else ():
            at = int(entry.record.registered_at)
            served[entry.record.model] = min(served.get(entry.record.model, at), at)
        return cls(served, sum(e.capacity for e in snapshot.entries) if snapshot is not None else 0)


class ClientIds:
    """The client ids a gateway tells apart: each kept until `ttl_s` after its last request, at most `cap` at once
    (None: no cap); past the cap a new id is served as SHARED_CLIENT until older ones expire. Most-recent last, so
    expiring looks at the front only (O(1) a request, amortized)."""

    def __init__(self, cap: int | None, ttl_s: float):
        self.cap = cap
        self.ttl_s = ttl_s
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.shared = 0  # requests served as SHARED_CLIENT because the table was full

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, client: str, now: float) -> str:
        """The id to serve `client` as (itself, or SHARED_CLIENT past the cap), noting the request."""
        seen = self._seen
        if client in seen:
            seen.move_to_end(client)
        elif self.cap is not None and len(seen) >= self.cap:
            self.expire(now)
            if len(seen) >= self.cap:
                self.shared += 1
                return SHARED_CLIENT
        seen[client] = now
        return client

    def __contains__(self, client: object) -> bool:
        return client in self._seen

    def expire(self, now: float) -> int:
        """Forget ids without a request for `ttl_s`; how many."""
        seen, horizon, gone = self._seen, now - self.ttl_s, 0
        while seen:
            client, at = next(iter(seen.items()))
            if at > horizon:
                break
            del seen[client]
            gone += 1
        return gone


MAX_DECLARED_REQUESTS = 1_000_000_000  # the most requests a caller may say its run sends


@dataclass(slots=True)
class _Run:
    declared: int  # the requests the caller said this run sends
    arrived: int = 0  # of them, received so far ...
    finished: int = 0  # ... and answered or failed


class DeclaredRuns:
    """Callers that say how many requests their run sends (`X-Fedpool-Requests: N`, or `?fedpool_requests=N` on
    the URL for a tool that takes only a URL: lm-eval's `base_url`): the dispatcher ranks each by the requests it
    has left under `shortest_first` (SRPT), where a caller that says nothing is ranked by the service it has had
    (`ClientBook`). Requests left = declared − finished, never below those still outstanding (a caller that sends
    more than it said, or retries, stays where its requests in flight put it).

    A run ends when all it declared are finished and nothing is outstanding; the caller's next request starts a
    new one (the same key running the same eval again). Declaring another N starts a new run too. A request
    without a declaration from a caller that had one ends it (ranked by its service again). Kept per client id
    and forgotten with it (`retain`, after the id table's expiry); each gateway replica counts what it serves, so
    behind several replicas a caller's requests left are what it declared less what that replica finished (its
    rank is later than its true one, alike for every caller split the same way)."""

    def __init__(self, report: Callable[[str, int | None], None],
                 announce: Callable[[str, float, int | None], None] | None = None):
        self._report = report  # (client, requests left or None): Dispatcher.set_client_requests_left
        self._announce = announce  # (client, prompt tokens, max tokens): Dispatcher.set_client_shape
        self._runs: dict[str, _Run] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def arrive(self, client: str, declared: int | None, prompt_tokens: float | None = None,
               max_tokens: int | None = None) -> None:
        """A request of `client` was received, with the size its caller declared (None: none) and, where it said it
        (`X-Fedpool-Prompt-Tokens`: an `eval run --gateway`), its run's mean prompt: announced as its shape when
        the run starts, so the first plan or wave need not guess it from the prompt's characters."""
        run = self._runs.get(client)
        if declared is None:
            if run is not None:
                del self._runs[client]
                self._report(client, None)
            return
        if run is None or run.declared != declared or (run.finished >= run.declared and run.arrived == run.finished):
            run = self._runs[client] = _Run(declared)
            if prompt_tokens is not None and self._announce is not None:
                self._announce(client, prompt_tokens, max_tokens)
        run.arrived += 1
        self._report(client, self._left(run))

    def finish(self, client: str, declared: int | None) -> None:
        """A request `arrive` counted was answered or failed (or its caller went away)."""
        run = self._runs.get(client)
        if declared is None or run is None or run.declared != declared or run.finished >= run.arrived:
            return  # (counted under a run that has ended or been replaced since)
        run.finished += 1
        self._report(client, self._left(run))

    def retain(self, known: Container[str]) -> None:
        """Forget the runs of callers no longer `known` (ids expired: idle for their TTL, or pushed out)."""
        for client in [c for c in self._runs if c not in known]:
            del self._runs[client]

    @staticmethod
    def _left(run: _Run) -> int:
        return max(run.declared - run.finished, run.arrived - run.finished)


class Forgetting(AppTask):
    """Every `period_s`: client ids idle for the TTL are forgotten, here and in the dispatcher (whose own sweep
    runs only while requests wait)."""

    task_name = "gateway-forget-idle"

    def __init__(self, ids: ClientIds, dispatcher: Dispatcher, period_s: float, runs: DeclaredRuns | None = None):
        self._ids, self._dispatcher, self.period_s, self._runs = ids, dispatcher, period_s, runs

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self._ids.expire(time.monotonic())
            if self._runs is not None:
                self._runs.retain(self._ids)
            self._dispatcher.forget_idle_clients(self._ids.ttl_s)


class _Tallies:
    """Requests answered (by endpoint and status) and their latency (by endpoint), kept as plain numbers and
    exposed as prometheus_client's Counter and Histogram would be: a request costs two dict lookups, not five
    locks (the gateway has one thread). `requests.labels(e, s).inc()` and `latency.labels(e).observe(v)` work as
    theirs do."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.timed: dict[str, list[float]] = {}  # endpoint -> a count per bucket (+Inf last), then the sum

    def count(self, endpoint: str, status: str) -> None:
        key = (endpoint, status)
        self.counts[key] = self.counts.get(key, 0) + 1

    def time(self, endpoint: str, seconds: float) -> None:
        timed = self.timed.get(endpoint)
        if timed is None:
            timed = self.timed[endpoint] = [0.0] * (len(LATENCY_BUCKETS_S) + 2)
        timed[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        timed[-1] += seconds

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("fedpool_gateway_requests", "Requests answered by the gateway (streams: how "
                                       "they ended: 200, broken, client_closed).", labels=("endpoint", "status"))
        for (endpoint, status), n in self.counts.items():
            requests.add_metric((endpoint, status), n)
        yield requests
        latency = HistogramMetricFamily("fedpool_gateway_request_seconds", "Gateway request latency.",
                                        labels=("endpoint",))
        for endpoint, timed in self.timed.items():
            cumulative = list(itertools.accumulate(timed[:-1]))
            bounds = [*(repr(float(b)) for b in LATENCY_BUCKETS_S), "+Inf"]
            latency.add_metric((endpoint,), list(zip(bounds, cumulative, strict=True)), timed[-1])
        yield latency


class _Labelled:
    """prometheus_client's `metric.labels(...).inc()` / `.observe(v)` over the tallies (for callers that fill a
    series by hand, as tests do)."""

    def __init__(self, tallies: _Tallies):
        self._tallies = tallies
        self._values: tuple[str, ...] = ()

    def labels(self, *values: str) -> _Labelled:
        self._values = values
        return self

    def inc(self, amount: float = 1.0) -> None:
        for _ in range(int(amount)):
            self._tallies.count(*self._values)

    def observe(self, seconds: float) -> None:
        self._tallies.time(self._values[0], seconds)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._tallies = _Tallies()
        self.registry.register(self._tallies)  # (a Collector by its collect())
        self.requests = _Labelled(self._tallies)
        self.latency = _Labelled(self._tallies)
        self.migrations = Counter("fedpool_gateway_stream_migrations", "Streams continued on another replica "
                                  "after their server died mid-stream.", registry=self.registry)
        self.shed = Counter("fedpool_gateway_shed", "Requests refused at once because the gateway was full "
                            "(429) or its event loop overloaded (503).", registry=self.registry)
        self.retries = Gauge("fedpool_gateway_dispatcher_retries", "Retries made by the dispatcher so far.",
                             registry=self.registry)
        self.resets = Gauge("fedpool_gateway_keepalive_resets", "Stale keep-alive connections retried at once "
                            "(not the servers' fault).", registry=self.registry)
        self.hedges = Gauge("fedpool_gateway_dispatcher_hedges", "Straggler hedges launched so far.",
                            registry=self.registry)
        self.inflight = Gauge("fedpool_gateway_server_inflight", "Requests in flight per server.", ("server_id",),
                              registry=self.registry)
        self.window = Gauge("fedpool_gateway_server_window", "Admission window per server.", ("server_id",),
                            registry=self.registry)
        self.clients = Gauge("fedpool_gateway_client_ids", "Client ids told apart now (capped).",
                             registry=self.registry)
        self.declared_runs = Gauge("fedpool_gateway_declared_runs", "Callers whose run's declared size "
                                   "(X-Fedpool-Requests) ranks them now.", registry=self.registry)
        self._servers: set[str] = set()

    def observe(self, endpoint: str, status: str, seconds: float) -> None:
        tallies = self._tallies
        tallies.count(endpoint, status)
        tallies.time(endpoint, seconds)

    def servers(self, figures: Mapping[str, tuple[int, int]]) -> None:
        """Per-server gauges: (in flight, window) by server id; a server gone from the pool loses its series."""
        for server_id, (inflight, window) in figures.items():
            self.inflight.labels(server_id).set(inflight)
            self.window.labels(server_id).set(window)
        for gone in self._servers - figures.keys():
            self.inflight.remove(gone)
            self.window.remove(gone)
        self._servers = set(figures)


# ---- where online requests go first ---------------------------------------------------------------------------
Steer = Callable[[InferenceRequest], tuple[str, ...] | None]  # an online request -> its servers first (None: any)


def steered(req: InferenceRequest, steer: Steer | None) -> InferenceRequest:
    """The request pinned where `steer` sends it (unchanged where it names nothing, or the request is pinned)."""
    servers = steer(req) if steer is not None and req.pinned_servers is None else None
    return req if servers is None else replace(req, pinned_servers=servers)


async def submit_steered(dispatcher: Dispatcher, req: InferenceRequest, steer: Steer | None) -> InferenceResult:
    """`dispatcher.submit` of the steered request; where it fails on the servers it was steered to in a way
    another server could answer (a retriable failure, or none of them routable in time), once more on any server
    of its model. A request the engine refused as wrong (REQUEST_ERROR), or a failure on this side (UNEXPECTED),
    is not sent again."""
    pinned = steered(req, steer)
    if pinned is req:
        return await dispatcher.submit(req)
    try:
        return await dispatcher.submit(pinned)
    except (NoServerError, RequestFailed) as exc:
        if not elsewhere_may(exc):
            raise
    return await dispatcher.submit(req)  # (the steered try counts as a failed request in the dispatcher's stats)


def elsewhere_may(exc: NoServerError | RequestFailed) -> bool:
    """Whether another server may answer what failed so on the servers a request was steered to."""
    return isinstance(exc, NoServerError) or exc.last_kind not in (None, FailureKind.REQUEST_ERROR,
                                                                   FailureKind.UNEXPECTED)
