"""What a dispatcher counts and learns of each server from its own traffic.

The in-flight ledger: every attempt counted once, per server, per client and per server x client, in the same
step as the choice that sends it (`take`) and given back however it ends (`release`); everything else reads it.
Each server's figures live on one object, `ServerSlots` (the dispatcher's `ServerState` extends it): in flight,
a coarse wall-clock history of the count (to line up with the registry's scrapes), busy seconds and occupancy,
kept on a `StallClock` (the monotonic clock less the seconds this process's own loop stood still).

What is learned from it (`ServerLearning`): each server's throughput and per-sequence speed, an adaptive admission
window re-decided once per learning period, and each model's hedge delay (`HedgeTimer`). Pure bookkeeping: clocks
injected, no I/O. docs/architecture.md says why each measure is what it is.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fedpool.federation.core.windows import WindowController, WindowDecision, WindowObservation

HISTORY_BUCKET_S = 0.05  # the count's history keeps one entry per this much wall time (the largest count seen)
HISTORY_S = 30.0  # ... over this much of the past: scrapes are at most a few probe intervals old


class ServerSlots:
    """One server's in-flight figures (mutated only by the ledger)."""

    __slots__ = ("busy_since", "busy_total", "by_client", "history", "id", "inflight", "occupancy_at",
                 "occupancy_total", "trimmed")

    def __init__(self, server_id: str):
        self.id = server_id
        self.inflight = 0
        self.by_client: dict[str, int] = {}
        self.busy_total = 0.0
        self.busy_since: float | None = None
        self.occupancy_total = 0.0
        self.occupancy_at: float | None = None
        # (bucket start, largest count in the bucket, count at its end): appended when a new bucket starts.
        self.history: deque[list[float]] = deque()
        self.trimmed = False

    def at(self, wall_time: float) -> int:
        """The count at that wall-clock time (the largest within its bucket: others' load is never
        overestimated); 0 before the first change; the oldest kept where the history no longer reaches."""
        history = self.history
        if not history:
            return 0
        index = bisect.bisect_right(history, wall_time, key=lambda b: b[0]) - 1
        if index < 0:
            return int(history[0][1]) if self.trimmed else 0
        bucket = history[index]
        return int(bucket[1] if wall_time < bucket[0] + HISTORY_BUCKET_S else bucket[2])


class StallClock:
    """The monotonic clock less every stall the dispatcher's grant passes saw (see the module docstring);
    continuous and never decreasing: it stands still while a pending grant pass is late."""

    def __init__(self, inner: Callable[[], float] = time.monotonic, tolerance_s: float = 0.005):
        self._inner = inner
        self.tolerance_s = tolerance_s
        self.stalled_s = 0.0  # stall seconds seen so far (beyond the tolerance), cumulative
        self.stalls = 0
        self.pending_since: float | None = None  # when the pending grant pass was scheduled (inner time)

    def now(self) -> float:
        now = self._inner()
        since = self.pending_since
        if since is not None and now - since > self.tolerance_s:
            return since + self.tolerance_s - self.stalled_s
        return now - self.stalled_s

    def ran(self, now: float) -> float:
        """The pending grant pass runs at `now` (inner time): its lateness beyond the tolerance is a stall.
        Returns the lateness (the loop's lag)."""
        since, self.pending_since = self.pending_since, None
        if since is None:
            return 0.0
        lag = now - since
        if lag > self.tolerance_s:
            self.stalled_s += lag - self.tolerance_s
            self.stalls += 1
        return lag


