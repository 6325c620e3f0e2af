"""The registry over its HTTP API (registry/api.py): what a client process needs of it — snapshots, capacity
leases, failure reports — and what the operator commands need (register, get, drain, deregister, ping, holders), without
being a Ray driver. Meets `PoolRegistry`, and the operator commands' use of the Ray client, as the Ray client does.

Where a client finds the API: the URL it is given (`--registry-url`, FEDPOOL_REGISTRY_URL), else the one the
registry wrote beside its token (STATE_DIR/registry.url). A URL found in the state dir is read again after a
failed call, so a registry that Ray restarted on a new port is found again; leases ride out the gap as they do
when the registry is away (federation/gateway/leases.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, cast

import aiohttp
import orjson

from fedpool.registry.api import ENTRY, lease_from_json, read_api_file, registry_error_of
from fedpool.registry.errors import AuthError, RegistryError
from fedpool.registry.holders import PoolHolders
from fedpool.registry.leases import DemandReport, Lease
from fedpool.registry.records import ServerRecord
from fedpool.registry.snapshot import PoolSnapshot, ServerEntry, WireRow
from fedpool.registry.weights import prior_weight

log = logging.getLogger("fedpool.registry")

URL_ENV = "FEDPOOL_REGISTRY_URL"
CALL_MARGIN_S = 10.0  # a call may take its long poll plus this before it is given up
PING_TIMEOUT_S = 2.0
REGISTER_WAIT_S = 120.0  # a registration waits for the registry's checks of the server (each up to its timeout)


class RegistryUnreachable(RegistryError):
    """The registry's API did not answer (connection refused, timed out, not a fedpool registry)."""


def ping_blocking(url: str, token: str | None, timeout_s: float = PING_TIMEOUT_S) -> dict[str, Any]:
    """The API's /v1/ping, for code with no event loop yet (the CLI choosing how to reach the registry).
    RegistryUnreachable when nothing that is a fedpool registry answers there."""
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/ping",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            info = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RegistryUnreachable(f"no fedpool registry answers at {url} ({exc})") from None
    if not isinstance(info, dict) or "fedpool_registry" not in info:
        raise RegistryUnreachable(f"{url} answers, but not as a fedpool registry")
    return info


