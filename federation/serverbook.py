"""What one dispatcher knows about each server: its in-flight count (with a history to line up with the
registry's scrapes), admission window, learned throughput, circuit breaker and answer counters."""

from __future__ import annotations

import bisect
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fedpool.federation.breaker import CircuitBreaker
from fedpool.federation.dispatch_types import ServerStats
from fedpool.federation.errors import FailureKind
from fedpool.federation.learning import LEARN_PERIOD_S, ServerLearning
from fedpool.federation.policies import Candidate
from fedpool.registry import ServerEntry

log = logging.getLogger("fedpool.dispatcher")

INFLIGHT_LOG_LEN = 4096  # (time, in-flight) changes kept per server to line up with stale scrapes


@dataclass(frozen=True, slots=True)
class BookSettings:
    window_factor: float
    adaptive_windows: bool
    learn_throughput: bool
    breaker_failures: int
    breaker_cooldown_s: float
    learn_period_s: float = LEARN_PERIOD_S


class ServerBook:
    def __init__(self, settings: BookSettings, *, clock: Callable[[], float], wall_clock: Callable[[], float]):
        self._settings = settings
        self._clock = clock
        self._wall_clock = wall_clock  # the registry stamps scrapes with wall-clock time
        self.inflight: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()
        self.busy_s: Counter[str] = Counter()
        self.failures: dict[str, Counter[str]] = {}
        self.learning: dict[str, ServerLearning] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        self._inflight_log: dict[str, list[tuple[float, int]]] = {}
        self._inflight_log_trimmed: set[str] = set()
        self._priors: dict[str, float] = {}
        self._rate_scale_at = -1.0
        self._rate_scale_value = 1.0

    # ---- slots --------------------------------------------------------------------------------
    def take(self, server: ServerEntry, now: float) -> None:
        self.inflight[server.id] += 1
        self._log_inflight(server.id)
        self.breaker(server.id).on_dispatch(now)
        self.learning_for(server).on_start(now, self.inflight[server.id], self.window(server))

    def release(self, server_id: str) -> None:
        self.inflight[server_id] -= 1
        if self.inflight[server_id] <= 0:
            del self.inflight[server_id]
        self._log_inflight(server_id)
        learning = self.learning.get(server_id)
        if learning is not None:
            learning.on_release(self._clock(), self.inflight.get(server_id, 0))

    # ---- what a policy sees -------------------------------------------------------------------
    def free_candidates(
        self, servers: list[ServerEntry], limit: int | None, rng: random.Random
    ) -> list[Candidate]:
        """Candidates with a free window slot. For policies that only look at a random sample, only the
        sample is built (a decision over 256 servers then costs what one over 4 does)."""
        free = [s for s in servers if self.inflight.get(s.id, 0) < self.window(s)]
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
            others = max(0.0, load.running + load.waiting - self._own_inflight_at(server.id, load.observed_at))
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
        learning.on_finish(0, 0.0, self._clock(), server.load.waiting if server.load else 0.0,
                           self.inflight.get(server.id, 0))
        self.failures.setdefault(server.id, Counter())[kind.value] += 1
        if kind.counts_against_server:
            self.breaker(server.id).on_failure(self._clock())

    def note_success(self, server: ServerEntry, tokens: int, latency_s: float) -> None:
        decision = self.learning_for(server).on_finish(
            tokens, latency_s, self._clock(), server.load.waiting if server.load else 0.0,
            self.inflight.get(server.id, 0),
        )
        if decision is not None:
            log.debug("window of %s now %.1f: %s", server.id, decision.window, decision.reason)
        self.breaker(server.id).on_success()
        self.answered[server.id] += 1
        self.tokens[server.id] += tokens
        self.busy_s[server.id] += latency_s

    def server_stats(self, entries: Iterable[ServerEntry]) -> tuple[ServerStats, ...]:
        """Per-server figures: every server answered, failed or in flight here, and those of `entries`."""
        windows = {e.id: self.window(e) for e in entries}
        ids = sorted(set(self.answered) | set(self.failures) | set(self.inflight) | set(windows))
        return tuple(
            ServerStats(
                server_id=sid,
                answered=self.answered.get(sid, 0),
                failures=dict(self.failures.get(sid, {})),
                inflight=self.inflight.get(sid, 0),
                window=windows.get(sid, 0),
                completion_tokens=self.tokens.get(sid, 0),
                busy_s=self.busy_s.get(sid, 0.0),
                learned_tokens_per_s=self.learning[sid].estimator.rate if sid in self.learning else None,
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
            inflight=self.inflight.get(server.id, 0),
            window=self.window(server),
            capacity=server.capacity,
            weight=self._weight(server),
            scraped_waiting=load.waiting if load else 0.0,
            scraped_running=load.running if load else 0.0,
        )

    def weight_of(self, server: ServerEntry) -> float:
        """Relative throughput of a server (what weighted policies and tail stealing compare)."""
        return self._weight(server)

    def _weight(self, server: ServerEntry) -> float:
        """Relative throughput: learned tokens/s where known, else the accelerator prior × capacity, put
        on the same scale through the servers whose rate is known."""
        prior = server.weight * server.capacity
        if not self._settings.learn_throughput:
            return prior
        learned = self.learning.get(server.id)
        if learned is not None and learned.estimator.rate:
            return learned.estimator.rate
        return prior * self._rate_scale()

    def _rate_scale(self) -> float:
        """Mean learned-rate / prior over the servers with a learned rate (1.0 when none): puts priors on
        the learned scale. Recomputed at most once per learning period."""
        now = self._clock()
        if now - self._rate_scale_at >= self._settings.learn_period_s or self._rate_scale_at < 0:
            ratios = [
                lrn.estimator.rate / self._priors[sid] for sid, lrn in self.learning.items()
                if lrn.estimator.rate and self._priors.get(sid)
            ]
            self._rate_scale_value = sum(ratios) / len(ratios) if ratios else 1.0
            self._rate_scale_at = now
        return self._rate_scale_value

    def _log_inflight(self, server_id: str) -> None:
        log_ = self._inflight_log.get(server_id)
        if log_ is None:
            log_ = self._inflight_log[server_id] = []
        log_.append((self._wall_clock(), self.inflight.get(server_id, 0)))
        if len(log_) > 2 * INFLIGHT_LOG_LEN:  # a list (bisect needs O(1) indexing), trimmed in halves
            del log_[:INFLIGHT_LOG_LEN]
            self._inflight_log_trimmed.add(server_id)

    def _own_inflight_at(self, server_id: str, wall_time: float) -> int:
        """Our in-flight count at that wall-clock time. Before the first logged change it was 0, unless the
        log was truncated: then the largest count it holds (so other clients' load is never overestimated)."""
        log_ = self._inflight_log.get(server_id)
        if not log_:
            return 0
        index = bisect.bisect_right(log_, (wall_time, float("inf"))) - 1
        if index < 0:
            return max(n for _, n in log_) if server_id in self._inflight_log_trimmed else 0
        return log_[index][1]
