"""An OpenAI-compatible endpoint in front of the pool, so third-party eval tools use it unchanged.

Requests go through the same dispatcher as fedpool's own clients: routed by policy, held to admission
windows, retried elsewhere on failure (streams: until the first byte), shared fairly between API keys.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import web
from fedpool.federation.dispatcher import Dispatcher
from fedpool.federation.errors import FailureKind, NoServerError, RequestFailed
from fedpool.federation.types import Endpoint, InferenceRequest
from fedpool.registry import PoolSnapshot
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("fedpool.gateway")

MAX_BODY_BYTES = 8 * 1024 * 1024
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One client of the gateway: its secret, its name (for fair share and metrics) and its weight."""

    secret: str
    client: str
    weight: float = 1.0


def parse_api_keys(text: str) -> list[ApiKey]:
    """`client:secret[:weight]` per line; blank lines and # comments skipped. Errors name the line."""
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if len(parts) not in (2, 3) or not parts[0] or len(parts[1]) < 8:
            raise ValueError(f"api key file line {number}: expected client:secret[:weight], secret ≥ 8 characters")
        try:
            weight = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise ValueError(f"api key file line {number}: weight {parts[2]!r} is not a number") from None
        if weight <= 0:
            raise ValueError(f"api key file line {number}: weight must be positive")
        keys.append(ApiKey(parts[1], parts[0], weight))
    return keys


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("fedpool_gateway_requests", "Requests answered by the gateway.",
                                ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("fedpool_gateway_request_seconds", "Gateway request latency.", ("endpoint",),
                                 buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.retries = Gauge("fedpool_gateway_dispatcher_retries", "Retries made by the dispatcher so far.",
                             registry=self.registry)
        self.hedges = Gauge("fedpool_gateway_dispatcher_hedges", "Straggler hedges launched so far.",
                            registry=self.registry)
        self.inflight = Gauge("fedpool_gateway_server_inflight", "Requests in flight per server.", ("server_id",),
                              registry=self.registry)
        self.window = Gauge("fedpool_gateway_server_window", "Admission window per server.", ("server_id",),
                            registry=self.registry)


class Gateway:
    """`web.Application` factory. Auth: when api keys are given every /v1 call needs `Authorization:
    Bearer SECRET` (compared in constant time); without keys it is open and clients are told apart by an
    optional `X-Client-Id` header."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        snapshot: Callable[[], PoolSnapshot | None],
        *,
        api_keys: list[ApiKey] | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ):
        self._dispatcher = dispatcher
        self._snapshot = snapshot
        self._keys = api_keys or []
        self._max_body = max_body_bytes
        self._metrics = _Metrics()
        for key in self._keys:
            dispatcher.set_client_weight(key.client, key.weight)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    # ---- handlers -----------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        stats = self._dispatcher.stats()
        self._metrics.retries.set(stats.retries)
        self._metrics.hedges.set(stats.hedges)
        for server in stats.servers:
            self._metrics.inflight.labels(server.server_id).set(server.inflight)
            self._metrics.window.labels(server.server_id).set(server.window)
        return web.Response(body=generate_latest(self._metrics.registry), content_type="text/plain", charset="utf-8")

    async def _models(self, request: web.Request) -> web.Response:
        client = self._authenticate(request)
        if isinstance(client, web.Response):
            return client
        snapshot = self._snapshot()
        models = sorted({e.record.model for e in snapshot.entries if e.status.routable}) if snapshot else []
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": "fedpool"} for m in models
        ]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.COMPLETIONS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.CHAT)

    async def _serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = time.perf_counter()
        response = await self._serve_inner(request, endpoint)
        self._metrics.requests.labels(endpoint.value, str(response.status)).inc()
        self._metrics.latency.labels(endpoint.value).observe(time.perf_counter() - started)
        return response

    async def _serve_inner(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        client = self._authenticate(request)
        if isinstance(client, web.Response):
            return client
        try:
            body = await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body larger than {self._max_body} bytes", "invalid_request_error")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return _error(400, "field 'model' (a string) is required", "invalid_request_error", param="model")
        needed = "prompt" if endpoint is Endpoint.COMPLETIONS else "messages"
        if needed not in body:
            return _error(400, f"field '{needed}' is required", "invalid_request_error", param=needed)
        try:
            req = InferenceRequest.from_body(
                body, request_id=f"gw-{uuid.uuid4().hex[:16]}", model=model, endpoint=endpoint, client_id=client,
                revision=request.headers.get("X-Model-Revision") or None,
            )
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        try:
            if body.get("stream"):
                return await self._relay_stream(request, req)
            result = await self._dispatcher.submit(req)
        except NoServerError as exc:
            return _error(503, str(exc), "service_unavailable", code="no_server")
        except RequestFailed as exc:
            if exc.last_kind is FailureKind.REQUEST_ERROR:
                return _error(400, str(exc), "invalid_request_error")
            return _error(502, str(exc), "upstream_error", code=exc.last_kind.value if exc.last_kind else None)
        payload = dict(result.completion.body or {})
        payload["model"] = model
        return web.json_response(payload, headers={"X-Fedpool-Server": result.server_id,
                                                   "X-Fedpool-Attempts": str(len(result.attempts))})

    async def _relay_stream(self, request: web.Request, req: InferenceRequest) -> web.StreamResponse:
        async with self._dispatcher.stream(req) as upstream:
            out = web.StreamResponse(headers={
                "Content-Type": upstream.response.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Fedpool-Server": upstream.server.id,
            })
            await out.prepare(request)
            async for chunk in upstream.response.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    def _authenticate(self, request: web.Request) -> str | web.Response:
        """The client name, or a 401 response. Never logs the presented secret."""
        if not self._keys:
            return request.headers.get("X-Client-Id", "anonymous")[:64]
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return _error(401, "missing bearer token (Authorization: Bearer KEY)", "authentication_error")
        match = None
        for key in self._keys:  # compare against every key, so timing does not reveal which one matched
            if hmac.compare_digest(key.secret.encode(), presented.encode()):
                match = key
        if match is None:
            return _error(401, "invalid API key", "authentication_error")
        return match.client


def _error(status: int, message: str, kind: str, *, param: str | None = None, code: str | None = None) -> web.Response:
    error: Mapping[str, object] = {"message": message, "type": kind, "param": param, "code": code}
    return web.json_response({"error": error}, status=status)
