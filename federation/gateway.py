"""An OpenAI-compatible endpoint in front of the pool, so third-party eval tools use it unchanged.

Requests go through the same dispatcher as fedpool's own clients: routed by policy, held to admission
windows, retried elsewhere on failure, shared between clients in the dispatcher's serving order. Streams
that lose their server mid-way are continued on another replica (`federation/streams.py`). Errors follow
OpenAI's shape on every route: `{"error": {"message", "type", "param", "code"}}`.

Who is a client (for fair share and the serving order): with an API key file, the key's client name; else a
bearer token the caller presents (each lm-eval process with its own OPENAI_API_KEY is its own client; the
token itself is never kept, only a short digest); else the `X-Fedpool-Client` header; else the caller's
address. Without keys the gateway binds to loopback only (the CLI refuses otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fedpool.federation.dispatcher import Dispatcher
from fedpool.federation.errors import FailureKind, NoServerError, RequestFailed
from fedpool.federation.httpauth import bearer, matches
from fedpool.federation.streams import StreamRelay
from fedpool.federation.types import Endpoint, InferenceRequest
from fedpool.registry import PoolSnapshot

log = logging.getLogger("fedpool.gateway")

MAX_BODY_BYTES = 8 * 1024 * 1024
MIN_SECRET_CHARS = 16
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RETRY_AFTER_S = 5  # what a 503 tells a client to wait while the model's servers are all unroutable
CLIENT_HEADER = "X-Fedpool-Client"
CLIENT_NAME = re.compile(r"[^A-Za-z0-9._:@-]")
LAG_PROBE_S = 0.01  # how often the loop-lag guard looks
LAG_LIMIT_S = 0.1  # event-loop lag (smoothed) above which new requests are refused at once
LAG_SMOOTHING = 0.1  # weight of one probe in the smoothed lag: one GC pause or slow callback does not trip it


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One client of the gateway: its secret, its name (for fair share and metrics) and its weight."""

    secret: str
    client: str
    weight: float = 1.0


