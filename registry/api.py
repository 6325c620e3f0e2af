"""The registry's HTTP API: what a process that is not a Ray driver needs of the registry (snapshots, capacity
leases, failure reports), and what the operator commands need (status, register, show, drain, remove).

An eval process that starts no CPU actors needs nothing of Ray but the registry, and joining Ray costs it CPU time
that the engines on the same cores want. The registry actor serves the same calls over HTTP on its own event loop,
so such a process, or an operator's command, reaches the registry with the aiohttp it already has.

Every call but `/v1/ping` needs the registry's token (`Authorization: Bearer`): unlike Ray's port, which only a
cluster's members reach, this port may be reachable from anywhere its host is. Bodies are JSON; snapshots are
encoded once per version (rows) and once per membership change (records), as for the Ray path.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from pydantic import TypeAdapter, ValidationError

from fedpool.registry.auth import token_digest
from fedpool.registry.demand import Served
from fedpool.registry.errors import AuthError, RegistrationError, RegistryError, UnknownServerError
from fedpool.registry.holders import PoolHolders
from fedpool.registry.leases import Lease
from fedpool.registry.records import ServerRecord
from fedpool.registry.snapshot import ServerEntry

log = logging.getLogger("fedpool.registry")

API_FILE = "registry.url"  # in the state dir, beside registry.token: where clients on this host find the API
MAX_WAIT_S = 30.0  # the longest long poll the API holds open
MAX_BODY = 16 * 1024 * 1024  # a demand report of a gateway with many client ids stays well under this
API_VERSION = 1


class ApiError(Exception):
    """An answer other than 200, with the reason in words."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


class ApiBackend(Protocol):
    """What the API serves (the registry actor)."""

    async def snapshot_json(self, since_version: int, timeout_s: float, known_membership: int,
                            have_version: int) -> bytes: ...

    async def lease(self, report: dict[str, Any], known_version: int = -1, wait_s: float = 0.0) -> Lease: ...

    async def release_lease(self, holder: str) -> None: ...

    async def report_failure(self, server_id: str, kind: str) -> bool: ...

    async def api_info(self) -> dict[str, Any]: ...

    async def holders(self, detail: bool = True) -> PoolHolders: ...

    async def ping(self) -> dict[str, Any]: ...

    async def get(self, server_id: str) -> ServerEntry: ...

    async def register(self, record: dict[str, Any], token: str | None, *, lease_ttl_s: float | None = None,
                       replace: bool = False, verify: bool = True) -> ServerEntry: ...

    async def drain(self, server_id: str, token: str | None) -> ServerEntry: ...

    async def deregister(self, server_id: str, token: str | None) -> ServerRecord: ...


def lease_json(lease: Lease) -> dict[str, Any]:
    return {"holder": lease.holder, "broker": lease.broker, "version": lease.version, "ttl_s": lease.ttl_s,
            "slots": dict(lease.slots), "safe": dict(lease.safe), "holders": lease.holders,
            "pool_served": list(lease.pool_served)}


def lease_from_json(data: dict[str, Any]) -> Lease:
    return Lease(holder=str(data["holder"]), broker=str(data["broker"]), version=int(data["version"]),
                 ttl_s=float(data["ttl_s"]), slots={str(k): int(v) for k, v in data["slots"].items()},
                 safe={str(k): int(v) for k, v in data["safe"].items()}, holders=int(data["holders"]),
                 pool_served=Served(*(float(x) for x in data.get("pool_served", ())[:3])))


ENTRY = TypeAdapter(ServerEntry)  # a server as the operator commands get it: the same entry as through Ray


def entry_json(entry: ServerEntry) -> Any:
    return ENTRY.dump_python(entry, mode="json")


def registry_error_json(exc: RegistryError) -> tuple[int, dict[str, Any]]:
    """A deliberate registry error as an answer the client raises again as the same error (registry_error_of)."""
    if isinstance(exc, UnknownServerError):
        return 404, {"error": str(exc), "unknown_server": exc.server_id, "removed": exc.removed}
    if isinstance(exc, RegistrationError):
        return 400, {"error": str(exc), "registration": {"server_id": exc.server_id, "reason": exc.reason,
                                                         "field": exc.field, "check": exc.check}}
    return (401 if isinstance(exc, AuthError) else 409), {"error": str(exc)}


def registry_error_of(answer: dict[str, Any]) -> RegistryError | None:
    """The registry error an answer carries (registry_error_json), or None where it carries none of them."""
    if "unknown_server" in answer:
        return UnknownServerError(str(answer["unknown_server"]), removed=answer.get("removed") is True)
    if isinstance(answer.get("registration"), dict):
        r = answer["registration"]
        return RegistrationError(str(r["server_id"]), str(r["reason"]), field=r.get("field"), check=r.get("check"))
    return None


