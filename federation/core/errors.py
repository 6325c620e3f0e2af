"""Typed failures (classified by exception type and status code, never by message text) and when a failed
attempt is tried again: at once (the request never reached the server), after a backoff (elsewhere if possible),
or not at all. Pure bookkeeping, no I/O."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum

from fedpool.federation.core.types import Attempt


class FailureKind(StrEnum):
    """How an attempt failed. A connection the server closed before a whole answer is one of three: CONNECT on a
    fresh connection (nothing of an answer came: the server is gone), RESET on a kept one closed at once (the
    server had closed it while idle, before the request reached it), DROPPED where the server took the request:
    a kept connection closed later than a round trip after the write, or any connection closed mid-answer."""

    CONNECT = "connect"  # nothing listening, refused, DNS; a fresh connection closed before any byte of an answer
    RESET = "reset"  # a kept connection the server had closed while idle: retried at once, not the server's fault
    DROPPED = "dropped"  # the server took the request and closed without a whole answer: counted, retried elsewhere
    TIMEOUT = "timeout"  # connect, first byte or total deadline passed
    STALLED = "stalled"  # no first byte within the first-byte timeout, and a copy elsewhere answered first
    RATE_LIMITED = "rate_limited"  # HTTP 429
    SERVER_ERROR = "server_error"  # HTTP 5xx (and 404/other 4xx that mean "not here")
    BAD_RESPONSE = "bad_response"  # 200 with a body that is not a valid completion
    REQUEST_ERROR = "request_error"  # HTTP 400/413/422: the request itself is wrong; retrying cannot help
    NO_SERVER = "no_server"  # no routable server serves the model (and revision) in time
    UNEXPECTED = "unexpected"  # an exception fedpool has no class for: a bug on this side, not the server's

    @property
    def retriable(self) -> bool:
        """Whether another attempt may succeed (at once after a RESET, after a backoff otherwise: RetryState)."""
        return self not in (FailureKind.REQUEST_ERROR, FailureKind.UNEXPECTED, FailureKind.NO_SERVER)

    @property
    def counts_against_server(self) -> bool:
        """Whether it says something about the server (breakers, the registry's passive failure reports)."""
        return self not in (FailureKind.RESET, FailureKind.REQUEST_ERROR, FailureKind.UNEXPECTED,
                            FailureKind.NO_SERVER)


class AttemptError(Exception):
    """One attempt at one server failed; `kind` says how."""

    def __init__(self, kind: FailureKind, detail: str, *, status: int | None = None,
                 upstream_message: str | None = None):
        self.kind = kind
        self.detail = detail
        self.status = status
        self.upstream_message = upstream_message  # the engine's own error text (HTTP errors), for the caller
        super().__init__(f"{kind.value}: {detail}" + (f" ({upstream_message})" if upstream_message else ""))


class NoServerError(Exception):
    """No registered server serves the requested model (and revision) in time."""


class RequestFailed(Exception):
    """Every attempt failed; carries the attempts so the record can say what happened."""

    def __init__(self, message: str, attempts: tuple[Attempt, ...], last_kind: FailureKind | None,
                 last_error: AttemptError | None = None, server_id: str | None = None):
        self.attempts = attempts
        self.last_kind = last_kind
        self.last_error = last_error  # the last attempt's failure (its status and engine message)
        self.server_id = server_id  # the server that refused or failed it last
        super().__init__(message)


def kind_for_status(status: int) -> FailureKind:
    if status == 429:
        return FailureKind.RATE_LIMITED
    if status in (400, 413, 422):
        return FailureKind.REQUEST_ERROR
    return FailureKind.SERVER_ERROR

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
