"""An OpenAI-compatible endpoint in front of the pool, so third-party eval tools use it unchanged.

Requests go through the same dispatcher as fedpool's own clients: routed by policy, held to admission
windows, retried elsewhere on failure, shared between clients in the dispatcher's serving order. Streams
that lose their server mid-way are continued on another replica (`federation/gateway/streams.py`). Errors follow
OpenAI's shape on every route: `{"error": {"message", "type", "param", "code"}}`.

Who is a client (fair share, serving order): an API key's client name; else a digest of the caller's bearer token
(never the token); else the `X-Fedpool-Client` header; else the caller's address. Without keys the gateway binds
to loopback only; the ids callers choose are capped (`ClientIds`) and forgotten when idle.

Per request the gateway does what it must and no more: the engine's bytes go back as they came (only a `model`
field that differs is rewritten); snapshot facts are computed once per snapshot (`PoolFacts`); no timer runs per
request (overload is the dispatcher's own measure of its loop's lag, `Overload`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import itertools
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from fedpool.federation.core.dispatcher import Dispatcher
from fedpool.federation.core.errors import FailureKind, NoServerError, RequestFailed
from fedpool.federation.core.types import Completion, Endpoint, InferenceRequest
from fedpool.federation.gateway import CLIENT_HEADER, PROMPT_HEADER, REQUESTS_HEADER, REQUESTS_QUERY
from fedpool.federation.gateway.answers import dumps, loads
from fedpool.federation.gateway.auth import ApiKey, bearer, matches, parse_api_keys, visible_holders
from fedpool.federation.gateway.state import (
    CLIENT_TTL_S,
    MAX_CLIENT_IDS,
    MAX_DECLARED_REQUESTS,
    SHARED_CLIENT,
    AppTask,
    ClientIds,
    DeclaredRuns,
    Forgetting,
    GatewayMetrics,
    Overload,
    PoolFacts,
    Steer,
    steered,
    submit_steered,
)
from fedpool.federation.gateway.streams import StreamRelay
from fedpool.registry import PoolHolders, PoolSnapshot

__all__ = ["RUNNER_OPTIONS", "SHARED_CLIENT", "ApiKey", "AppTask", "Gateway", "answer_bytes", "parse_api_keys",
           "serving", "upstream_failure"]
_Metrics = GatewayMetrics  # (its old name, which tests/test_cluster_files.py reads)

log = logging.getLogger("fedpool.gateway")
_ENDPOINTS = {endpoint.value: endpoint for endpoint in Endpoint}  # a route's path -> its endpoint

MAX_BODY_BYTES = 8 * 1024 * 1024
RETRY_AFTER_S = 5  # what a 503 tells a client to wait while the model's servers are all unroutable
HOLDERS_PATH = "/pool/holders"  # who is on the pool (`Gateway(holders=...)`), as the caller may see it
MAX_PROMPT_TOKENS = 10_000_000
CLIENT_NAME = re.compile(r"[^A-Za-z0-9._:@-]")
GC_GEN0_THRESHOLD = 20_000  # young-generation collections every ~20k net allocations, not 700 (CPython's default)
# How the gateway's app is served (`serving`; the CLI passes the same): a request whose caller has gone is
# cancelled at once, so it gives its engine slot back instead of holding it until the engine answers.
RUNNER_OPTIONS: Mapping[str, Any] = {"access_log": None, "handler_cancellation": True}


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str = "127.0.0.1", port: int = 0, *, reuse_port: bool | None = None,
                  backlog: int = 128) -> AsyncIterator[str]:
    """Serve `app` on host:port (0: the OS picks) for the block, with RUNNER_OPTIONS; yields its base URL."""
    runner = web.AppRunner(app, **RUNNER_OPTIONS)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=backlog).start()
        yield f"http://{host}:{port or runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


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
        max_client_ids: int = MAX_CLIENT_IDS,
        client_ttl_s: float = CLIENT_TTL_S,
        tune_gc: bool = True,
        clock: Callable[[], float] = time.time,
        holders: Callable[[], Awaitable[PoolHolders | None]] | None = None,
        steer: Steer | None = None,
    ):
        """`holders`: who is on the pool (`PoolConnection.holders`), served at HOLDERS_PATH as the caller may see
        it (`auth.visible_holders`); `steer` (the Batch API sets it): where online requests go first (`Steer`)."""
        self._dispatcher = dispatcher
        self._holders = holders
        self._alias_secret = secrets.token_bytes(16)  # the holders view's aliases: stable while this gateway runs
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
        self._metrics = GatewayMetrics()
        self.overload = Overload(dispatcher)
        # Without keys, the caller's choice; with keys, the key file's names and their callers' own clients
        # (`_client`): capped either way.
        self.client_ids = ClientIds(max_client_ids, client_ttl_s)
        self.runs = DeclaredRuns(dispatcher.set_client_requests_left, dispatcher.set_client_shape)
        self._forgetting = Forgetting(self.client_ids, dispatcher, max(0.05, client_ttl_s / 10), self.runs)
        self._tune_gc, self.steer = tune_gc, steer
        self._facts_of: PoolSnapshot | None = None
        self._facts = PoolFacts.of(None)
        self._request_ids = itertools.count()
        self._id_prefix = f"gw-{secrets.token_hex(4)}-"
        for key in self._keys:
            dispatcher.set_client_weight(key.client, key.weight)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body, middlewares=[self._openai_errors])
        app.on_startup.append(self._settle_gc)
        app.on_startup.append(self._forgetting.start)
        app.on_cleanup.append(self._forgetting.stop)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id:.+}", self._model)
        app.router.add_post(Endpoint.COMPLETIONS, self._serve)
        app.router.add_post(Endpoint.CHAT, self._serve)
        if self._holders is not None:
            app.router.add_get(HOLDERS_PATH, self._holders_view)
        return app

    async def _settle_gc(self, _app: web.Application) -> None:
        """Under load, CPython's full collections (walking every object the process holds) stalled the loop
        periodically. What is alive at startup lives for the process: frozen, full collections walk only what
        came later; and young collections run every ~20k allocations instead of 700 (no request leaves cyclic
        garbage)."""
        if not self._tune_gc:
            return
        gc.collect()
        gc.freeze()
        young, middle, old = gc.get_threshold()
        gc.set_threshold(max(young, GC_GEN0_THRESHOLD), middle, old)

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
        self._metrics.servers({s.server_id: (s.inflight, s.window) for s in stats.servers})
        self._metrics.clients.set(len(self.client_ids))
        self._metrics.declared_runs.set(len(self.runs))
        return web.Response(body=generate_latest(self._metrics.registry), content_type="text/plain", charset="utf-8")

    async def _holders_view(self, request: web.Request) -> web.Response:
        assert self._holders is not None
        try:
            view = await self._holders()
        except Exception as exc:  # the registry is away or restarting
            return _error(503, f"the registry did not say who is on the pool ({type(exc).__name__})", "api_error")
        if view is None:
            return _error(404, "this gateway's registry client does not say who is on the pool",
                          "invalid_request_error")
        shown = self.visible_holders(view, bearer(request))
        if shown is None:
            return _error(401, "who is on the pool is shown to an API key's holder (Authorization: Bearer KEY)",
                          "authentication_error", code="invalid_api_key")
        return web.Response(body=shown.model_dump_json(), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    def visible_holders(self, view: PoolHolders, presented: bytes | None) -> PoolHolders | None:
        """`view` as the caller presenting `presented` may see it (None: refused): `auth.visible_holders` with
        this gateway's keys and aliases."""
        return visible_holders(view, self._keys, presented, self._alias_secret)

    def facts(self) -> PoolFacts:
        """The current snapshot's facts (recomputed only when the snapshot is another object)."""
        snapshot = self._snapshot()
        if snapshot is not self._facts_of:
            self._facts, self._facts_of = PoolFacts.of(snapshot), snapshot
        return self._facts

    async def _models(self, request: web.Request) -> web.Response:
        client = self._client(request)
        if isinstance(client, web.Response):
            return client
        return web.json_response({"object": "list", "data": [
            _model_object(model, created) for model, created in sorted(self.facts().served.items())]})

    async def _model(self, request: web.Request) -> web.Response:
        client = self._client(request)
        if isinstance(client, web.Response):
            return client
        model = request.match_info["model_id"]
        served = self.facts().served
        if model not in served:
            return self._unknown_model(model, served)
        return web.json_response(_model_object(model, served[model]))

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        """/v1/completions and /v1/chat/completions (the route is the endpoint; one coroutine a request, not a
        chain: a coroutine frame more is walked at every resumption of the request's task). Refusals are built
        by helpers and carry their own status; a stream is relayed in a coroutine of its own (`_stream`)."""
        started = time.perf_counter()
        endpoint = _ENDPOINTS[request.path]
        status = "500"
        try:
            if self.overload.check():  # before reading the body: refusing must cost as little as possible
                status = "503"
                return self._overloaded()
            client = self._client(request, own=True)
            if isinstance(client, web.Response):
                status = str(client.status)
                return client
            said = _declared(request)
            if isinstance(said, web.Response):
                status = "400"
                return said
            # (many callers in one bucket: no one caller's size)
            declared, prompt = (None, None) if client == SHARED_CLIENT else said
            try:
                body = loads(await request.read())
            except (web.HTTPRequestEntityTooLarge, ValueError, UnicodeDecodeError) as exc:
                unreadable = self._unreadable(exc)
                status = str(unreadable.status)
                return unreadable
            req = self._admit(body, endpoint, client, request)
            if isinstance(req, web.Response):
                status = str(req.status)
                return req
            model = req.model
            self._inflight += 1
            self.runs.arrive(client, declared, prompt, req.params.max_tokens)
            try:
                if body.get("stream"):
                    response, status = await self._stream(request, steered(req, self.steer), model)
                    return response
                result = await submit_steered(self._dispatcher, req, self.steer)
            except NoServerError as exc:
                status = "503"
                return _error(503, str(exc), "service_unavailable", code="no_server",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
            except RequestFailed as exc:
                failed, status = self._failed(exc)
                return failed
            finally:
                self._inflight -= 1
                self.runs.finish(client, declared)
            status = "200"
            return web.Response(body=answer_bytes(result.completion, model, endpoint, req.request_id), headers={
                "Content-Type": "application/json", "X-Fedpool-Server": result.server_id,
                "X-Fedpool-Attempts": str(len(result.attempts)), "X-Fedpool-Engine": result.engine,
                "X-Fedpool-Accelerator": result.accelerator, "X-Fedpool-Revision": result.model_revision})
        except asyncio.CancelledError:
            status = "client_closed"  # the caller went away (handler cancellation): its slot is already back
            raise
        finally:
            self._metrics.observe(endpoint, status, time.perf_counter() - started)  # (a StrEnum: its own value)

    def _overloaded(self) -> web.Response:
        """A 503 at once: the gateway's event loop is behind (`Overload`)."""
        self._metrics.shed.inc()
        return _error(503, "the gateway is overloaded (its event loop is "
                      f"{self.overload.lag_s() * 1000:.0f} ms behind); retry shortly", "service_unavailable",
                      code="gateway_overloaded", headers={"Retry-After": "1"})

    def _unreadable(self, exc: Exception) -> web.Response:
        """The refusal of a body that could not be read: too large (413), or not JSON (400)."""
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            return _error(413, f"request body larger than {self._max_body} bytes", "invalid_request_error")
        return _error(400, "request body is not valid JSON", "invalid_request_error")  # (JSONDecodeError: a ValueError)

    def _admit(self, body: Any, endpoint: Endpoint, client: str,
               request: web.Request) -> InferenceRequest | web.Response:
        """The request `body` asks for, or the response that refuses it: a body its endpoint cannot serve (400),
        a model no server serves (404), the gateway at its in-flight limit (429)."""
        problem = _check_body(body, endpoint)
        if problem is not None:
            return problem
        model = body["model"]
        facts = self.facts()
        if model not in facts.served:
            return self._unknown_model(model, facts.served)
        limit = self._max_inflight if self._max_inflight is not None else max(256, 2 * facts.capacity)
        if self._inflight >= limit:
            self._metrics.shed.inc()
            return _error(429, "the gateway is at capacity; retry shortly", "rate_limit_error",
                          code="gateway_overloaded", headers={"Retry-After": "1"})
        try:
            return InferenceRequest.from_body(
                body, request_id=f"{self._id_prefix}{next(self._request_ids)}", model=model, endpoint=endpoint,
                client_id=client, revision=request.headers.get("X-Model-Revision") or None,
            )
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")

    async def _stream(self, request: web.Request, req: InferenceRequest,
                      model: str) -> tuple[web.StreamResponse, str]:
        """Relay a streamed request (`StreamRelay`): its response, and how it ended for the metrics."""
        relay = StreamRelay(self._dispatcher, self._snapshot, request, req, model)
        response = await relay.run()
        self._metrics.migrations.inc(relay.outcome.migrations)
        status = ("client_closed" if relay.outcome.client_gone else
                  "broken" if relay.outcome.broken else str(response.status))
        return response, status

    def _failed(self, exc: RequestFailed) -> tuple[web.Response, str]:
        """The answer to a request whose every attempt failed (`upstream_failure`), and its status."""
        status, error, headers = upstream_failure(exc)
        return web.json_response({"error": error}, status=status, headers=headers), str(status)

    def _unknown_model(self, model: str, served: Mapping[str, int]) -> web.Response:
        return _error(404, f"The model `{model}` does not exist: no registered server serves it (served: "
                      f"{', '.join(sorted(served)) or 'none'})", "invalid_request_error", param="model",
                      code="model_not_found")

    # ---- who is asking --------------------------------------------------------------------------
    def knows(self, presented: bytes | None) -> bool:
        """Whether `presented` is one of the API keys (False when the gateway has none; every key is compared)."""
        return any([matches(presented, key.secret.encode()) for key in self._keys])  # (a list: no early exit)

    def client_of(self, request: web.Request) -> str | web.Response:
        """Who is asking, as for an online request (the Batch API scopes files and batches by it), or a 401."""
        return self._client(request)

    def _client(self, request: web.Request, own: bool = False) -> str | web.Response:
        """The client's name, or a 401 response. Never logs a presented secret. `own` (an online request): with
        keys, a caller naming one of its own clients (`X-Fedpool-Client`: an eval of a process that sends through
        this gateway, `eval run --gateway`) is served as that client of its key, `KEY/NAME`, at the key's weight —
        each eval ranked and planned on its own, within the id table's cap like any id."""
        presented = bearer(request)
        if not self._keys:
            if presented:  # each tool with its own token is its own client; the token is not kept
                name = "token-" + hashlib.sha256(presented).hexdigest()[:10]
            else:
                named = request.headers.get(CLIENT_HEADER)
                name = CLIENT_NAME.sub("_", named)[:64] if named else f"peer-{request.remote or 'unknown'}"
            return self.client_ids.admit(name, time.monotonic())
        if presented is None:
            return _error(401, "missing bearer token (Authorization: Bearer KEY)", "authentication_error",
                          code="missing_api_key")
        match = None
        for key in self._keys:  # compare against every key, so timing does not reveal which one matched
            if matches(presented, key.secret.encode()):
                match = key
        if match is None:
            return _error(401, "invalid API key", "authentication_error", code="invalid_api_key")
        named = request.headers.get(CLIENT_HEADER) if own else None
        if not named:
            self.client_ids.admit(match.client, time.monotonic())
            return match.client
        name = f"{match.client}/{CLIENT_NAME.sub('_', named)[:64]}"
        if name not in self.client_ids:
            self._dispatcher.set_client_weight(name, match.weight)
        admitted = self.client_ids.admit(name, time.monotonic())
        return match.client if admitted == SHARED_CLIENT else admitted  # (past the cap: the key's own, not shared)


def _declared(request: web.Request) -> tuple[int | None, float | None] | web.Response:
    """The run size the caller declared (`REQUESTS_HEADER`, else `REQUESTS_QUERY` on the URL) and its requests' mean
    prompt tokens (`PROMPT_HEADER`), each None if not said, or a 400 naming the culprit."""
    raw = request.headers.get(REQUESTS_HEADER)
    where = REQUESTS_HEADER
    if raw is None and request.query_string:
        raw, where = request.query.get(REQUESTS_QUERY), REQUESTS_QUERY
    prompt = request.headers.get(PROMPT_HEADER)
    if raw is None:
        return None, None
    n, tokens = _number(raw, int), _number(prompt, float)
    if not 1 <= n <= MAX_DECLARED_REQUESTS or (prompt is not None and not 0 < tokens <= MAX_PROMPT_TOKENS):
        culprit, given = (PROMPT_HEADER, prompt) if 1 <= n <= MAX_DECLARED_REQUESTS else (where, raw)
        return _error(400, f"{culprit} must be the number of requests this caller's run sends (from 1 to "
                      f"{MAX_DECLARED_REQUESTS}), and {PROMPT_HEADER} its requests' mean prompt tokens (above 0, up "
                      f"to {MAX_PROMPT_TOKENS}), not {str(given)[:40]!r}", "invalid_request_error", param=culprit,
                      code="invalid_declared_requests")
    return int(n), tokens if prompt is not None else None


def _number(raw: str | None, kind: type[int] | type[float]) -> float:  # (0 where it is none)
    try:
        return kind(raw.strip()) if raw is not None else 0
    except ValueError:
        return 0


def upstream_failure(exc: RequestFailed) -> tuple[int, dict[str, object], dict[str, str]]:
    """(Status, OpenAI error object, headers) of a request whose every attempt failed. An upstream refusal keeps
    the engine's own status and message (its culprit field), attributed to the server that said it; exhausted
    retries are 502 (429 when the engines were rate-limiting). The Batch API writes the same into its error files."""
    err = exc.last_error
    headers = {"X-Fedpool-Server": exc.server_id} if exc.server_id else {}
    if exc.last_kind is FailureKind.REQUEST_ERROR and err is not None:
        status = err.status or 400
        message = err.upstream_message or str(exc)
        return status, _error_object(f"{message} (from server {exc.server_id})", "invalid_request_error",
                                     code="upstream_refused"), headers
    if exc.last_kind is FailureKind.RATE_LIMITED:
        return 429, _error_object(str(exc), "rate_limit_error", code="upstream_rate_limited"), \
            {**headers, "Retry-After": "1"}
    return 502, _error_object(str(exc), "upstream_error", code=exc.last_kind.value if exc.last_kind else None), headers


def answer_bytes(completion: Completion, model: str, endpoint: Endpoint, request_id: str) -> bytes:
    """The engine's body as it sent it, but for a `model` field other than the name the client asked for (an
    engine that reports its weights' path, say): only then is the body decoded and encoded again. An answer
    with no body of its own (assembled from a stream, or from an in-process transport) is written in OpenAI's
    shape from its fields."""
    raw = completion.raw
    if raw is not None and completion.model == model:
        return raw
    if raw is not None:
        body = loads(raw)
        body["model"] = model
        return dumps(body)
    if endpoint is Endpoint.CHAT:
        message: dict[str, Any] = {"role": "assistant", "content": completion.text}
        if completion.reasoning_content is not None:
            message["reasoning_content"] = completion.reasoning_content
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": completion.finish_reason}
    else:
        choice = {"index": 0, "text": completion.text, "finish_reason": completion.finish_reason}
    prompt, answer = completion.prompt_tokens, completion.completion_tokens
    usage = {"prompt_tokens": prompt, "completion_tokens": answer,
             "total_tokens": prompt + answer if prompt is not None and answer is not None else None}
    return dumps({"id": f"cmpl-{request_id}", "object": "chat.completion" if endpoint is Endpoint.CHAT
                  else "text_completion", "created": int(time.time()), "model": model, "choices": [choice],
                  "usage": usage})


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


def _error_object(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> dict[str, object]:
    return {"message": message, "type": kind, "param": param, "code": code}


def _error(status: int, message: str, kind: str, *, param: str | None = None, code: str | None = None,
           headers: Mapping[str, str] | None = None) -> web.Response:
    error = _error_object(message, kind, param=param, code=code)
    return web.json_response({"error": error}, status=status, headers=headers)
