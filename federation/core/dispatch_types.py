"""The dispatcher's public value types: how it is configured, and the figures it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedpool.federation.gateway.transport import StreamBody, Timeouts
from fedpool.federation.core.types import Attempt
from fedpool.registry import ServerEntry

CLIENT_ORDERS = ("fair", "shortest_first", "longest_answers_first")


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    max_attempts: int = 8
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    no_server_timeout_s: float = 60.0
    window_factor: float = 1.0  # admission window ceiling = engine capacity × this
    adaptive_windows: bool = True  # grow/shrink each server's window from what the dispatcher observes
    learn_throughput: bool = True  # weigh servers by observed tokens/s once known (prior: accelerator)
    # A server whose KV cache (ServerRecord.kv_cache_tokens) this dispatcher's attempts are expected to fill takes
    # no more until some end: long prompts (video) do not pile up in the engine's queue behind a window sized on
    # short ones. Off by default: on Table 7's pool it held the V100s below what their engines ran (federated
    # 40.2-46.5 s over six runs, median 41.7, against 38.7-41.7, median 39.4, without; docs/architecture.md).
    kv_admission: bool = False
    # A scrape that shows most of this dispatcher's attempts on a server queued in its engine shrinks that
    # server's window at once (learning.SCRAPE_QUEUE_SHARE), and with this on, the attempts beyond the new window
    # started less than a second ago are taken back to their queues (on engines that drop a request whose client
    # has gone): a plan or window that sent a server far more than it runs is undone at the next scrape instead of
    # draining for seconds while other servers idle.
    give_back_queued: bool = True
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    hedging: bool = True  # duplicate stragglers at the tail; only greedy requests (temperature 0)
    hedge_factor: float = 2.0  # hedge once an attempt takes this × the model's median latency
    hedge_min_delay_s: float = 0.2
    learn_period_s: float = 2.0  # how often each server's throughput and admission window are re-decided
    # Which waiting request is served first when the pool is full. "fair": the client with the fewest
    # requests in flight per unit of weight (every eval progresses at the same pace). "shortest_first": the
    # client with the least work left (as it reports with set_client_remaining), fair among equals: evals
    # finish one after another, so results arrive sooner on average while the pool stays as busy.
    client_order: str = "fair"


@dataclass(frozen=True, slots=True)
class ServerStats:
    server_id: str
    answered: int
    failures: dict[str, int]
    inflight: int
    window: int
    completion_tokens: int
    busy_s: float
    learned_tokens_per_s: float | None = None
    window_reason: str | None = None


@dataclass(frozen=True, slots=True)
class DispatcherStats:
    submitted: int
    completed: int
    failed: int
    retries: int
    hedges: int
    inflight_total: int
    servers: tuple[ServerStats, ...]
    waiting: int = 0  # requests waiting for a slot
    decisions: int = 0  # slots granted (each a routing decision)
    decision_s: float = 0.0  # CPU time spent granting them (queue order, policy, slot accounting)
    loop_stalled_s: float = 0.0  # seconds this process's loop stood still with attempts in flight (not charged)
    preempted: int = 0  # attempts that gave their slot back to a shrunk lease or window (federation/core/preempt.py)
    preempted_lost_s: float = 0.0  # the engine time those attempts had used


@dataclass(frozen=True, slots=True)
class Slot:
    """A place held in a server's admission window for one attempt of a client's request."""

    server: ServerEntry
    client_id: str
    acquired_at: float


@dataclass(frozen=True, slots=True)
class OpenStream:
    """An upstream response being streamed; read `response.content`."""

    server: ServerEntry
    response: StreamBody
    attempts: tuple[Attempt, ...]
