"""Evals that hand their placement to a gateway (`fedpool eval run --gateway URL`): the scheduling tier.

An `eval run` normally places its own requests inside the share of every server it leases. Many eval processes
then make many schedules, each seeing only its own evals (docs/architecture.md, "One schedule across processes").
With `--gateway`, the process keeps its samples, media, verifier, metrics and artifact, and sends every request
to one fedpool gateway saying which eval it is for (`X-Fedpool-Client`) and how many requests that eval's run
sends (`X-Fedpool-Requests`): the gateway's one dispatcher sees every process's evals as its clients and places
them as one process places its own. `DelegatingDispatcher` is what `EvalRun` talks to in place of a `Dispatcher`
(a `Sender`); each answer's server, engine, accelerator and revision come from the gateway's `X-Fedpool-*`
headers. The gateway retries failed attempts by its own rules; this side waits out only the gateway's refusals
for its own load (`gateway_overloaded`, after Retry-After) and a gateway it cannot reach, up to `unreachable_s`;
every other failure is the record's, as with a dispatcher. How a request reaches the gateway is a `GatewayPost`:
`GatewayHttp` over aiohttp, or the simulator's in-process gateway, so the scheduling benchmarks run this class.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import aiohttp
import yarl
from pydantic import SecretStr

from fedpool.clients.batchclient import BatchError
from fedpool.federation import Endpoint, InferenceRequest, InferenceResult
from fedpool.federation.core.errors import AttemptError, FailureKind, NoServerError, RequestFailed, kind_for_status
from fedpool.federation.core.types import Attempt
from fedpool.federation.gateway import CLIENT_HEADER, PROMPT_HEADER, REQUESTS_HEADER
from fedpool.federation.gateway.transport import parse_completion, request_body

REVISION_HEADER = "X-Model-Revision"
PATHS = {Endpoint.COMPLETIONS: "/v1/completions", Endpoint.CHAT: "/v1/chat/completions"}
UNREACHABLE_S = 60.0  # how long a request waits for a gateway it cannot reach (or that sheds load) before failing
BACKOFF_S = (0.25, 2.0)  # first and longest wait between tries at a gateway that did not take the request
TOTAL_TIMEOUT_S = 3600.0  # one request through the gateway, queueing there included (its own deadlines are shorter)


class Sender(Protocol):
    """What an eval sends its requests through and tells what it has left: the process's own `Dispatcher`, or a
    `DelegatingDispatcher` that hands placement to a gateway (clients/delegate.py)."""

    def client_done_sending(self, client_id: str, done: bool = True) -> None: ...
    def set_client_remaining(self, client_id: str, work: float, requests: int | None = None) -> None: ...
    def set_client_shape(self, client_id: str, prompt_tokens: float, max_tokens: int | None) -> None: ...
    def expect(self, client_id: str, model: str, requests: int, *, loading: bool = False) -> None: ...
    async def submit(self, request: InferenceRequest) -> InferenceResult: ...


class GatewayPost(Protocol):
    """POST `body` to `path` of the gateway with `headers`: (status, response headers, response body). Raises
    OSError or aiohttp.ClientError when the gateway cannot be reached."""

    def __call__(self, path: str, headers: Mapping[str, str], body: bytes
                 ) -> Awaitable[tuple[int, Mapping[str, str], bytes]]: ...


class GatewayRefused(BatchError):
    """A gateway this process cannot send through, named: `kind` "input" (the URL or key given is at fault) or
    "unavailable" (nothing answers there), the exit codes of the Batch API client's refusals."""


