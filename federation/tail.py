"""The tail of a client's run: its last requests in flight, where a straggler would hold up the whole eval.

Once a client has said it has nothing left to send and nothing waits in the dispatcher, its requests in flight
may be copied onto idle servers: a straggler older than the model's hedge delay (a multiple of its median
latency) is copied onto an idle replica (hedging), and a server that frees a slot copies the request queued
last on the server that will drain slowest, if slower than itself (stealing). The first answer wins; the
other copy is cancelled (its slot given back before the request returns).

A copy only ever runs on a *replica* of the first server: the same engine, model and revision, with the
revision explicitly set (`unspecified` matches nothing), and only for requests whose answer a copy cannot
change (greedy decoding, no bit-reproducibility asked), so the winner of a timing race cannot change what is
recorded beyond the batch numerics of one engine build.

Cost where it does not apply: a request in flight is registered (`enter`, a dict insert) and awaited inline
by its own task — no task, timer or future of its own. A copy that wins cancels the waiting task
(`Racer.task`), which takes the copy's answer (`won`). Copies, and the 10 Hz look for stragglers, exist only
at a tail.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fedpool.federation.clientbook import ClientBook
from fedpool.federation.dispatch_types import DispatchConfig
from fedpool.federation.errors import AttemptError
from fedpool.federation.learning import HedgeTimer
from fedpool.federation.policies import Policy
from fedpool.federation.routes import Route
from fedpool.federation.serverbook import ServerBook, ServerState
from fedpool.federation.types import Completion, InferenceRequest
from fedpool.registry import ServerEntry

HEDGE_RECHECK_S = 0.1  # how often, at a tail, stragglers look for an idle server to be copied onto
UNSPECIFIED_REVISION = "unspecified"

StartCopy = Callable[["Racer", ServerState], None]


def replicas(a: ServerEntry, b: ServerEntry) -> bool:
    """Whether a copy on `b` may stand in for an attempt on `a`: same engine, model and explicit revision."""
    return (a.record.engine == b.record.engine and a.record.model == b.record.model
            and a.record.revision == b.record.revision and a.record.revision != UNSPECIFIED_REVISION)


@dataclass(eq=False, slots=True)
class Racer:
    """A hedgeable request in flight on `server`, awaited by `task`; at most one copy of it runs elsewhere."""

    request: InferenceRequest
    server: ServerState
    route: Route
    started: float
    task: asyncio.Task[object] | None
    racing: bool = True  # the first attempt has not returned yet
    copy: asyncio.Task[None] | None = None
    copy_server: ServerState | None = None
    copy_started: float = 0.0
    won: Completion | None = None  # the copy's answer, when it came first
    won_at: float = 0.0
    copy_error: AttemptError | None = None
    copy_ran: bool = False  # the copy's task started (else its slot is given back when it is done)
    hedged: bool = False  # a copy was started (hedge or steal)
    cancelled_task: bool = False  # the copy answered first and cancelled `task` to hand it the answer


class TailRescue:
    def __init__(self, config: DispatchConfig, *, clients: ClientBook, book: ServerBook, policy: Policy,
                 rng: random.Random, clock: Callable[[], float], waiting: Callable[[], int],
                 start_copy: StartCopy):
        self.enabled = config.hedging and not policy.plans_the_tail
        self._clients = clients
        self._book = book
        self._policy = policy
        self._rng = rng
        self._clock = clock
        self._waiting = waiting
        self._start_copy = start_copy
        self.timer = HedgeTimer(config.hedge_factor, config.hedge_min_delay_s)
        self._racers: dict[str, dict[Racer, None]] = {}  # server id -> its racers, oldest first
        self._look: asyncio.TimerHandle | None = None
        self.hedges = 0

    # ---- racers ------------------------------------------------------------------------------------
    def enter(self, request: InferenceRequest, server: ServerState, route: Route, started: float) -> Racer | None:
        """Register a request in flight that a copy may race (None where none may)."""
        if not self.enabled or not request.hedgeable:
            return None
        racer = Racer(request, server, route, started, asyncio.current_task())
        racers = self._racers.get(server.id)
        if racers is None:
            racers = self._racers[server.id] = {}
        racers[racer] = None
        if self._look is None and request.client_id in self._clients.done_sending:
            self._arm()
        return racer

    def leave(self, racer: Racer) -> None:
        """The first attempt returned (or failed): nothing may copy it any more."""
        racer.racing = False
        racers = self._racers.get(racer.server.id)
        if racers is not None:
            racers.pop(racer, None)
            if not racers:
                del self._racers[racer.server.id]

    def client_done(self, client_id: str) -> None:
        if self._racers and self._look is None:
            self._arm()

    # ---- hedging -----------------------------------------------------------------------------------
    def _arm(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._look = loop.call_later(HEDGE_RECHECK_S, self._look_for_stragglers)

    def _look_for_stragglers(self) -> None:
        """At a tail (nothing waits in the dispatcher): copy each straggler older than its hedge delay onto an
        idle replica. Looks again while racers of clients done sending remain."""
        self._look = None
        done = self._clients.done_sending
        tail = [r for racers in self._racers.values() for r in racers
                if r.request.client_id in done and r.copy is None and not r.hedged]
        if not tail:
            return
        if not self._waiting():
            now = self._clock()
            for racer in tail:
                delay = self.timer.delay(racer.request.model)
                if delay is not None and now - racer.started >= delay and racer.racing:
                    self._hedge(racer)
        self._arm()

    def _hedge(self, racer: Racer) -> None:
        primary = racer.server.entry
        if primary is None:
            return
        free = [s for s in racer.route.free if s is not racer.server and s.entry is not None
                and replicas(primary, s.entry)]
        if not free:
            return
        if self._policy.candidate_limit is not None and len(free) > self._policy.candidate_limit:
            free = self._rng.sample(free, self._policy.candidate_limit)
        self._start_copy(racer, self._policy.choose(free, racer.request))

    # ---- stealing ----------------------------------------------------------------------------------
    def on_release(self, thief: ServerState) -> None:
        """A slot freed on `thief`: it may take stragglers queued on slower servers (only at a tail)."""
        if not (self.enabled and self._racers and self._clients.done_sending) or self._waiting():
            return
        entry = thief.entry
        if entry is None:
            return
        done = self._clients.done_sending

        def eligible(r: Racer) -> bool:
            return (r.request.client_id in done and r.server.entry is not None and replicas(r.server.entry, entry)
                    and thief in r.route.servers)

        for victim in self._stealable(thief, eligible):
            self._start_copy(victim, thief)

    def _stealable(self, thief: ServerState, eligible: Callable[[Racer], bool]) -> Iterator[Racer]:
        """While the thief has room: the racer queued last on the server whose queue drains slowest (in flight
        ÷ learned rate), if slower than the thief would drain with one more."""
        book = self._book
        if thief.weight <= 0:
            return
        while book.has_room(thief):
            worst, victim_id = book.drain_s(thief, extra=1), None
            for server_id, racers in self._racers.items():
                if server_id == thief.id or not racers:
                    continue
                drain = book.drain_s(next(iter(racers)).server)
                if drain > worst:
                    worst, victim_id = drain, server_id
            if victim_id is None:
                return
            racers = self._racers[victim_id]
            victim = next((r for r in reversed(racers) if r.copy is None and not r.hedged and r.racing
                           and eligible(r)), None)
            if victim is None:
                return
            racers.pop(victim)
            if not racers:
                del self._racers[victim_id]
            yield victim
