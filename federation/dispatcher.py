"""The request path: choose a server, hold a slot in its admission window, POST, release, retry elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import aiohttp
from fedpool.federation.clientbook import ClientBook
from fedpool.federation.dispatch_types import DispatchConfig, DispatcherStats, OpenStream, Slot
from fedpool.federation.errors import AttemptError, FailureKind, NoServerError, RequestFailed
from fedpool.federation.hedging import AttemptOutcome
from fedpool.federation.ledger import InflightLedger
from fedpool.federation.policies import Candidate, DispatchState, Hold, Policy, RouteContext
from fedpool.federation.retries import RetryState, backoff_s
from fedpool.federation.routes import Routes
from fedpool.federation.serverbook import BookSettings, ServerBook
from fedpool.federation.stalls import LoopStalls
from fedpool.federation.tail import TailRescue
from fedpool.federation.transport import open_stream, post_completion
from fedpool.federation.types import Attempt, Completion, InferenceRequest, InferenceResult
from fedpool.federation.waiting import Blocked, Waiter, WaitQueues
from fedpool.registry import PoolSnapshot, ServerEntry

log = logging.getLogger("fedpool.dispatcher")

WAIT_POLL_S = 0.25  # waiters re-check breakers and snapshots at least this often
STALL_MIN_S = 1.0  # a raced-out attempt this old whose server answered nothing since it started: `stalled`


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
        self._config = config = config or DispatchConfig()
        self._clock = clock
        self._rng = rng or random.Random(0)
        self._on_failure = on_failure
        self._sleep = sleep
        # Busy time and occupancy (what server speeds are measured on) leave out the seconds this process's
        # own loop stood still (federation/stalls.py). Only on the real clock: an injected clock is a test's
        # deterministic time, which real stalls must not move.
        self._stalls = LoopStalls(lambda: self._ledger.total() > 0) if clock is time.monotonic else None
        self._ledger = InflightLedger(clock=self._stalls.clock if self._stalls else clock, wall_clock=wall_clock)
        self._clients = ClientBook(config.client_order, self._ledger)
        self._book = ServerBook(BookSettings(config.window_factor, config.adaptive_windows, config.learn_throughput,
                                             config.breaker_failures, config.breaker_cooldown_s,
                                             config.learn_period_s), self._ledger, clock=clock)
        # A new snapshot may change the servers and their priors: the scale that puts priors on the learned
        # rates is computed again.
        self._routes = Routes(snapshots, on_new_snapshot=self._book.forget_rate_scale)
        self._waiting = WaitQueues()
        self._tail = TailRescue(config, clients=self._clients, waiting=self._waiting, routes=self._routes,
                                book=self._book, policy=policy, rng=self._rng, clock=clock, start_copy=self._copy)
        policy.attach(DispatchState(self._ledger, self._clients, clock))
        self._submitted = self._completed = self._failed = self._retries = 0
        self._tick_handle: asyncio.TimerHandle | None = None
        self._grant_soon: asyncio.Handle | None = None  # one grant pass for every request submitted in a tick
        self._decisions = 0
        self._decision_s = 0.0

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def client_order(self) -> str:
        return self._clients.order

    @property
    def ledger(self) -> InflightLedger:
        return self._ledger

    def client_done_sending(self, client_id: str, done: bool = True) -> None:
        """A client says it has nothing left to send: its outstanding requests are the tail of its run,
        where stragglers may be hedged."""
        if done:
            self._clients.done_sending.add(client_id)
        else:
            self._clients.done_sending.discard(client_id)

    def set_client_weight(self, client_id: str, weight: float) -> None:
        """Weighted fair share when the pool is saturated: a client of weight 2 gets twice the slots."""
        self._clients.set_weight(client_id, weight)

    def set_client_remaining(self, client_id: str, work: float, requests: int | None = None) -> None:
        """How much work the client has left (any consistent unit; used by client_order="shortest_first")
        and, when known, how many requests it has still to complete (used by planned routing)."""
        self._clients.set_remaining(client_id, work, requests)

    def set_client_shape(self, client_id: str, prompt_tokens: float, max_tokens: int | None) -> None:
        """A client's expected prompt length and answer budget, before its first request (the planned
        policy's prior; answers' usage replaces it), so a first plan need not wait for this client to send."""
        self._clients.announce_shape(client_id, prompt_tokens, max_tokens)

    def registered_models(self) -> dict[str, set[str]]:
        """Model -> revisions of every registered server (routable or not) in the current snapshot."""
        snapshot = self._snapshots()
        out: dict[str, set[str]] = {}
        for entry in snapshot.entries if snapshot is not None else ():
            out.setdefault(entry.record.model, set()).add(entry.record.revision)
        return out

    def notify_snapshot(self) -> None:
        """Call when a new snapshot arrived: waiting requests look again."""
        self._dispatch_waiting()

    # ---- the hot path -------------------------------------------------------------------------
    async def submit(self, request: InferenceRequest) -> InferenceResult:
        """Complete the request exactly once or raise RequestFailed / NoServerError after every retry."""
        self._submitted += 1
        retry = RetryState()
        while True:
            slot = await self._acquire(request, retry.tried)
            started = self._clock()
            primary = self._start_attempt(slot, request)
            winner, others, hedged = await self._tail.race(request, slot.server, primary, started)
            for outcome in others:
                if outcome.cancelled:
                    self._settle_lost_race(outcome, retry)
            errors = [o for o in others if o.error is not None]
            if winner is None:
                for outcome in errors[:-1]:
                    self._record_failure(outcome.server, outcome.started, outcome.error, retry)  # type: ignore[arg-type]
                last = errors[-1]
                await self._after_failure(request, last.server, last.started, last.error, retry)  # type: ignore[arg-type]
                continue
            for outcome in errors:
                self._record_failure(outcome.server, outcome.started, outcome.error, retry)  # type: ignore[arg-type]
            return self._answered(request, winner, retry, hedged)

    def _answered(self, request: InferenceRequest, winner: AttemptOutcome, retry: RetryState,
                  hedged: bool) -> InferenceResult:
        server, completion = winner.server, winner.completion
        assert completion is not None
        latency = winner.finished - winner.started
        retry.attempts.append(Attempt(server.id, winner.started, latency))
        self._book.note_success(self._routes.current(server), completion.completion_tokens or 0, latency,
                                request.client_id)
        self._policy.observe_answer(request.client_id, server, completion.prompt_tokens,
                                    completion.completion_tokens)
        self._clients.note_served(request.client_id, completion.prompt_tokens, completion.completion_tokens, latency)
        self._tail.timer.observe(request.model, latency)
        self._completed += 1
        return InferenceResult(
            request_id=request.request_id, completion=completion, server_id=server.id,
            engine=server.engine.value, accelerator=server.record.accelerator,
            model_revision=server.record.revision, latency_s=latency, attempts=tuple(retry.attempts), hedged=hedged,
        )

    def _settle_lost_race(self, outcome: AttemptOutcome, retry: RetryState) -> None:
        """A copy cancelled because another answered first. If its server answered nothing at all while it
        ran (long enough to tell), the server accepts requests and does not answer them: a passive failure
        (`stalled`), reported like any other, so a hung server cannot come out of a run looking healthy."""
        age = outcome.finished - outcome.started
        silent = self._book.last_answer_at.get(outcome.server.id, float("-inf")) < outcome.started
        delay = self._tail.timer.delay(outcome.server.record.model) or 0.0
        if silent and age >= max(STALL_MIN_S, 2 * delay):
            err = AttemptError(FailureKind.STALLED, f"no answer in {age:.1f}s while a copy elsewhere answered")
            self._record_failure(outcome.server, outcome.started, err, retry)
            return
        retry.attempts.append(Attempt(outcome.server.id, outcome.started, age, lost_race=True))

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

    def _copy(self, server: ServerEntry, request: InferenceRequest) -> asyncio.Task[Completion]:
        """A second attempt of `request` on `server` (a hedge or a steal), counted like any other."""
        return self._start_attempt(self._take(server, request.client_id, self._clock()), request)

    @contextlib.asynccontextmanager
    async def stream(self, request: InferenceRequest) -> AsyncIterator[OpenStream]:
        """An upstream streaming response with its slot held until the caller is done reading it.

        Failures before the first byte are retried elsewhere like any request; once bytes have gone to
        the caller the stream cannot move here, and a break is the caller's to handle (the gateway
        continues it on another replica)."""
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
            self._book.note_success(self._routes.current(server), 0, self._clock() - started, request.client_id)
            self._completed += 1
        except BaseException:
            self._failed += 1
            raise
        finally:
            response.release()
            self._release(slot)

    def note_stream_failure(self, server: ServerEntry, kind: FailureKind) -> None:
        """A stream broke after its first byte (the caller saw it): counted against the server."""
        self._note_failure(server, kind)

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

    # ---- waiting for a slot -------------------------------------------------------------------
    async def _acquire(self, request: InferenceRequest, tried: set[str]) -> Slot:
        """Wait for a slot, in the serving order (ClientBook.key, then arrival); a request that just finished
        cannot barge ahead of waiting ones."""
        loop = asyncio.get_running_loop()
        client = request.client_id
        self._clients.note_request(client, request.prompt_chars(), request.params.max_tokens)
        self._clients.waiting[client] += 1
        waiter = self._waiting.join(request, tried, loop.create_future(),
                                    self._clock() + self._config.no_server_timeout_s)
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
            self._waiting.leave(waiter)
            self._clients.waiting[client] -= 1
            if self._clients.waiting[client] <= 0:
                del self._clients.waiting[client]

    def _grant_submitted(self) -> None:
        self._grant_soon = None
        self._dispatch_waiting()

    def _tick(self) -> None:
        self._tick_handle = None
        self._dispatch_waiting()

    def _dispatch_waiting(self) -> None:
        """Grant free slots to waiters (synchronous: choice and count happen in one step)."""
        if not self._waiting:
            return
        started = time.perf_counter()
        try:
            now = self._clock()
            blocked: Blocked = set()
            memo: set[str] = set()  # the policy's scratch for this pass
            while (head := self._waiting.next_head(self._clients.key, blocked)) is not None:
                held = self._place(head, now, memo)
                if held is None:
                    self._waiting.pop(head)
                else:
                    blocked.add(head.route_key if held is Hold.ROUTE_FULL else (head.request.client_id,
                                                                                  head.route_key))
            if self._waiting and self._tick_handle is None:
                # Re-check while anyone waits: breakers half-open, no-server deadlines pass with time, and a
                # policy may hold requests for reasons that move with time (a plan's next period).
                delay = min(WAIT_POLL_S, self._policy.recheck_s() or WAIT_POLL_S)
                self._tick_handle = asyncio.get_running_loop().call_later(delay, self._tick)
        finally:
            self._decision_s += time.perf_counter() - started

    def _place(self, waiter: Waiter, now: float, memo: set[str]) -> Hold | None:
        """Give the waiter a slot if its policy places it (None), else say why it waits."""
        request = waiter.request
        servers = self._routes.servers_for(request)
        view = _RouteView(servers, waiter.tried, now, memo, self._book, self._rng)
        placed = self._policy.place(view, RouteContext(request.request_id, request.prefix_text(), request.client_id))
        if isinstance(placed, Hold):
            if not servers and now >= waiter.deadline:
                waiter.future.set_exception(NoServerError(
                    f"no routable server serves model {request.model!r}"
                    + (f" revision {request.revision!r}" if request.revision else "")
                    + f" (waited {self._config.no_server_timeout_s:g}s)"
                ))
                return None
            return placed
        waiter.future.set_result(self._take(next(s for s in servers if s.id == placed), request.client_id, now))
        self._decisions += 1
        return None

    def _take(self, server: ServerEntry, client_id: str, now: float) -> Slot:
        """Count a slot on the chosen server. Called in the same step as the choice (no await in
        between), so concurrent picks cannot pile onto one server."""
        self._book.take(server, client_id, now)
        if self._stalls is not None:
            self._stalls.arm()
        return Slot(server, client_id, now)

    def _release(self, slot: Slot) -> None:
        self._ledger.release(slot.server.id, slot.client_id)
        self._tail.on_release(slot.server)  # before waiters: it only takes stragglers that come first
        self._dispatch_waiting()

    # ---- bookkeeping --------------------------------------------------------------------------
    def _note_failure(self, server: ServerEntry, kind: FailureKind) -> None:
        self._book.note_failure(self._routes.current(server), kind)
        if kind.counts_against_server and self._on_failure is not None:
            self._on_failure(server.id, kind)

    def inflight(self) -> dict[str, int]:
        return self._ledger.by_server()

    def stats(self) -> DispatcherStats:
        snapshot = self._snapshots()
        return DispatcherStats(
            submitted=self._submitted, completed=self._completed, failed=self._failed, retries=self._retries,
            hedges=self._tail.hedges, inflight_total=self._ledger.total(), waiting=self._waiting.live(),
            decisions=self._decisions, decision_s=self._decision_s,
            loop_stalled_s=self._stalls.stalled_s if self._stalls else 0.0,
            servers=self._book.server_stats(snapshot.entries if snapshot else ()),
        )


class _RouteView:
    """One waiting request's route, as its policy sees it for one decision (see policies.RouteView)."""

    __slots__ = ("_book", "_now", "_rng", "_tried", "memo", "servers")

    def __init__(self, servers: Sequence[ServerEntry], tried: set[str], now: float, memo: set[str],
                 book: ServerBook, rng: random.Random):
        self.servers, self._tried, self._now, self.memo, self._book, self._rng = servers, tried, now, memo, book, rng

    def usable(self, server: ServerEntry, *, avoid_tried: bool = True) -> bool:
        return ((not avoid_tried or server.id not in self._tried) and self._book.breaker(server.id).allows(self._now)
                and self._book.has_room(server))

    def free_candidates(self, limit: int | None) -> list[Candidate]:
        # Servers this request failed on are avoided while any other open one serves the route (even if full:
        # then it waits for those rather than going back).
        avoid = not self._tried or any(s.id not in self._tried and self._book.breaker(s.id).allows(self._now)
                                       for s in self.servers)
        return self._book.free_candidates(self.servers, limit, self._rng,
                                          lambda s: self.usable(s, avoid_tried=avoid))
