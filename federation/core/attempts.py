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
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fedpool.federation.core.clientbook import ClientBook
from fedpool.federation.core.errors import AttemptError, FailureKind, RequestFailed, RetryState, backoff_s
from fedpool.federation.core.ledger import HedgeTimer
from fedpool.federation.core.routes import Route
from fedpool.federation.core.serverbook import ServerBook, ServerState
from fedpool.federation.core.types import (
    Attempt,
    Completion,
    DispatchConfig,
    InferenceRequest,
    StreamProgress,
    Transport,
)
from fedpool.registry import Engine, ServerEntry, adapter_for

HEDGE_RECHECK_S = 0.1  # how often, at a tail, stragglers look for a server to be copied onto
UNSPECIFIED_REVISION = "unspecified"

StartCopy = Callable[["InFlight", ServerState], None]
Pick = Callable[[Sequence[ServerState], InferenceRequest], ServerState]
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
class InFlight:
    """One attempt in flight on `server`, awaited by `task`: the dispatcher's record of it. A hedgeable one is a
    racer (at most one copy of its request runs elsewhere at a tail); one on an engine that lets a cancelled request
    go (`cancel_s` not None) may be given back, and is noted on its server (`ServerState.attempts`)."""

    request: InferenceRequest
    server: ServerState
    route: Route
    started: float
    task: asyncio.Task[Any] | None
    cancel_s: float | None = None  # its engine lets the request go this long after a cancel (None: never taken)
    progress: StreamProgress | None = None  # streamed: taken only once its engine decodes (marked by the transport)
    racing: bool = True  # the first attempt has not returned yet
    copy: asyncio.Task[None] | None = None
    copy_server: ServerState | None = None
    copy_started: float = 0.0
    copy_ran: bool = False  # the copy's task started (else its slot is given back when it is done)
    won: Completion | None = None  # the copy's answer
    won_at: float = 0.0
    copy_error: AttemptError | None = None
    cancelled_task: bool = False  # the copy answered first and cancelled `task` to hand it the answer

    @property
    def client(self) -> str:
        return self.request.client_id


