"""Attempts in flight that the dispatcher copies or takes back.

Copies, at the tail of a client's run (`TailRescue`): once a client has sent its last request and nothing
waits, a straggler older than the model's hedge delay is copied onto an idle replica (hedging), and a server
that frees a slot copies the request queued last on the server that will drain slowest (stealing); the first
answer wins, the other is cancelled. Only replicas (same engine, model and explicit revision), only greedy
requests, only engines that drop a request whose client hung up.

Give-backs (`Preemptions`): young attempts give their slot back to a shrunk capacity lease, to a client ranked
first in the order, or to a window a scrape of the engine's queue shrank; the request goes back to its queue.
Only on engines that let a cancelled request go (`ENGINE_CANCEL_S`). docs/architecture.md says why.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedpool.federation.core.clientbook import ClientBook
from fedpool.federation.core.errors import AttemptError
from fedpool.federation.core.learning import HedgeTimer
from fedpool.federation.core.policy import Policy
from fedpool.federation.core.routes import Route
from fedpool.federation.core.serverbook import ServerBook, ServerState
from fedpool.federation.core.types import Completion, InferenceRequest, StreamProgress
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


# ---- give-backs -----------------------------------------------------------------------------------------------
PREEMPT_MAX_AGE_S = 1.0  # attempts younger than this may give their slot back to a shrunk lease
# How long an engine goes on with a request whose connection closed, by engine: the slot stays counted that long
# after the give-back, so no request lands on an engine still running the one it replaced. vLLM's API server
# cancels a handler as its client disconnects (as fedpool's emulator does). llama.cpp's server (this pool's build)
# runs a non-streamed request to its end after its client has gone — four cancelled 200-token requests kept all 4
# slots busy 6 s later, and a give-back there queued the next requests in the engine (4 deep for 5 s,
# benchmarks/multiprocess.py) — but stops a streamed one at its next token, so the transport asks it for streams
# (transport.STREAMED_ENGINES) and only those are given back, and only once they decode: llama.cpp reads a cancel
# between its batches, and a prompt is one batch, so a stream cancelled in its prompt holds its slot to the
# prompt's end — four streams of ~400 prompt tokens cancelled 0.1 s in (no token yet) kept all 4 slots 3.6–6.9 s,
# where four decoding streams let go of theirs 0.06 s after the cancel (the engine's requests_processing, 50 ms
# samples, 2 runs each; 0.5 s held here before, and the multiprocess run's engine queued 4 as leases settled).
# So a streamed attempt is taken only once its engine has sent a byte (`transport.StreamProgress`), and its slot
# stays counted 0.2 s more (over 3× what was measured). SGLang notices a closed connection only on the first 4 s
# timeout of its wait for the request's output (`_wait_one_response`; deploy/emulator.py `abort_check_s`), but the
# transport aborts a cancelled attempt there at once by its id (`HttpTransport`, /abort_request). Other servers
# are not checked: never asked to give a slot back.
ENGINE_CANCEL_S = {"vllm": 0.0, "sglang": 0.0}
STREAMED_CANCEL_S = {"vllm": 0.0, "llamacpp": 0.2}


def engine_cancel_s(engine: str | None, streamed: bool = False) -> float | None:
    """Seconds the engine may run a request after its client went away (`streamed`: the request was sent as a
    stream); None: until its end (never taken)."""
    return (STREAMED_CANCEL_S if streamed else ENGINE_CANCEL_S).get(engine or "")


Task = asyncio.Task[Any]


class Preemptions:
    def __init__(self, clock: Callable[[], float], max_age_s: float = PREEMPT_MAX_AGE_S):
        self._clock = clock
        self._max_age_s = max_age_s
        self.running: dict[str, dict[Task, float]] = {}  # server id -> attempt's task -> when it started
        self.client_of: dict[Task, str] = {}  # the client of each attempt in `running`
        self._taken: dict[Task, str] = {}  # attempts cancelled to give their slot back -> their server
        # Streamed attempts running: taken only once their engine sends (`StreamProgress.decoding`; see above).
        self.streams: dict[Task, StreamProgress] = {}
        self.count = 0  # attempts given back
        self.lost_s = 0.0  # the engine time they had used

    def ended(self, server_id: str, task: Task | None) -> None:
        """The attempt let its slot go (answered, failed, cancelled or taken)."""
        running = self.running.get(server_id)
        if running is not None and task is not None and running.pop(task, None) is not None and not running:
            del self.running[server_id]
        if task is not None:
            self.client_of.pop(task, None)
        if self.streams and task is not None:
            self.streams.pop(task, None)

    def over_limit(self, server_id: str, excess: int, racers: Mapping[Task, Racer] | None,
                   max_age_s: float | None = None) -> int:
        """Take up to `excess` attempts on the server (beyond those already taken), the youngest first and only
        those younger than the age limit (`max_age_s`, else the one given at construction) and racing no copy;
        returns how many were taken now."""
        max_age = self._max_age_s if max_age_s is None else max_age_s
        self.pending()  # (drops the taken ones that ended before they could see their cancel)
        running = self.running.get(server_id)
        if not running or excess <= 0:
            return 0
        excess -= sum(1 for t in running if t in self._taken)
        now = self._clock()
        taken = 0
        for task, started in reversed(running.items()):  # (noted as each attempt starts: the youngest last)
            if taken >= excess or now - started >= max_age:
                break
            taken += self._take(task, server_id, started, now, racers)
        return taken

    def pending(self) -> int:
        """Attempts taken whose slots have not come back yet."""
        for gone in [t for t in self._taken if t.done()]:  # (ended before it could see its cancel)
            del self._taken[gone]
        return len(self._taken)

    def take_for(self, client: str, servers: set[str], count: int, racers: Mapping[Task, Racer] | None) -> int:
        """Take up to `count` of `client`'s attempts on those servers, the youngest first, each younger than the age
        limit and racing no copy (and, streamed, decoding); returns how many were taken."""
        now = self._clock()
        young = [(started, task, sid) for sid in servers if (running := self.running.get(sid))
                 for task, started in running.items()
                 if now - started < self._max_age_s and self.client_of.get(task) == client]
        young.sort(key=lambda t: t[0], reverse=True)
        taken = 0
        for started, task, sid in young:
            if taken >= count:
                break
            taken += self._take(task, sid, started, now, racers)
        return taken

    def _take(self, task: Task, server_id: str, started: float, now: float,
              racers: Mapping[Task, Racer] | None) -> bool:
        """Cancel the attempt to give its slot back, unless it is taken already, ended, racing a copy or (streamed)
        still in its prompt; whether it was taken."""
        racer = racers.get(task) if racers is not None else None
        if task in self._taken or task.done() or (racer is not None and racer.copy_server is not None):
            return False
        progress = self.streams.get(task)
        if progress is not None and not progress.decoding:
            return False  # still in its prompt: the engine would hold the slot to the prompt's end anyway
        if racer is not None:
            racer.racing = False  # no copy may start for it now
        self._taken[task] = server_id
        self.lost_s += now - started
        task.cancel()
        return True

    def requeue(self, task: Task | None) -> bool:
        """Called where the request's attempt was cancelled: True when the cancel was a give-back alone (the
        caller did not cancel too): the cancel is withdrawn and the request goes back to its queue."""
        if task is None or self._taken.pop(task, None) is None:
            return False
        if task.cancelling() != 1:
            return False  # the caller cancelled as well: the request is cancelled
        task.uncancel()
        self.count += 1
        return True