class GatewayHttp:
    """`GatewayPost` over HTTP to the gateway at `url` (its base URL, with or without `/v1`), with the caller's API
    key (never logged, never in argv: the CLI reads it from $FEDPOOL_API_KEY)."""

    def __init__(self, url: str, api_key: str | None = None, *, total_timeout_s: float = TOTAL_TIMEOUT_S):
        parsed = yarl.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"{url!r} is not an http(s) URL of a gateway")
        if parsed.user is not None or parsed.password is not None:
            raise ValueError("a gateway URL carries no credentials (they would be recorded with the run): put the "
                             "key in $FEDPOOL_API_KEY")
        base = str(parsed.with_query(None).with_fragment(None)).rstrip("/")
        self.url = base[:-3] if base.endswith("/v1") else base
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=total_timeout_s, sock_connect=10.0)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout,
                                                  connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        return self._session

    async def __call__(self, path: str, headers: Mapping[str, str], body: bytes
                       ) -> tuple[int, Mapping[str, str], bytes]:
        async with self._open().post(self.url + path, data=body, headers={**headers, **self._auth}) as response:
            return response.status, response.headers, await response.read()

    async def models(self) -> dict[str, set[str]]:
        """Model -> revisions the gateway serves (`GET /v1/models`; revisions it does not list: none). Raises
        LookupError naming the gateway and what it said when it refuses (a key it does not know: 401)."""
        async with self._open().get(self.url + "/v1/models", headers=self._auth) as response:
            raw = await response.read()
            if response.status != 200:
                raise LookupError(f"the gateway at {self.url} answered {response.status} to GET /v1/models: "
                                  f"{_message(raw)}")
        try:
            data = json.loads(raw)["data"]
            return {str(m["id"]): set() for m in data}
        except (ValueError, KeyError, TypeError) as exc:
            raise LookupError(f"{self.url} is not a fedpool gateway (GET /v1/models: {type(exc).__name__})") from None

    @classmethod
    def of(cls, url: str | None, api_key: SecretStr | None) -> GatewayHttp | None:
        """`--gateway URL` with the key from $FEDPOOL_API_KEY (None without one), or GatewayRefused naming what is
        wrong with it."""
        if url is None:
            return None
        try:
            return cls(url, api_key.get_secret_value() if api_key is not None else None)
        except ValueError as exc:
            raise GatewayRefused(f"--gateway: {exc}", kind="input") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def check_gateway(url: str, api_key: SecretStr | None, model: str, wait_s: float | None) -> GatewayHttp:
    """`require_gateway` from outside an event loop (the CLI, before anything is written): the gateway, to send
    through (its connections are opened again by the run's own event loop)."""
    gateway = GatewayHttp.of(url, api_key)
    assert gateway is not None
    asyncio.run(require_gateway(gateway, model, wait_s))
    return gateway


async def require_gateway(gateway: GatewayHttp, model: str, wait_s: float | None) -> None:
    """Refuse a gateway that cannot be reached, refuses the key, or serves no such model (NoServerError, after
    waiting up to `wait_s` for one), before anything is written; its connections are let go after."""
    from fedpool.clients.rundir import wait_for_model

    try:
        await wait_for_model(gateway.models, model, None, wait_s or 0.0,
                             "register one with the gateway's pool, or wait for one: --wait-for-servers SECONDS")
    except LookupError as exc:
        raise GatewayRefused(f"--gateway: {exc}", kind="input") from None
    except (TimeoutError, OSError, aiohttp.ClientError) as exc:
        raise GatewayRefused(f"--gateway: cannot reach {gateway.url} ({type(exc).__name__}: {exc})",
                             kind="unavailable") from None
    finally:
        await gateway.aclose()


