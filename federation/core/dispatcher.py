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
import itertools
import logging
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping

from fedpool.federation.core.attempts import ENGINE_CANCEL_S, STREAMED_CANCEL_S, Preemptions, Racer, TailRescue
from fedpool.federation.core.clientbook import ClientBook, client_size
from fedpool.federation.core.errors import AttemptError, FailureKind, RequestFailed, RetryState, backoff_s
from fedpool.federation.core.grants import CLIENT_TTL_S, GrantPass
from fedpool.federation.core.learning import HedgeTimer
from fedpool.federation.core.ledger import InflightLedger, StallClock
from fedpool.federation.core.policy import DispatchState, Policy
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
    sends_stream,
)
from fedpool.registry import ClientDemand, ModelDemand, PoolSnapshot, ServerEntry

log = logging.getLogger("fedpool.dispatcher")

# Kind -> what the mean of these requests ((requests, (prompt, answer tokens)) per client) costs on one server of
# that kind, over the routable servers of one model (federation/routing/horizon.py `kind_costs`).
KindPricer = Callable[[Iterable[ServerEntry], Iterable[tuple[int, tuple[float, float]]]], dict[str, float]]

PREEMPTED = ("gave its slot back: this process's capacity lease shrank (another process's client comes first), "
             "or a scrape found most of its attempts on the server queued in the engine")
# A client that said it is about to send (`expect`: an eval that has loaded its samples) counts as demand for the
# capacity lease until its requests arrive, or this long: the lease is asked for while the client gets ready, not
# at its first request (the 19-eval suite's first lease came 0.38 s after its first request).
EXPECT_HOLD_S = 2.0
STALL_MIN_S = 1.0  # a raced-out attempt this old whose server answered nothing since it started: `stalled`
NO_TRIED: set[str] = set()  # shared, never mutated: a request that has failed nowhere yet


