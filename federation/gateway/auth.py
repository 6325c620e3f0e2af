"""Bearer tokens on HTTP requests (the gateway's API keys, the jobs API's token): parsed without trusting the
header's bytes, compared in constant time, never logged."""

from __future__ import annotations

import hmac

from aiohttp import web


def bearer(request: web.Request) -> bytes | None:
    """The presented token as bytes, or None when there is no `Authorization: Bearer TOKEN`. A header that is
    not valid UTF-8 (aiohttp keeps its bytes as surrogates) is compared as those bytes: it simply matches
    nothing, it never raises."""
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return None
    return presented.strip().encode("utf-8", "surrogateescape")


def matches(presented: bytes | None, expected: bytes) -> bool:
    return presented is not None and hmac.compare_digest(presented, expected)
