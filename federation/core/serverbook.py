"""What one dispatcher knows about each server: one `ServerState` per server (its in-flight figures from the
ledger, admission window, learned speed, circuit breaker, answer counters) and the routes it serves, each with an
index of its servers that have room, kept current as slots are taken and given back, windows move, breakers open
and close and snapshots arrive. A grant samples from that index: O(1), whatever the pool's size. A server that
leaves the snapshot leaves every route at once; its state is forgotten when nothing of it is in flight any more
(long-running processes hold no state for servers that are gone).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedpool.federation.core.errors import FailureKind
from fedpool.federation.core.ledger import HISTORY_S, LEARN_PERIOD_S, InflightLedger, ServerLearning, ServerSlots
from fedpool.federation.core.routes import Route, RouteKey
from fedpool.federation.core.types import STREAMED_ENGINES, ServerStats
from fedpool.federation.core.windows import (
    admissible,
    guard_queue,
    kv_budget,
    kv_share_back,
    mean_kv,
    our_queue,
    our_scraped_queue,
)
from fedpool.registry import PoolSnapshot, ServerEntry, adapter_for

if TYPE_CHECKING:
    from fedpool.federation.core.attempts import InFlight

log = logging.getLogger("fedpool.dispatcher")

CLIENT_LATENCY_ALPHA = 0.05  # one answer's weight in its client's mean latency (what server speeds compare to)
# A learned speed no answer has renewed for this many learning periods fades toward the prior (on the learned
# scale), with this many periods' time constant: a server measured slow once and then given nothing (the
# others' expected waits always lower) is tried again instead of keeping that one measurement for good.
STALE_PERIODS = 2.0


@dataclass(frozen=True, slots=True)
class BookSettings:
    window_factor: float
    adaptive_windows: bool
    learn_throughput: bool
    breaker_failures: int
    breaker_cooldown_s: float
    learn_period_s: float = LEARN_PERIOD_S
    engine_queue_guard: bool = True


class ServerState(ServerSlots):
    """One server as the dispatcher sees it. Policies read `id`, `inflight`, `window`, `capacity`, `weight`,
    `scraped_waiting`, `scraped_running` and `expected_wait`; only the book and the ledger change it."""

    __slots__ = ("abort_path", "answer_s", "answered", "attempts", "breaker_failures", "capacity", "entry",
                 "failures", "half_open", "kv_budget", "kv_by_client", "kv_inflight", "last_answer_at", "learning",
                 "lease", "lease_changes", "open_until", "present", "queue_clear", "queue_full", "routes", "scrape_at",
                 "scrape_inflight", "scraped_running", "scraped_waiting", "streamed", "tokens", "trial", "url",
                 "weight", "window")

    def __init__(self, server_id: str):
        super().__init__(server_id)
        self.entry: ServerEntry | None = None
        self.url = ""
        self.streamed = False  # its engine is asked for streamed answers (transport.STREAMED_ENGINES)
        self.abort_path: str | None = None  # its engine aborts a request by id there (EngineAdapter.abort_path)
        self.capacity = 1
        self.window = 0
        self.weight = 1.0
        self.scraped_waiting = 0.0
        self.scraped_running = 0.0
        self.learning: ServerLearning | None = None
        self.routes: list[Route] = []
        # The dispatcher's attempts here that may give their slot back, by the task awaiting each (youngest last):
        # it notes each as it starts and drops it as it lets its slot go (federation/core/attempts.py).
        self.attempts: dict[asyncio.Task[Any], InFlight] = {}
        self.present = False  # in the current snapshot, routable
        self.lease: int | None = None  # slots the registry leases this process there (None: not leasing)
        self.lease_changes: deque[tuple[float, int]] = deque()  # (wall time, the lease before) over HISTORY_S
        self.queue_full = False  # the engine queues beyond what we know: no new grants until it drains
        self.queue_clear = 0  # scrapes in a row with the queue empty, while queue_full
        # KV admission: the engine's KV cache in tokens (this process's share of it under a lease; None: unknown, no
        # limit), and what this dispatcher's attempts there are expected to hold (per client, to give back exactly).
        self.kv_budget: float | None = None
        self.kv_inflight = 0.0
        self.kv_by_client: dict[str, float] = {}
        self.scrape_at = float("-inf")  # observed_at of the newest scrape seen
        self.scrape_inflight = 0  # this dispatcher's attempts there when that scrape was taken (if it showed a queue)
        # Circuit breaker: open after consecutive failures, then one half-open trial after the cool-down.
        self.breaker_failures = 0
        self.open_until: float | None = None  # open (None: closed): no grants until then, then half-open
        self.half_open = False
        self.trial = False  # the half-open trial is in flight
        self.answered = 0
        self.tokens = 0
        self.answer_s = 0.0
        self.failures: dict[str, int] = {}
        self.last_answer_at = float("-inf")

    @property
    def expected_wait(self) -> float:
        """(in-flight + queued) per unit of throughput: lower is sooner."""
        return (self.inflight + self.scraped_waiting + 1) / (self.weight if self.weight > 1e-9 else 1e-9)

    @property
    def admits(self) -> bool:
        """Whether the breaker lets a new attempt through (closed, or half-open with no trial in flight)."""
        return self.open_until is None or (self.half_open and not self.trial)


class ServerBook:
    def __init__(self, settings: BookSettings, ledger: InflightLedger, *, clock: Callable[[], float]):
        self._settings = settings
        self.ledger = ledger
        self._clock = clock
        self.routes: dict[RouteKey, Route] = {}
        self.states: dict[str, ServerState] = {}  # the current snapshot's servers, and departed ones still busy
        self._snapshot: PoolSnapshot | None = None
        self._open: set[ServerState] = set()  # breakers open (waiting for their cool-down)
        self._rate_scale = 1.0
        self._refreshed_at = float("-inf")
        self._client_latency: dict[str, float] = {}  # client -> its mean answer latency over every server
        self._stale_after_s = STALE_PERIODS * settings.learn_period_s
        self.lease_slots: Mapping[str, int] | None = None  # this process's capacity lease (None: not leasing)
        self.on_forget: Callable[[str], None] | None = None  # told when a server's state is dropped
        # A client's request's KV (ClientBook.kv_tokens): `kv_size` for windows.admissible, `kv_cost` for KV admission.
        self.kv_size: Callable[[str], float] | None = None
        self.kv_cost: Callable[[str], float] | None = None
        # Told when a scrape of a server's engine queue shrank its window below what is in flight there (the dispatcher
        # takes the youngest back; None: nothing is); `at_tail`: WindowController.on_scrape's, asked at such a scrape.
        self.on_queued: Callable[[ServerState], None] | None = None
        self.at_tail: Callable[[ServerState], bool] = lambda _state: False

    # ---- the pool ---------------------------------------------------------------------------------
    def sync(self, snapshot: PoolSnapshot | None) -> bool:
        """Take a new snapshot (same object: nothing to do); True when it was new."""
        if snapshot is self._snapshot:
            return False
        self._snapshot = snapshot
        seen = set()
        for entry in snapshot.entries if snapshot is not None else ():
            seen.add(entry.id)
            state = self.states.get(entry.id)
            if state is None:
                slots = self.ledger.slots(entry.id, ServerState)
                assert isinstance(slots, ServerState)
                state = self.states[entry.id] = slots
            self._adopt(state, entry)
        for server_id in [sid for sid in self.states if sid not in seen]:
            state = self.states[server_id]
            state.present = False
            self._forget_if_idle(state)
        for route in self.routes.values():
            self._fill(route)
        self._refresh(force=True)
        return True

    def _adopt(self, state: ServerState, entry: ServerEntry) -> None:
        state.entry = entry
        state.url = entry.record.url
        state.streamed = entry.record.engine in STREAMED_ENGINES
        state.abort_path = adapter_for(entry.record.engine).abort_path
        state.present = entry.status.routable
        if state.learning is None or state.capacity != entry.capacity:
            state.capacity = entry.capacity
            if state.learning is None:  # a server new to this dispatcher: within the lease held now
                state.lease = self.lease_slots.get(state.id, 0) if self.lease_slots is not None else None
                state.learning = ServerLearning.for_capacity(
                    entry.capacity, adaptive=self._settings.adaptive_windows,
                    max_factor=self._settings.window_factor, period_s=self._settings.learn_period_s)
        self._set_kv_budget(state)
        load = entry.load
        state.scraped_waiting = load.waiting if load is not None else 0.0
        state.scraped_running = load.running if load is not None else 0.0
        if load is not None and load.observed_at > state.scrape_at:
            state.scrape_at = load.observed_at
            if self._settings.engine_queue_guard:
                guard_queue(state, load)
            if load.waiting > 0 and state.learning is not None:
                # Ours queued in the engine (`our_queue`): the window shrinks now, not at the next answer; attempts
                # beyond it the engine has likely not started are the dispatcher's to take back (`on_queued`).
                ours = state.scrape_inflight = state.at(load.observed_at)
                queued = our_queue(load.waiting, load.running, ours)
                start = admissible(load, state.capacity, queued, entry.record.kv_cache_tokens,
                                   mean_kv(self.ledger.clients_on(state.id), self.kv_size))
                if state.learning.on_scrape(queued, ours, self.at_tail(state), *start):
                    self._rewindow(state)
                    if state.inflight > state.window and self.on_queued is not None:
                        self.on_queued(state)
                    return
        self._rewindow(state)

    def route(self, key: RouteKey, model: str, revision: str | None, engines: tuple[str, ...] | None,
              server_ids: tuple[str, ...] | None) -> Route:
        """The route for a request's key, made on first use (its servers from the current snapshot)."""
        route = self.routes.get(key)
        if route is None:
            route = self.routes[key] = Route(key, model, revision, engines, server_ids)
            self._fill(route)
        return route

    def _fill(self, route: Route) -> None:
        servers = []
        snapshot = self._snapshot
        if snapshot is not None:
            for entry in snapshot.entries:
                if route.admits(entry):
                    servers.append(self.states[entry.id])
        kept = set(servers)
        for state in route.servers:
            if state not in kept and route in state.routes:
                state.routes.remove(route)
        for state in servers:
            if route not in state.routes:
                state.routes.append(route)
        route.set_servers(servers)
        for state in servers:
            route.set_free(state, self.has_room(state))

    def drop_route(self, route: Route) -> None:
        """A route nobody waits on any more (gateway callers pin servers at will: routes must not pile up)."""
        if self.routes.get(route.key) is route:
            del self.routes[route.key]
        for state in route.servers:
            if route in state.routes:
                state.routes.remove(route)
        route.set_servers([])

    def _forget_if_idle(self, state: ServerState) -> None:
        if state.present or state.inflight:
            return
        for route in list(state.routes):
            route.remove(state)
        state.routes.clear()
        self._open.discard(state)
        del self.states[state.id]
        self.ledger.forget(state.id)
        if self.on_forget is not None:
            self.on_forget(state.id)

    def get(self, server_id: str) -> ServerState | None:
        return self.states.get(server_id)

    # ---- slots ---------------------------------------------------------------------------------------
    def has_room(self, state: ServerState) -> bool:
        return (state.present and state.inflight < state.window
                and (state.kv_budget is None or state.kv_inflight < state.kv_budget)
                and (state.open_until is None or (state.half_open and not state.trial)))

    def take(self, state: ServerState, client_id: str, now: float) -> None:
        """Count a slot there (same step as the choice); the server leaves the index when full: its window of
        requests, or its KV cache, is taken."""
        n = self.ledger.take(state, client_id)
        learning = state.learning
        assert learning is not None
        learning.on_start(now, n, state.window)
        full = n >= state.window
        if state.kv_budget is not None and self.kv_cost is not None:
            cost = self.kv_cost(client_id)
            state.kv_inflight += cost
            state.kv_by_client[client_id] = state.kv_by_client.get(client_id, 0.0) + cost
            full = full or state.kv_inflight >= state.kv_budget
        if state.half_open:  # this is the one trial
            state.trial = True
        if full or state.trial:
            for route in state.routes:
                route.set_free(state, False)

    def release(self, state: ServerState, client_id: str) -> None:
        kv_freed = False
        if state.kv_by_client:
            kv_freed = kv_share_back(state, client_id)
        n = self.ledger.release(state, client_id)
        if n == state.window - 1 or not n or kv_freed:
            room = self.has_room(state)
            for route in state.routes:
                route.set_free(state, room)
        if not n and not state.present:
            self._forget_if_idle(state)

    def _set_kv_budget(self, state: ServerState) -> None:
        """The engine's KV cache (its record's, discovered at registration), this process's share of it under a
        lease: the same fraction of the cache as of the slots."""
        entry = state.entry
        budget = kv_budget(entry.record.kv_cache_tokens if entry is not None else None, state.lease, state.capacity,
                           admits_by_kv=self.kv_cost is not None)
        if budget != state.kv_budget:
            state.kv_budget = budget
            room = self.has_room(state)
            for route in state.routes:
                route.set_free(state, room)

    def set_lease(self, state: ServerState, slots: int | None) -> None:
        """The registry's lease of slots there for this process (None: not leasing)."""
        if state.lease != slots:
            now, changes = self.ledger.wall_now(), state.lease_changes
            changes.append((now, state.lease or 0))
            while now - changes[0][0] > HISTORY_S:
                changes.popleft()
            state.lease = slots
            self._set_kv_budget(state)
            self._rewindow(state)

    def apply_lease(self, slots: Mapping[str, int] | None) -> None:
        """A new lease for the whole pool (servers it does not name get no slots; None: not leasing)."""
        self.lease_slots = slots
        for state in self.states.values():
            self.set_lease(state, None if slots is None else slots.get(state.id, 0))

    def _rewindow(self, state: ServerState) -> None:
        window = self.window(state)
        if window != state.window:
            state.window = window
            room = self.has_room(state)
            for route in state.routes:
                route.set_free(state, room)

    def window(self, state: ServerState) -> int:
        """This dispatcher's admission window there: the learned window, less what other clients keep running
        or queued on the engine (from the registry's scrape), within this process's lease; 0 while the
        engine's own queue shows it full."""
        learning = state.learning
        if learning is None or not state.present:
            return 0
        window = learning.window(state.capacity)
        entry = state.entry
        load = entry.load if entry is not None else None
        if load is not None:
            # The scrape is up to a probe interval old: compare it with what *we* had in flight then.
            others = max(0.0, load.running + load.waiting - state.at(load.observed_at))
            if state.lease is not None:  # slots leased since: the broker saw the other holders' work there end
                others = max(0.0, others - max(0, state.lease - _lease_at(state, load.observed_at)))
            window = min(window, max(1, int(state.capacity - others)))
        window = max(1, window)
        if state.lease is not None:
            window = min(window, state.lease)
        if state.queue_full:
            window = 0
        return window

    def held(self) -> dict[str, int]:
        """The lease this dispatcher works within now, per server (what it tells the broker it holds)."""
        return {sid: s.lease for sid, s in self.states.items() if s.lease}

    # ---- breakers ------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Breakers whose cool-down passed turn half-open (one trial); learned weights refresh once a period."""
        for state in [s for s in self._open if s.open_until is not None and s.open_until <= now]:
            self._open.discard(state)
            state.half_open = True
            room = self.has_room(state)
            for route in state.routes:
                route.set_free(state, room)
        self._refresh()

    def next_cooldown(self) -> float | None:
        return min((s.open_until for s in self._open if s.open_until is not None), default=None)

    # ---- outcomes ------------------------------------------------------------------------------------
    def note_success(self, state: ServerState, tokens: int, latency_s: float, client_id: str | None = None) -> None:
        now = self._clock()
        learning = state.learning
        if learning is not None:
            # What this answer would take on the pool's average server: the client's mean latency (an
            # exponential mean over its answers, every server alike). Server speeds compare attempt-seconds
            # against it, so the mix of requests a server was given cancels out.
            reference = max(latency_s, 0.0)
            if client_id is not None and latency_s > 0:
                mean = self._client_latency.get(client_id)
                reference = latency_s if mean is None else mean + CLIENT_LATENCY_ALPHA * (latency_s - mean)
                self._client_latency[client_id] = reference
            at = self.ledger.clock()  # the ledger's busy seconds and occupancy there, as of its clock
            busy = state.busy_total + (at - state.busy_since if state.busy_since is not None else 0.0)
            occupancy = state.occupancy_total + (state.inflight * (at - state.occupancy_at)
                                                 if state.occupancy_at is not None else 0.0)
            # The engine-queue rule: our part of the scrape's queue, against what was in flight here when it was
            # taken, not now (answers since would make an old queue look like a flood): `our_scraped_queue`, inline.
            ours, held = state.scrape_inflight, state.scraped_running + state.scraped_waiting
            decision = learning.on_finish(tokens, latency_s, now, busy, state.scraped_waiting * min(1.0, ours / held)
                                          if held > 0 else 0.0, ours, occupancy, reference_s=reference)
            if decision is not None:
                log.debug("window of %s now %.1f: %s", state.id, decision.window, decision.reason)
                self._rewindow(state)
            state.weight = self._weight(state, now)
        if state.open_until is not None or state.breaker_failures:
            state.breaker_failures, state.open_until, state.half_open, state.trial = 0, None, False, False
            self._open.discard(state)
            room = self.has_room(state)
            for route in state.routes:
                route.set_free(state, room)
        state.last_answer_at = now
        state.answered += 1
        state.tokens += tokens
        state.answer_s += latency_s
        if now - self._refreshed_at >= self._settings.learn_period_s:
            self._refresh()

    def note_failure(self, state: ServerState, kind: FailureKind) -> None:
        learning = state.learning
        now = self._clock()
        if learning is not None:
            if kind is FailureKind.RATE_LIMITED:
                learning.on_rate_limited()
            decision = learning.on_finish(0, 0.0, now, self.ledger.busy_s(state.id), our_scraped_queue(state),
                                          state.scrape_inflight, self.ledger.occupancy_s(state.id))
            if decision is not None:
                self._rewindow(state)
        state.failures[kind.value] = state.failures.get(kind.value, 0) + 1
        if kind.counts_against_server:
            state.breaker_failures += 1
            state.trial = False
            if state.open_until is not None or state.breaker_failures >= self._settings.breaker_failures:
                state.open_until = now + self._settings.breaker_cooldown_s  # a failed trial re-opens
                state.half_open = False
                self._open.add(state)
                for route in state.routes:
                    route.set_free(state, False)

    def forget_client(self, client_id: str) -> None:
        self._client_latency.pop(client_id, None)

    # ---- learned weights -------------------------------------------------------------------------------
    def _weight(self, state: ServerState, now: float) -> float:
        """Relative throughput: the learned speed of one sequence × capacity where known, else the accelerator
        prior × capacity, put on the same scale through the servers whose speed is known."""
        entry = state.entry
        prior = (entry.weight if entry is not None else 1.0) * state.capacity
        learning = state.learning
        if not self._settings.learn_throughput or learning is None:
            return prior
        if not learning.sequence_speed:
            return prior * self._rate_scale
        learned = learning.sequence_speed * state.capacity
        stale = now - (learning.speed_at or 0.0) - self._stale_after_s
        if stale <= 0:
            return learned
        fallback = prior * self._rate_scale
        return fallback + (learned - fallback) * math.exp(-stale / self._stale_after_s)

    def _refresh(self, force: bool = False) -> None:
        """At most once per learning period (or when the pool changed): the scale that puts priors on the
        learned scale (mean learned ÷ prior over the servers measured lately, else over all measured), then
        every weight (they also fade with time)."""
        now = self._clock()
        if not force and now - self._refreshed_at < self._settings.learn_period_s:
            return
        self._refreshed_at = now
        fresh, known = [], []
        for state in self.states.values():
            learning, entry = state.learning, state.entry
            if learning is None or entry is None or not learning.sequence_speed or entry.weight <= 0:
                continue
            ratio = learning.sequence_speed / entry.weight
            known.append(ratio)
            if now - (learning.speed_at or 0.0) <= self._stale_after_s:
                fresh.append(ratio)
        ratios = fresh or known
        self._rate_scale = sum(ratios) / len(ratios) if ratios else 1.0
        for state in self.states.values():
            state.weight = self._weight(state, now)

    def weight_of(self, state: ServerState) -> float:
        return state.weight

    def drain_s(self, state: ServerState, extra: int = 0) -> float:
        """How long the server would take to finish what this dispatcher has there (+ extra), in units of
        its relative throughput (what tail stealing compares)."""
        return (state.inflight + extra) / state.weight if state.weight > 0 else float("inf")

    # ---- figures ---------------------------------------------------------------------------------------
    def server_stats(self, entries: Iterable[ServerEntry]) -> tuple[ServerStats, ...]:
        """Per-server figures: every server of `entries` and every other the book still holds."""
        ids = sorted({e.id for e in entries} | set(self.states))
        out = []
        for sid in ids:
            state = self.states.get(sid)
            if state is None:
                out.append(ServerStats(sid, 0, {}, 0, 0, 0, 0.0))
                continue
            learning = state.learning
            out.append(ServerStats(
                server_id=sid, answered=state.answered, failures=dict(state.failures), inflight=state.inflight,
                window=state.window, completion_tokens=state.tokens, busy_s=state.answer_s,
                learned_tokens_per_s=learning.tokens_per_s if learning is not None else None,
                window_reason=learning.last_decision.reason if learning and learning.last_decision else None))
        return tuple(out)


def _lease_at(state: ServerState, wall_time: float) -> int:
    """The lease the dispatcher held there at that wall-clock time (the current one beyond the kept changes)."""
    for when, before in state.lease_changes:
        if when > wall_time:
            return before
    return state.lease or 0
