"""Per-server circuit breaker: open after consecutive failures, one half-open trial after a cool-down."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    failure_threshold: int = 5
    cooldown_s: float = 5.0
    consecutive_failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if now - self.opened_at >= self.cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self, now: float) -> bool:
        state = self.state(now)
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self.trial_in_flight)

    def on_dispatch(self, now: float) -> None:
        if self.state(now) is BreakerState.HALF_OPEN:
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None
        self.trial_in_flight = False

    def on_failure(self, now: float) -> None:
        self.consecutive_failures += 1
        self.trial_in_flight = False
        if self.opened_at is not None or self.consecutive_failures >= self.failure_threshold:
            self.opened_at = now  # a failed half-open trial re-opens for another cool-down