class InflightLedger:
    def __init__(self, *, clock: Callable[[], float], wall_clock: Callable[[], float]):
        self.clock = clock  # busy time and occupancy are measured on it
        self._clock = clock
        self._wall_clock = wall_clock
        self._servers: dict[str, ServerSlots] = {}
        self.clients: dict[str, int] = {}  # client -> attempts in flight (read-only to everyone else)
        self._since: dict[str, float] = {}  # client -> the sum of when its attempts in flight took their slots
        self._total = 0

    def slots(self, server_id: str, factory: Callable[[str], ServerSlots] = ServerSlots) -> ServerSlots:
        """The server's figures, made (by `factory`) on first use."""
        slots = self._servers.get(server_id)
        if slots is None:
            slots = self._servers[server_id] = factory(server_id)
        return slots

    def forget(self, server_id: str) -> bool:
        """Drop a server's figures if nothing of it is in flight; True when dropped."""
        slots = self._servers.get(server_id)
        if slots is None or slots.inflight:
            return slots is None
        del self._servers[server_id]
        return True

    # ---- changes ------------------------------------------------------------------------------------
    def take(self, slots: ServerSlots, client_id: str) -> int:
        """One more attempt of `client_id` there; returns the server's count after it."""
        now = self._clock()
        n = slots.inflight
        if slots.occupancy_at is not None:
            slots.occupancy_total += n * (now - slots.occupancy_at)
        slots.occupancy_at = now
        if n == 0:
            slots.busy_since = now
        slots.inflight = n = n + 1
        slots.by_client[client_id] = slots.by_client.get(client_id, 0) + 1
        self.clients[client_id] = self.clients.get(client_id, 0) + 1
        self._since[client_id] = self._since.get(client_id, 0.0) + now
        self._total += 1
        # The count's coarse history (one bucket per HISTORY_BUCKET_S of wall time; inlined here and in
        # release: it runs for every attempt).
        wall, history = self._wall_clock(), slots.history
        if history and wall < history[-1][0] + HISTORY_BUCKET_S:
            last = history[-1]
            last[2] = n
            if n > last[1]:
                last[1] = n
        else:
            self._new_bucket(slots, wall, n)
        return n

    def release(self, slots: ServerSlots, client_id: str) -> int:
        """That attempt ended (answered, failed or cancelled); returns the server's count after it."""
        now = self._clock()
        n = slots.inflight
        if slots.occupancy_at is not None:
            slots.occupancy_total += n * (now - slots.occupancy_at)
        slots.occupancy_at = now
        slots.inflight = n = n - 1
        if n == 0 and slots.busy_since is not None:
            slots.busy_total += now - slots.busy_since
            slots.busy_since = None
        left = slots.by_client[client_id] - 1
        if left:
            slots.by_client[client_id] = left
        else:
            del slots.by_client[client_id]
        left = self.clients[client_id] - 1
        if left:
            self.clients[client_id] = left
            # Which attempt ended is not said: the sum of start times keeps their mean (exact for the last one).
            self._since[client_id] -= self._since[client_id] / (left + 1)
        else:
            del self.clients[client_id]
            del self._since[client_id]
        self._total -= 1
        wall, history = self._wall_clock(), slots.history
        if history and wall < history[-1][0] + HISTORY_BUCKET_S:
            history[-1][2] = n
        else:
            self._new_bucket(slots, wall, n)
        return n

    @staticmethod
    def _new_bucket(slots: ServerSlots, wall: float, n: int) -> None:
        history = slots.history
        history.append([wall, n, n])
        while wall - history[0][0] > HISTORY_S and len(history) > 1:
            history.popleft()
            slots.trimmed = True

    # ---- reads --------------------------------------------------------------------------------------
    def on_server(self, server_id: str) -> int:
        slots = self._servers.get(server_id)
        return slots.inflight if slots is not None else 0

    def of_client(self, client_id: str) -> int:
        return self.clients.get(client_id, 0)

    def held_s(self, client_id: str) -> float:
        """Seconds the client's attempts in flight have held their slots so far, together (on the ledger's clock)."""
        n = self.clients.get(client_id, 0)
        return n * self._clock() - self._since[client_id] if n else 0.0

    def clients_on(self, server_id: str) -> Mapping[str, int]:
        """Client -> attempts in flight on that server (a live view: do not keep it)."""
        slots = self._servers.get(server_id)
        return slots.by_client if slots is not None else _EMPTY

    def by_server(self) -> dict[str, int]:
        return {sid: s.inflight for sid, s in self._servers.items() if s.inflight}

    def total(self) -> int:
        return self._total

    def servers(self) -> set[str]:
        """Servers with attempts in flight."""
        return {sid for sid, s in self._servers.items() if s.inflight}

    def known(self) -> int:
        """Servers the ledger holds figures for (in flight or not)."""
        return len(self._servers)

    def busy_s(self, server_id: str) -> float:
        """Seconds (monotonic clock) this dispatcher has had at least one attempt on the server, up to now."""
        slots = self._servers.get(server_id)
        if slots is None:
            return 0.0
        return slots.busy_total + (self._clock() - slots.busy_since if slots.busy_since is not None else 0.0)

    def occupancy_s(self, server_id: str) -> float:
        """Attempt-seconds on the server so far (∫ count dt): per-sequence speeds divide by it, so a server's
        speed does not grow with the traffic it is given (tokens per busy second does, with its batch)."""
        slots = self._servers.get(server_id)
        if slots is None or slots.occupancy_at is None:
            return 0.0
        return slots.occupancy_total + slots.inflight * (self._clock() - slots.occupancy_at)

    def wall_now(self) -> float:
        """Now, on the wall clock the counts' history is kept on (the registry's scrapes are stamped on it)."""
        return self._wall_clock()

    def at(self, server_id: str, wall_time: float) -> int:
        """The server's count at that wall-clock time (see ServerSlots.at)."""
        slots = self._servers.get(server_id)
        return slots.at(wall_time) if slots is not None else 0


_EMPTY: Mapping[str, int] = {}


# ---- what is learned from it -----------------------------------------------------------------------------------

LEARN_PERIOD_S = 2.0  # throughput and window decisions are made at most this often per server


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
    # One sequence's speed, as of its latest answer: the answers' reference latencies (each client's mean latency
    # over every server, ServerBook) per attempt-second here: 1.0 for a server as fast as the pool's average for the
    # same requests, whatever mix it was given. Neither the traffic a server is given nor the shape of its requests
    # moves it (tokens per busy second, or per attempt-second, did), and it is renewed at each answer, not at the end
    # of a period (docs/architecture.md).
    sequence_speed: float | None = None
    speed_at: float | None = None  # when sequence_speed was last measured (an answer)
    sequence_rate: BusyRate = field(default_factory=lambda: BusyRate(tau_s=3 * LEARN_PERIOD_S))
    _latencies: list[float] = field(default_factory=list)
    _rate_limited: int = 0
    full: bool = False  # the window was full at some point this period
    period_start: float | None = None
    admissible: float = 0.0  # of the last scrape's queue (ours), what the engine could still start (windows.admissible)

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

    def on_scrape(self, waiting: float, inflight: int, tail: bool = False, admissible: float = 0.0,
                  measured: bool = False) -> WindowDecision | None:
        """A new scrape of the engine that shows a queue (`inflight`: this dispatcher's attempts there when it was
        taken; `tail`, `admissible` and `measured`: WindowController.on_scrape's, `admissible` kept for the next
        period's decision)."""
        self.admissible = admissible
        if not self.adaptive:
            return None
        decision = self.controller.on_scrape(waiting, inflight, tail=tail, admissible=admissible, measured=measured)
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
            admissible=self.admissible,
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
