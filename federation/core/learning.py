"""What the dispatcher learns from its own traffic: each server's throughput (generated tokens per busy
second, decayed) and an adaptive admission window. Pure: the clock is passed in, nothing does I/O."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

LEARN_PERIOD_S = 2.0  # throughput and window decisions are made at most this often per server
# Between answers, a scrape shrinks a window only when at least this share of this dispatcher's attempts on the
# engine wait in its queue (three waiting for every one running: the last wait three batches). A smaller queue
# keeps a KV-bound engine's batch full: shrinking on every queue of a few (7 waiting beside 9 running on the
# simulator's 16-slot engines) took the simulated 256 x 64 world from 1.280x to 1.352x the bound; at half the
# attempts queued, 1.330x; at three quarters it never fires there.
SCRAPE_QUEUE_SHARE = 0.75


@dataclass
class BusyRate:
    """An amount (generated tokens, priced work) per busy second, both exponentially decayed with time
    constant `tau_s`. Busy seconds are the ledger's (`InflightLedger.busy_s`, cumulative), so every rate a
    dispatcher learns is measured against the same busy time: seconds with at least one of its requests on
    the server, idle gaps not counted."""

    tau_s: float
    amount: float = 0.0
    busy: float = 0.0
    answered: int = 0
    _at: float | None = None
    _busy_seen: float = 0.0

    def add(self, now: float, busy_total_s: float, amount: float) -> float | None:
        """Add an amount; returns the rate after it (None while there is no busy time yet)."""
        at = self._at
        if at is not None and now > at:
            keep = math.exp(-(now - at) / self.tau_s)
            self.amount *= keep
            self.busy *= keep
        busy = busy_total_s - self._busy_seen
        if busy > 0:
            self.busy += busy
        self._busy_seen = busy_total_s
        self._at = now
        self.amount += amount
        self.answered += 1
        return self.amount / self.busy if self.busy > 0 and self.amount > 0 else None

    def value(self, now: float, busy_total_s: float, min_answers: int = 1) -> float | None:
        self._advance(now, busy_total_s)
        if self.answered < min_answers or self.busy <= 0 or self.amount <= 0:
            return None
        return self.amount / self.busy

    def _advance(self, now: float, busy_total_s: float) -> None:
        if self._at is not None and now > self._at:
            keep = math.exp(-(now - self._at) / self.tau_s)
            self.amount *= keep
            self.busy *= keep
        self.busy += max(0.0, busy_total_s - self._busy_seen)
        self._busy_seen = busy_total_s
        self._at = now


@dataclass(frozen=True, slots=True)
class WindowObservation:
    """One period at one server, as the dispatcher and the registry saw it."""

    throughput: float  # tokens/s this period
    per_token_latency_s: float | None  # median request latency / output tokens this period
    scraped_waiting: float  # the engine's own queue (all clients), from the registry
    rate_limited: int  # HTTP 429s this period
    window_was_full: bool  # this dispatcher used the whole window at some point
    inflight: int | None = None  # what this dispatcher had on the server when its engine was last scraped


@dataclass(frozen=True, slots=True)
class WindowDecision:
    window: float
    reason: str


@dataclass
class WindowController:
    """Grow while throughput rises and the engine's queue stays empty; shrink on queueing, latency
    inflation or 429. Starts at the engine's capacity: enough to fill its batch."""

    capacity: int
    window: float = field(default=0.0)
    max_factor: float = 1.0  # never more than capacity × this in flight from one dispatcher
    shrink: float = 0.75
    # A short engine queue keeps the batch full (the engine always has the next prompt ready); only a queue
    # longer than this fraction of the capacity (and at least 2) is excess that would lengthen the tail and
    # bind requests to a server before they need to be. Of the capacity, not of the window: against the
    # window the allowance shrank with every shrink, and prompt-heavy mixes (where a chunked-prefill engine
    # always shows a few requests waiting for their first chunk) ratcheted windows down to ~10 of 256.
    queue_tolerance: float = 0.05
    growth: float = 1.25  # a full window over an engine with no excess queue grows by this factor (≥ +1)
    # Shrink when this period's median per-token latency exceeds this × the median of the last
    # `baseline_periods` periods: sudden inflation (a queue building inside the engine). Not against the
    # best ever seen: with mixed workloads (long prompts with short answers beside chat-length answers)
    # per-token latency moves with the mix, and that rule collapsed windows to 1–5 on the speedup
    # benchmark; a lasting shift of the mix becomes the new baseline. Off by default (None): even this
    # form cost the Table 7 benchmark 1.26 → 1.57 × the ideal makespan (mix shifts still read as
    # inflation); the engine-queue rule catches queueing that engines report.
    inflation_limit: float | None = None
    baseline_periods: int = 8
    _last_throughput: float = 0.0
    _recent_latency: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.window <= 0:
            self.window = float(self.capacity)

    @property
    def limit(self) -> int:
        return max(1, int(self.window))

    @property
    def queue_allowance(self) -> float:
        return max(2.0, self.queue_tolerance * self.capacity)

    def decide(self, obs: WindowObservation) -> WindowDecision:
        ceiling = max(1.0, self.capacity * self.max_factor)
        inflated = False
        if obs.per_token_latency_s is not None:
            recent = self._recent_latency
            if self.inflation_limit is not None and len(recent) >= 2:
                inflated = obs.per_token_latency_s > self.inflation_limit * statistics.median(recent)
            recent.append(obs.per_token_latency_s)
            while len(recent) > self.baseline_periods:
                recent.popleft()
        if obs.rate_limited:
            decision = WindowDecision(max(1.0, self.window * self.shrink), f"{obs.rate_limited} × HTTP 429")
        elif obs.scraped_waiting >= self.queue_allowance:
            if obs.inflight is not None:
                # What the engine was running for us when the scrape was taken (`inflight`: ours there then; the
                # queue counted at most what we had there), plus a short queue: one step to the right size, not a
                # shrink per period while a queue we built earlier drains.
                target = obs.inflight - min(obs.scraped_waiting, obs.inflight) + self.queue_allowance
                new = max(1.0, min(self.window, target))
            else:
                new = max(1.0, self.window * self.shrink)
            decision = WindowDecision(new, f"engine queue {obs.scraped_waiting:g}")
        elif inflated:
            decision = WindowDecision(max(1.0, self.window * self.shrink), "latency inflation")
        elif obs.window_was_full and obs.scraped_waiting < self.queue_allowance / 2:
            grown = max(self.window + 1, self.window * self.growth)
            decision = WindowDecision(min(ceiling, grown), "full window, engine not queueing")
        elif obs.window_was_full and obs.throughput >= 0.98 * self._last_throughput:
            decision = WindowDecision(min(ceiling, self.window + 1), "throughput held or rose at a full window")
        else:
            decision = WindowDecision(min(ceiling, self.window), "steady")
        self.window = decision.window
        self._last_throughput = obs.throughput
        return decision

    def on_scrape(self, waiting: float, inflight: int) -> WindowDecision | None:
        """The engine's queue as a scrape shows it, between answers (`waiting`: this dispatcher's attempts queued
        there, of `inflight` it had there then): the engine-queue rule of `decide`, shrinking only, at the probe
        rate, and only for a queue of most of those attempts (`SCRAPE_QUEUE_SHARE`). At the answers' rate alone a
        deep queue went unseen for as long as no answer came: a V100 whose 256 slots held long answers kept a
        window of 256, and 200 prompts in its queue, for 12 s."""
        if waiting < max(self.queue_allowance, SCRAPE_QUEUE_SHARE * inflight):
            return None
        target = max(1.0, inflight - waiting + self.queue_allowance)
        if target >= self.window:
            return None
        self.window = target
        return WindowDecision(target, f"engine queue {waiting:g} (scrape)")


