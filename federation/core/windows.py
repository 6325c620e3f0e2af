"""How much one dispatcher may put on a server: the adaptive admission window's rule (grow while throughput rises
and the engine's queue stays empty; shrink on queueing, latency inflation or 429) and the KV-cache budget of KV
admission. Pure: no I/O, no clock of its own."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedpool.federation.core.serverbook import ServerState
    from fedpool.registry import LoadSample

# Between answers, a scrape shrinks a window only when at least this share of this dispatcher's attempts on the
# engine wait in its queue (three waiting for every one running: the last wait three batches); a smaller queue keeps
# a KV-bound engine's batch full (docs/architecture.md).
SCRAPE_QUEUE_SHARE = 0.75
TAIL_QUEUE = 2  # at a tail (`Dispatcher._at_tail`), the engine queue that shrinks a window
# The engine's own queue as a safety net (`guard_queue`): a server whose newest scrape shows requests waiting beyond
# what this dispatcher knows is full for new grants until QUEUE_CLEAR_SCRAPES scrapes in a row show its queue empty.
QUEUE_TRIP = 1.0
QUEUE_CLEAR_SCRAPES = 2
# An engine whose KV cache is under this full and whose batch has a free slot is still admitting its queue
# (`admissible`: as many of it as the cache's room below this takes)
KV_ROOM = 0.9


@dataclass(frozen=True, slots=True)
class WindowObservation:
    """One period at one server, as the dispatcher and the registry saw it."""

    throughput: float  # tokens/s this period
    per_token_latency_s: float | None  # median request latency / output tokens this period
    scraped_waiting: float  # the engine's own queue (all clients), from the registry
    rate_limited: int  # HTTP 429s this period
    window_was_full: bool  # this dispatcher used the whole window at some point
    inflight: int | None = None  # what this dispatcher had on the server when its engine was last scraped
    admissible: float = 0.0  # of that scrape's queue (ours), the prompts the engine can still start (`admissible`)


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
    # A short engine queue keeps the batch full; only a queue longer than this fraction of the capacity (and at
    # least 2) is excess that would lengthen the tail. Of the capacity, not the window (which would ratchet down).
    queue_tolerance: float = 0.05
    growth: float = 1.25  # a full window over an engine with no excess queue grows by this factor (≥ +1)
    # Shrink when this period's median per-token latency exceeds this × the median of the last `baseline_periods`
    # periods (a queue building inside the engine). Off by default (None): mix shifts read as inflation; the
    # engine-queue rule catches the queueing engines report (docs/architecture.md).
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
        elif (overflow := obs.scraped_waiting - obs.admissible) >= self.queue_allowance:
            if obs.inflight is not None:
                # What the engine was running for us when the scrape was taken (`inflight`: ours there then; the
                # queue counted at most what we had there) and what it can still start, plus a short queue: one step
                # to the right size, not a shrink per period while a queue we built earlier drains.
                target = obs.inflight - min(overflow, obs.inflight) + self.queue_allowance
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

    def on_scrape(self, waiting: float, inflight: int, *, tail: bool = False, admissible: float = 0.0,
                  measured: bool = False) -> WindowDecision | None:
        """The engine's queue as a scrape shows it, between answers (`waiting`: this dispatcher's attempts queued
        there, of `inflight` it had there then): the engine-queue rule of `decide`, shrinking only, at the probe
        rate: at the answers' rate alone a deep queue goes unseen for as long as no answer comes
        (docs/architecture.md). At a `tail` (every client in flight has sent its last, nothing waits, another server
        has room: `Dispatcher._at_tail`) a queue of TAIL_QUEUE shrinks it to what runs and one more: nothing else
        would keep the batch full there, and the queued attempts can start elsewhere now. Elsewhere only the queue
        beyond what the engine can still start (`admissible`) counts, and, unless that was `measured` against the
        engine's free cache, only a queue of most of our attempts there (`SCRAPE_QUEUE_SHARE`): a shorter one keeps a
        KV-bound engine's batch full."""
        overflow = waiting - admissible
        if tail and waiting >= TAIL_QUEUE:
            target = max(1.0, inflight - waiting + 1)
        elif overflow < max(self.queue_allowance, 0.0 if measured else SCRAPE_QUEUE_SHARE * inflight):
            return None
        else:
            target = max(1.0, inflight - overflow + self.queue_allowance)
        if target >= self.window:
            return None
        self.window = target
        return WindowDecision(target, f"engine queue {waiting:g} (scrape{', tail' if tail else ''})")