class Dispatcher(GrantPass):
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
        # Busy time and occupancy (what server speeds are measured on) leave out the seconds this process's
        # own loop stood still (ledger.StallClock, probed by the grant passes). Only on the real clock: an
        # injected clock is a test's deterministic time, which real stalls must not move.
        self._stalls = StallClock() if clock is time.monotonic else None
        self._ledger = InflightLedger(clock=self._stalls.now if self._stalls else clock, wall_clock=wall_clock)
        self._clients = ClientBook(config.client_order, self._ledger)
        self._book = ServerBook(BookSettings(config.window_factor, config.adaptive_windows, config.learn_throughput,
                                             config.breaker_failures, config.breaker_cooldown_s,
                                             config.learn_period_s), self._ledger, clock=clock)
        self._book.on_forget = policy.forget_server
        self._book.kv_cost = self._clients.kv_tokens if config.kv_admission else None
        # Hedgeable requests in flight, by the task awaiting each (None: no copies under this config or policy).
        self._racers: dict[asyncio.Task[object], Racer] | None = (
            {} if config.hedging and not policy.plans_the_tail else None)
        self._hedge_timer = HedgeTimer(config.hedge_factor, config.hedge_min_delay_s)
        self._tail = TailRescue(enabled=self._racers is not None, timer=self._hedge_timer,
                                racers=self._racers if self._racers is not None else {}, clients=self._clients,
                                book=self._book, policy=policy, rng=self._rng, clock=clock,
                                waiting=lambda: self._waiting, start_copy=self._start_copy)
        # Attempts that may give their slot back: when a lease shrinks, and (give_back_queued) when a scrape shows
        # them queued in their engine beyond the window.
        self._preempt = Preemptions(clock)
        if config.give_back_queued:
            self._book.on_queued = self._take_back_queued
        self._give_back_queued = config.give_back_queued
        # Attempts are noted for a give-back in the client order too (preempt.py, `take_for`): callers ranked by
        # their service exist only under shortest_first.
        self._order_takes = config.client_order == "shortest_first"
        self._observes = policy.observes_answers
        policy.attach(DispatchState(self._ledger, self._clients, clock))
        self.loop_lag_s = 0.0  # the loop's lateness running the grant passes (smoothed): overload, seen here
        # Told when this process starts (True) or stops (False) wanting slots: the lease client reports a start
        # at once, not at its next renewal.
        self.on_demand: Callable[[bool], None] | None = None
        # Told when a slot comes back on a server where this process held more than its (shrunk) lease: the broker
        # gives that slot to another process once it hears of it, so the lease client reports now, not at its
        # next renewal (up to half a second later for every slot that moves).
        self.on_over_lease_release: Callable[[], None] | None = None
        self._expected: dict[str, tuple[str, int, float, bool]] = {}  # client -> (model, requests, since, loading)
        self._seq = itertools.count()
        self._waiting = 0  # requests waiting for a slot, every route
        self._waiting_routes: set[Route] = set()
        self._submitted_routes: set[Route] = set()  # routes with requests submitted in this loop turn
        self._grant_soon: asyncio.Handle | None = None
        self._grant_asked_at = 0.0
        self.loop_lag_at = 0.0
        self._tick_handle: asyncio.TimerHandle | None = None
        self._swept_at = clock()
        self._submitted = self._completed = self._failed = self._retries = self._decisions = 0
        self._decision_s = 0.0

    # ---- what clients say ---------------------------------------------------------------------------
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

    def set_client_requests_left(self, client_id: str, requests: int | None) -> None:
        """A caller that says only how many requests it has still to complete (the gateway's
        `X-Fedpool-Requests`): under client_order="shortest_first" ranked by them × one of its requests' expected
        work, least remaining first (SRPT) beside the clients that report their work; None: it says nothing any
        more (ranked by the service it has had again)."""
        self._clients.declare_requests(client_id, requests)
        self._touch(client_id)

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
    def demand(self) -> tuple[ModelDemand, ...]:
        """What this process wants, per model: each client with requests waiting or in flight (or about to send
        them: `expect`), how many slots it could use now, its rank in the client order (smaller first) and its
        weight. O(waiting + busy servers + clients expected)."""
        wanted: dict[str, dict[str, int]] = {}
        for route in self._waiting_routes:
            per = wanted.setdefault(route.model, {})
            for client, queue in route.queues.items():
                live = sum(1 for w in queue if not w.future.done())
                if live:
                    per[client] = per.get(client, 0) + live
        for state in self._book.states.values():
            if state.inflight and state.entry is not None:
                per = wanted.setdefault(state.entry.record.model, {})
                for client, n in state.by_client.items():
                    per[client] = per.get(client, 0) + n
        clients, now = self._clients, self._clock()
        loading: set[str] = set()
        for client, (model, n, since, still_loading) in list(self._expected.items()):
            per = wanted.setdefault(model, {})
            if client in per or now - since >= EXPECT_HOLD_S:  # its requests speak for it now, or never came
                del self._expected[client]
            else:
                per[client] = n
                if still_loading:
                    loading.add(client)
        snapshot = self._snapshots() if wanted else None
        entries = snapshot.entries if snapshot is not None else ()
        return tuple(ModelDemand(model=model, clients=tuple(
            ClientDemand(client=c, wanted=n, rank=clients.first(c), weight=clients.weight(c),
                         served_s=None if c in loading else clients.served_s(c, now), loading=c in loading,
                         work_left=clients.work_left(c))
            for c, n in sorted(per.items())), kind_costs=self._kind_costs(model, entries, per))
            for model, per in sorted(wanted.items()) if per)

    def _kind_costs(self, model: str, entries: Iterable[ServerEntry], per: Mapping[str, int]) -> dict[str, float]:
        if self._price_kinds is None:
            return {}
        shape = self._clients.shape
        return self._price_kinds((e for e in entries if e.record.model == model),
                                 ((n, size) for c, n in per.items() if (size := client_size(shape(c))) is not None))

    def served_totals(self) -> tuple[float, float]:
        """Every answer's work (prompt + 2 × completion tokens) and the engine slot-seconds they held."""
        return self._clients.served_totals()

    def held(self) -> dict[str, int]:
        """The capacity lease this process works within now, per server."""
        return self._book.held()

    def apply_lease(self, slots: Mapping[str, int] | None) -> None:
        """Work within this lease of slots per server from now on (None: no lease, every window is the
        dispatcher's own); waiting requests look again at once."""
        self._book.apply_lease(slots)
        if slots is not None:  # attempts beyond the lease that have only just started give their slots back
            for server_id in list(self._preempt.running):
                state = self._book.states.get(server_id)
                if state is not None and state.lease is not None and state.inflight > state.lease:
                    self._preempt.over_limit(server_id, state.inflight - state.lease, self._racers)
        for route in list(self._waiting_routes):
            self._grant(route)

    def notify_snapshot(self) -> None:
        """Call when a new snapshot arrived: routes are rebuilt, waiting requests look again."""
        if self._book.sync(self._snapshots()):
            for route in list(self._waiting_routes):
                self._grant(route)

    def _take_back_queued(self, state: ServerState) -> None:
        """A scrape of the engine's queue shrank the server's window below what is in flight there (told by the
        book during a sync): the youngest attempts beyond it give their slots back, whatever their age — they are
        the ones the engine has queued (a burst sent before any answer sat 25 s in an SGLang queue while the
        servers the plan meant for it went on: attempts over a second old were not taken, and SGLang was not asked)."""
        if state.inflight > state.window:
            self._preempt.over_limit(state.id, state.inflight - state.window, self._racers, math.inf)

    # ---- the hot path -------------------------------------------------------------------------------
    async def submit(self, request: InferenceRequest) -> InferenceResult:
        """Complete the request exactly once or raise RequestFailed / NoServerError after every retry."""
        self._submitted += 1
        client = request.client_id
        racers = self._racers
        task = asyncio.current_task() if racers is not None and request.params.temperature == 0 \
            and not request.reproducible else None  # hedgeable (tail.hedgeable): a copy may race it at the tail
        retry: RetryState | None = None
        while True:
            tried = retry.tried if retry is not None else NO_TRIED
            granted = self._grant_now(request, tried)
            state, route = granted if granted is not None else await self._acquire(request, tried)
            started = self._clock()
            cancel_s = None  # on an engine that drops the request once its client went: may be given back
            progress = None  # a streamed attempt that may be given back: marked by the transport once it decodes
            entry = state.entry
            if entry is not None and (self._give_back_queued or self._order_takes or state.lease is not None):
                # (engine_cancel_s and noting the attempt in Preemptions.running, inlined: every attempt passes here)
                streamed = sends_stream(state, request)
                cancel_s = (STREAMED_CANCEL_S if streamed else ENGINE_CANCEL_S).get(entry.record.engine)
                if cancel_s is not None:
                    running = self._preempt.running.get(state.id)
                    if running is None:
                        running = self._preempt.running[state.id] = {}
                    current_task = task or asyncio.current_task()
                    running[current_task] = started  # type: ignore[index]
                    self._preempt.client_of[current_task] = client  # type: ignore[index]
                    if streamed:  # taken only once it decodes (preempt.py): the transport says when
                        progress = self._preempt.streams[current_task] = StreamProgress()  # type: ignore[index]
            racer = None
            if task is not None and racers is not None:
                racer = racers[task] = Racer(request, state, route, started, task)
                if client in self._clients.done_sending:  # at the tail: stragglers are looked for
                    self._tail.client_done()
            try:
                completion = await self._transport.complete(state, request, progress)
            except AttemptError as err:
                self._release(state, client)
                if racer is not None:
                    won = await self._copy_outcome(racer, retry)
                    if won is not None and racer.won is not None:
                        retry = won[1]
                        self._record_failure(state, started, err, retry)
                        return self._answered(request, won[0], racer.won, racer.copy_started, racer.won_at, retry,
                                              hedged=True)
                retry = retry or RetryState()
                await self._after_failure(request, state, started, err, retry)
                continue
            except asyncio.CancelledError:
                current = task or asyncio.current_task()
                if self._preempt.requeue(current):  # slot back (shrunk lease or window), the request to its queue
                    self._give_back(state, client, current, cancel_s or 0.0)
                    if racer is not None:
                        self._end_race(racer)
                    retry = retry or RetryState()
                    retry.attempts.append(Attempt(state.id, started, self._clock() - started, detail=PREEMPTED))
                    continue
                self._release(state, client)
                if racer is None:
                    raise
                self._end_race(racer)
                if (not racer.cancelled_task or racer.won is None or racer.copy_server is None or task is None
                        or task.cancelling() != 1):
                    await self._drop_copy(racer)
                    raise
                task.uncancel()  # the cancel was the winning copy's: the request is answered
                retry = retry or RetryState()
                self._settle_lost_race(state, started, retry)
                return self._answered(request, racer.copy_server, racer.won, racer.copy_started, racer.won_at,
                                      retry, hedged=True)
            except BaseException:
                self._release(state, client)
                if racer is not None:
                    self._end_race(racer)
                    await self._drop_copy(racer)
                raise
            answered_at = self._clock()
            self._release(state, client)
            if racer is None:
                return self._answered(request, state, completion, started, answered_at, retry, False)
            racer.racing = False  # (_end_race, inlined: every hedgeable request passes here)
            if task is not None and racers is not None and racers.get(task) is racer:
                del racers[task]
            if racer.copy is not None and racer.copy_server is not None:
                await self._drop_copy(racer)
                retry = retry or RetryState()
                if racer.copy_error is None:  # (a failed copy was counted against its server already)
                    retry.attempts.append(Attempt(racer.copy_server.id, racer.copy_started,
                                                  answered_at - racer.copy_started, lost_race=True))
            return self._answered(request, state, completion, started, answered_at, retry,
                                  racer.copy_server is not None)

    def _give_back(self, state: ServerState, client: str, task: asyncio.Task[object] | None, delay: float) -> None:
        """An attempt was taken for a shrunk lease: its slot is released once its engine has let the request go
        (`delay` seconds from now, `engine_cancel_s`)."""
        self._preempt.ended(state.id, task)
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self._release, state, client)
        else:
            self._release(state, client)

    def _end_race(self, racer: Racer) -> None:
        racer.racing = False
        if self._racers is not None and racer.task is not None and self._racers.get(racer.task) is racer:
            del self._racers[racer.task]

    def _answered(self, request: InferenceRequest, state: ServerState, completion: Completion, started: float,
                  answered_at: float, retry: RetryState | None, hedged: bool) -> InferenceResult:
        latency = answered_at - started
        attempts = retry.attempts if retry is not None else []
        attempts.append(Attempt(state.id, started, latency))
        client = request.client_id
        self._book.sync(self._snapshots())  # the window decision below reads the newest scrape
        self._book.note_success(state, completion.completion_tokens or 0, latency, client)
        entry = state.entry
        if self._observes and entry is not None:
            self._policy.observe_answer(client, entry, completion.prompt_tokens, completion.completion_tokens, latency,
                                        completion.engine_times)
        self._clients.note_served(client, completion.prompt_tokens, completion.completion_tokens, latency)
        seen = self._hedge_timer.latencies.get(request.model)  # (HedgeTimer.observe, inlined: every answer)
        if seen is None:
            seen = self._hedge_timer.latencies[request.model] = deque(maxlen=self._hedge_timer.window)
        seen.append(latency)
        self._completed += 1
        if self._waiting_routes:
            self._touch(client)  # its service grew: under shortest_first its place in the queue moves
        record = entry.record if entry is not None else None
        return InferenceResult(
            request_id=request.request_id, completion=completion, server_id=state.id,
            engine=record.engine.value if record is not None else "",
            accelerator=record.accelerator if record is not None else "",
            model_revision=record.revision if record is not None else "", latency_s=latency,
            attempts=tuple(attempts), hedged=hedged,
        )

    # ---- failures -----------------------------------------------------------------------------------
    def _record_failure(self, state: ServerState, started: float, err: AttemptError, retry: RetryState) -> None:
        retry.record(state.id, started, self._clock(), err)
        self._note_failure(state, err.kind)

    async def _after_failure(self, request: InferenceRequest, state: ServerState, started: float,
                             err: AttemptError, retry: RetryState) -> None:
        """Record a failed attempt; return to retry (at once or after a backoff) or raise RequestFailed."""
        self._record_failure(state, started, err, retry)
        if err.kind.retriable:
            self._retries += 1
        try:
            at_once = retry.retry_at_once(request.request_id, state.id, err, self._config.max_attempts)
        except RequestFailed:
            self._failed += 1
            raise
        if not at_once:
            await self._sleep(backoff_s(retry.counted, self._config.backoff_base_s, self._config.backoff_max_s,
                                        self._rng))

    def _note_failure(self, state: ServerState, kind: FailureKind) -> None:
        self._book.note_failure(state, kind)
        if kind.counts_against_server and self._on_failure is not None:
            self._on_failure(state.id, kind)

    def note_stream_failure(self, server_id: str, kind: FailureKind) -> None:
        """A stream broke after its first byte (the caller saw it): counted against the server."""
        state = self._book.get(server_id)
        if state is not None:
            self._note_failure(state, kind)
        elif kind.counts_against_server and self._on_failure is not None:
            self._on_failure(server_id, kind)

    # ---- copies at the tail (federation/core/attempts.py decides when and where) ------------------------------
    def _start_copy(self, racer: Racer, state: ServerState) -> None:
        """A second attempt of a racer's request on `state` (a hedge or a steal), counted like any other."""
        client = racer.request.client_id
        now = self._clock()
        self._book.take(state, client, now)
        self._clients.started(client, now)
        racer.copy_server, racer.copy_started = state, now
        self._tail.hedges += 1
        racer.copy = asyncio.get_running_loop().create_task(self._run_copy(racer, state))

        def release_if_never_ran(task: asyncio.Task[None]) -> None:
            # A task cancelled before its first step never runs its body (nor its `finally`).
            if not racer.copy_ran:
                self._release(state, client)

        racer.copy.add_done_callback(release_if_never_ran)

    async def _run_copy(self, racer: Racer, state: ServerState) -> None:
        racer.copy_ran = True
        try:
            completion = await self._transport.complete(state, racer.request)
        except AttemptError as err:
            racer.copy_error = err
            self._note_failure(state, err.kind)
            return
        finally:
            self._release(state, racer.request.client_id)
        racer.won, racer.won_at = completion, self._clock()
        if racer.racing and racer.task is not None:
            racer.racing = False
            racer.cancelled_task = True
            racer.task.cancel()  # the first attempt's task takes the copy's answer (Dispatcher.submit)

    async def _copy_outcome(self, racer: Racer, retry: RetryState | None
                            ) -> tuple[ServerState, RetryState] | None:
        """The first attempt failed: a copy still running may answer instead."""
        self._end_race(racer)
        copy = racer.copy
        if copy is None or racer.copy_server is None:
            return None
        if not copy.done():
            await asyncio.wait([copy])
        retry = retry or RetryState()
        if racer.copy_error is not None:  # (counted against its server when it failed)
            retry.record(racer.copy_server.id, racer.copy_started, self._clock(), racer.copy_error)
            return None
        if racer.won is None:
            return None
        return racer.copy_server, retry

    async def _drop_copy(self, racer: Racer) -> None:
        """Cancel a copy that lost (or whose request is gone) and wait for it: its slot is back on return."""
        copy = racer.copy
        if copy is None:
            return
        racer.racing = False
        if not copy.done():
            copy.cancel()
            await asyncio.gather(copy, return_exceptions=True)

    def _settle_lost_race(self, state: ServerState, started: float, retry: RetryState) -> None:
        """The first attempt was cancelled because a copy answered first. If its server answered nothing at all
        while it ran (long enough to tell), the server accepts requests and does not answer them: a passive
        failure (`stalled`), reported like any other, so a hung server cannot come out of a run looking healthy."""
        now = self._clock()
        age = now - started
        entry = state.entry
        delay = self._hedge_timer.delay(entry.record.model if entry is not None else "") or 0.0
        if state.last_answer_at < started and age >= max(STALL_MIN_S, 2 * delay):
            self._record_failure(state, started, AttemptError(
                FailureKind.STALLED, f"no answer in {age:.1f}s while a copy elsewhere answered"), retry)
            return
        retry.attempts.append(Attempt(state.id, started, age, lost_race=True))

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
            self._policy.forget_client(client)
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