class RegistryHttpClient:
    """Async access to the registry's HTTP API with the registry's token (every call but ping needs it).

    One aiohttp session per event loop (a CLI command may run more than one loop): `aclose()` closes the
    current one; the client stays usable and opens another on its next call."""

    def __init__(self, url: str, token: str, *, url_file_dir: Path | None = None):
        if not url.startswith(("http://", "https://")):
            raise RegistryError(f"registry URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self._token = token
        self._url_file_dir = url_file_dir  # where to look again for the URL after a failed call
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._members: tuple[int, dict[str, ServerRecord]] | None = None
        self._last: PoolSnapshot | None = None

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self._token}"},
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
            self._loop = loop
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        self._loop = None

    async def _call(self, method: str, path: str, *, wait_s: float = 0.0, params: dict[str, str] | None = None,
                    body: Any = None) -> Any:
        """One call; a URL from the state dir is looked up again and the call tried once more when it fails to
        connect (a registry restarted on another port)."""
        for attempt in (1, 2):
            try:
                return await self._once(method, path, wait_s, params, body)
            except RegistryUnreachable:
                if attempt == 2 or not await asyncio.to_thread(self._reread_url):
                    raise
        raise AssertionError("unreachable")

    async def _once(self, method: str, path: str, wait_s: float, params: dict[str, str] | None, body: Any) -> Any:
        timeout = aiohttp.ClientTimeout(total=wait_s + CALL_MARGIN_S)
        data = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else None
        try:
            async with self._client().request(method, self.url + path, params=params, data=data, headers=headers,
                                              timeout=timeout) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RegistryUnreachable(f"the registry API at {self.url} did not answer {path} "
                                      f"({type(exc).__name__}: {exc})") from None
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise RegistryUnreachable(f"{self.url}{path} answered {status} with a body that is not JSON") from None
        typed = registry_error_of(answer) if status in (400, 404) else None
        if typed is not None:
            raise typed
        if status == 401:
            raise AuthError(f"the registry API at {self.url} refused this process's token: {answer.get('error')}")
        if status == 409:  # the registry refused the operation: its own words, as through Ray
            raise RegistryError(str(answer.get("error")))
        if status != 200:
            raise RegistryError(f"the registry API at {self.url}{path} answered {status}: {answer.get('error')}")
        return answer

    def _reread_url(self) -> bool:
        """Whether the state dir names another URL now (then it is used from here on)."""
        if self._url_file_dir is None:
            return False
        fresh = read_api_file(self._url_file_dir)
        if fresh is None or fresh.rstrip("/") == self.url:
            return False
        log.warning("the registry API moved to %s (was %s)", fresh, self.url)
        self.url = fresh.rstrip("/")
        return True

    async def ping(self) -> dict[str, Any]:
        """The registry's state as the Ray client's `ping` gives it (`fedpool registry status`)."""
        info: dict[str, Any] = await self._call("GET", "/v1/status")
        return info

    def _server_path(self, server_id: str, action: str = "") -> str:
        return f"/v1/servers/{urllib.parse.quote(server_id, safe='')}{action}"

    async def get(self, server_id: str) -> ServerEntry:
        return ENTRY.validate_python(await self._call("GET", self._server_path(server_id)))

    async def register(self, record: ServerRecord, *, lease_ttl_s: float | None = None, replace: bool = False,
                       verify: bool = True) -> ServerEntry:
        body = {"record": record.model_dump(mode="json"), "lease_ttl_s": lease_ttl_s, "replace": replace,
                "verify": verify}
        return ENTRY.validate_python(await self._call("POST", "/v1/servers", wait_s=REGISTER_WAIT_S, body=body))

    async def drain(self, server_id: str) -> ServerEntry:
        return ENTRY.validate_python(await self._call("POST", self._server_path(server_id, "/drain"), body={}))

    async def deregister(self, server_id: str) -> ServerRecord:
        return ServerRecord.model_validate(await self._call("DELETE", self._server_path(server_id)))

    async def snapshot(self, since_version: int = -1, timeout_s: float = 0.0) -> PoolSnapshot:
        """The pool now, or once it is newer than `since_version` (waiting up to `timeout_s`); as the Ray client's,
        a snapshot of the version already held comes back as the held object, and records travel only when the
        membership changed."""
        held = self._last
        params = {"since": str(since_version), "timeout": repr(float(timeout_s)),
                  "membership": str(self._members[0] if self._members is not None else -1),
                  "have": str(held.version if held is not None else -1)}
        wire = await self._call("GET", "/v1/snapshot", wait_s=timeout_s, params=params)
        version = int(wire["version"])
        if wire["rows"] is None:
            if held is None or held.version != version:
                raise RegistryError(f"the registry API answered version {version} without rows it never sent")
            return held
        if wire["records"] is not None:
            self._members = (int(wire["membership"]),
                             {r.id: r for r in map(ServerRecord.model_validate, wire["records"])})
        if self._members is None:
            raise RegistryError("the registry API sent rows without the records they belong to")
        raw: list[list[Any]] = wire["rows"]

        def rows() -> tuple[WireRow, ...]:  # made into entries on first use, as the Ray client's pickles are
            return cast(tuple[WireRow, ...], tuple(map(tuple, raw)))

        self._last = PoolSnapshot.from_rows(version, float(wire["taken_at"]), rows, self._members[1], prior_weight,
                                            count=len(raw))
        return self._last

    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease:
        answer = await self._call("POST", "/v1/lease", wait_s=wait_s, body={
            "report": report.model_dump(mode="json"), "known_version": known_version, "wait_s": wait_s})
        return lease_from_json(answer)

    async def release_lease(self, holder: str) -> None:
        await self._call("POST", "/v1/lease/release", body={"holder": holder})

    async def report_failure(self, server_id: str, kind: str) -> bool:
        answer = await self._call("POST", "/v1/failure", body={"server_id": server_id, "kind": kind})
        return bool(answer["known"])

    async def holders(self, detail: bool = True) -> PoolHolders:
        """Who is on the pool, as the Ray client's `holders` says it (`GET /v1/holders`, `?detail=0`)."""
        return PoolHolders.model_validate(await self._call("GET", "/v1/holders" + ("" if detail else "?detail=0")))


def find_registry_api(*, url: str | None, token: str | None, state_dir: Path | None,
                      environ: dict[str, str] | None = None) -> RegistryHttpClient | None:
    """The registry's API for a client process, or None where the caller should use Ray: no URL given or found
    in the state dir, or no token to call it with. A URL given (argument or FEDPOOL_REGISTRY_URL) must answer
    and take this token (RegistryError otherwise); one found in the state dir is only a shortcut: when it does
    not answer (the registry is gone or was started elsewhere) or does not take the token (it came from elsewhere
    and belongs to another registry), None."""
    env = environ if environ is not None else dict(os.environ)
    given = url or env.get(URL_ENV)
    if given:
        if not token:
            raise AuthError(f"the registry API at {given} needs the registry's token (--token-file-path, "
                            "FEDPOOL_REGISTRY_TOKEN or the state dir's registry.token)")
        client = RegistryHttpClient(given, token)
        _check(ping_blocking(client.url, token), client.url)
        return client
    if state_dir is None or not token:
        return None
    found = read_api_file(state_dir)
    if found is None:
        return None
    try:
        info = ping_blocking(found, token)
    except RegistryUnreachable as exc:
        log.info("%s; reaching the registry through Ray", exc)
        return None
    if not info.get("token_ok"):
        # The token came from elsewhere (a flag, the environment) and is not this registry's: the state dir may
        # belong to another registry than the one meant. Through Ray, as without an API.
        log.info("the registry API at %s does not take this process's token; reaching the registry through Ray",
                 found)
        return None
    return RegistryHttpClient(found, token, url_file_dir=state_dir)


def _check(info: dict[str, Any], url: str) -> None:
    if not info.get("token_ok"):
        raise AuthError(f"the registry at {url} refused this process's token: use the token of its state dir "
                        f"({info.get('state_dir')}/registry.token)")