class TailRescue:
    def __init__(self, *, enabled: bool, timer: HedgeTimer, racers: dict[asyncio.Task[Any], InFlight],
                 clients: ClientBook, book: ServerBook, pick: Pick, sample: int | None, rng: random.Random,
                 clock: Callable[[], float], waiting: Callable[[], int], start_copy: StartCopy):
        self.enabled = enabled
        self.timer = timer
        self._racers = racers  # the dispatcher's: hedgeable requests in flight, by the task awaiting each
        self._clients = clients
        self._book = book
        self._pick = pick  # how a copy picks among replicas with room (the policy's picker, or the least wait) ...
        self._sample = sample  # ... from a sample of this many (None: all)
        self._rng = rng
        self._clock = clock
        self._waiting = waiting
        self._start_copy = start_copy
        self._look: asyncio.TimerHandle | None = None
        self.hedges = 0
        self._groups: dict[TailKey, dict[ServerState, list[InFlight]]] | None = None  # _tail_groups, when grouped
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

    def _hedge(self, racer: InFlight) -> None:
        primary = racer.server.entry
        if primary is None:
            return
        limit = self._sample
        free = self._replicas_free(racer, primary, racer.route.free, limit)
        if not free:
            return
        if limit is not None and len(free) > limit:
            free = self._rng.sample(free, limit)
        self._start_copy(racer, self._pick(free, racer.request))

    def _replicas_free(self, racer: InFlight, primary: ServerEntry, free: Sequence[ServerState],
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

    def _tail_groups(self) -> dict[TailKey, dict[ServerState, list[InFlight]]]:
        """The racers of clients done sending that may still be copied (racing, no copy yet), by route and
        replica class (engine, model, revision: who may race whom), then by server, oldest first. Grouped at most
        every HEDGE_RECHECK_S, and when a client is done sending or a request of such a client starts an attempt
        (a retry, a request given back by a shrunk lease), not at every release (grouping at every release at a tail
        cost O(racers) a release). A racer that stopped qualifying is dropped as it comes up."""
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

    def _stealable(self, thief: ServerState, queued_on: dict[ServerState, list[InFlight]]) -> Iterator[InFlight]:
        """While the thief has room: the racer queued last on the server whose queue drains slowest (in flight
        ÷ learned rate, as it is now, not as grouped), if slower than the thief would drain with one more."""
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
STALL_MIN_S = 1.0  # a raced-out attempt this old whose server answered nothing since it started: `stalled`
PREEMPT_MAX_AGE_S = 1.0  # attempts younger than this may give their slot back to a shrunk lease
# How long an engine goes on with a request whose connection closed, by engine (None: until its end, so never
# taken): the slot stays counted that long after the give-back, so no request lands on an engine still running the
# one it replaced. vLLM drops it at once; llama.cpp stops only a streamed request, at its next token (so only those
# are given back there, once they decode: a prompt is one batch it does not interrupt); SGLang is aborted by id by
# the transport. docs/architecture.md has the measurements.
ENGINE_CANCEL_S = {"vllm": 0.0, "sglang": 0.0}
STREAMED_CANCEL_S = {"vllm": 0.0, "llamacpp": 0.2}


def engine_cancel_s(engine: str | None, streamed: bool = False) -> float | None:
    """Seconds the engine may run a request after its client went away (`streamed`: the request was sent as a
    stream); None: until its end (never taken)."""
    return (STREAMED_CANCEL_S if streamed else ENGINE_CANCEL_S).get(engine or "")


Task = asyncio.Task[Any]


class Preemptions:
    """Attempts taken to give their slot back: which, how many, and what they had cost. The attempts themselves are
    noted on their servers (`ServerState.attempts`, youngest last) by the dispatcher as each starts."""

    def __init__(self, clock: Callable[[], float], max_age_s: float = PREEMPT_MAX_AGE_S):
        self._clock = clock
        self._max_age_s = max_age_s
        self._taken: dict[Task, str] = {}  # attempts cancelled to give their slot back -> their server
        self.count = 0  # attempts given back
        self.lost_s = 0.0  # the engine time they had used

    def over_limit(self, server: ServerState, excess: int, max_age_s: float | None = None,
                   when_decoding: Callable[[], None] | None = None) -> int:
        """Take up to `excess` attempts on the server (beyond those already taken), the youngest first and only
        those younger than the age limit (`max_age_s`, else the one given at construction) and racing no copy;
        returns how many were taken now. A streamed attempt passed over in its prompt calls `when_decoding` as it
        starts to decode (to be looked at again then, not at the next lease)."""
        max_age = self._max_age_s if max_age_s is None else max_age_s
        self.pending()  # (drops the taken ones that ended before they could see their cancel)
        running = server.attempts
        if not running or excess <= 0:
            return 0
        excess -= sum(1 for t in running if t in self._taken)
        now = self._clock()
        taken = 0
        for attempt in reversed(running.values()):  # (noted as each attempt starts: the youngest last)
            if taken >= excess or now - attempt.started >= max_age:
                break
            if self._take(attempt, now):
                taken += 1
            elif when_decoding is not None and (progress := attempt.progress) is not None and not progress.decoding:
                progress.then = when_decoding
        return taken

    def pending(self) -> int:
        """Attempts taken whose slots have not come back yet."""
        for gone in [t for t in self._taken if t.done()]:  # (ended before it could see its cancel)
            del self._taken[gone]
        return len(self._taken)

    def take_for(self, client: str, servers: Iterable[ServerState], count: int) -> int:
        """Take up to `count` of `client`'s attempts on those servers, the youngest first, each younger than the age
        limit and racing no copy (and, streamed, decoding); returns how many were taken."""
        now = self._clock()
        young = [a for s in servers for a in s.attempts.values()
                 if now - a.started < self._max_age_s and a.client == client]
        young.sort(key=lambda a: a.started, reverse=True)
        taken = 0
        for attempt in young:
            if taken >= count:
                break
            taken += self._take(attempt, now)
        return taken

    def _take(self, attempt: InFlight, now: float) -> bool:
        """Cancel the attempt to give its slot back, unless it is taken already, ended, racing a copy or (streamed)
        still in its prompt; whether it was taken."""
        task = attempt.task
        if task is None or task in self._taken or task.done() or attempt.copy_server is not None:
            return False
        progress = attempt.progress
        if progress is not None and not progress.decoding:
            return False  # still in its prompt: the engine would hold the slot to the prompt's end anyway
        attempt.racing = False  # no copy may start for it now
        self._taken[task] = attempt.server.id
        self.lost_s += now - attempt.started
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


# ---- how an attempt ends, other than answered -----------------------------------------------------------------
class AttemptEnds:
    """Failed attempts recorded and retried, and copies at the tail started, raced and dropped: the part of the
    dispatcher (federation/core/dispatcher.py, which extends this) that ends attempts that were not simply answered.
    The state it works on is the dispatcher's, declared here."""

    _book: ServerBook
    _tail: TailRescue
    _transport: Transport
    _config: DispatchConfig
    _hedge_timer: HedgeTimer
    _clock: Callable[[], float]
    _rng: random.Random
    _sleep: Callable[[float], Awaitable[None]]
    _on_failure: Callable[[str, FailureKind], None] | None
    _failed: int
    _retries: int
    _release: Callable[..., None]

    # ---- failures ---------------------------------------------------------------------------------------------
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

    async def _lost_copy(self, attempt: InFlight, answered_at: float, retry: RetryState | None) -> RetryState | None:
        """The first attempt answered while its copy ran: the copy is cancelled, and noted as a lost race."""
        await self._drop_copy(attempt)
        if attempt.copy_server is None:
            return retry
        retry = retry or RetryState()
        if attempt.copy_error is None:  # (a failed copy was counted against its server already)
            retry.attempts.append(Attempt(attempt.copy_server.id, attempt.copy_started,
                                          answered_at - attempt.copy_started, lost_race=True))
        return retry

    # ---- copies at the tail (TailRescue decides when and where) -----------------------------------------------
    def _start_copy(self, racer: InFlight, state: ServerState) -> None:
        """A second attempt of a racer's request on `state` (a hedge or a steal), counted like any other."""
        client = racer.request.client_id
        now = self._clock()
        self._book.take(state, client, now)
        racer.copy_server, racer.copy_started = state, now
        self._tail.hedges += 1
        racer.copy = asyncio.get_running_loop().create_task(self._run_copy(racer, state))

        def release_if_never_ran(task: asyncio.Task[None]) -> None:
            # A task cancelled before its first step never runs its body (nor its `finally`).
            if not racer.copy_ran:
                self._release(state, client)

        racer.copy.add_done_callback(release_if_never_ran)

    async def _run_copy(self, racer: InFlight, state: ServerState) -> None:
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

    async def _copy_outcome(self, racer: InFlight, retry: RetryState | None
                            ) -> tuple[ServerState, RetryState] | None:
        """The first attempt failed: a copy still running may answer instead."""
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

    async def _drop_copy(self, racer: InFlight) -> None:
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