@dataclass
class ServerLearning:
    """Everything one dispatcher learns about one server: its throughput (tokens per busy second, decayed
    over ~3 learning periods) and its admission window, re-decided once per period."""

    rate: BusyRate
    controller: WindowController
    period_s: float = LEARN_PERIOD_S
    adaptive: bool = True
    last_decision: WindowDecision | None = None
    tokens_per_s: float | None = None  # tokens per busy second as of the last closed period (the window's view)
    # One sequence's speed, as of its latest answer: the answers' reference latencies (each client's mean
    # latency over every server, ServerBook) per attempt-second here — 1.0 for a server as fast as the pool's
    # average for the same requests, whatever mix of requests it was given. Weights compare this × capacity,
    # which does not grow with the traffic a server is given (tokens per busy second does: a server given
    # more requests batches more, learned a higher rate and was given still more; two equal servers ended
    # 92/8), nor with the shape of its requests (tokens per attempt-second did: a server that had answered a
    # short-answer eval's requests, mostly prefill, looked slower than its twin by half and got a third of
    # the traffic once that eval was done). As of each answer, not of the last closed period: two equal servers
    # whose periods closed either side of a slow spell were left 4.7× apart until the next, and the one
    # measured slow was given no request to close it with.
    sequence_speed: float | None = None
    speed_at: float | None = None  # when sequence_speed was last measured (an answer)
    sequence_rate: BusyRate = field(default_factory=lambda: BusyRate(tau_s=3 * LEARN_PERIOD_S))
    _latencies: list[float] = field(default_factory=list)
    _rate_limited: int = 0
    full: bool = False  # the window was full at some point this period
    period_start: float | None = None

    @classmethod
    def for_capacity(
        cls, capacity: int, *, adaptive: bool, max_factor: float, period_s: float = LEARN_PERIOD_S
    ) -> ServerLearning:
        return cls(BusyRate(tau_s=3 * period_s), WindowController(capacity, max_factor=max_factor), period_s, adaptive,
                   sequence_rate=BusyRate(tau_s=3 * period_s))

    def window(self, capacity: int) -> int:
        if self.controller.capacity != capacity:  # the registry learned a new capacity: start over from it
            self.controller = WindowController(capacity, max_factor=self.controller.max_factor)
        return self.controller.limit if self.adaptive else max(1, int(capacity * self.controller.max_factor))

    def on_start(self, now: float, inflight_after: int, window: int) -> None:
        if self.period_start is None:
            self.period_start = now
        if inflight_after >= window:
            self.full = True

    def on_rate_limited(self) -> None:
        self._rate_limited += 1

    def on_scrape(self, waiting: float, inflight: int) -> WindowDecision | None:
        """A new scrape of the engine (`inflight`: this dispatcher's attempts there when it was taken)."""
        if not self.adaptive:
            return None
        decision = self.controller.on_scrape(waiting, inflight)
        if decision is not None:
            self.last_decision = decision
        return decision

    def on_finish(self, tokens: int, latency_s: float, now: float, busy_total_s: float, scraped_waiting: float,
                  inflight: int, occupancy_s: float = 0.0, reference_s: float = 0.0) -> WindowDecision | None:
        """An answer (or a failure, with 0 tokens) came back; at most once a period, the window is re-decided."""
        if tokens > 0:
            self._latencies.append(latency_s / tokens)
            self.rate.add(now, busy_total_s, tokens)
        if reference_s > 0:
            self.sequence_speed = self.sequence_rate.add(now, occupancy_s, reference_s)
            self.speed_at = now
        if self.period_start is None or now - self.period_start < self.period_s:
            return None
        self.period_start = now
        rate = self.rate.value(now, busy_total_s)
        if rate is None:
            return None
        self.tokens_per_s = rate
        if not self.adaptive:
            return None
        ordered = sorted(self._latencies)
        obs = WindowObservation(
            throughput=rate,
            per_token_latency_s=ordered[len(ordered) // 2] if ordered else None,
            scraped_waiting=scraped_waiting,
            rate_limited=self._rate_limited,
            window_was_full=self.full,
            inflight=inflight,
        )
        self._latencies, self._rate_limited, self.full = [], 0, False
        self.last_decision = self.controller.decide(obs)
        return self.last_decision


class HedgeTimer:
    """When to hedge a straggler: `factor` × the median latency of recent answers for a model, never sooner
    than `min_delay_s`, and not at all before `min_samples` answers have been seen."""

    def __init__(self, factor: float = 2.0, min_delay_s: float = 0.2, min_samples: int = 8, window: int = 200):
        self._factor = factor
        self._min_delay_s = min_delay_s
        self._min_samples = min_samples
        self.window = window
        self.latencies: dict[str, deque[float]] = {}  # model -> recent answer latencies (the dispatcher appends)

    def observe(self, model: str, latency_s: float) -> None:
        seen = self.latencies.get(model)
        if seen is None:
            seen = self.latencies[model] = deque(maxlen=self.window)
        seen.append(latency_s)

    def delay(self, model: str) -> float | None:
        seen = self.latencies.get(model)
        if not seen or len(seen) < self._min_samples:
            return None
        return max(self._min_delay_s, self._factor * statistics.median(seen))

    def forget(self, models: set[str]) -> None:
        """Keep only these models' latencies (a model no server serves any more is forgotten)."""
        for model in [m for m in self.latencies if m not in models]:
            del self.latencies[model]
