"""Failure classification by exception type and status code, never by message text."""

from __future__ import annotations

import asyncio
from enum import StrEnum
from typing import TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    from fedpool.federation.core.types import Attempt


class FailureKind(StrEnum):
    CONNECT = "connect"  # nothing listening, refused, DNS
    RESET = "reset"  # a reused keep-alive connection closed by the server: retried at once, not its fault
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


def classify_exception(exc: BaseException, *, reused_connection: bool) -> FailureKind:
    """Map a transport exception to a FailureKind. Order matters: subclasses before their bases."""
    if isinstance(exc, AttemptError):
        return exc.kind
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return FailureKind.TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError):
        return FailureKind.CONNECT
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
        # llama.cpp's server closes idle keep-alive connections early; a request written to such a socket
        # fails before the server ever saw it. On a fresh connection the same error means the server died.
        return FailureKind.RESET if reused_connection else FailureKind.CONNECT
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ContentTypeError, ValueError)):
        return FailureKind.BAD_RESPONSE
    if isinstance(exc, aiohttp.ClientResponseError):
        return kind_for_status(exc.status)
    if isinstance(exc, aiohttp.ClientError):
        return FailureKind.CONNECT  # the remaining transport failures (invalid URL, TLS, proxy) are the link's
    return FailureKind.UNEXPECTED
