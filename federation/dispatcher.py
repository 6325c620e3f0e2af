"""The request path: choose a server, hold a slot in its admission window, POST, release, retry elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from federation.errors import AttemptError, FailureKind, NoServerError, RequestFailed
from federation.hedging import HedgeTimer, race
from federation.policies import Policy, RouteContext
from federation.serverbook import BookSettings, ServerBook
from federation.transport import Timeouts, open_stream, post_completion
from federation.types import Attempt, Completion, InferenceRequest, InferenceResult
from registry import PoolSnapshot, ServerEntry

log = logging.getLogger("fedpool.dispatcher")

WAIT_POLL_S = 0.25  # waiters re-check breakers and snapshots at least this often
MAX_RESET_RETRIES = 3  # immediate retries for stale keep-alive connections, per request
HEDGE_RECHECK_S = 0.1  # how often a straggler looks again for an idle server to hedge on


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    max_attempts: int = 8
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    no_server_timeout_s: float = 60.0
    window_factor: float = 1.0  # admission window ceiling = engine capacity × this
    adaptive_windows: bool = True  # grow/shrink each server's window from what the dispatcher observes
    learn_throughput: bool = True  # weigh servers by observed tokens/s once known (prior: accelerator)
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    hedging: bool = True  # duplicate stragglers at the tail; only greedy requests (temperature 0)
    hedge_factor: float = 2.0  # hedge once an attempt takes this × the model's median latency
    hedge_min_delay_s: float = 0.2


@dataclass(frozen=True, slots=True)
class Slot:
    server: ServerEntry
    client_id: str
    acquired_at: float


@dataclass(slots=True)
class _RetryState:
    attempts: list[Attempt] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)
    counted: int = 0
    resets: int = 0


@dataclass(frozen=True, slots=True)
class OpenStream:
    """An upstream response being streamed; read `response.content`."""

    server: ServerEntry
    response: aiohttp.ClientResponse
    attempts: tuple[Attempt, ...]


@dataclass(eq=False, slots=True)
class _Waiter:
    """A request waiting in the dispatcher for a slot on any server that can take it."""

    request: InferenceRequest
    tried: set[str]
    future: asyncio.Future[Slot]
    seq: int
    deadline: float

    @property
    def route_key(self) -> tuple[object, ...]:
        r = self.request
        return (r.model, r.revision, r.pinned_engines, r.pinned_servers)


@dataclass(frozen=True, slots=True)
class ServerStats:
    server_id: str
    answered: int
    failures: dict[str, int]
    inflight: int
    window: int
    completion_tokens: int
    busy_s: float
    learned_tokens_per_s: float | None = None
    window_reason: str | None = None


@dataclass(frozen=True, slots=True)
class DispatcherStats:
    submitted: int
    completed: int
    failed: int
    retries: int
    hedges: int
    inflight_total: int
    servers: tuple[ServerStats, ...]


class Dispatcher:
    """Spreads requests over the servers of the current snapshot. One per client process; shareable by
    any number of concurrent evaluations in it, so their requests merge in each engine's batch."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        snapshots: Callable[[], PoolSnapshot | None],
        policy: Policy,
        *,
        config: DispatchConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        on_failure: Callable[[str, FailureKind], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self._session = session
        self._snapshots = snapshots
        self._policy = policy
        self._config = config or DispatchConfig()
        self._clock = clock
        self._rng = rng or random.Random(0)
        self._on_failure = on_failure
        self._sleep = sleep
        self._book = ServerBook(
            BookSettings(self._config.window_factor, self._config.adaptive_windows, self._config.learn_throughput,
                         self._config.breaker_failures, self._config.breaker_cooldown_s),
            clock=clock, wall_clock=wall_clock,
        )
        self._submitted = self._completed = self._failed = self._retries = 0
        self._waiters: list[_Waiter] = []
        self._client_inflight: Counter[str] = Counter()
        self._seq = itertools.count()
        self._tick_handle: asyncio.TimerHandle | None = None
        self._route_cache: dict[tuple[object, ...], list[ServerEntry]] = {}
        self._route_cache_version = -1
        self._route_cache_snapshot: PoolSnapshot | None = None
        self._client_weights: dict[str, float] = {}
        self._clients_done: set[str] = set()
        self._hedge_timer = HedgeTimer(self._config.hedge_factor, self._config.hedge_min_delay_s)
        self._hedges = 0

    @property
    def policy(self) -> Policy:
        return self._policy

    def client_done_sending(self, client_id: str, done: bool = True) -> None:
        """A client says it has nothing left to send: its outstanding requests are the tail of its run,
        where stragglers may be hedged."""
        if done:
            self._clients_done.add(client_id)
        else:
            self._clients_done.discard(client_id)

    def set_client_weight(self, client_id: str, weight: float) -> None:
        """Weighted fair share when the pool is saturated: a client of weight 2 gets twice the slots."""
        if weight <= 0:
            raise ValueError("client weight must be positive")
        self._client_weights[client_id] = weight

    def notify_snapshot(self) -> None:
        """Call when a new snapshot arrived: waiting requests look again."""
        self._dispatch_waiting()

    # ---- the hot path -------------------------------------------------------------------------
    async def submit(self, request: InferenceRequest) -> InferenceResult:
        """Complete the request exactly once or raise RequestFailed / NoServerError after every retry."""
        self._submitted += 1
        retry = _RetryState()
        hedgeable = self._config.hedging and request.body.get("temperature") == 0
        while True:
            slot = await self._acquire(request, retry.tried)
            started = self._clock()
            primary = asyncio.create_task(self._attempt(slot, request))
            winner, others, hedged = await race(
                primary, slot.server, started,
                launch=(lambda s=slot.server: self._launch_hedge(request, s)) if hedgeable else None,
                delay_s=self._hedge_timer.delay(request.model) if hedgeable else None,
                recheck_s=HEDGE_RECHECK_S, clock=self._clock,
            )
            self._hedges += hedged
            for outcome in others:
                if outcome.cancelled:
                    retry.attempts.append(Attempt(outcome.server.id, outcome.started,
                                                  outcome.finished - outcome.started, None, "hedge lost"))
            errors = [o for o in others if o.error is not None]
            if winner is None:
                for outcome in errors[:-1]:
                    self._record_failure(outcome.server, outcome.started, outcome.error, retry)  # type: ignore[arg-type]
                last = errors[-1]
                await self._after_failure(request, last.server, last.started, last.error, retry)  # type: ignore[arg-type]
                continue
            for outcome in errors:
                self._record_failure(outcome.server, outcome.started, outcome.error, retry)  # type: ignore[arg-type]
            server, completion = winner.server, winner.completion
            assert completion is not None
            latency = winner.finished - winner.started
            retry.attempts.append(Attempt(server.id, winner.started, latency))
            self._book.note_success(server, completion.completion_tokens or 0, latency)
            self._hedge_timer.observe(request.model, latency)
            self._completed += 1
            return InferenceResult(
                request_id=request.request_id,
                completion=completion,
                server_id=server.id,
                engine=server.engine.value,
                accelerator=server.record.accelerator,
                model_revision=server.record.revision,
                latency_s=latency,
                attempts=tuple(retry.attempts),
                hedged=hedged,
            )

    async def _attempt(self, slot: Slot, request: InferenceRequest) -> Completion:
        """One POST on a held slot; the slot is released however it ends (cancellation included)."""
        try:
            return await post_completion(self._session, slot.server.url, request, self._config.timeouts)
        finally:
            self._release(slot)

    def _launch_hedge(
        self, request: InferenceRequest, primary: ServerEntry
    ) -> tuple[asyncio.Task[Completion], ServerEntry, float] | None:
        """A duplicate on another idle server of the same model revision, only at the tail of a run: the
        request's client has nothing left to send and nothing else waits for this model. None otherwise."""
        if request.client_id not in self._clients_done:
            return None
        key = (request.model, request.revision, request.pinned_engines, request.pinned_servers)
        if any(w.route_key == key and not w.future.done() for w in self._waiters):
            return None
        now = self._clock()
        servers = [
            s for s in self._servers_for(request)
            if s.id != primary.id and s.record.revision == primary.record.revision
            and self._book.breaker(s.id).allows(now)
        ]
        free = self._book.free_candidates(servers, self._policy.candidate_limit, self._rng)
        if not free:
            return None
        decision = self._policy.choose(free, RouteContext(request.request_id, request.prefix_text()))
        server = next(s for s in servers if s.id == decision.server_id)
        slot = self._take(server, request.client_id, now)
        return asyncio.create_task(self._attempt(slot, request)), server, now

    @contextlib.asynccontextmanager
    async def stream(self, request: InferenceRequest) -> AsyncIterator[OpenStream]:
        """An upstream streaming response with its slot held until the caller is done reading it.

        Failures before the first byte are retried elsewhere like any request; once bytes have gone to
        the caller the stream cannot move, and a break is the caller's to report."""
        self._submitted += 1
        retry = _RetryState()
        while True:
            slot = await self._acquire(request, retry.tried)
            server = slot.server
            started = self._clock()
            try:
                response = await open_stream(self._session, server.url, request, self._config.timeouts)
            except AttemptError as err:
                self._release(slot)
                await self._after_failure(request, server, started, err, retry)
                continue
            break
        try:
            yield OpenStream(server, response, tuple(retry.attempts))
            self._book.note_success(server, 0, self._clock() - started)
            self._completed += 1
        except BaseException:
            self._failed += 1
            raise
        finally:
            response.release()
            self._release(slot)

    def _record_failure(self, server: ServerEntry, started: float, err: AttemptError, retry: _RetryState) -> None:
        retry.attempts.append(Attempt(server.id, started, self._clock() - started, err.kind, err.detail))
        self._note_failure(server, err.kind)

    async def _after_failure(
        self, request: InferenceRequest, server: ServerEntry, started: float, err: AttemptError, retry: _RetryState
    ) -> None:
        """Record a failed attempt; return to retry (after backoff) or raise RequestFailed."""
        self._record_failure(server, started, err, retry)
        if not err.kind.retriable:
            self._failed += 1
            raise RequestFailed(
                f"request {request.request_id} refused by {server.id}: {err}", tuple(retry.attempts), err.kind
            ) from err
        self._retries += 1
        if err.kind is FailureKind.RESET and retry.resets < MAX_RESET_RETRIES:
            retry.resets += 1
            return  # the request never reached the server: retry at once
        retry.counted += 1
        retry.tried.add(server.id)
        if retry.counted >= self._config.max_attempts:
            self._failed += 1
            raise RequestFailed(
                f"request {request.request_id} failed {retry.counted} times; last: {err}",
                tuple(retry.attempts), err.kind,
            ) from err
        await self._sleep(self._backoff(retry.counted))

    async def _acquire(self, request: InferenceRequest, tried: set[str]) -> Slot:
        """Wait for a slot. Waiters are served fairly: the client with the fewest requests in flight per
        unit of weight first, then arrival order; a request that just finished cannot barge ahead."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(request, tried, loop.create_future(), next(self._seq),
                         self._clock() + self._config.no_server_timeout_s)
        self._waiters.append(waiter)
        self._dispatch_waiting()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            # Granted a slot in the same tick as the cancellation: give it back.
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self._release(waiter.future.result())
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _dispatch_waiting(self) -> None:
        """Grant free slots to waiters (synchronous: choice and count happen in one step)."""
        if not self._waiters:
            return
        now = self._clock()
        blocked: set[tuple[object, ...]] = set()
        while True:
            best: _Waiter | None = None
            best_key: tuple[float, int] | None = None
            for waiter in self._waiters:
                if waiter.future.done() or waiter.route_key in blocked:
                    continue
                cid = waiter.request.client_id
                key = (self._client_inflight.get(cid, 0) / self._client_weights.get(cid, 1.0), waiter.seq)
                if best_key is None or key < best_key:
                    best, best_key = waiter, key
            if best is None:
                break
            if not self._place(best, now):
                blocked.add(best.route_key)
        self._waiters = [w for w in self._waiters if not w.future.done()]
        if self._waiters and self._tick_handle is None:
            # Re-check while anyone waits: breakers half-open and no-server deadlines pass with time.
            self._tick_handle = asyncio.get_running_loop().call_later(WAIT_POLL_S, self._tick)

    def _tick(self) -> None:
        self._tick_handle = None
        self._dispatch_waiting()

    def _place(self, waiter: _Waiter, now: float) -> bool:
        """Give the waiter a slot if a server can take it; False when its route is full."""
        request = waiter.request
        servers = self._servers_for(request)
        open_ = [s for s in servers if self._book.breaker(s.id).allows(now)]
        untried = [s for s in open_ if s.id not in waiter.tried] or open_
        free = self._book.free_candidates(untried, self._policy.candidate_limit, self._rng)
        if not free:
            if not servers and now >= waiter.deadline:
                waiter.future.set_exception(NoServerError(
                    f"no routable server serves model {request.model!r}"
                    + (f" revision {request.revision!r}" if request.revision else "")
                    + f" (waited {self._config.no_server_timeout_s:g}s)"
                ))
                return True
            return False
        decision = self._policy.choose(free, RouteContext(request.request_id, request.prefix_text()))
        server = next(s for s in untried if s.id == decision.server_id)
        waiter.future.set_result(self._take(server, request.client_id, now))
        return True

    def _take(self, server: ServerEntry, client_id: str, now: float) -> Slot:
        """Count a slot on the chosen server. Called in the same step as the choice (no await in
        between), so concurrent picks cannot pile onto one server."""
        self._book.take(server, now)
        self._client_inflight[client_id] += 1
        return Slot(server, client_id, now)

    def _release(self, slot: Slot) -> None:
        self._book.release(slot.server.id)
        self._client_inflight[slot.client_id] -= 1
        if self._client_inflight[slot.client_id] <= 0:
            del self._client_inflight[slot.client_id]
        self._dispatch_waiting()

    # ---- bookkeeping --------------------------------------------------------------------------
    def _servers_for(self, request: InferenceRequest) -> list[ServerEntry]:
        """Routable servers for the request's route, computed once per snapshot version and route."""
        snapshot = self._snapshots()
        if snapshot is None:
            return []
        key = (request.model, request.revision, request.pinned_engines, request.pinned_servers)
        if self._route_cache_version != snapshot.version or self._route_cache_snapshot is not snapshot:
            self._route_cache.clear()
            self._route_cache_version, self._route_cache_snapshot = snapshot.version, snapshot
            self._book.forget_rate_scale()
        servers = self._route_cache.get(key)
        if servers is None:
            view = snapshot.filter(
                model=request.model,
                revision=request.revision,
                engines=request.pinned_engines,
                server_ids=request.pinned_servers,
                routable_only=True,
            )
            servers = self._route_cache[key] = list(view.entries)
        return servers

    def _backoff(self, failures: int) -> float:
        """Exponential backoff with full jitter."""
        ceiling = min(self._config.backoff_max_s, self._config.backoff_base_s * 2 ** (failures - 1))
        return self._rng.uniform(0, ceiling)

    def _note_failure(self, server: ServerEntry, kind: FailureKind) -> None:
        self._book.note_failure(server, kind)
        if kind.counts_against_server and self._on_failure is not None:
            self._on_failure(server.id, kind)

    def inflight(self) -> dict[str, int]:
        return dict(self._book.inflight)

    def stats(self) -> DispatcherStats:
        book = self._book
        snapshot = self._snapshots()
        windows = {e.id: book.window(e) for e in snapshot.entries} if snapshot else {}
        ids = sorted(set(book.answered) | set(book.failures) | set(book.inflight) | set(windows))
        return DispatcherStats(
            submitted=self._submitted,
            completed=self._completed,
            failed=self._failed,
            retries=self._retries,
            hedges=self._hedges,
            inflight_total=sum(book.inflight.values()),
            servers=tuple(
                ServerStats(
                    server_id=sid,
                    answered=book.answered.get(sid, 0),
                    failures=dict(book.failures.get(sid, {})),
                    inflight=book.inflight.get(sid, 0),
                    window=windows.get(sid, 0),
                    completion_tokens=book.tokens.get(sid, 0),
                    busy_s=book.busy_s.get(sid, 0.0),
                    learned_tokens_per_s=book.learning[sid].estimator.rate if sid in book.learning else None,
                    window_reason=(
                        book.learning[sid].last_decision.reason  # type: ignore[union-attr]
                        if sid in book.learning and book.learning[sid].last_decision else None
                    ),
                )
                for sid in ids
            ),
        )
