"""Bearer tokens on HTTP requests (the gateway's API keys, the jobs API's token): parsed without trusting the
header's bytes, compared in constant time, never logged. The gateway's key file (`parse_api_keys`), and who may see
who is on the pool (`visible_holders`): with keys, a key's holder; client names, an operator's key's only."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from fedpool.registry import PoolHolders

MIN_SECRET_CHARS = 16
OPERATOR = "operator"  # a key file line's last field that makes its key an operator's


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


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One client of the gateway: its secret, its name (for fair share and metrics) and its weight; an operator's
    key (`operator`) may also see who the pool's clients are (the holders view, `visible_holders`)."""

    secret: str
    client: str
    weight: float = 1.0
    operator: bool = False


def parse_api_keys(text: str) -> list[ApiKey]:
    """`client:secret[:weight][:operator]` per line; blank lines and # comments skipped. Errors name the line."""
    keys: list[ApiKey] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        operator = len(parts) > 2 and parts[-1] == OPERATOR
        if operator:
            parts.pop()
        if len(parts) not in (2, 3) or not parts[0] or len(parts[1]) < MIN_SECRET_CHARS:
            raise ValueError(f"api key file line {number}: expected client:secret[:weight][:{OPERATOR}], secret ≥ "
                             f"{MIN_SECRET_CHARS} characters")
        if parts[1] in seen:  # one secret, two clients: whoever holds it could be either
            raise ValueError(f"api key file line {number}: the same secret as line {seen[parts[1]]}; every client "
                             "needs its own")
        seen[parts[1]] = number
        try:
            weight = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise ValueError(f"api key file line {number}: weight {parts[2]!r} is not a number") from None
        if weight <= 0:
            raise ValueError(f"api key file line {number}: weight must be positive")
        keys.append(ApiKey(parts[1], parts[0], weight, operator))
    return keys


def key_of(keys: Sequence[ApiKey], presented: bytes | None) -> ApiKey | None:
    """The key `presented` is, or None (compared with every key, so timing does not say which matched)."""
    found = None
    for key in keys:
        if matches(presented, key.secret.encode()):
            found = key
    return found


def visible_holders(view: PoolHolders, keys: Sequence[ApiKey], presented: bytes | None,
                    secret: bytes) -> PoolHolders | None:
    """Who is on the pool as the caller presenting `presented` may see it: without keys (a gateway open on
    loopback only) all of it; with keys, for a key's holder only (None: refused), and the clients' and processes'
    names for an operator's key only — others see aliases keyed with `secret` (`PoolHolders.redacted`)."""
    if not keys:
        return view
    key = key_of(keys, presented)
    if key is None:
        return None
    return view if key.operator else view.redacted(secret)
