"""The request path: wait for a slot on the request's route, in the serving order; the policy picks a server
with room (sampled from the route's index); count the slot in the same step; send; give the slot back however
the attempt ends; learn from the answer; retry elsewhere on failure.

One request, start to end: `submit` → `_acquire` (the request joins its route's queue; granted on the loop's
next turn, together with every request submitted in the same turn, in the client order) → `_grant` (the
policy places the head: `ServerBook.take` counts the slot and updates the index) → the transport's
`complete` → `_release` (the slot back; waiting requests on that server's routes granted) → `_answered`
(learning, client service, result). Waiting, granting and giving back are the grant pass
(`federation/core/grants.py`, which `Dispatcher` extends); hedging and stealing at a client's tail are
`federation/core/attempts.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fedpool.federation.core.attempts import (
    ENGINE_CANCEL_S,
    STREAMED_CANCEL_S,
    AttemptEnds,
    InFlight,
    Preemptions,
    TailRescue,
)
from fedpool.federation.core.clientbook import ClientBook
from fedpool.federation.core.errors import AttemptError, FailureKind, RetryState
from fedpool.federation.core.grants import CLIENT_TTL_S, GrantPass, KindPricer
from fedpool.federation.core.ledger import HedgeTimer, InflightLedger, StallClock
from fedpool.federation.core.policy import DispatchState, Policy, PolicyHooks, least_expected_wait
from fedpool.federation.core.routes import Route
from fedpool.federation.core.serverbook import BookSettings, ServerBook, ServerState
from fedpool.federation.core.types import (
    Attempt,
    Completion,
    DispatchConfig,
    DispatcherStats,
    InferenceRequest,
    InferenceResult,
    OpenStream,
    StreamProgress,
    Transport,
)
from fedpool.registry import PoolSnapshot, Served

log = logging.getLogger("fedpool.dispatcher")


PREEMPTED = ("gave its slot back: this process's capacity lease shrank (another process's client comes first), "
             "or a scrape found most of its attempts on the server queued in the engine")
NO_TRIED: set[str] = set()  # shared, never mutated: a request that has failed nowhere yet


class Dispatcher(GrantPass, AttemptEnds):
    """Spreads requests over the servers of the current snapshot. One per client process; shareable by
    any number of concurrent evaluations in it, so their requests merge in each engine's batch."""

    def __init__(
        self,
        transport: Transport,
        snapshots: Callable[[], PoolSnapshot | None],
        policy: Policy,
        *,
        config: DispatchConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        on_failure: Callable[[str, FailureKind], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        price_kinds: KindPricer | None = None,
    ):
        self._config = config = config or DispatchConfig()
        self._transport = transport
        # What a client's mean request costs on each server kind of its model, for the lease broker (None: the
        # broker places this process's slots by count alone).
        self._price_kinds = price_kinds
        self._snapshots = snapshots
        self._policy = policy
        self._clock = clock
        self._rng = rng or random.Random(0)
        self._on_failure = on_failure
        self._sleep = sleep
        self._make_books(config, clock, wall_clock)
        self._hooks = hooks = policy.attach(DispatchState(self._ledger, self._clients, clock))
        self._book.on_forget = hooks.forget_server
        self._make_tail(config, hooks, clock)
        self.loop_lag_s = 0.0  # the loop's lateness running the grant passes (smoothed): overload, seen here
        self.loop_lag_at = 0.0
        # Told when this process starts (True) or stops (False) wanting slots: the lease client reports a start
        # at once, not at its next renewal.
        self.on_demand: Callable[[bool], None] | None = None
        # Told when a slot comes back on a server where this process held more than its (shrunk) lease: the broker
        # gives that slot to another process once it hears of it, so the lease client reports now.
        self.on_over_lease_release: Callable[[], None] | None = None
        self._expected: dict[str, tuple[str, int, float, bool]] = {}  # client -> (model, requests, since, loading)
        self._seq = itertools.count()
        self._waiting = 0  # requests waiting for a slot, every route
        self._waiting_routes: set[Route] = set()
        self._submitted_routes: set[Route] = set()  # routes with requests submitted in this loop turn
        self._grant_soon: asyncio.Handle | None = None
        self._grant_asked_at = 0.0
        self._tick_handle: asyncio.TimerHandle | None = None
        self._swept_at = clock()
        self._submitted = self._completed = self._failed = self._retries = self._decisions = 0
        self._decision_s = 0.0

    def _make_books(self, config: DispatchConfig, clock: Callable[[], float], wall_clock: Callable[[], float]) -> None:
        """The ledger, the client and server books, and what gives attempts back."""
        # Busy time and occupancy (what server speeds are measured on) leave out the seconds this process's own loop
        # stood still (ledger.StallClock, probed by the grant passes). Only on the real clock: an injected clock is
        # a test's deterministic time, which real stalls must not move.
        self._stalls = StallClock() if clock is time.monotonic else None
        self._ledger = InflightLedger(clock=self._stalls.now if self._stalls else clock, wall_clock=wall_clock)
        self._clients = ClientBook(config.client_order, self._ledger)
        self._book = ServerBook(BookSettings(config.window_factor, config.adaptive_windows, config.learn_throughput,
                                             config.breaker_failures, config.breaker_cooldown_s,
                                             config.learn_period_s), self._ledger, clock=clock)
        self._book.kv_size = self._clients.kv_tokens
        self._book.kv_cost = self._clients.kv_tokens if config.kv_admission else None
        # Attempts that may give their slot back: when a lease shrinks, when a scrape shows them queued in their
        # engine beyond the window (give_back_queued), and to a caller first in the order (shortest_first only:
        # callers ranked by their service exist only there; attempts.py `take_for`).
        self._preempt = Preemptions(clock)
        if config.give_back_queued:
            self._book.on_queued, self._book.at_tail = self._take_back_queued, self._at_tail
        self._all_sent = (math.nan, False)  # (when, whether every client in flight has sent its last: _at_tail)
        self._give_back_queued = config.give_back_queued
        self._order_takes = config.client_order == "shortest_first"

    def _make_tail(self, config: DispatchConfig, hooks: PolicyHooks, clock: Callable[[], float]) -> None:
        """Copies at a client's tail: hedgeable requests in flight, by the task awaiting each (None: no copies
        under this config, or a policy that places the tail itself)."""
        self._racers: dict[asyncio.Task[Any], InFlight] | None = (
            {} if config.hedging and not hooks.plans_the_tail else None)
        self._hedge_timer = HedgeTimer(config.hedge_factor, config.hedge_min_delay_s)
        self._tail = TailRescue(enabled=self._racers is not None, timer=self._hedge_timer,
                                racers=self._racers if self._racers is not None else {}, clients=self._clients,
                                book=self._book, pick=hooks.pick or least_expected_wait, sample=hooks.sample,
                                rng=self._rng, clock=clock, waiting=lambda: self._waiting, start_copy=self._start_copy)

    # ---- what clients say ---------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self._policy

    def policy_state(self) -> dict[str, Any] | None:
        """The policy's own state worth logging (JSON-able), where it says any (`PolicyHooks.describe`)."""
        return self._hooks.describe() if self._hooks.describe is not None else None

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
            self._tail.client_done()
        else:
            self._clients.done_sending.discard(client_id)
            self._tail.clients_changed()  # (client_done regroups too)

    def done_sending(self, client_id: str) -> bool:
        """Whether the client said it has nothing left to send (`client_done_sending`)."""
        return client_id in self._clients.done_sending

    def set_client_weight(self, client_id: str, weight: float) -> None:
        """Weighted fair share when the pool is saturated: a client of weight 2 gets twice the slots."""
        self._clients.set_weight(client_id, weight)
        self._touch(client_id)

    def set_client_remaining(self, client_id: str, work: float, requests: int | None = None) -> None:
        """How much work the client has left (any consistent unit; used by client_order="shortest_first")
        and, when known, how many requests it has still to complete (used by planned routing)."""
        self._clients.set_remaining(client_id, work, requests)
        self._touch(client_id)

    def set_client_requests_left(self, client_id: str, requests: int | None, *, background: bool = False) -> None:
        """A caller that says only how many requests it has still to complete (the gateway's
        `X-Fedpool-Requests`): under client_order="shortest_first" ranked by them × one of its requests' expected
        work, least remaining first (SRPT) beside the clients that report their work; None: it says nothing any
        more (ranked by the service it has had again). `background` (a Batch API batch): in every order it ranks
        after every client that is not, so online callers keep their latency and it fills the capacity they
        leave."""
        self._clients.declare_requests(client_id, requests, background=background)
        self._touch(client_id)

    def online_within(self, seconds: float) -> bool:
        """Whether a caller that is not a Batch API batch (online traffic, an eval) submitted a request in the
        last `seconds` (the batches' online reserve reads it: clients/batchrunner.py `OnlineReserve`)."""
        return self._clients.foreground_since(self._clock() - seconds)

    def background_about(self) -> bool:
        """Whether a Batch API batch is a client with requests left (`OnlineReserve` steers online requests then)."""
        return self._clients.background_about()

    def set_client_shape(self, client_id: str, prompt_tokens: float, max_tokens: int | None) -> None:
        """A client's expected prompt length and answer budget, before its first request (the planned
        policy's prior; answers' usage replaces it), so a first plan need not wait for this client to send."""
        self._clients.announce_shape(client_id, prompt_tokens, max_tokens)

    def expect(self, client_id: str, model: str, requests: int, *, loading: bool = False) -> None:
        """The client is about to send `requests` requests for `model` (an eval that has loaded its samples and
        waits for the others to load): counted as demand until its requests arrive, or for EXPECT_HOLD_S, so a
        capacity lease is asked for now and is in hand at its first request. `requests` 0 takes it back.
        `loading`: it has not read its samples yet (`requests` is what it may send at most) — the broker holds it
        an equal share beside the first clients in the order, so another process that loaded a moment sooner
        does not take every slot and keep it a whole answer (ClientDemand.loading)."""
        if requests <= 0 or self.on_demand is None:  # (no lease to ask for: nothing to count)
            self._expected.pop(client_id, None)
            return
        idle = not self._waiting and not self._ledger.total() and not self._expected
        self._expected[client_id] = (model, requests, self._clock(), loading)
        if idle:
            self.on_demand(True)

    def registered_models(self) -> dict[str, set[str]]:
        """Model -> revisions of every registered server (routable or not) in the current snapshot."""
        snapshot = self._snapshots()
        return snapshot.revisions() if snapshot is not None else {}

    # ---- capacity leases (federation/gateway/leases.py renews them; the dispatcher decides within them) ---------
    def served_totals(self) -> Served:
        """Every answer's work (prompt + 2 × completion tokens), the engine slot-seconds they held, their tokens."""
        return self._clients.served_totals()

    def price_by_pool(self, served: Served) -> None:
        """Every lease holder's answers, as the broker sums them: until this process has an answer of its own, its
        callers' requests are priced by them (`ClientBook.expected_s`)."""
        self._clients.pool_served = served

    def held(self) -> dict[str, int]:
        """The capacity lease this process works within now, per server."""
        return self._book.held()

    def apply_lease(self, slots: Mapping[str, int] | None) -> None:
        """Work within this lease of slots per server from now on (None: no lease, every window is the
        dispatcher's own); waiting requests look again at once."""
        self._book.apply_lease(slots)
        if slots is not None:
            for state in list(self._book.states.values()):
                self._over_lease(state)
        for route in list(self._waiting_routes):
            self._grant(route)

    def _over_lease(self, state: ServerState) -> None:
        """Attempts beyond the server's lease that have only just started give their slots back; a streamed one
        still in its prompt is looked at again as it starts to decode. (Left to the next lease, a gateway replica
        whose first requests were prefilling when its lease halved kept them — and the other replica waited with
        no slot — a renewal or two: 0.5-1 s of an 8 s lm-eval run.)"""
        if state.attempts and state.lease is not None and state.inflight > state.lease:
            self._preempt.over_limit(state, state.inflight - state.lease,
                                     when_decoding=functools.partial(self._over_lease_soon, state))

    def _over_lease_soon(self, state: ServerState) -> None:
        asyncio.get_running_loop().call_soon(self._over_lease, state)  # (not inside the transport's read)

    def notify_snapshot(self) -> None:
        """Call when a new snapshot arrived: routes are rebuilt, waiting requests look again."""
        if self._book.sync(self._snapshots()):
            for route in list(self._waiting_routes):
                self._grant(route)

    def _take_back_queued(self, state: ServerState) -> None:
        """A scrape of the engine's queue shrank the server's window below what is in flight there (told by the
        book during a sync): the youngest attempts beyond it give their slots back, whatever their age — they are
        the ones the engine has queued, not started, however long they have waited (docs/architecture.md)."""
        if state.inflight > state.window:
            self._preempt.over_limit(state, state.inflight - state.window, math.inf)

    def _at_tail(self, state: ServerState) -> bool:
        """Whether the server is at a tail: nothing waits on its routes, another of their servers has room, and
        every client with a request in flight has sent its last (or has no end in view: an online caller) — a
        queue in its engine is then worth moving (windows.py). Read once per clock tick."""
        routes = state.routes
        if not routes or any(route.waiting for route in routes) or not any(r.has_room_besides(state) for r in routes):
            return False
        now = self._clock()
        if self._all_sent[0] != now:
            clients = self._clients
            done = clients.done_sending
            self._all_sent = (now, bool(done) and all(c in done or clients.open_ended(c) for c in self._ledger.clients))
        return self._all_sent[1]

    # ---- the hot path -------------------------------------------------------------------------------
    async def submit(self, request: InferenceRequest) -> InferenceResult:
        """Complete the request exactly once or raise RequestFailed / NoServerError after every retry."""
        self._submitted += 1
        # A hedgeable request (attempts.hedgeable: greedy, not asked to be reproducible) may be raced at its tail.
        hedged = self._racers is not None and request.params.temperature == 0 and not request.reproducible
        task = asyncio.current_task()  # (the attempt's: a give-back or a winning copy cancels it)
        retry: RetryState | None = None
        while True:
            tried = retry.tried if retry is not None else NO_TRIED
            granted = self._grant_now(request, tried)
            state, route = granted if granted is not None else await self._acquire(request, tried)
            attempt = self._begin(request, state, route, hedged, task)
            outcome: InferenceResult | RetryState | None
            try:
                completion = await self._transport.complete(state, request, attempt.progress)
            except AttemptError as err:
                self._release(state, request.client_id, attempt)
                outcome = await self._attempt_failed(attempt, err, retry)
            except asyncio.CancelledError:
                outcome = await self._cancelled(attempt, retry)
                if outcome is None:
                    raise
            except BaseException:
                self._release(state, request.client_id, attempt)
                await self._drop_copy(attempt)
                raise
            else:
                answered_at = self._clock()
                self._release(state, request.client_id, attempt)
                if attempt.copy is not None:  # a copy raced it and lost
                    retry = await self._lost_copy(attempt, answered_at, retry)
                return self._answered(attempt, state, completion, attempt.started, answered_at, retry)
            if isinstance(outcome, InferenceResult):
                return outcome
            retry = outcome

    def _begin(self, request: InferenceRequest, state: ServerState, route: Route, hedged: bool,
               task: asyncio.Task[Any] | None) -> InFlight:
        """The attempt's record, noted where give-backs (on an engine that lets a cancelled request go: its slot may
        go back to a shrunk lease or window) and copies at the tail (a hedgeable request) will look for it."""
        started = self._clock()
        attempt = InFlight(request, state, route, started, None)
        entry = state.entry
        if entry is not None and (self._give_back_queued or self._order_takes or state.lease is not None):
            streamed = state.streamed and request.streamable
            attempt.cancel_s = (STREAMED_CANCEL_S if streamed else ENGINE_CANCEL_S).get(entry.record.engine)
            if attempt.cancel_s is not None and task is not None:
                attempt.task = task
                state.attempts[task] = attempt
                if streamed:  # taken only once it decodes: the transport says when
                    attempt.progress = StreamProgress()
        if hedged and self._racers is not None and task is not None:
            attempt.task = task
            self._racers[task] = attempt
            if request.client_id in self._clients.done_sending:  # at the tail: stragglers are looked for
                self._tail.client_done()
        else:
            attempt.racing = False
        return attempt

    async def _attempt_failed(self, attempt: InFlight, err: AttemptError,
                              retry: RetryState | None) -> InferenceResult | RetryState:
        """The attempt failed (its slot is back): a copy still running may answer instead; else it is recorded and
        the request is tried again (at once, or after a backoff) or RequestFailed is raised."""
        if attempt.copy is not None:
            won = await self._copy_outcome(attempt, retry)
            if won is not None and attempt.won is not None:
                retry = won[1]
                self._record_failure(attempt.server, attempt.started, err, retry)
                return self._answered(attempt, won[0], attempt.won, attempt.copy_started, attempt.won_at, retry,
                                      hedged=True)
        retry = retry or RetryState()
        await self._after_failure(attempt.request, attempt.server, attempt.started, err, retry)
        return retry

    async def _cancelled(self, attempt: InFlight, retry: RetryState | None) -> InferenceResult | RetryState | None:
        """The attempt's task was cancelled: a give-back (the request goes back to its queue), a winning copy's
        answer handed over, or the caller's cancel (None: the caller raises it again)."""
        state, client, task = attempt.server, attempt.client, attempt.task
        if self._preempt.requeue(task):  # slot back (shrunk lease or window), the request to its queue
            self._give_back(attempt)
            retry = retry or RetryState()
            retry.attempts.append(Attempt(state.id, attempt.started, self._clock() - attempt.started,
                                          detail=PREEMPTED))
            return retry
        self._release(state, client, attempt)
        if (task is None or not attempt.cancelled_task or attempt.won is None or attempt.copy_server is None
                or task.cancelling() != 1):
            await self._drop_copy(attempt)
            return None
        task.uncancel()  # the cancel was the winning copy's: the request is answered
        retry = retry or RetryState()
        self._settle_lost_race(state, attempt.started, retry)
        return self._answered(attempt, attempt.copy_server, attempt.won, attempt.copy_started, attempt.won_at,
                              retry, hedged=True)

    def _give_back(self, attempt: InFlight) -> None:
        """An attempt was taken for a shrunk lease or window: its slot is released once its engine has let the
        request go (`InFlight.cancel_s` seconds from now)."""
        self._release(attempt.server, attempt.client, attempt, attempt.cancel_s or 0.0)

    def _answered(self, attempt: InFlight, state: ServerState, completion: Completion, started: float,
                  answered_at: float, retry: RetryState | None, hedged: bool | None = None) -> InferenceResult:
        """The request is answered by `state` (the attempt's own server, or its copy's): learning, the client's
        service, the result with every attempt."""
        request = attempt.request
        latency = answered_at - started
        attempts = retry.attempts if retry is not None else []
        attempts.append(Attempt(state.id, started, latency))
        client = request.client_id
        self._book.sync(self._snapshots())  # the window decision below reads the newest scrape
        self._book.note_success(state, completion.completion_tokens or 0, latency, client)
        entry = state.entry
        if self._hooks.on_answer is not None and entry is not None:
            self._hooks.on_answer(client, entry, completion.prompt_tokens, completion.completion_tokens, latency,
                                  completion.engine_times)
        self._clients.note_served(client, completion.prompt_tokens, completion.completion_tokens, latency)
        self._hedge_timer.observe(request.model, latency)
        self._completed += 1
        if self._waiting_routes:
            self._touch(client)  # its service grew: under shortest_first its place in the queue moves
        record = entry.record if entry is not None else None
        return InferenceResult(
            request_id=request.request_id, completion=completion, server_id=state.id,
            engine=record.engine.value if record is not None else "",
            accelerator=record.accelerator if record is not None else "",
            model_revision=record.revision if record is not None else "", latency_s=latency,
            attempts=tuple(attempts), hedged=attempt.copy_server is not None if hedged is None else hedged,
        )

    # ---- streams ------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def stream(self, request: InferenceRequest, *, continuation: bool = False) -> AsyncIterator[OpenStream]:
        """An upstream streaming response with its slot held until the caller is done reading it.

        Failures before the first byte are retried elsewhere like any request; once bytes have gone to the
        caller the stream cannot move here, and a break is the caller's to handle (the gateway continues it on
        another replica, as a `continuation`: the same request, not a new submission). The slot is given back
        on every path, cancellation included."""
        if not continuation:
            self._submitted += 1
        client = request.client_id
        retry: RetryState | None = None
        while True:
            state, _ = await self._acquire(request, retry.tried if retry is not None else NO_TRIED)
            started = self._clock()
            try:
                response = await self._transport.open_stream(state, request)
            except AttemptError as err:
                self._release(state, client)
                retry = retry or RetryState()
                await self._after_failure(request, state, started, err, retry)
                continue
            except BaseException:
                self._release(state, client)
                raise
            break
        try:
            assert state.entry is not None
            yield OpenStream(state.entry, response, tuple(retry.attempts) if retry is not None else ())
            self._book.note_success(state, 0, self._clock() - started, client)
        finally:
            response.release()
            self._release(state, client)

    def stream_ended(self, ok: bool) -> None:
        """The caller's verdict on a stream it relayed (after any continuations): answered, or failed."""
        if ok:
            self._completed += 1
        else:
            self._failed += 1

    # ---- bounded state and figures ---------------------------------------------------------------------
    def forget_idle_clients(self, ttl_s: float = CLIENT_TTL_S) -> int:
        """Forget clients idle for `ttl_s` now (the gateway calls this when it has many); returns how many."""
        idle = self._clients.idle(self._clock(), ttl_s)
        for client in idle:
            self._expected.pop(client, None)
            self._clients.forget(client)
            self._book.forget_client(client)
            if self._hooks.forget_client is not None:
                self._hooks.forget_client(client)
        return len(idle)

    def inflight(self) -> dict[str, int]:
        return self._ledger.by_server()

    def stats(self) -> DispatcherStats:
        snapshot = self._snapshots()
        return DispatcherStats(
            submitted=self._submitted, completed=self._completed, failed=self._failed, retries=self._retries,
            hedges=self._tail.hedges, inflight_total=self._ledger.total(), waiting=self._waiting,
            preempted=self._preempt.count, preempted_lost_s=self._preempt.lost_s,
            decisions=self._decisions, decision_s=self._decision_s,
            loop_stalled_s=self._stalls.stalled_s if self._stalls is not None else 0.0,
            servers=self._book.server_stats(snapshot.entries if snapshot else ()),
        )