def admissible(load: LoadSample, capacity: int, queued: float, kv_cache_tokens: int | None = None,
               kv_each: float | None = None) -> tuple[float, bool]:
    """Of `queued` (this dispatcher's part of the engine's queue in the scrape `load`), how many are prompts waiting
    for their prefill step, which the engine can still start as it is, not overflow; and whether that was measured
    against its free cache. vLLM and SGLang admit a burst of prompts a step's token budget at a time: 256 sent at
    once to an idle emulated A100 showed 11 running and 245 waiting, its cache 0.2% full, and the engine-queue rules
    shrank the window to 24 and took 232 back — the engine then ran 20-70 where it could run 256, for the ~5 s its
    window took to grow back (Table 7 pool, the batch bench: 1.12-1.17x the ideal; 1.08-1.09x with such queues left
    alone). Nothing while the cache is KV_ROOM full or the batch has no free slot, or where the engine does not say how
    full its cache is (llama.cpp's builds of today). Where the cache's size (`kv_cache_tokens`, the record's) and
    what one of ours holds (`kv_each`) are known, as many of the queue as the cache's room below KV_ROOM takes, our
    part in proportion; else all of it (counted whole, a queue of long prompts the cache had room for few of was
    kept: a V100 held 117 long-context prompts queued beside 48 running for 4 s while its twin stood idle)."""
    usage = load.kv_cache_usage
    if usage is None or load.waiting <= 0 or queued <= 0:
        return 0.0, False
    measured = bool(kv_cache_tokens and kv_each and kv_each > 0)
    if usage >= KV_ROOM or load.running >= capacity:
        return 0.0, measured
    if not measured:
        return queued, False
    assert kv_cache_tokens is not None and kv_each is not None
    room = (KV_ROOM - usage) * kv_cache_tokens / kv_each
    return min(queued, room * queued / load.waiting), True


def mean_kv(clients: Mapping[str, int], kv_tokens: Callable[[str], float] | None) -> float | None:
    """The KV cache one of these attempts (client -> attempts) is expected to hold (`ClientBook.kv_tokens`)."""
    count = sum(clients.values())
    if kv_tokens is None or count <= 0:
        return None
    return sum(n * kv_tokens(c) for c, n in clients.items()) / count


def guard_queue(state: ServerState, load: LoadSample) -> None:
    """The engine's own queue (a new scrape, `load`): requests waiting there beyond its capacity mean someone else
    filled it; the server takes no new grants (`queue_full`) until it shows empty again."""
    beyond = load.running + load.waiting - state.capacity
    if load.waiting >= QUEUE_TRIP and beyond >= QUEUE_TRIP:
        state.queue_full, state.queue_clear = True, 0
    elif state.queue_full and load.waiting <= 0:
        state.queue_clear += 1
        state.queue_full = state.queue_clear < QUEUE_CLEAR_SCRAPES


def our_queue(waiting: float, running: float, ours: float) -> float:
    """Of an engine's queue (`waiting`, beside `running`), the part that is one dispatcher's with `ours` attempts
    there: in proportion to its share of all the engine holds (all of it where it is the engine's only client). The
    engine serves its queue in arrival order, so its attempts are as likely to wait as any other's; counted whole,
    one process's queue of long prompts shrank the window of another beside it to 2, its leased slots idle."""
    held = running + waiting
    return waiting * min(1.0, ours / held) if held > 0 else 0.0


def our_scraped_queue(state: ServerState) -> float:
    """`our_queue` of the server's last scrape, against what this dispatcher had there when it was taken."""
    return our_queue(state.scraped_waiting, state.scraped_running, state.scrape_inflight)


def kv_share_back(state: ServerState, client_id: str) -> bool:
    """Give back one of the client's attempts' share of the KV it holds on `state` (its mean there: the estimate may
    have moved since the attempt took it, and the client's share drops to exactly 0 with its last one); True when
    that made room under the budget."""
    held = state.kv_by_client.get(client_id)
    count = state.by_client.get(client_id, 0)
    if held is None or count <= 0:
        return False
    share = held / count
    if count == 1:
        del state.kv_by_client[client_id]
    else:
        state.kv_by_client[client_id] = held - share
    budget = state.kv_budget
    was_full = budget is not None and state.kv_inflight >= budget
    state.kv_inflight = max(0.0, state.kv_inflight - share) if state.kv_by_client else 0.0
    return was_full and budget is not None and state.kv_inflight < budget


def kv_budget(kv_cache_tokens: int | None, lease: int | None, capacity: int, *, admits_by_kv: bool) -> float | None:
    """The KV cache this dispatcher may fill on a server (None: no limit): the engine's cache (its record's,
    discovered at registration), under a lease the same fraction of it as of the slots."""
    if kv_cache_tokens is None or not admits_by_kv:
        return None
    budget = float(kv_cache_tokens)
    if lease is not None:
        budget *= min(1.0, lease / max(1, capacity))
    return budget