def _number(request: web.Request, name: str, default: float, cast: Callable[[str], float] = float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ApiError(400, f"query parameter {name}={raw!r} is not a number") from None


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ApiError(400, f"body field {name!r} must be a {names}, not {type(value).__name__}")
    return value


def make_api(backend: ApiBackend, token_sha256: str) -> web.Application:
    """The API's routes over `backend`; callers authenticate with the token whose SHA-256 is `token_sha256`."""
    expected = token_sha256.encode()
    app = web.Application(middlewares=[_errors(expected)], client_max_size=MAX_BODY)
    _add_client_routes(app, backend, expected)
    _add_operator_routes(app, backend, _bearer, _answer, _body_of)
    return app


def _bearer(request: web.Request) -> str:
    """The token of the request's `Authorization: Bearer` header ("" without one)."""
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


def _token_ok(request: web.Request, expected: bytes) -> bool:
    """Whether the request carries the token whose SHA-256 is `expected`."""
    token = _bearer(request)
    return bool(token) and hmac.compare_digest(token_digest(token).encode(), expected)


async def _body_of(request: web.Request) -> dict[str, Any]:
    """The request's body, a JSON object (else an ApiError 400)."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _answer(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _errors(expected: bytes) -> Middleware:
    """The middleware that checks the token (every call but `/v1/ping`) and answers errors as JSON."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.path != "/v1/ping" and not _token_ok(request, expected):
                raise ApiError(401, "missing or wrong registry token (Authorization: Bearer TOKEN)")
            return await handler(request)
        except ApiError as exc:
            return _answer({"error": str(exc)}, exc.status)
        except ValidationError as exc:
            return _answer({"error": f"invalid body: {exc.errors(include_url=False)}"}, 400)
        except RegistryError as exc:  # unknown server, refused registration: the same error as through Ray
            status, body = registry_error_json(exc)
            return _answer(body, status)

    return errors


def _add_client_routes(app: web.Application, backend: ApiBackend, expected: bytes) -> None:
    """What a client process needs: ping (open to all: it says whether the token is right), snapshots, capacity
    leases and failure reports."""

    async def ping(request: web.Request) -> web.Response:
        return _answer({"fedpool_registry": API_VERSION, "token_ok": _token_ok(request, expected),
                        **await backend.api_info()})

    async def snapshot(request: web.Request) -> web.Response:
        body = await backend.snapshot_json(
            int(_number(request, "since", -1, int)), min(MAX_WAIT_S, max(0.0, _number(request, "timeout", 0.0))),
            int(_number(request, "membership", -1, int)), int(_number(request, "have", -1, int)))
        return web.Response(body=body, content_type="application/json")

    async def lease(request: web.Request) -> web.Response:
        body = await _body_of(request)
        known = _field(body, "known_version", int) if "known_version" in body else -1
        wait_s = min(MAX_WAIT_S, max(0.0, float(_field(body, "wait_s", (int, float))) if "wait_s" in body else 0.0))
        return _answer(lease_json(await backend.lease(_field(body, "report", dict), known, wait_s)))

    async def release(request: web.Request) -> web.Response:
        await backend.release_lease(_field(await _body_of(request), "holder", str))
        return _answer({"released": True})

    async def failure(request: web.Request) -> web.Response:
        body = await _body_of(request)
        return _answer({"known": await backend.report_failure(_field(body, "server_id", str),
                                                              _field(body, "kind", str))})

    app.router.add_get("/v1/ping", ping)
    app.router.add_get("/v1/snapshot", snapshot)
    app.router.add_post("/v1/lease", lease)
    app.router.add_post("/v1/lease/release", release)
    app.router.add_post("/v1/failure", failure)


def _add_operator_routes(app: web.Application, backend: ApiBackend, bearer: Callable[[web.Request], str],
                         answer: Callable[[Any], web.Response],
                         body_of: Callable[[web.Request], Awaitable[dict[str, Any]]]) -> None:
    """What the operator commands need (`fedpool registry status`, `server add | show | drain | remove`, `pool
    status`): the token was checked by the middleware, and the mutations pass it on to the registry, which checks it
    again. Who is on the pool (`/v1/holders`) is for the token's holders, the operators: client names included."""

    async def status(request: web.Request) -> web.Response:
        return answer(await backend.ping())

    async def holders(request: web.Request) -> web.Response:
        detail = request.query.get("detail", "1") not in ("0", "false")
        return answer((await backend.holders(detail)).model_dump(mode="json"))

    async def get(request: web.Request) -> web.Response:
        return answer(entry_json(await backend.get(request.match_info["server_id"])))

    async def register(request: web.Request) -> web.Response:
        body = await body_of(request)
        ttl = _field(body, "lease_ttl_s", (int, float)) if body.get("lease_ttl_s") is not None else None
        entry = await backend.register(_field(body, "record", dict), bearer(request), lease_ttl_s=ttl,
                                       replace=body.get("replace") is True, verify=body.get("verify") is not False)
        return answer(entry_json(entry))

    async def drain(request: web.Request) -> web.Response:
        return answer(entry_json(await backend.drain(request.match_info["server_id"], bearer(request))))

    async def deregister(request: web.Request) -> web.Response:
        record = await backend.deregister(request.match_info["server_id"], bearer(request))
        return answer(record.model_dump(mode="json"))

    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/holders", holders)
    app.router.add_post("/v1/servers", register)
    app.router.add_get("/v1/servers/{server_id}", get)
    app.router.add_post("/v1/servers/{server_id}/drain", drain)
    app.router.add_delete("/v1/servers/{server_id}", deregister)


async def serve_api(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Start `app` on host:port (0: a free port); returns the runner and the URL it answers on."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        import socket

        shown = socket.gethostname()
    return runner, f"http://{shown}:{bound}"


async def write_api_file(state_dir: Path, url: str, incarnation: str) -> None:
    """Say where the API answers, beside the token (written whole: a reader never sees half of it)."""

    def write() -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = state_dir / f".{API_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps({"url": url, "incarnation": incarnation}) + "\n", encoding="utf-8")
        os.replace(tmp, state_dir / API_FILE)

    await asyncio.to_thread(write)


def read_api_file(state_dir: Path) -> str | None:
    """The URL the registry of `state_dir` last said it answers on, or None."""
    try:
        data = json.loads((state_dir / API_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    url = data.get("url") if isinstance(data, dict) else None
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else None