class DelegatingDispatcher:
    """What `EvalRun` sends through when its process hands placement to a gateway (the module's docstring)."""

    def __init__(self, post: GatewayPost, *, where: str = "the gateway",
                 clock: Callable[[], float] = time.monotonic, unreachable_s: float = UNREACHABLE_S,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep):
        self._post = post
        self._where = where
        self._clock = clock
        self._unreachable_s = unreachable_s
        self._sleep = sleep
        self._declared: dict[str, int] = {}  # eval -> the size of its run (its first report after it started)
        self._prompts: dict[str, float] = {}  # eval -> its mean prompt tokens, as it announced them
        self.waited = 0  # tries the gateway did not take (unreachable, or shedding load), waited out

    # ---- what an eval says of itself: the gateway learns it from the requests -----------------------------------
    def client_done_sending(self, client_id: str, done: bool = True) -> None:
        """`done=False`: the eval (re)starts, and its next report of what it has left is its run's size."""
        if not done:
            self._declared.pop(client_id, None)
            self._prompts.pop(client_id, None)

    def set_client_remaining(self, client_id: str, work: float, requests: int | None = None) -> None:
        """The first report of a run is its size, declared to the gateway with each request (it counts down what
        it answers itself: `DeclaredRuns`)."""
        if requests and client_id not in self._declared:
            self._declared[client_id] = requests

    def set_client_shape(self, client_id: str, prompt_tokens: float, max_tokens: int | None) -> None:
        """The eval's mean prompt, sent with its run size (`X-Fedpool-Prompt-Tokens`): the gateway announces it as
        the eval's shape when the run starts (its answer budget is each request's `max_tokens`)."""
        self._prompts[client_id] = prompt_tokens

    def expect(self, client_id: str, model: str, requests: int, *, loading: bool = False) -> None:
        """Nothing to ask for: the gateway holds the lease on the pool, not this process."""

    # ---- requests ---------------------------------------------------------------------------------------------
    async def submit(self, request: InferenceRequest) -> InferenceResult:
        """The answer to `request` through the gateway, or RequestFailed / NoServerError as a dispatcher raises."""
        if request.pinned_engines or request.pinned_servers:
            raise RequestFailed(f"{request.request_id}: pinned engines or servers are placed by this process's own "
                                "dispatcher, not through a gateway (run it without --gateway)", (),
                                FailureKind.REQUEST_ERROR)
        headers = {CLIENT_HEADER: request.client_id, "Content-Type": "application/json"}
        declared = self._declared.get(request.client_id)
        if declared:
            headers[REQUESTS_HEADER] = str(declared)
            prompt = self._prompts.get(request.client_id)
            if prompt is not None and prompt > 0:
                headers[PROMPT_HEADER] = f"{prompt:.6g}"
        if request.revision:
            headers[REVISION_HEADER] = request.revision
        body = json.dumps(request_body(request)).encode()
        started = self._clock()
        deadline, backoff = started + self._unreachable_s, BACKOFF_S[0]
        while True:
            try:
                status, answer_headers, raw = await self._post(PATHS[request.endpoint], headers, body)
            except (TimeoutError, OSError, aiohttp.ClientError) as exc:
                status, answer_headers, raw = 0, {}, f"unreachable: {type(exc).__name__}: {exc}".encode()
            if status == 200:
                return self._result(request, answer_headers, raw, started)
            wait = _retry_after(status, answer_headers, raw, backoff)
            if wait is None or self._clock() + wait > deadline:
                raise self._failure(request, status, answer_headers, raw, started)
            self.waited += 1
            await self._sleep(wait)
            backoff = min(BACKOFF_S[1], backoff * 2)

    def _result(self, request: InferenceRequest, headers: Mapping[str, str], raw: bytes,
                started: float) -> InferenceResult:
        latency = self._clock() - started
        server = headers.get("X-Fedpool-Server", "")
        try:
            completion = parse_completion(raw, request.endpoint)
        except AttemptError as exc:
            raise RequestFailed(f"{request.request_id}: {self._where} answered 200 with {exc.detail}",
                                (Attempt(server, started, latency, exc.kind, exc.detail),), exc.kind, exc,
                                server or None) from None
        tries = max(1, _int(headers.get("X-Fedpool-Attempts"), 1))
        earlier = tuple(Attempt("", started, 0.0, None, f"an earlier attempt, retried by {self._where}")
                        for _ in range(tries - 1))
        return InferenceResult(
            request_id=request.request_id, completion=completion, server_id=server,
            engine=headers.get("X-Fedpool-Engine", "unknown"),
            accelerator=headers.get("X-Fedpool-Accelerator", "unknown"),
            model_revision=headers.get("X-Fedpool-Revision", request.revision or "unspecified"),
            latency_s=latency, attempts=(*earlier, Attempt(server, started, latency)))

    def _failure(self, request: InferenceRequest, status: int, headers: Mapping[str, str], raw: bytes,
                 started: float) -> Exception:
        message = _message(raw)
        code = _code(raw)
        if code == "no_server":
            return NoServerError(f"{self._where}: {message}")
        if status == 0:  # never reached it
            kind = FailureKind.CONNECT
        elif code == "upstream_refused" or status in (400, 413, 422):
            kind = FailureKind.REQUEST_ERROR
        else:
            kind = kind_for_status(status) if status != 502 else _kind_of_code(code)
        server = headers.get("X-Fedpool-Server") or None
        detail = f"{self._where} answered {status}: {message}" if status else f"{self._where}: {message}"
        error = AttemptError(kind, detail, status=status or None, upstream_message=message)
        return RequestFailed(f"{request.request_id}: {detail}",
                             (Attempt(server or "", started, self._clock() - started, kind, detail),), kind, error,
                             server)


def _retry_after(status: int, headers: Mapping[str, str], raw: bytes, backoff: float) -> float | None:
    """How long to wait before trying the gateway again: it was unreachable (status 0), or shed the request for its
    own load (`gateway_overloaded`, after its Retry-After); None: the failure is the request's."""
    if status == 0:
        return backoff
    if status in (429, 503) and _code(raw) == "gateway_overloaded":
        return max(backoff, float(_int(headers.get("Retry-After"), 1)))
    return None


def _error_of(raw: bytes) -> dict[str, Any]:
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def _message(raw: bytes) -> str:
    message = _error_of(raw).get("message")
    return str(message) if message else raw[:200].decode("utf-8", "replace")


def _code(raw: bytes) -> str | None:
    code = _error_of(raw).get("code")
    return str(code) if code is not None else None


def _kind_of_code(code: str | None) -> FailureKind:
    """A 502's failure, as the gateway named it (the last attempt's FailureKind value)."""
    try:
        return FailureKind(code) if code else FailureKind.SERVER_ERROR
    except ValueError:
        return FailureKind.SERVER_ERROR


def _int(raw: str | None, default: int) -> int:
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default