def parse_api_keys(text: str) -> list[ApiKey]:
    """`client:secret[:weight]` per line; blank lines and # comments skipped. Errors name the line."""
    keys: list[ApiKey] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if len(parts) not in (2, 3) or not parts[0] or len(parts[1]) < MIN_SECRET_CHARS:
            raise ValueError(f"api key file line {number}: expected client:secret[:weight], secret ≥ "
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
        keys.append(ApiKey(parts[1], parts[0], weight))
    return keys


class AppTask:
    """One background coroutine (`_run`) for an aiohttp app's life: `start` and `stop` fit on_startup and
    on_cleanup; stop cancels it and waits for it."""

    task_name = "app-task"
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    async def start(self, _app: web.Application | None = None) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve `app` on host:port (0: a free port the OS picks) for the block; yields its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        yield f"http://{host}:{port or runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class LoopLagGuard(AppTask):
    """Overload seen where it happens: the gateway's own event loop falling behind. A probe sleeps
    `probe_s` and measures how late it woke; a smoothed lag above `limit_s` means requests are arriving faster
    than this process can handle them, and new ones are refused at once (503, Retry-After) until the lag is
    back under half the limit. Without it a CPU-bound gateway queued every request, its latency grew without
    bound, clients timed out and retried, and goodput collapsed to well under its sustained rate (the
    in-flight cap cannot see this: with fast engines few requests are in flight, they are just late)."""

    def __init__(self, probe_s: float = LAG_PROBE_S, limit_s: float = LAG_LIMIT_S):
        self.probe_s = probe_s
        self.limit_s = limit_s
        self.lag_s = 0.0
        self.overloaded = False

    task_name = "gateway-loop-lag"

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + self.probe_s
            await asyncio.sleep(self.probe_s)
            lag = max(0.0, loop.time() - expected)
            self.lag_s += LAG_SMOOTHING * (lag - self.lag_s)
            if self.overloaded:
                self.overloaded = self.lag_s > self.limit_s / 2
            else:
                self.overloaded = self.lag_s > self.limit_s


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("fedpool_gateway_requests", "Requests answered by the gateway (streams: how they "
                                "ended: 200, broken, client_closed).", ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("fedpool_gateway_request_seconds", "Gateway request latency.", ("endpoint",),
                                 buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.migrations = Counter("fedpool_gateway_stream_migrations", "Streams continued on another replica "
                                  "after their server died mid-stream.", registry=self.registry)
        self.shed = Counter("fedpool_gateway_shed", "Requests refused at once because the gateway was full "
                            "(429) or its event loop overloaded (503).", registry=self.registry)
        self.retries = Gauge("fedpool_gateway_dispatcher_retries", "Retries made by the dispatcher so far.",
                             registry=self.registry)
        self.resets = Gauge("fedpool_gateway_keepalive_resets", "Stale keep-alive connections retried at once "
                            "(not the servers' fault).", registry=self.registry)
        self.hedges = Gauge("fedpool_gateway_dispatcher_hedges", "Straggler hedges launched so far.",
                            registry=self.registry)
        self.inflight = Gauge("fedpool_gateway_server_inflight", "Requests in flight per server.", ("server_id",),
                              registry=self.registry)
        self.window = Gauge("fedpool_gateway_server_window", "Admission window per server.", ("server_id",),
                            registry=self.registry)


class Gateway:
    """`web.Application` factory over one dispatcher."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        snapshot: Callable[[], PoolSnapshot | None],
        *,
        api_keys: list[ApiKey] | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_inflight: int | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self._dispatcher = dispatcher
        self._snapshot = snapshot
        self._keys = api_keys or []
        self._max_body = max_body_bytes
        # Requests held at once (waiting or running); past it the gateway answers 429 at once instead of
        # queueing without bound (the queue is what collapsed the gateway under overload). None: twice the
        # pool's capacity, at least 256.
        self._max_inflight = max_inflight
        self._inflight = 0
        self._clock = clock
        self._started = int(clock())
        self._metrics = _Metrics()
        self.lag = LoopLagGuard()
        for key in self._keys:
            dispatcher.set_client_weight(key.client, key.weight)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body, middlewares=[self._openai_errors])
        app.on_startup.append(self.lag.start)
        app.on_cleanup.append(self.lag.stop)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id:.+}", self._model)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    @web.middleware
    async def _openai_errors(self, request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Every error in OpenAI's shape: unknown routes (404), methods (405), bodies too large (413)."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = {401: "authentication_error", 404: "invalid_request_error", 405: "invalid_request_error",
                    413: "invalid_request_error"}.get(exc.status, "api_error")
            message = {404: f"no route {request.method} {request.path} (this gateway serves /v1/completions, "
                            "/v1/chat/completions, /v1/models)",
                       405: f"method {request.method} is not allowed on {request.path}",
                       413: f"request body larger than {self._max_body} bytes"}.get(exc.status, exc.reason)
            headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return _error(exc.status, message, kind, headers=headers)

    # ---- handlers -----------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        stats = self._dispatcher.stats()
        self._metrics.retries.set(stats.retries)
        self._metrics.resets.set(sum(s.failures.get(FailureKind.RESET.value, 0) for s in stats.servers))
        self._metrics.hedges.set(stats.hedges)
        for server in stats.servers:
            self._metrics.inflight.labels(server.server_id).set(server.inflight)
            self._metrics.window.labels(server.server_id).set(server.window)
        return web.Response(body=generate_latest(self._metrics.registry), content_type="text/plain", charset="utf-8")

    def _served(self) -> dict[str, int]:
        """Every model a registered server serves (routable or not) -> its earliest registration time."""
        snapshot = self._snapshot()
        out: dict[str, int] = {}
        for entry in snapshot.entries if snapshot else ():
            at = int(entry.record.registered_at)
            out[entry.record.model] = min(out.get(entry.record.model, at), at)
        return out

    async def _models(self, request: web.Request) -> web.Response:
        client = self._client(request)
        if isinstance(client, web.Response):
            return client
        return web.json_response({"object": "list", "data": [
            _model_object(model, created) for model, created in sorted(self._served().items())]})

    async def _model(self, request: web.Request) -> web.Response:
        client = self._client(request)
        if isinstance(client, web.Response):
            return client
        model = request.match_info["model_id"]
        served = self._served()
        if model not in served:
            return self._unknown_model(model, served)
        return web.json_response(_model_object(model, served[model]))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.COMPLETIONS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.CHAT)

    async def _serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = time.perf_counter()
        status = "500"
        try:
            response, status = await self._serve_inner(request, endpoint)
            return response
        finally:
            self._metrics.requests.labels(endpoint.value, status).inc()
            self._metrics.latency.labels(endpoint.value).observe(time.perf_counter() - started)

    async def _serve_inner(self, request: web.Request, endpoint: Endpoint) -> tuple[web.StreamResponse, str]:
        if self.lag.overloaded:  # before reading the body: refusing must cost as little as possible
            self._metrics.shed.inc()
            return _error(503, f"the gateway is overloaded (its event loop is {self.lag.lag_s * 1000:.0f} ms "
                          "behind); retry shortly", "service_unavailable", code="gateway_overloaded",
                          headers={"Retry-After": "1"}), "503"
        client = self._client(request)
        if isinstance(client, web.Response):
            return client, str(client.status)
        try:
            body = await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body larger than {self._max_body} bytes", "invalid_request_error"), "413"
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON", "invalid_request_error"), "400"
        problem = _check_body(body, endpoint)
        if problem is not None:
            return problem, "400"
        model = body["model"]
        served = self._served()
        if model not in served:
            return self._unknown_model(model, served), "404"
        if self._full():
            self._metrics.shed.inc()
            return _error(429, "the gateway is at capacity; retry shortly", "rate_limit_error",
                          code="gateway_overloaded", headers={"Retry-After": "1"}), "429"
        try:
            req = InferenceRequest.from_body(
                body, request_id=f"gw-{uuid.uuid4().hex[:16]}", model=model, endpoint=endpoint, client_id=client,
                revision=request.headers.get("X-Model-Revision") or None,
            )
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error"), "400"
        self._inflight += 1
        try:
            if body.get("stream"):
                relay = StreamRelay(self._dispatcher, self._snapshot, request, req, model)
                response = await relay.run()
                self._metrics.migrations.inc(relay.outcome.migrations)
                status = ("client_closed" if relay.outcome.client_gone else
                          "broken" if relay.outcome.broken else str(response.status))
                return response, status
            result = await self._dispatcher.submit(req)
        except NoServerError as exc:
            return _error(503, str(exc), "service_unavailable", code="no_server",
                          headers={"Retry-After": str(RETRY_AFTER_S)}), "503"
        except RequestFailed as exc:
            return self._failed(exc)
        finally:
            self._inflight -= 1
        payload = dict(result.completion.body or {})
        payload["model"] = model
        return web.json_response(payload, headers={"X-Fedpool-Server": result.server_id,
                                                   "X-Fedpool-Attempts": str(len(result.attempts))}), "200"

    def _failed(self, exc: RequestFailed) -> tuple[web.Response, str]:
        """An upstream refusal keeps the engine's own status and message (its culprit field), attributed to the
        server that said it; exhausted retries are 502 (429 when the engines were rate-limiting)."""
        err = exc.last_error
        headers = {"X-Fedpool-Server": exc.server_id} if exc.server_id else {}
        if exc.last_kind is FailureKind.REQUEST_ERROR and err is not None:
            status = err.status or 400
            message = err.upstream_message or str(exc)
            return _error(status, f"{message} (from server {exc.server_id})", "invalid_request_error",
                          code="upstream_refused", headers=headers), str(status)
        if exc.last_kind is FailureKind.RATE_LIMITED:
            return _error(429, str(exc), "rate_limit_error", code="upstream_rate_limited",
                          headers={**headers, "Retry-After": "1"}), "429"
        return _error(502, str(exc), "upstream_error", code=exc.last_kind.value if exc.last_kind else None,
                      headers=headers), "502"

    def _unknown_model(self, model: str, served: Mapping[str, int]) -> web.Response:
        return _error(404, f"The model `{model}` does not exist: no registered server serves it (served: "
                      f"{', '.join(sorted(served)) or 'none'})", "invalid_request_error", param="model",
                      code="model_not_found")

    def _full(self) -> bool:
        limit = self._max_inflight
        if limit is None:
            snapshot = self._snapshot()
            limit = max(256, 2 * sum(e.capacity for e in snapshot.entries)) if snapshot else 256
        return self._inflight >= limit

    # ---- who is asking --------------------------------------------------------------------------
    def knows(self, presented: bytes | None) -> bool:
        """Whether `presented` is one of the API keys (False when the gateway has none)."""
        found = False
        for key in self._keys:
            found |= matches(presented, key.secret.encode())
        return found

    def _client(self, request: web.Request) -> str | web.Response:
        """The client's name, or a 401 response. Never logs a presented secret."""
        presented = bearer(request)
        if not self._keys:
            if presented:  # each tool with its own token is its own client; the token is not kept
                return "token-" + hashlib.sha256(presented).hexdigest()[:10]
            named = request.headers.get(CLIENT_HEADER)
            if named:
                return CLIENT_NAME.sub("_", named)[:64]
            return f"peer-{request.remote or 'unknown'}"
        if presented is None:
            return _error(401, "missing bearer token (Authorization: Bearer KEY)", "authentication_error",
                          code="missing_api_key")
        match = None
        for key in self._keys:  # compare against every key, so timing does not reveal which one matched
            if matches(presented, key.secret.encode()):
                match = key
        if match is None:
            return _error(401, "invalid API key", "authentication_error", code="invalid_api_key")
        return match.client


def _check_body(body: object, endpoint: Endpoint) -> web.Response | None:
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object", "invalid_request_error")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return _error(400, "field 'model' (a string) is required", "invalid_request_error", param="model")
    needed = "prompt" if endpoint is Endpoint.COMPLETIONS else "messages"
    if needed not in body:
        return _error(400, f"field '{needed}' is required", "invalid_request_error", param=needed)
    return None


def _model_object(model: str, created: int) -> dict[str, object]:
    return {"id": model, "object": "model", "created": created, "owned_by": "fedpool"}


def _error(status: int, message: str, kind: str, *, param: str | None = None, code: str | None = None,
           headers: Mapping[str, str] | None = None) -> web.Response:
    error: Mapping[str, object] = {"message": message, "type": kind, "param": param, "code": code}
    return web.json_response({"error": error}, status=status, headers=headers)
