"""The tail of a client's run: its last requests in flight, where a straggler would hold up the whole eval.

Once a client has said it has nothing left to send and nothing waits in the dispatcher, its requests in flight
may be copied onto idle servers: a straggler older than the model's hedge delay (a multiple of its median
latency) is copied onto a replica with room (hedging), and a server that frees a slot copies the request
queued last on the server that will drain slowest, if slower than itself (stealing). The first answer wins;
the other copy is cancelled (its slot given back before the request returns).

A copy only ever runs on a *replica* of the first server: the same engine, model and revision, with the
revision explicitly set (`unspecified` matches nothing), and only for requests whose answer a copy cannot
change (`hedgeable`: greedy decoding, no bit-reproducibility asked), so the winner of a timing race cannot
change what is recorded beyond the batch numerics of one engine build. And only on an engine that aborts a
request whose client hangs up (vLLM, SGLang): llama.cpp runs a non-streamed request to its end, so there the
losing copy would hold its slot and only add load.

Cost where it does not apply: the dispatcher notes a hedgeable request in flight in a dict (its task → a
`Racer`) and awaits it inline — no task, timer or future of its own, and no call into this module. A copy
that wins cancels the waiting task, which takes the copy's answer. Copies, and the 10 Hz look for
stragglers, exist only at a tail.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from fedpool.federation.core.clientbook import ClientBook
from fedpool.federation.core.errors import AttemptError
from fedpool.federation.core.learning import HedgeTimer
from fedpool.federation.routing.policies import Policy
from fedpool.federation.core.routes import Route
from fedpool.federation.core.serverbook import ServerBook, ServerState
from fedpool.federation.core.types import Completion, InferenceRequest
from fedpool.registry import Engine, ServerEntry, adapter_for

HEDGE_RECHECK_S = 0.1  # how often, at a tail, stragglers look for a server to be copied onto
UNSPECIFIED_REVISION = "unspecified"

StartCopy = Callable[["Racer", ServerState], None]
TailKey = tuple[Route, str, str, str]  # a route and a replica class: engine, model, revision


def hedgeable(request: InferenceRequest) -> bool:
    """A copy elsewhere cannot change what is recorded: greedy decoding, and no bit-reproducibility asked."""
    return request.params.temperature == 0 and not request.reproducible


def replicas(a: ServerEntry, b: ServerEntry) -> bool:
    """Whether a copy on `b` may stand in for an attempt on `a`: same engine, model and explicit revision."""
    return (a.record.engine == b.record.engine and a.record.model == b.record.model
            and a.record.revision == b.record.revision and a.record.revision != UNSPECIFIED_REVISION)


# Engines that abort a non-streamed request whose client hung up: a losing copy frees its slot there.
CANCELLING_ENGINES = frozenset(e.value for e in Engine if adapter_for(e).cancels_on_disconnect)


def may_race(a: ServerEntry, b: ServerEntry) -> bool:
    """Whether a copy on `b` may race an attempt on `a`: replicas, on an engine where the loser is cancelled
    by hanging up (llama.cpp runs a non-streamed request to its end: the copy would only add load)."""
    return a.record.engine in CANCELLING_ENGINES and replicas(a, b)


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
    copy_ran: bool = False  # the copy's task started (else its slot is given back when it is done)
    won: Completion | None = None  # the copy's answer
    won_at: float = 0.0
    copy_error: AttemptError | None = None
    cancelled_task: bool = False  # the copy answered first and cancelled `task` to hand it the answer


class TailRescue:
    def __init__(self, *, enabled: bool, timer: HedgeTimer, racers: dict[asyncio.Task[object], Racer],
                 clients: ClientBook, book: ServerBook, policy: Policy, rng: random.Random,
                 clock: Callable[[], float], waiting: Callable[[], int], start_copy: StartCopy):
        self.enabled = enabled
        self.timer = timer
        self._racers = racers  # the dispatcher's: hedgeable requests in flight, by the task awaiting each
        self._clients = clients
        self._book = book
        self._policy = policy
        self._rng = rng
        self._clock = clock
        self._waiting = waiting
        self._start_copy = start_copy
        self._look: asyncio.TimerHandle | None = None
        self.hedges = 0
        self._groups: dict[TailKey, dict[ServerState, list[Racer]]] | None = None  # _tail_groups, when grouped
        self._grouped_at = 0.0

    def client_done(self) -> None:
        """A client has nothing left to send (or a request of one that has started an attempt): look for its
        stragglers from now on; the tail's racers are grouped afresh at the next release."""
        self.clients_changed()
        if self.enabled and self._racers and self._look is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._look = loop.call_later(HEDGE_RECHECK_S, self._look_for_stragglers)

    # ---- hedging -----------------------------------------------------------------------------------
    def _look_for_stragglers(self) -> None:
        """At a tail (nothing waits in the dispatcher): copy each straggler older than its hedge delay onto a
        replica with room. Looks again while racers of clients done sending remain."""
        self._look = None
        done = self._clients.done_sending
        tail = [r for r in self._racers.values()
                if r.request.client_id in done and r.racing and r.copy_server is None]
        if not tail:
            return
        if not self._waiting():
            now = self._clock()
            for racer in tail:
                delay = self.timer.delay(racer.request.model)
                if delay is not None and now - racer.started >= delay:
                    self._hedge(racer)
        self.client_done()

    def _hedge(self, racer: Racer) -> None:
        primary = racer.server.entry
        if primary is None:
            return
        limit = self._policy.candidate_limit
        free = self._replicas_free(racer, primary, racer.route.free, limit)
        if not free:
            return
        if limit is not None and len(free) > limit:
            free = self._rng.sample(free, limit)
        self._start_copy(racer, self._policy.choose(free, racer.request))

    def _replicas_free(self, racer: Racer, primary: ServerEntry, free: Sequence[ServerState],
                       limit: int | None) -> list[ServerState]:
        """The route's servers with room that may race the racer's server: from a sample of 4 × the policy's
        candidates where the route has more (every hedge scanned every free server: O(servers) a straggler at
        the tail), all of them where the sample has none."""
        def races(s: ServerState) -> bool:
            return s is not racer.server and s.entry is not None and may_race(primary, s.entry)

        if limit is not None and len(free) > 4 * limit:
            sampled = [s for s in self._rng.sample(free, 4 * limit) if races(s)]
            if sampled:
                return sampled
        return [s for s in free if races(s)]

    # ---- stealing ----------------------------------------------------------------------------------
    def on_release(self, thief: ServerState) -> None:
        """A slot freed on `thief`: it may take stragglers queued on slower servers (only at a tail: the
        dispatcher calls this only while some client is done sending and nothing waits)."""
        entry = thief.entry
        if not self._racers or entry is None or self._waiting():
            return
        record = entry.record
        if (record.engine not in CANCELLING_ENGINES or record.revision == UNSPECIFIED_REVISION or thief.weight <= 0
                or not self._book.has_room(thief)):
            return  # (may_race: nothing may race onto it)
        groups = self._tail_groups()
        for route in thief.routes:
            queued_on = groups.get((route, record.engine, record.model, record.revision))
            if queued_on:
                for victim in self._stealable(thief, queued_on):
                    self._start_copy(victim, thief)

    def clients_changed(self) -> None:
        """The clients done sending changed: the tail's racers are grouped afresh at the next release."""
        self._groups = None

    def _tail_groups(self) -> dict[TailKey, dict[ServerState, list[Racer]]]:
        """The racers of clients done sending that may still be copied (racing, no copy yet), by route and
        replica class (engine, model, revision: who may race whom), then by server, oldest first. Grouped at most
        every HEDGE_RECHECK_S, and when a client is done sending or a request of such a client starts an attempt
        (a retry, a request given back by a shrunk lease), not at every release: grouping every racer at every
        release at a tail was 99% of the 10,000-server simulation's CPU (py-spy). A racer that stopped qualifying
        is dropped as it comes up."""
        now = self._clock()
        groups = self._groups
        if groups is not None and now - self._grouped_at < HEDGE_RECHECK_S:
            return groups
        groups = {}
        done = self._clients.done_sending
        for racer in self._racers.values():  # oldest first (insertion order)
            if racer.racing and racer.copy_server is None and racer.request.client_id in done:
                entry = racer.server.entry
                if entry is None or entry.record.engine not in CANCELLING_ENGINES:
                    continue
                record = entry.record
                key = (racer.route, record.engine, record.model, record.revision)
                queued_on = groups.get(key)
                if queued_on is None:
                    queued_on = groups[key] = {}
                queued = queued_on.get(racer.server)
                if queued is None:
                    queued = queued_on[racer.server] = []
                queued.append(racer)
        self._groups, self._grouped_at = groups, now
        return groups

    def _stealable(self, thief: ServerState, queued_on: dict[ServerState, list[Racer]]) -> Iterator[Racer]:
        """While the thief has room: the racer queued last on the server whose queue drains slowest (in flight
        ÷ learned rate, as it is now: drains ranked as grouped, 0.1 s stale, made the 4,096-server world 3%
        slower), if slower than the thief would drain with one more."""
        book = self._book
        done = self._clients.done_sending
        while queued_on and book.has_room(thief):
            worst, victim_server = book.drain_s(thief, extra=1), None
            for server in queued_on:
                if server is not thief:
                    drain = book.drain_s(server)
                    if drain > worst:
                        worst, victim_server = drain, server
            if victim_server is None:
                return
            queued = queued_on[victim_server]
            victim = queued.pop()
            if not queued:
                del queued_on[victim_server]
            if (victim.racing and victim.copy_server is None and victim.request.client_id in done
                    and victim_server.entry is not None):
                yield victim
