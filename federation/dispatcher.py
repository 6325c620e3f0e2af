"""The request path: choose a server, hold a slot in its admission window, POST, release, retry elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from fedpool.federation.dispatch_types import DispatchConfig, DispatcherStats, OpenStream, Slot
from fedpool.federation.errors import AttemptError, FailureKind, NoServerError, RequestFailed
from fedpool.federation.hedging import HedgeTimer, race
from fedpool.federation.ordering import ClientOrder
from fedpool.federation.planner import Planner
from fedpool.federation.policies import Policy, RouteContext
from fedpool.federation.retries import RetryState, backoff_s
from fedpool.federation.routes import Routes
from fedpool.federation.serverbook import BookSettings, ServerBook
from fedpool.federation.stealing import RaceBook, Racer
from fedpool.federation.transport import open_stream, post_completion
from fedpool.federation.types import Attempt, Completion, InferenceRequest, InferenceResult
from fedpool.registry import PoolSnapshot, ServerEntry

log = logging.getLogger("fedpool.dispatcher")

WAIT_POLL_S = 0.25  # waiters re-check breakers and snapshots at least this often
HEDGE_RECHECK_S = 0.1  # how often a straggler looks again for an idle server to hedge on


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
        return self.request.route_key()


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
                         self._config.breaker_failures, self._config.breaker_cooldown_s,
                         self._config.learn_period_s),
            clock=clock, wall_clock=wall_clock,
        )
        # A new snapshot may change the servers and their priors: the scale that puts priors on the learned
        # rates is computed again.
        self._routes = Routes(snapshots, on_new_snapshot=self._book.forget_rate_scale)
        self._submitted = self._completed = self._failed = self._retries = 0
        # Waiting requests, FIFO per (client, route): a grant looks at each queue's head only, so it costs
        # O(clients × routes), not O(waiters). Cancelled waiters are dropped lazily when they reach a head.
        self._queues: dict[tuple[str, tuple[object, ...]], deque[_Waiter]] = {}
        self._route_waiting: Counter[tuple[object, ...]] = Counter()  # live waiters per route
        self._client_inflight: Counter[str] = Counter()
        self._seq = itertools.count()
        self._tick_handle: asyncio.TimerHandle | None = None
        self._grant_soon: asyncio.Handle | None = None  # one grant pass for every request submitted in a tick
        self._decisions = 0
        self._decision_s = 0.0
        self._order = ClientOrder(self._config.client_order)
        self._clients_done: set[str] = set()
        self._hedge_timer = HedgeTimer(self._config.hedge_factor, self._config.hedge_min_delay_s)
        self._hedges = 0
        self._races = RaceBook()  # hedgeable requests in flight, per server: what tail stealing may take
        self._planner = (Planner(clock, self._config.plan_period_s, warmup_s=5 * self._config.plan_period_s,
                                 order=self._order.first if self._order.name != "fair" else None)
                         if self._config.planned else None)
        self._client_waiting: Counter[str] = Counter()  # requests queued for a slot, per client

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def client_order(self) -> str:
        return self._order.name

    def client_done_sending(self, client_id: str, done: bool = True) -> None:
        """A client says it has nothing left to send: its outstanding requests are the tail of its run,
        where stragglers may be hedged."""
        if done:
            self._clients_done.add(client_id)
        else:
            self._clients_done.discard(client_id)

    def set_client_weight(self, client_id: str, weight: float) -> None:
        """Weighted fair share when the pool is saturated: a client of weight 2 gets twice the slots."""
        self._order.set_weight(client_id, weight)

    def set_client_remaining(self, client_id: str, work: float, requests: int | None = None) -> None:
        """How much work the client has left (any consistent unit; used by client_order="shortest_first")
        and, when known, how many requests it has still to complete (used by planned routing)."""
        self._order.set_remaining(client_id, work)
        if requests is not None and self._planner is not None:
            self._planner.set_remaining(client_id, requests)

    def set_client_shape(self, client_id: str, prompt_tokens: float, max_tokens: int | None) -> None:
        """A client's expected prompt length and answer budget, before its first request: the planner's prior
        (answers' usage replaces it), so the first plan need not wait for this client to send."""
        if self._planner is not None:
            self._planner.note_prior(client_id, prompt_tokens, max_tokens)

    @property
    def planner(self) -> Planner | None:
        return self._planner

    def notify_snapshot(self) -> None:
        """Call when a new snapshot arrived: waiting requests look again."""
        self._dispatch_waiting()

    # ---- the hot path -------------------------------------------------------------------------
    async def submit(self, request: InferenceRequest) -> InferenceResult:
        """Complete the request exactly once or raise RequestFailed / NoServerError after every retry."""
        self._submitted += 1
        retry = RetryState()
        hedgeable = self._config.hedging and request.body.get("temperature") == 0
        while True:
            slot = await self._acquire(request, retry.tried)
            started = self._clock()
            primary = self._start_attempt(slot, request)
            racer = Racer(request, slot.server, asyncio.get_running_loop().create_future()) if hedgeable else None
            if racer is not None:
                self._races.add(racer)
            try:
                winner, others, hedged = await race(
                    primary, slot.server, started,
                    launch=(lambda s=slot.server, r=racer: self._launch_hedge(request, s, r)) if hedgeable else None,
                    delay_s=self._hedge_timer.delay(request.model) if hedgeable else None,
                    recheck_s=HEDGE_RECHECK_S, clock=self._clock,
                    wake=(lambda r=racer: r.wake) if racer is not None else None,
                )
            finally:
                if racer is not None:
                    self._races.forget(racer)
                    if racer.stolen is not None:  # stolen in the same tick the race ended: drop the copy
                        racer.stolen[0].cancel()
                        racer.stolen = None
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
            self._book.note_success(self._routes.current(server), completion.completion_tokens or 0, latency)
            if self._planner is not None:
                self._planner.note_answer(request.client_id, server, completion.prompt_tokens,
                                          completion.completion_tokens)
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

    def _start_attempt(self, slot: Slot, request: InferenceRequest) -> asyncio.Task[Completion]:
        """One POST on a held slot, as a task; the slot is released however it ends. A task cancelled before
        its first step never runs its body (nor its `finally`), so that case releases from a callback."""
        started = [False]
        task = asyncio.create_task(self._attempt(slot, request, started))

        def release_if_never_started(done: asyncio.Task[Completion]) -> None:
            if not started[0]:
                self._release(slot)

        task.add_done_callback(release_if_never_started)
        return task

    async def _attempt(self, slot: Slot, request: InferenceRequest, started: list[bool]) -> Completion:
        started[0] = True
        try:
            return await post_completion(self._session, slot.server.url, request, self._config.timeouts)
        finally:
            self._release(slot)

    def _client_key(self, client_id: str) -> tuple[float, float]:
        """The order clients are served in (smaller first), for waiters and stolen stragglers alike."""
        return self._order.key(client_id, self._client_inflight.get(client_id, 0))

    def _steal_for(self, thief: ServerEntry) -> None:
        """Tail stealing. `thief` just freed a slot; a client that has sent everything may have requests
        queued on a server that will take much longer to drain (in flight ÷ learned rate) than the thief.
        The thief starts a copy of the one queued there last, if that client comes before every waiting
        request in the serving order; the first answer wins and the other copy is cancelled (the engine
        drops it). So one eval's stragglers do not wait behind a slow server while a fast one has room."""
        best_waiting: tuple[float, float] | None = None
        for (cid, _route), queue in self._queues.items():
            if any(not w.future.done() for w in itertools.islice(queue, 4)):
                key = self._client_key(cid)
                if best_waiting is None or key < best_waiting:
                    best_waiting = key
        now = self._clock()

        def eligible(r: Racer) -> bool:
            return (r.request.client_id in self._clients_done
                    and (best_waiting is None or self._client_key(r.request.client_id) < best_waiting)
                    and r.server.record.revision == thief.record.revision
                    and any(s.id == thief.id for s in self._routes.servers_for(r.request)))

        for victim in self._races.stealable(thief, self._book, eligible):
            slot = self._take(thief, victim.request.client_id, now)
            victim.stolen = (self._start_attempt(slot, victim.request), thief, now)
            if not victim.wake.done():
                victim.wake.set_result(None)

    def _launch_hedge(
        self, request: InferenceRequest, primary: ServerEntry, racer: Racer | None = None
    ) -> tuple[asyncio.Task[Completion], ServerEntry, float] | None:
        """A duplicate on another idle server of the same model revision, only at the tail of a run: the
        request's client has nothing left to send and nothing else waits for this model. None otherwise.
        A stolen request's copy is already running on the server that took it."""
        if racer is not None and racer.stolen is not None:
            launched, racer.stolen = racer.stolen, None
            return launched
        if racer is not None:
            self._races.forget(racer)
        launched = self._hedge_on(request, primary)
        if launched is None and racer is not None:
            if racer.wake.done():
                racer.wake = asyncio.get_running_loop().create_future()
            self._races.add(racer)  # not taken: it may be stolen later
        return launched

    def _hedge_on(
        self, request: InferenceRequest, primary: ServerEntry
    ) -> tuple[asyncio.Task[Completion], ServerEntry, float] | None:
        if request.client_id not in self._clients_done:
            return None
        key = request.route_key()
        if self._route_waiting.get(key):
            return None
        now = self._clock()
        servers = [
            s for s in self._routes.servers_for(request)
            if s.id != primary.id and s.record.revision == primary.record.revision
            and self._book.breaker(s.id).allows(now)
        ]
        free = self._book.free_candidates(servers, self._policy.candidate_limit, self._rng)
        if not free:
            return None
        decision = self._policy.choose(free, RouteContext(request.request_id, request.prefix_text()))
        server = next(s for s in servers if s.id == decision.server_id)
        slot = self._take(server, request.client_id, now)
        return self._start_attempt(slot, request), server, now

    @contextlib.asynccontextmanager
    async def stream(self, request: InferenceRequest) -> AsyncIterator[OpenStream]:
        """An upstream streaming response with its slot held until the caller is done reading it.

        Failures before the first byte are retried elsewhere like any request; once bytes have gone to
        the caller the stream cannot move, and a break is the caller's to report."""
        self._submitted += 1
        retry = RetryState()
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
            self._book.note_success(self._routes.current(server), 0, self._clock() - started)
            self._completed += 1
        except BaseException:
            self._failed += 1
            raise
        finally:
            response.release()
            self._release(slot)

    def _record_failure(self, server: ServerEntry, started: float, err: AttemptError, retry: RetryState) -> None:
        retry.record(server.id, started, self._clock(), err)
        self._note_failure(server, err.kind)

    async def _after_failure(
        self, request: InferenceRequest, server: ServerEntry, started: float, err: AttemptError, retry: RetryState
    ) -> None:
        """Record a failed attempt; return to retry (at once or after a backoff) or raise RequestFailed."""
        self._record_failure(server, started, err, retry)
        if err.kind.retriable:
            self._retries += 1
        try:
            at_once = retry.retry_at_once(request.request_id, server.id, err, self._config.max_attempts)
        except RequestFailed:
            self._failed += 1
            raise
        if not at_once:
            await self._sleep(backoff_s(retry.counted, self._config.backoff_base_s, self._config.backoff_max_s,
                                        self._rng))

    async def _acquire(self, request: InferenceRequest, tried: set[str]) -> Slot:
        """Wait for a slot. Waiters are served fairly: the client with the fewest requests in flight per
        unit of weight first, then arrival order; a request that just finished cannot barge ahead."""
        loop = asyncio.get_running_loop()
        answer = request.body.get("max_tokens")
        if isinstance(answer, int | float):
            self._order.note_answer_length(request.client_id, float(answer))
        if self._planner is not None:
            self._planner.note_request(request.client_id, request.prompt_chars(),
                                       float(answer) if isinstance(answer, int | float) else None)
        self._client_waiting[request.client_id] += 1
        waiter = _Waiter(request, tried, loop.create_future(), next(self._seq),
                         self._clock() + self._config.no_server_timeout_s)
        key = waiter.route_key
        self._queues.setdefault((request.client_id, key), deque()).append(waiter)
        self._route_waiting[key] += 1
        # Granted on the loop's next turn, not here: requests that arrive together (evals starting at once,
        # a client refilling its workers) are granted in one pass, in the client order, instead of in the
        # order their coroutines happened to run.
        if self._grant_soon is None:
            self._grant_soon = loop.call_soon(self._grant_submitted)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            # Granted a slot in the same tick as the cancellation: give it back.
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self._release(waiter.future.result())
            raise
        finally:
            if not waiter.future.done():
                waiter.future.cancel()  # leaves its queue when it reaches the head
            self._client_waiting[request.client_id] -= 1
            if self._client_waiting[request.client_id] <= 0:
                del self._client_waiting[request.client_id]
            self._route_waiting[key] -= 1
            if self._route_waiting[key] <= 0:
                del self._route_waiting[key]

    def _grant_submitted(self) -> None:
        self._grant_soon = None
        self._dispatch_waiting()

    def _dispatch_waiting(self) -> None:
        """Grant free slots to waiters (synchronous: choice and count happen in one step). Fair: the
        client with the fewest requests in flight per unit of weight first, then arrival order."""
        if not self._queues:
            return
        started = time.perf_counter()
        try:
            self._grant_waiting()
        finally:
            self._decision_s += time.perf_counter() - started

    def _grant_waiting(self) -> None:
        now = self._clock()
        blocked: set[tuple[object, ...]] = set()
        full_kinds: set[str] = set()  # planned routing: server kinds found with no free slot in this pass
        while True:
            best_queue: deque[_Waiter] | None = None
            best_key: tuple[float, float, int] | None = None
            for (cid, route), queue in list(self._queues.items()):
                while queue and queue[0].future.done():
                    queue.popleft()
                if not queue:
                    del self._queues[(cid, route)]
                    continue
                if route in blocked or (cid, route) in blocked:
                    continue
                key = (*self._client_key(cid), queue[0].seq)
                if best_key is None or key < best_key:
                    best_queue, best_key = queue, key
            if best_queue is None:
                break
            head = best_queue[0]
            placed = self._place(head, now, full_kinds)
            if placed is True:
                best_queue.popleft()
            elif placed is False:
                blocked.add(head.route_key)
            else:  # held by the plan: this client waits for its planned servers; others may go on
                blocked.add((head.request.client_id, head.route_key))
        if self._queues and self._tick_handle is None:
            # Re-check while anyone waits: breakers half-open and no-server deadlines pass with time (and
            # the planner's first plan, made once every client has had a moment to send).
            delay = WAIT_POLL_S
            if self._planner is not None:  # pacing credit grows with time, not with events
                delay = min(delay, self._config.plan_period_s / 2)
                if self._planner.warming_up():
                    delay = min(delay, self._planner.wait_s() + 1e-3, self._config.plan_period_s / 5)
            self._tick_handle = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        self._tick_handle = None
        self._dispatch_waiting()

    def _place(self, waiter: _Waiter, now: float, full_kinds: set[str] | None = None) -> bool | None:
        """Give the waiter a slot if a server can take it; False when its route is full, None when the plan
        holds it for servers that are full."""
        request = waiter.request
        servers = self._routes.servers_for(request)
        if self._planner is not None and servers:
            book, tried = self._book, waiter.tried

            def usable(server: ServerEntry, avoid_tried: bool = True) -> bool:
                return ((not avoid_tried or server.id not in tried) and book.breaker(server.id).allows(now)
                        and book.inflight.get(server.id, 0) < book.window(server))

            pick = self._planner.pick(request.client_id, servers, self._client_waiting, usable, full_kinds)
            if pick is None and tried:  # every planned server was tried: any of them again, as below
                pick = self._planner.pick(request.client_id, servers, self._client_waiting,
                                          lambda s: usable(s, avoid_tried=False))
            if pick is None:
                return None  # held for its planned servers (which are full); other clients may go on
            waiter.future.set_result(self._take(pick, request.client_id, now))
            self._decisions += 1
            return True
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
        self._decisions += 1
        return True

    def _take(self, server: ServerEntry, client_id: str, now: float) -> Slot:
        """Count a slot on the chosen server. Called in the same step as the choice (no await in
        between), so concurrent picks cannot pile onto one server."""
        self._book.take(server, now)
        self._client_inflight[client_id] += 1
        if self._planner is not None:
            self._planner.on_sent(client_id, server.id)
        return Slot(server, client_id, now)

    def _release(self, slot: Slot) -> None:
        self._book.release(slot.server.id)
        if self._planner is not None:
            self._planner.on_done(slot.client_id, slot.server.id)
        self._client_inflight[slot.client_id] -= 1
        if self._client_inflight[slot.client_id] <= 0:
            del self._client_inflight[slot.client_id]
        if self._config.hedging and self._races and self._clients_done:
            self._steal_for(slot.server)  # before waiters: it only takes stragglers that come first
        self._dispatch_waiting()

    # ---- bookkeeping --------------------------------------------------------------------------
    def _note_failure(self, server: ServerEntry, kind: FailureKind) -> None:
        self._book.note_failure(self._routes.current(server), kind)
        if kind.counts_against_server and self._on_failure is not None:
            self._on_failure(server.id, kind)

    def inflight(self) -> dict[str, int]:
        return dict(self._book.inflight)

    def stats(self) -> DispatcherStats:
        snapshot = self._snapshots()
        return DispatcherStats(
            submitted=self._submitted,
            completed=self._completed,
            failed=self._failed,
            retries=self._retries,
            hedges=self._hedges,
            inflight_total=sum(self._book.inflight.values()),
            waiting=sum(1 for queue in self._queues.values() for w in queue if not w.future.done()),
            decisions=self._decisions,
            decision_s=self._decision_s,
            servers=self._book.server_stats(snapshot.entries if snapshot else ()),
        )
