"""What one dispatcher knows about each server beyond the ledger's counts: its admission window, learned
throughput, circuit breaker and answer counters; and the candidates a policy sees."""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fedpool.federation.breaker import CircuitBreaker
from fedpool.federation.dispatch_types import ServerStats
from fedpool.federation.errors import FailureKind
from fedpool.federation.learning import LEARN_PERIOD_S, ServerLearning
from fedpool.federation.ledger import InflightLedger
from fedpool.federation.policies import Candidate
from fedpool.registry import ServerEntry

log = logging.getLogger("fedpool.dispatcher")

SAMPLE_TRIES = 4  # random draws per wanted candidate before a sampled choice scans the whole route
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


class ServerBook:
    def __init__(self, settings: BookSettings, ledger: InflightLedger, *, clock: Callable[[], float]):
        self._settings = settings
        self.ledger = ledger
        self._clock = clock
        self.answered: Counter[str] = Counter()
        self.last_answer_at: dict[str, float] = {}  # monotonic time of each server's latest answer
        self.tokens: Counter[str] = Counter()
        self.busy_s: Counter[str] = Counter()  # summed answer latencies (what the stats report)
        self.failures: dict[str, Counter[str]] = {}
        self.learning: dict[str, ServerLearning] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        self._priors: dict[str, float] = {}
        self._rate_scale_at = -1.0
        self._rate_scale_value = 1.0
        self._client_latency: dict[str, float] = {}  # client -> its mean answer latency over every server

    # ---- slots --------------------------------------------------------------------------------
    def take(self, server: ServerEntry, client_id: str, now: float) -> None:
        after = self.ledger.take(server.id, client_id)
        self.breaker(server.id).on_dispatch(now)
        self.learning_for(server).on_start(now, after, self.window(server))

    def has_room(self, server: ServerEntry) -> bool:
        return self.ledger.on_server(server.id) < self.window(server)

    # ---- what a policy sees -------------------------------------------------------------------
    def free_candidates(
        self, servers: Sequence[ServerEntry], limit: int | None, rng: random.Random,
        accept: Callable[[ServerEntry], bool] | None = None,
    ) -> list[Candidate]:
        """Candidates with a free window slot (and `accept`ed). A policy that looks at a random sample of
        `limit` servers gets one drawn without visiting every server (a few random draws each; the whole route
        is scanned only when those find too few), so a decision over 256 servers costs what one over 4 does."""
        ok = accept or self.has_room
        if limit is not None and len(servers) > SAMPLE_TRIES * limit:
            picked: dict[str, ServerEntry] = {}
            for _ in range(SAMPLE_TRIES * limit):
                server = servers[rng.randrange(len(servers))]
                if server.id not in picked and ok(server):
                    picked[server.id] = server
                    if len(picked) == limit:
                        return [self._candidate(s) for s in picked.values()]
        free = [s for s in servers if ok(s)]
        if limit is not None and len(free) > limit:
            free = rng.sample(free, limit)
        return [self._candidate(s) for s in free]

    def window(self, server: ServerEntry) -> int:
        """This dispatcher's admission window there, less what other clients keep running or queued on
        the engine (from the registry's scrape), so several clients sharing a server do not overfill it."""
        window = self.learning_for(server).window(server.capacity)
        load = server.load
        if load is not None:
            # The scrape is up to a probe interval old: compare it with what *we* had in flight then.
            others = max(0.0, load.running + load.waiting - self.ledger.at(server.id, load.observed_at))
            window = min(window, max(1, int(server.capacity - others)))
        return max(1, window)

    def breaker(self, server_id: str) -> CircuitBreaker:
        breaker = self._breakers.get(server_id)
        if breaker is None:
            breaker = CircuitBreaker(self._settings.breaker_failures, self._settings.breaker_cooldown_s)
            self._breakers[server_id] = breaker
        return breaker

    def learning_for(self, server: ServerEntry) -> ServerLearning:
        learning = self.learning.get(server.id)
        if learning is None:
            learning = ServerLearning.for_capacity(
                server.capacity, adaptive=self._settings.adaptive_windows, max_factor=self._settings.window_factor,
                period_s=self._settings.learn_period_s,
            )
            self.learning[server.id] = learning
        return learning

    def forget_rate_scale(self) -> None:
        self._rate_scale_at = -1.0

    # ---- outcomes -----------------------------------------------------------------------------
    def note_failure(self, server: ServerEntry, kind: FailureKind) -> None:
        learning = self.learning_for(server)
        if kind is FailureKind.RATE_LIMITED:
            learning.on_rate_limited()
        now = self._clock()
        learning.on_finish(0, 0.0, now, self.ledger.busy_s(server.id), server.load.waiting if server.load else 0.0,
                           self.ledger.on_server(server.id), self.ledger.occupancy_s(server.id))
        self.failures.setdefault(server.id, Counter())[kind.value] += 1
        if kind.counts_against_server:
            self.breaker(server.id).on_failure(now)

    def note_success(self, server: ServerEntry, tokens: int, latency_s: float, client_id: str | None = None) -> None:
        decision = self.learning_for(server).on_finish(
            tokens, latency_s, self._clock(), self.ledger.busy_s(server.id),
            server.load.waiting if server.load else 0.0, self.ledger.on_server(server.id),
            self.ledger.occupancy_s(server.id), reference_s=self._reference_latency(client_id, latency_s),
        )
        if decision is not None:
            log.debug("window of %s now %.1f: %s", server.id, decision.window, decision.reason)
        self.breaker(server.id).on_success()
        self.last_answer_at[server.id] = self._clock()
        self.answered[server.id] += 1
        self.tokens[server.id] += tokens
        self.busy_s[server.id] += latency_s

    def _reference_latency(self, client_id: str | None, latency_s: float) -> float:
        """What this answer would take on the pool's average server: the client's mean latency (an exponential
        mean over its answers, every server alike). Server speeds compare attempt-seconds against it, so the
        mix of requests a server was given cancels out."""
        if client_id is None or latency_s <= 0:
            return max(latency_s, 0.0)
        mean = self._client_latency.get(client_id)
        mean = latency_s if mean is None else mean + CLIENT_LATENCY_ALPHA * (latency_s - mean)
        self._client_latency[client_id] = mean
        return mean

    def server_stats(self, entries: Iterable[ServerEntry]) -> tuple[ServerStats, ...]:
        """Per-server figures: every server answered, failed or in flight here, and those of `entries`."""
        windows = {e.id: self.window(e) for e in entries}
        ids = sorted(set(self.answered) | set(self.failures) | self.ledger.servers() | set(windows))
        return tuple(
            ServerStats(
                server_id=sid,
                answered=self.answered.get(sid, 0),
                failures=dict(self.failures.get(sid, {})),
                inflight=self.ledger.on_server(sid),
                window=windows.get(sid, 0),
                completion_tokens=self.tokens.get(sid, 0),
                busy_s=self.busy_s.get(sid, 0.0),
                learned_tokens_per_s=self.learning[sid].tokens_per_s if sid in self.learning else None,
                window_reason=(
                    self.learning[sid].last_decision.reason  # type: ignore[union-attr]
                    if sid in self.learning and self.learning[sid].last_decision else None
                ),
            )
            for sid in ids
        )

    # ---- internals ----------------------------------------------------------------------------
    def _candidate(self, server: ServerEntry) -> Candidate:
        load = server.load
        self._priors[server.id] = server.weight * server.capacity
        return Candidate(
            server_id=server.id,
            inflight=self.ledger.on_server(server.id),
            window=self.window(server),
            capacity=server.capacity,
            weight=self.weight_of(server),
            scraped_waiting=load.waiting if load else 0.0,
            scraped_running=load.running if load else 0.0,
        )

    def weight_of(self, server: ServerEntry) -> float:
        """Relative throughput: the learned speed of one sequence × capacity where known, else the accelerator
        prior × capacity, put on the same scale through the servers whose speed is known."""
        prior = server.weight * server.capacity
        if not self._settings.learn_throughput:
            return prior
        learned = self._learned(server.id, server.capacity)
        if learned is None:
            return prior * self._rate_scale()
        stale = self._unrenewed_s(self.learning[server.id], self._clock()) - self._stale_after_s
        if stale <= 0:
            return learned
        fallback = prior * self._rate_scale()
        return fallback + (learned - fallback) * math.exp(-stale / self._stale_after_s)

    @property
    def _stale_after_s(self) -> float:
        return STALE_PERIODS * self._settings.learn_period_s

    @staticmethod
    def _unrenewed_s(learning: ServerLearning, now: float) -> float:
        """Seconds since an answer last renewed the server's learned speed."""
        return now - (learning.speed_at or 0.0)

    def _learned(self, server_id: str, capacity: int) -> float | None:
        learning = self.learning.get(server_id)
        if learning is None or not learning.sequence_speed:
            return None
        return learning.sequence_speed * capacity

    def drain_s(self, server: ServerEntry, extra: int = 0) -> float:
        """How long the server would take to finish what this dispatcher has there (+ extra), in units of
        its relative throughput (what tail stealing compares)."""
        rate = self.weight_of(server)
        return (self.ledger.on_server(server.id) + extra) / rate if rate > 0 else float("inf")

    def _rate_scale(self) -> float:
        """Mean learned-rate / prior over the servers with a learned rate (1.0 when none), those measured in
        the last STALE_PERIODS periods where any were: puts priors on the learned scale. Recomputed at most
        once per learning period."""
        now = self._clock()
        if now - self._rate_scale_at >= self._settings.learn_period_s or self._rate_scale_at < 0:
            known = [
                (learned / self._priors[sid], self._unrenewed_s(lrn, now) <= self._stale_after_s)
                for sid, lrn in self.learning.items()
                if self._priors.get(sid) and (learned := self._learned(sid, lrn.controller.capacity)) is not None
            ]
            # Servers measured lately set the scale (a stale measurement would pull the prior it fades to)
            ratios = [ratio for ratio, fresh in known if fresh] or [ratio for ratio, _ in known]
            self._rate_scale_value = sum(ratios) / len(ratios) if ratios else 1.0
            self._rate_scale_at = now
        return self._rate_scale_value
