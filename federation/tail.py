"""The tail of a run: straggler hedging and tail stealing, both raced by `hedging.race`.

Both act only at the tail: the client has said it has nothing left to send **and no request waits in the
dispatcher, for any route**. (A client that hands all its requests over at once has "sent everything" from
its first second; hedging and stealing then ran the whole run long, duplicating work and moving requests
against the plan: on the Table 7 design they cost 4-5% of the makespan.) Hedging: a hedgeable request
(greedy, no bit-for-bit reproducibility asked) still running after `hedge_factor` × the model's median
latency is copied onto an idle server. Stealing: when a slot frees, requests queued on a server that will
drain slower than this one may be taken: the freed server starts a copy of the one queued there last.
Either way the first answer wins and the other copy is cancelled.

A copy only ever runs on a *replica* of the first server: the same engine, model and revision, with the
revision explicitly set (`unspecified` matches nothing), so the winner of a timing race cannot change what
is recorded beyond the batch numerics of one engine build.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from fedpool.federation.clientbook import ClientBook
from fedpool.federation.dispatch_types import DispatchConfig
from fedpool.federation.hedging import AttemptOutcome, HedgeTimer, race
from fedpool.federation.policies import Policy, RouteContext
from fedpool.federation.routes import Routes
from fedpool.federation.serverbook import ServerBook
from fedpool.federation.stealing import RaceBook, Racer
from fedpool.federation.types import Completion, InferenceRequest
from fedpool.federation.waiting import WaitQueues
from fedpool.registry import ServerEntry

HEDGE_RECHECK_S = 0.1  # how often a straggler looks again for an idle server to hedge on
UNSPECIFIED_REVISION = "unspecified"

Copy = tuple[asyncio.Task[Completion], ServerEntry, float]
StartCopy = Callable[[ServerEntry, InferenceRequest], asyncio.Task[Completion]]


def replicas(a: ServerEntry, b: ServerEntry) -> bool:
    """Whether a copy on `b` may stand in for an attempt on `a`: same engine, model and explicit revision."""
    return (a.record.engine == b.record.engine and a.record.model == b.record.model
            and a.record.revision == b.record.revision and a.record.revision != UNSPECIFIED_REVISION)


class TailRescue:
    def __init__(self, config: DispatchConfig, *, clients: ClientBook, waiting: WaitQueues, routes: Routes,
                 book: ServerBook, policy: Policy, rng: random.Random, clock: Callable[[], float],
                 start_copy: StartCopy):
        self._enabled = config.hedging and not policy.plans_the_tail
        self._clients = clients
        self._waiting = waiting
        self._routes = routes
        self._book = book
        self._policy = policy
        self._rng = rng
        self._clock = clock
        self._start_copy = start_copy
        self.timer = HedgeTimer(config.hedge_factor, config.hedge_min_delay_s)
        self._races = RaceBook()  # hedgeable requests in flight, per server: what stealing may take
        self.hedges = 0

    async def race(self, request: InferenceRequest, server: ServerEntry, primary: asyncio.Task[Completion],
                   started: float) -> tuple[AttemptOutcome | None, list[AttemptOutcome], bool]:
        """Await the attempt on `server`, racing copies against it at the tail when the request allows."""
        if not (self._enabled and request.hedgeable):
            return await race(primary, server, started, launch=None, delay_s=None, recheck_s=HEDGE_RECHECK_S,
                              clock=self._clock)
        racer = Racer(request, server, asyncio.get_running_loop().create_future())
        self._races.add(racer)
        try:
            outcome = await race(primary, server, started, launch=lambda: self._launch(racer),
                                 delay_s=self.timer.delay(request.model), recheck_s=HEDGE_RECHECK_S,
                                 clock=self._clock, wake=lambda: racer.wake)
        finally:
            self._races.forget(racer)
            if racer.stolen is not None:  # stolen in the same tick the race ended: drop the copy
                racer.stolen[0].cancel()
                racer.stolen = None
        self.hedges += outcome[2]
        return outcome

    def on_release(self, thief: ServerEntry) -> None:
        """A slot freed on `thief`: it may take stragglers queued on slower servers (before waiters: it only
        takes stragglers of clients that come first in the serving order)."""
        if not (self._enabled and self._races and self._clients.done_sending) or self._waiting.total():
            return  # not the tail while any request waits: a thief takes waiting work, not another's stragglers
        best_waiting = min((self._clients.key(c) for c in self._waiting.waiting_clients()), default=None)

        def eligible(r: Racer) -> bool:
            return (r.request.client_id in self._clients.done_sending
                    and (best_waiting is None or self._clients.key(r.request.client_id) < best_waiting)
                    and replicas(r.server, thief)
                    and any(s.id == thief.id for s in self._routes.servers_for(r.request)))

        for victim in self._races.stealable(thief, self._book, eligible):
            victim.stolen = (self._start_copy(thief, victim.request), thief, self._clock())
            if not victim.wake.done():
                victim.wake.set_result(None)

    def _launch(self, racer: Racer) -> Copy | None:
        """A copy for `racer`: the one a stealing server already started, else a hedge on another idle replica
        (only at the tail: the client has nothing left to send and nothing waits in the dispatcher)."""
        if racer.stolen is not None:
            launched, racer.stolen = racer.stolen, None
            return launched
        self._races.forget(racer)
        launched = self._hedge(racer.request, racer.server)
        if launched is None:
            if racer.wake.done():
                racer.wake = asyncio.get_running_loop().create_future()
            self._races.add(racer)  # not copied: it may be stolen later
        return launched

    def _hedge(self, request: InferenceRequest, primary: ServerEntry) -> Copy | None:
        if request.client_id not in self._clients.done_sending or self._waiting.total():
            return None  # while anything waits, a copy would take a slot some waiting request needs
        now = self._clock()
        servers = [s for s in self._routes.servers_for(request)
                   if s.id != primary.id and replicas(primary, s) and self._book.breaker(s.id).allows(now)]
        free = self._book.free_candidates(servers, self._policy.candidate_limit, self._rng)
        if not free:
            return None
        decision = self._policy.choose(free, RouteContext(request.request_id, request.prefix_text(),
                                                          request.client_id))
        server = next(s for s in servers if s.id == decision.server_id)
        return self._start_copy(server, request), server, now
