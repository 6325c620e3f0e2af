"""When a failed attempt is tried again: at once (the request never reached the server), after a backoff
(elsewhere if possible), or not at all. Pure bookkeeping, no I/O."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from fedpool.federation.core.errors import AttemptError, FailureKind, RequestFailed
from fedpool.federation.core.types import Attempt

MAX_RESET_RETRIES = 3  # immediate retries for stale keep-alive connections, per request


@dataclass(slots=True)
class RetryState:
    """One request's tries so far."""

    attempts: list[Attempt] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)  # servers that failed it (avoided while others can serve)
    counted: int = 0  # failures that count towards max_attempts
    resets: int = 0  # stale connections retried at once

    def record(self, server_id: str, started: float, now: float, err: AttemptError) -> None:
        self.attempts.append(Attempt(server_id, started, now - started, err.kind, err.detail))

    def retry_at_once(self, request_id: str, server_id: str, err: AttemptError, max_attempts: int) -> bool:
        """After a recorded failure: True to retry at once, False to retry after a backoff. Raises
        RequestFailed when the request must not be tried again (refused, or out of attempts)."""
        if not err.kind.retriable:
            raise RequestFailed(
                f"request {request_id} refused by {server_id}: {err}", tuple(self.attempts), err.kind, err, server_id
            ) from err
        if err.kind is FailureKind.RESET and self.resets < MAX_RESET_RETRIES:
            self.resets += 1
            return True  # the request never reached the server
        self.counted += 1
        self.tried.add(server_id)
        if self.counted >= max_attempts:
            raise RequestFailed(
                f"request {request_id} failed {self.counted} times; last: {err}", tuple(self.attempts), err.kind,
                err, server_id,
            ) from err
        return False


def backoff_s(failures: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter."""
    return rng.uniform(0, min(max_s, base_s * 2 ** (failures - 1)))
