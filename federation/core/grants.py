"""The grant pass: how a request waits for a slot on its route and is given one, in the serving order, and how a
slot comes back. `Dispatcher` (federation/core/dispatcher.py) is a `GrantPass`; the two files are the two halves of
the request path: who gets which slot when (here), and sending, learning and retrying (there).

A request that finds room in a quiet loop turn is placed at once (`_grant_now`); otherwise it joins its route's
queue (`_acquire`) and is granted on the loop's next turn together with every request submitted in the same turn
(`_grant_submitted` → `_grant`: the policy places the head, `ServerBook.take` counts the slot in the same step).
A slot given back (`_release`) grants the waiting requests of that server's routes; while anyone waits, a tick
looks again at snapshots, breakers, no-server deadlines and the policy's own times.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from fedpool.federation.core.attempts import InFlight, Preemptions, TailRescue
from fedpool.federation.core.clientbook import ClientBook, client_size
from fedpool.federation.core.errors import NoServerError
from fedpool.federation.core.ledger import InflightLedger, StallClock
from fedpool.federation.core.policy import Hold, Policy, PolicyHooks
from fedpool.federation.core.routes import Route, Waiter
from fedpool.federation.core.serverbook import ServerBook, ServerState
from fedpool.federation.core.types import DispatchConfig, InferenceRequest
from fedpool.registry import ClientDemand, ModelDemand, PoolSnapshot, ServerEntry

log = logging.getLogger("fedpool.dispatcher")

# A client that said it is about to send (`expect`: an eval that has loaded its samples) counts as demand for the
# capacity lease until its requests arrive, or this long: the lease is asked for while the client gets ready, not
# at its first request.
EXPECT_HOLD_S = 2.0
# (Kind -> what the mean of these requests (client -> (requests, (prompt, answer tokens))) costs on one server of
# that kind, client -> kind -> one of its requests'), over the routable servers of one model
# (federation/routing/horizon.py `kind_costs`).
KindPricer = Callable[[Iterable[ServerEntry], Mapping[str, tuple[int, tuple[float, float]]]],
                      tuple[dict[str, float], dict[str, dict[str, float]]]]
WAIT_POLL_S = 0.25  # while requests wait: breakers half-open, deadlines pass, snapshots are looked at again
CLIENT_TTL_S = 600.0  # a client with nothing in flight or waiting for this long is forgotten
MAX_IDLE_ROUTES = 256  # routes kept with nobody waiting (each is rebuilt from the snapshot on demand)
NO_SKIP: set[str] = set()  # shared, never mutated: a grant pass that holds no client
LAG_SMOOTHING = 0.1  # weight of one grant pass's lateness in the smoothed loop lag
LAG_STALE_S = 1.0  # a smoothed loop lag with no grant pass for longer than this fades ...
LAG_HALF_LIFE_S = 0.5  # ... by half every this many seconds beyond it


class GrantPass:
    """Waiting for a slot and being granted one; giving it back. The state it works on is the dispatcher's (made in
    `Dispatcher.__init__`), declared here."""

    _book: ServerBook
    _clients: ClientBook
    _policy: Policy
    _hooks: PolicyHooks
    _config: DispatchConfig
    _ledger: InflightLedger
    _stalls: StallClock | None
    _preempt: Preemptions
    _tail: TailRescue
    _racers: dict[asyncio.Task[Any], InFlight] | None
    _clock: Callable[[], float]
    _snapshots: Callable[[], PoolSnapshot | None]
    _rng: random.Random
    _seq: Iterator[int]
    _waiting: int  # requests waiting for a slot, every route
    _waiting_routes: set[Route]
    _submitted_routes: set[Route]  # routes with requests submitted in this loop turn
    _grant_soon: asyncio.Handle | None
    _grant_asked_at: float
    _tick_handle: asyncio.TimerHandle | None
    _swept_at: float
    _decisions: int
    _decision_s: float
    loop_lag_s: float  # the loop's lateness running the grant passes (smoothed): overload, seen here
    loop_lag_at: float
    on_demand: Callable[[bool], None] | None
    on_over_lease_release: Callable[[], None] | None
    _expected: dict[str, tuple[str, int, float, bool]]  # client -> (model, requests, since, loading): `expect`
    _price_kinds: KindPricer | None
    _order_takes: bool  # young attempts give their slots back to a client first in the order (`_take_for_order`)

    def _grant_now(self, request: InferenceRequest, tried: set[str]) -> tuple[ServerState, Route] | None:
        """The first request of a loop turn, on a route where nothing waits and where room is left after it, is
        placed at once (None: it waits in `_acquire`). The grant pass that this turn schedules still runs (it
        measures the loop's lag); the turn's later requests wait for it and are granted there in the client order,
        and so is any request that would take the route's last slot. Placing the first at once saves the pass's
        waiter, its future and a turn of the loop.
        It can take a slot a later request of the same turn comes before in the client order only when that turn
        brings more requests than the route has room for."""
        if self._grant_soon is not None:
            return None
        route = self._book.routes.get((request.model, request.revision, request.pinned_engines,
                                       request.pinned_servers))
        if route is None or route.waiting or not route.free:
            return None
        began = time.perf_counter()
        now = self._clock()
        self._book.sync(self._snapshots())
        if route.waiting or not route.free or self._book.routes.get(route.key) is not route:
            return None
        client = request.client_id
        self._clients.note_request(client, request, now)  # (again in `_acquire` if it waits: it only sets)
        route.memo.clear()
        try:
            placed = self._policy.place(route, request, tried)
        except Exception:
            return None  # (the grant pass asks again, and says what went wrong)
        if isinstance(placed, Hold) or route not in placed.routes:
            return None
        if len(route.free) < 2 and placed.inflight + 1 >= placed.window:
            return None  # the route's last slot: the turn's requests compete for it in the client order
        if not self._waiting and self.on_demand is not None and not self._ledger.total():
            self.on_demand(True)  # idle until now
        self._book.take(placed, client, now)
        self._decisions += 1
        self._ask_grant_pass(asyncio.get_running_loop())
        if now - self._swept_at >= CLIENT_TTL_S / 10:
            self._sweep(now)
        self._decision_s += time.perf_counter() - began
        return placed, route

    def _ask_grant_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        """The grant pass on the loop's next turn (how late it runs is the loop's lag)."""
        self._grant_soon = loop.call_soon(self._grant_submitted)
        self._grant_asked_at = loop.time()
        if self._stalls is not None:
            self._stalls.pending_since = self._grant_asked_at

    async def _acquire(self, request: InferenceRequest, tried: set[str]) -> tuple[ServerState, Route]:
        """Wait for a slot, in the serving order (ClientBook.key, then arrival); a request that just finished
        cannot barge ahead of waiting ones."""
        loop = asyncio.get_running_loop()
        client = request.client_id
        clients = self._clients
        now = self._clock()
        clients.note_request(client, request, now)
        route = self._book.routes.get((request.model, request.revision, request.pinned_engines,
                                       request.pinned_servers))
        if route is None:
            self._book.sync(self._snapshots())
            route = self._book.route((request.model, request.revision, request.pinned_engines,
                                      request.pinned_servers), request.model, request.revision,
                                     request.pinned_engines, request.pinned_servers)
        waiter = Waiter(request, tried, loop.create_future(), next(self._seq),
                        now + self._config.no_server_timeout_s, route)
        route.join(waiter, clients.key(client))
        clients.waiting[client] += 1
        if not self._waiting and self.on_demand is not None and not self._ledger.total():
            self.on_demand(True)  # idle until now
        self._waiting += 1
        self._waiting_routes.add(route)
        # Granted on the loop's next turn, not here: requests that arrive together (evals starting at once,
        # a client refilling its workers) are granted in one pass, in the client order, instead of in the
        # order their coroutines happened to run.
        self._submitted_routes.add(route)
        if self._grant_soon is None:
            self._ask_grant_pass(loop)
        try:
            return await waiter.future, route
        except asyncio.CancelledError:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self._release(future.result(), client)  # granted in the same turn as the cancellation
            raise
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
            route.waiting -= 1
            self._waiting -= 1
            left = clients.waiting[client] - 1
            if left:
                clients.waiting[client] = left
            else:
                del clients.waiting[client]
            if not route.waiting:
                self._waiting_routes.discard(route)
                if len(self._book.routes) > MAX_IDLE_ROUTES:
                    self._book.drop_route(route)

    def _grant_submitted(self) -> None:
        self._grant_soon = None
        # How late this pass runs is the loop's lag: a stall for the ledger's clock, overload for the gateway.
        now = asyncio.get_running_loop().time()
        lag = self._stalls.ran(now) if self._stalls is not None else now - self._grant_asked_at
        # What was smoothed before fades once older than LAG_STALE_S: after a quiet spell (a gateway refusing
        # everything runs no grant passes) the first pass is not judged by the overload before it (the gateway
        # refused again at once, for as long as that took to average out).
        previous, age = self.loop_lag_s, now - self.loop_lag_at
        if age > LAG_STALE_S:
            previous *= 0.5 ** ((age - LAG_STALE_S) / LAG_HALF_LIFE_S)
        self.loop_lag_s = previous + LAG_SMOOTHING * (lag - previous)
        self.loop_lag_at = now
        self._book.sync(self._snapshots())
        routes, self._submitted_routes = self._submitted_routes, set()
        for route in routes:
            self._grant(route)

    def _grant(self, route: Route) -> None:
        """Grant free slots of the route to its waiters, in the serving order (synchronous: the choice and the
        count happen in one step)."""
        if not route.waiting:
            route.unpark_all()  # (nothing is parked, as a rule)
            return
        # perf_counter, not process_time: the CPU clock of a process with Ray's threads is a syscall; the pass is
        # synchronous, so its wall time is its CPU time.
        began = time.perf_counter()
        now = self._clock()
        key, policy, book = self._clients.key, self._policy, self._book
        held: set[str] = set()
        route.memo.clear()
        while route.waiting and route.free:
            head = route.head(key, held)
            if head is None:
                # Room left over that a parked client waits for (a freed server woke only its group's first):
                # wake the next of each such group rather than leave the slot idle until the tick.
                if route.parked and route.unpark_ready():
                    continue
                break
            try:
                placed = policy.place(route, head.request, head.tried)
            except Exception:
                placed = self._misplaced(route, head, None)
            else:
                if not isinstance(placed, Hold) and route not in placed.routes:
                    placed = self._misplaced(route, head, placed)
            if placed is Hold.ROUTE_FULL:
                break
            if placed is Hold.CLIENT_HELD:
                held.add(head.request.client_id)
                continue
            route.granted(head)
            if route.took_for == head.request.client_id:
                route.took_for = None
            book.take(placed, head.request.client_id, now)
            head.future.set_result(placed)
            self._decisions += 1
        if held:
            route.unskip(held, key)
        if self._order_takes and route.waiting and not route.free:
            self._take_for_order(route, held)
        # The tick only for requests still ungranted (`waiting` counts the granted ones until they resume): a
        # request that found room arms no timer.
        if self._tick_handle is None and route.waiting and (route.parked or route.head(key, NO_SKIP) is not None):
            self._arm_tick()
        if now - self._swept_at >= CLIENT_TTL_S / 10:  # (every grant pass, so a pool that never waits sweeps too)
            self._sweep(now)
        self._decision_s += time.perf_counter() - began

    def _take_for_order(self, route: Route, held: set[str]) -> None:
        """The route is full and its first waiting client is a gateway caller (ranked by its service, or by the
        requests it says it has left: `ClientBook.gives_way`): the caller furthest behind it in the order gives back
        young attempts (attempts.py, `Preemptions.take_for`) — as many as leave it still behind after
        the swap (its rank less one request's work per slot given, against the waiting client's plus one of its
        own per slot taken), less those already given back whose slots have not come back yet. Not for a client the
        policy held in this pass (`held`), nor again for one it took slots for that has not been granted one since
        (`Route.took_for`): held by its policy, the slots it was given went to the others again, and their attempts
        were taken at every turn while nothing ended (three small batches: 0 of 155 requests in 12 minutes)."""
        clients = self._clients
        head = route.head(clients.key, NO_SKIP)
        if head is None or head.request.client_id in held or head.request.client_id == route.took_for:
            return
        first = head.request.client_id
        if not clients.gives_way(first):
            return
        rank, own = clients.first(first), clients.expected_work(first)
        victim, top = None, rank
        for client in self._ledger.clients:
            if client != first and clients.gives_way(client) and (r := clients.first(client)) > top:
                victim, top = client, r
        if victim is None:
            return
        per = clients.expected_work(victim)
        if per <= 0 or own <= 0:
            return  # nothing known of either's requests yet
        swaps = 0
        while (swaps < clients.waiting.get(first, 0) and top - (swaps + 1) * per > rank + (swaps + 1) * own):
            swaps += 1
        swaps -= self._preempt.pending()
        if swaps > 0 and self._preempt.take_for(victim, route.servers, swaps):
            route.took_for = first

    def _misplaced(self, route: Route, head: Waiter, placed: object) -> ServerState | Hold:
        """A policy's bug (it raised: `placed` None; or it answered with a server outside the route) costs that one
        decision, not the grant pass, which stopped there and never re-armed its timer, leaving every waiter
        waiting: logged, and a sampled server with room answers instead."""
        name, request_id = type(self._policy).__name__, head.request.request_id
        if placed is None:
            log.exception("policy %s failed placing request %s", name, request_id)
        else:
            log.error("policy %s placed request %s on %r, outside its route", name, request_id,
                      getattr(placed, "id", placed))
        free = route.free_candidates(1, head.tried, self._rng)
        return free[0] if free else Hold.ROUTE_FULL

    def _arm_tick(self) -> None:
        recheck = self._hooks.recheck_s
        delay = min(WAIT_POLL_S, (recheck() if recheck is not None else None) or WAIT_POLL_S)
        cooldown = self._book.next_cooldown()
        if cooldown is not None:
            delay = max(0.0, min(delay, cooldown - self._clock()))
        self._tick_handle = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        """While anyone waits: new snapshots, breakers half-open, no-server deadlines, a policy's own times."""
        self._tick_handle = None
        now = self._clock()
        self._book.sync(self._snapshots())
        self._book.tick(now)
        for route in list(self._waiting_routes):
            if not route.servers:
                for waiter in route.waiters():
                    if now >= waiter.deadline:
                        waiter.future.set_exception(NoServerError(
                            f"no routable server serves model {waiter.request.model!r}"
                            + (f" revision {waiter.request.revision!r}" if waiter.request.revision else "")
                            + f" (waited {self._config.no_server_timeout_s:g}s)"))
            route.unpark_all()  # a policy's reasons to hold a client are looked at again every tick
            self._grant(route)  # (re-arms the tick while requests there are still ungranted)

    def _release(self, state: ServerState, client: str, attempt: InFlight | None = None, after_s: float = 0.0) -> None:
        """A slot back on `state` (an attempt answered, failed, was cancelled; a copy ended), `after_s` from now (the
        time its engine takes to let a cancelled request go). With its attempt, the attempt's record ends at once: it
        may no longer be given back or raced."""
        if attempt is not None and (task := attempt.task) is not None:
            attempt.racing = False
            if state.attempts.get(task) is attempt:
                del state.attempts[task]
            if self._racers is not None and self._racers.get(task) is attempt:
                del self._racers[task]
        if after_s > 0:
            asyncio.get_running_loop().call_later(after_s, self._release, state, client)
            return
        self._book.release(state, client)
        if state.lease is not None and self.on_over_lease_release is not None and state.inflight >= state.lease:
            self.on_over_lease_release()  # (it held one more than its lease there until now)
        if not self._waiting and self.on_demand is not None and not self._ledger.total():
            self.on_demand(False)  # idle from now: the lease can go back
        if self._racers and self._clients.done_sending:
            self._tail.on_release(state)  # before waiters: it only takes stragglers of clients done sending
        for route in state.routes:
            if route.waiting:
                route.touch(client, self._clients.key(client))
                self._grant(route)

    # ---- what this process wants of the lease broker ----------------------------------------------------------
    def demand(self) -> tuple[ModelDemand, ...]:
        """What this process wants, per model: each client with requests waiting or in flight (or about to send
        them: `expect`), how many slots it could use now, its rank in the client order (smaller first) and its
        weight; and, for the people watching the pool, its requests answered and left and whether it has sent its
        last. O(waiting + busy servers + clients expected)."""
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
        out = []
        for model, per in sorted(wanted.items()):
            if per:
                costs, of_client = self._kind_costs(model, entries, per)
                out.append(ModelDemand(model=model, clients=tuple(
                    self._client_demand(c, n, c in loading, of_client.get(c, {})) for c, n in sorted(per.items())),
                    kind_costs=costs, order=clients.order))
        return tuple(out)

    def _client_demand(self, c: str, wanted: int, loading: bool, kind_costs: dict[str, float]) -> ClientDemand:
        clients = self._clients
        request_s, running = (None, 0) if loading else clients.request_s(c)
        return ClientDemand(client=c, wanted=wanted, rank=clients.first(c), weight=clients.weight(c),
                            served_s=None if loading else clients.served_s(c), request_s=request_s, running=running,
                            loading=loading, work_left=clients.work_left(c), answered=clients.answered(c),
                            requests_left=clients.requests_left_of(c), sent_all=c in clients.done_sending,
                            kind_costs=kind_costs)

    def client_progress(self, client_id: str) -> ClientDemand:
        """A client with nothing waiting or in flight, as a lease report's `ended` names it: its progress only."""
        clients = self._clients
        return ClientDemand(client=client_id, wanted=0, answered=clients.answered(client_id),
                            requests_left=clients.requests_left_of(client_id),
                            sent_all=client_id in clients.done_sending)

    def _kind_costs(self, model: str, entries: Iterable[ServerEntry], per: Mapping[str, int]
                    ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        if self._price_kinds is None:
            return {}, {}
        shape = self._clients.shape
        return self._price_kinds((e for e in entries if e.record.model == model),
                                 {c: (n, size) for c, n in per.items() if (size := client_size(shape(c))) is not None})

    def _touch(self, client: str) -> None:
        """The client's serving key moved: its waiting requests take their new place."""
        if self._waiting_routes:
            key = self._clients.key(client)
            for route in self._waiting_routes:
                route.touch(client, key)


    def _sweep(self, now: float) -> None:
        """Forget clients gone for CLIENT_TTL_S (nothing in flight or waiting): their service, shapes, latency."""
        self._swept_at = now
        for client in self._clients.idle(now, CLIENT_TTL_S):
            self._clients.forget(client)
            self._book.forget_client(client)
            if self._hooks.forget_client is not None:
                self._hooks.forget_client(client)
