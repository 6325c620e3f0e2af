"""How the dispatcher reaches a server: the `Transport` interface (one attempt, or one opened stream, typed
failures) and its implementation over HTTP (aiohttp). Tests and the simulator in benchmarks/ implement the
same interface in process."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
import math
import secrets
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson

from fedpool.federation.core.errors import AttemptError, FailureKind, kind_for_status
from fedpool.federation.core.types import (
    TYPED_FIELDS,
    Completion,
    Endpoint,
    EngineTimes,
    InferenceRequest,
    StreamProgress,
    Target,
    Timeouts,
    sends_stream,
)
from fedpool.federation.gateway.upstream import KeepAlivePool, pool_of

log = logging.getLogger("fedpool.transport")

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024  # of an error answer: the engine's message is in its first few hundred bytes
MAX_ERROR_MESSAGE_CHARS = 2000
JSON_HEADERS = {"Content-Type": "application/json"}
ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5.0)  # an abort call to an engine (HttpTransport._abort)
# Failures after which the engine may still be running the request (so an engine that aborts by id is asked to)
ABORTED_AFTER = frozenset({FailureKind.TIMEOUT, FailureKind.RESET, FailureKind.CONNECT})


def loads(raw: bytes | str) -> Any:
    """JSON in, Python out: orjson (about 3x json's speed on completion bodies), falling back to json for what
    only json accepts (NaN, Infinity, a byte-order mark), so no engine's answer is refused for its dialect.
    Raises json.JSONDecodeError (orjson's error is a subclass) or UnicodeDecodeError."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(value: Any) -> bytes:
    """Compact JSON bytes (orjson: about 10x json's speed on request bodies); json for what orjson refuses
    (integers past 64 bits, keys that are not strings)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()


def client_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=timeouts.total_s, sock_connect=timeouts.connect_s,
                                 sock_read=timeouts.first_byte_s)


def whole_answer_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    """For an answer sent whole (not streamed): its first byte is its last, so the shorter of first byte and total
    bounds it, with no read timer besides. aiohttp re-arms a read timeout on every chunk it receives: two timer
    handles more a request, each a heap push on the loop."""
    return aiohttp.ClientTimeout(total=min(timeouts.first_byte_s, timeouts.total_s), sock_connect=timeouts.connect_s)


_ATTEMPT: contextvars.ContextVar[SimpleNamespace | None] = contextvars.ContextVar("fedpool_attempt", default=None)


class ReuseTrackingConnector(aiohttp.TCPConnector):
    """aiohttp's connector, telling the attempt it connects for (`_ATTEMPT`, in the caller's context) whether the
    connection came from its pool: a reset there is a stale keep-alive connection's, not the server's. (An aiohttp
    TraceConfig says the same, but with any trace config aiohttp builds and awaits six trace events a request:
    ~10% of a pass-through request's CPU.)"""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        # The dispatcher's plain answers go over this leaner pool instead (federation/gateway/upstream.py); it closes
        # with the connector, so with the session. A capped connector keeps every request on aiohttp's.
        self.keepalive: KeepAlivePool | None = KeepAlivePool() if not kwargs.get("limit") else None
        # Connections that carried a request already, as weak references without callbacks (CPython shares one
        # such reference per object, and a set of them is all C; a WeakSet costs Python calls per lookup). The
        # references of closed connections are pruned as the set doubles.
        self._used: set[weakref.ref[Any]] = set()
        self._prune_at = 1024

    async def close(self, *, abort_ssl: bool = False) -> None:
        if self.keepalive is not None:
            self.keepalive.close()
        await super().close(abort_ssl=abort_ssl)

    async def connect(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Any:  # noqa: ASYNC109 (its signature)
        connection = await super().connect(req, traces, timeout)
        protocol = connection.protocol
        if protocol is not None:
            used = weakref.ref(protocol)
            if used in self._used:
                attempt = _ATTEMPT.get()
                if attempt is not None:
                    attempt.reused = True
            else:
                self._used.add(used)
                if len(self._used) > self._prune_at:
                    self._used = {ref for ref in self._used if ref() is not None}
                    self._prune_at = max(1024, 2 * len(self._used))
        return connection


class HttpTransport:
    """The Transport over one shared aiohttp session (no connection cap: admission windows bound the load).

    On an engine that aborts a request by id (`Target.abort_path`: SGLang), each attempt carries an id of its own
    (`rid`), and an attempt cancelled before its answer (a hedge's losing copy, a slot given back, a caller gone)
    is aborted there at once: SGLang notices a closed connection only at its next 4 s check, running or queueing
    the request until then."""

    def __init__(self, session: aiohttp.ClientSession, timeouts: Timeouts | None = None):
        self.session = session
        self.timeouts = timeouts or Timeouts()
        self._timeout = client_timeout(self.timeouts)
        self._whole_timeout = whole_answer_timeout(self.timeouts)
        self._whole_s = min(self.timeouts.first_byte_s, self.timeouts.total_s)
        self._keepalive = pool_of(session)
        self._rid_prefix = f"fedpool-{secrets.token_hex(6)}-"  # ids unique across processes sharing an engine
        self._rids = itertools.count()
        self._aborts: set[asyncio.Task[None]] = set()  # abort calls under way (held until they end)
        self.aborted = 0  # abort calls that reached the engine

    async def complete(
        self, server: Target, request: InferenceRequest, progress: StreamProgress | None = None
    ) -> Completion:
        """POST the request; return the parsed completion (with the engine's bytes) or raise AttemptError. On a
        server whose engine is asked for streams, a request a stream can carry whole (`sends_stream`) is sent
        with stream=true and its events assembled into the completion."""
        if sends_stream(server, request):
            return await self._assembled(server, request, progress)
        body = request_body(request)
        abort_path = server.abort_path
        if abort_path is not None:
            body["rid"] = rid = f"{self._rid_prefix}{next(self._rids)}"
        try:
            data = orjson.dumps(body)
        except TypeError:  # what orjson refuses (integers past 64 bits, keys that are not strings)
            data = json.dumps(body).encode()
        url = server.url + request.endpoint
        pool = self._keepalive
        if pool is not None and (destination := pool.destination(url)) is not None:
            try:
                answer = await pool.post(
                    destination,
                    data,
                    timeout_s=self._whole_s,
                    connect_s=self.timeouts.connect_s,
                    limit=MAX_RESPONSE_BYTES,
                )
            except AttemptError as exc:
                if abort_path is not None and exc.kind in ABORTED_AFTER:
                    self._abort(server.url + abort_path, rid)
                raise
            except asyncio.CancelledError:
                if abort_path is not None:
                    self._abort(server.url + abort_path, rid)
                raise
            if answer.status != 200:
                raise http_error(answer.status, answer.body[:MAX_ERROR_BODY_BYTES])
            return parse_completion(answer.body, request.endpoint)
        attempt = SimpleNamespace(reused=False)
        _ATTEMPT.set(attempt)  # this task's context: the connector notes there whether it reused a connection
        try:
            async with self.session.post(url, data=data, headers=JSON_HEADERS, timeout=self._whole_timeout) as resp:
                if resp.status != 200:
                    raise http_error(resp.status, await read_body(resp, MAX_ERROR_BODY_BYTES, cut=True))
                length = resp.content_length
                raw = (
                    await resp.read()
                    if length is not None and length <= MAX_RESPONSE_BYTES
                    else await read_body(resp, MAX_RESPONSE_BYTES)
                )
        except AttemptError:
            raise
        except asyncio.CancelledError:
            if abort_path is not None:
                self._abort(server.url + abort_path, rid)
            raise
        except Exception as exc:
            if abort_path is not None:  # (a timeout, a reset: the engine may still be running it)
                self._abort(server.url + abort_path, rid)
            raise transport_error(exc, attempt.reused) from exc
        return parse_completion(raw, request.endpoint)

    async def settle(self) -> None:
        """Wait for the abort calls under way to end."""
        while self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)

    def _abort(self, url: str, rid: str) -> None:
        """Ask the engine to abort the request `rid` (off the caller's path: the call runs as a task of its own,
        held until it ends; a failure is only logged — the engine's own check of the closed connection remains)."""
        task = asyncio.get_running_loop().create_task(self._post_abort(url, rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _post_abort(self, url: str, rid: str) -> None:
        try:
            async with self.session.post(
                url, data=dumps({"rid": rid}), headers=JSON_HEADERS, timeout=ABORT_TIMEOUT
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    self.aborted += 1
                else:
                    log.debug("abort of %s at %s: HTTP %s", rid, url, resp.status)
        except Exception as exc:  # the session closing, the server gone: nothing is left to abort there
            log.debug("abort of %s at %s failed: %r", rid, url, exc)

    async def _assembled(
        self, server: Target, request: InferenceRequest, progress: StreamProgress | None
    ) -> Completion:
        attempt = SimpleNamespace(reused=False)
        _ATTEMPT.set(attempt)
        body = request_body(request, stream=True)
        body["stream_options"] = STREAM_USAGE
        try:
            async with self.session.post(
                server.url + request.endpoint, data=dumps(body), headers=STREAM_HEADERS, timeout=self._timeout
            ) as resp:
                if resp.status != 200:
                    raise http_error(resp.status, await read_body(resp, MAX_ERROR_BODY_BYTES, cut=True))
                return await assemble_stream(resp.content, request.endpoint, progress)
        except AttemptError:
            raise
        except Exception as exc:
            raise transport_error(exc, attempt.reused) from exc

    async def open_stream(self, server: Target, request: InferenceRequest) -> aiohttp.ClientResponse:
        return await open_stream(self.session, server.url, request, self.timeouts, self._timeout, close=server.streamed)


@dataclass(frozen=True, slots=True)
class UrlTarget:
    """A server known by its URL alone (outside a dispatcher), asked for streams or not."""

    id: str
    url: str
    streamed: bool = False
    abort_path: str | None = None


def new_session(*, limit: int = 0) -> aiohttp.ClientSession:
    """The one shared session a dispatcher uses (no global connection cap; windows bound the load)."""
    return aiohttp.ClientSession(connector=ReuseTrackingConnector(limit=limit, ttl_dns_cache=300))


async def post_completion(
    session: aiohttp.ClientSession, base_url: str, request: InferenceRequest, timeouts: Timeouts
) -> Completion:
    """POST the request to one server outside any dispatcher; the parsed completion, or AttemptError."""
    return await HttpTransport(session, timeouts).complete(UrlTarget(base_url, base_url), request)


def request_body(request: InferenceRequest, stream: bool = False) -> dict[str, Any]:
    """The OpenAI body of a request: its generation fields (typed ones as set, the rest passed through as
    given), prompt or messages, model, stream."""
    params = request.params
    body: dict[str, Any] = dict(params.extra)
    for name in TYPED_FIELDS:
        value = getattr(params, name)
        if value is not None:
            body[name] = list(value) if name == "stop" else value
    prompt = request.prompt
    if prompt is not None:
        body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
    if request.messages is not None:
        body["messages"] = list(request.messages)
    body["model"] = request.model
    body["stream"] = stream
    return body


# Engines whose answers are asked for as a stream and assembled into one completion. llama.cpp's server (this
# pool's build) runs a non-streamed request to its end after its client has gone — four cancelled 200-token
# requests kept all 4 slots busy 6 s later — but stops a streamed one at its next token (within 0.5 s). Streamed,
# a request fedpool cancels (a hedge's losing copy, a slot given back to a shrunk lease, a gateway client that
# went away) frees the engine's slot, not only fedpool's count of it. vLLM aborts a request whose connection
# closed either way, SGLang at once by its id (`HttpTransport`, `Target.abort_path`); a server of unknown kind is
# asked for what its caller asked.
# llama.cpp's server also closes the connection after every stream though its head says keep-alive: a streamed
# request to these engines asks for `Connection: close`, so no pooled connection is reused after the engine closed
# it (the next request on it would fail as a reset).
STREAM_HEADERS = {**JSON_HEADERS, "Connection": "close"}
STREAM_USAGE = {"include_usage": True}  # OpenAI's stream option: the last event carries the token counts


async def assemble_stream(
    content: aiohttp.StreamReader, endpoint: Endpoint, progress: StreamProgress | None = None
) -> Completion:
    """Read an OpenAI event stream (`data: {...}` lines, `data: [DONE]` last) to its end into one completion:
    the text of every event joined, the last finish_reason, the usage of the event that carries it. Without a
    usage event the completion tokens are the events that carried text (one token an event on the engines in
    `STREAMED_ENGINES`) and the prompt tokens are unknown. An error event, a body past MAX_RESPONSE_BYTES, or a
    stream that ends before its last event is an AttemptError. `progress` is marked at the first bytes."""
    chat = endpoint is Endpoint.CHAT
    parts: list[str] = []
    thoughts: list[str] = []
    finish = usage = model = timings = None
    size = 0
    events = 0
    done = False
    buffer = b""
    async for chunk in content.iter_any():
        if progress is not None:
            progress.decoding = True
            progress = None
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise AttemptError(
                FailureKind.BAD_RESPONSE, f"response larger than {MAX_RESPONSE_BYTES // (1024 * 1024)} MiB"
            )
        lines = (buffer + chunk).split(b"\n")
        buffer = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, `event:` lines
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError as exc:
                raise AttemptError(FailureKind.BAD_RESPONSE, "stream event is not JSON") from exc
            if type(event) is not dict:
                raise AttemptError(FailureKind.BAD_RESPONSE, "stream event is not a JSON object")
            if "error" in event:
                raise AttemptError(
                    FailureKind.SERVER_ERROR, "error event in the stream", upstream_message=upstream_message(payload)
                )
            if model is None and type(event.get("model")) is str:
                model = event["model"]
            if type(event.get("usage")) is dict:
                usage = event["usage"]
            if type(event.get("timings")) is dict:
                timings = event["timings"]
            choices = event.get("choices")
            if not choices:
                continue  # the usage event has none
            choice = choices[0] if type(choices) is list else None
            if type(choice) is not dict:
                raise AttemptError(FailureKind.BAD_RESPONSE, "stream event has no choice")
            if chat:
                delta = choice.get("delta")
                if type(delta) is dict:
                    text, thought = delta.get("content"), delta.get("reasoning_content")
                    if type(thought) is str and thought:
                        thoughts.append(thought)
                        events += 1
                    if type(text) is str and text:
                        parts.append(text)
                        events += 1
            elif type(text := choice.get("text")) is str and text:
                parts.append(text)
                events += 1
            if type(choice.get("finish_reason")) is str:
                finish = choice["finish_reason"]
        if done:
            break
    if not done and finish is None:
        raise AttemptError(FailureKind.BAD_RESPONSE, "stream ended before its last event")
    prompt_tokens: int | None = None
    completion_tokens: int | None = events
    if usage is not None:
        prompt_tokens = usage.get("prompt_tokens") if type(usage.get("prompt_tokens")) is int else None
        completion_tokens = usage.get("completion_tokens") if type(usage.get("completion_tokens")) is int else events
    return Completion(
        "".join(parts),
        finish,
        prompt_tokens,
        completion_tokens,
        "".join(thoughts) if thoughts else None,
        None,
        model,
        engine_times(timings),
    )


def transport_error(exc: BaseException, reused_connection: bool) -> AttemptError:
    kind = classify_exception(exc, reused_connection=reused_connection)
    if kind is FailureKind.UNEXPECTED:
        log.warning("unexpected %s on the request path: %s", type(exc).__name__, str(exc)[:300])
        return AttemptError(kind, f"{type(exc).__name__}: {str(exc)[:300]}")
    return AttemptError(kind, type(exc).__name__)


def http_error(status: int, raw: bytes) -> AttemptError:
    """A non-200 answer as an AttemptError carrying the engine's own message (vLLM, SGLang and llama.cpp put
    it in `{"error": {"message": ...}}`, older SGLang in `{"message": ...}`; otherwise the body's text)."""
    return AttemptError(
        kind_for_status(status), f"HTTP {status}", status=status, upstream_message=upstream_message(raw)
    )


def upstream_message(raw: bytes, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str | None:
    text = raw[: 4 * limit].decode("utf-8", errors="replace").strip()
    if not text:
        return None
    try:
        body = loads(text)
    except json.JSONDecodeError:
        return text[:limit]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:limit]
        if isinstance(error, str):
            return error[:limit]
        if isinstance(body.get("message"), str):
            return body["message"][:limit]
        if isinstance(body.get("detail"), str):
            return body["detail"][:limit]
    return text[:limit]


async def open_stream(
    session: aiohttp.ClientSession, base_url: str, request: InferenceRequest, timeouts: Timeouts,
    read_timeout: aiohttp.ClientTimeout | None = None, *, close: bool = False,
) -> aiohttp.ClientResponse:
    """POST with stream=true; returns the open response once its head says 200 (the caller reads and
    releases it), or raises AttemptError. Nothing has reached the caller's client yet, so a failure
    here can still be retried elsewhere. Cancelled while it waits for the head, the connection is closed
    (aiohttp's own handling): nothing is left open. `close`: the engine closes the connection after a stream
    (STREAMED_ENGINES), so it is not kept for another request."""
    attempt = SimpleNamespace(reused=False)
    _ATTEMPT.set(attempt)
    try:
        resp = await session.post(base_url + request.endpoint.value, data=dumps(request_body(request, stream=True)),
                                  headers=STREAM_HEADERS if close else JSON_HEADERS,
                                  timeout=read_timeout or client_timeout(timeouts))
    except Exception as exc:
        raise transport_error(exc, attempt.reused) from exc
    if resp.status != 200:
        try:
            raw = await read_body(resp, MAX_ERROR_BODY_BYTES, cut=True)
        except Exception:  # the body of an error is a courtesy; the status decides
            raw = b""
        finally:
            resp.release()
        raise http_error(resp.status, raw)
    return resp


async def read_body(resp: aiohttp.ClientResponse, limit: int, *, cut: bool = False) -> bytes:
    """The whole body, up to `limit` bytes: past it, AttemptError (BAD_RESPONSE), or with `cut` its first
    `limit` bytes. (`content.read(n)` alone returns what has arrived so far, which is not the whole body.)"""
    length = resp.content_length
    if length is not None and length <= limit:
        return await resp.read()
    if length is not None and not cut:
        raise AttemptError(FailureKind.BAD_RESPONSE, f"response larger than {limit // (1024 * 1024)} MiB")
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            if cut:
                break
            raise AttemptError(FailureKind.BAD_RESPONSE, f"response larger than {limit // (1024 * 1024)} MiB")
    return b"".join(parts)[:limit]


def parse_completion(raw: bytes, endpoint: Endpoint) -> Completion:
    """Read an OpenAI completion body; anything off-schema is a BAD_RESPONSE, never a crash. The body's bytes
    are kept on the completion (`raw`, with its `model`), for a proxy to pass through as they are."""
    try:
        body = orjson.loads(raw)  # (loads(), inlined: every answer passes here)
    except orjson.JSONDecodeError:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AttemptError(FailureKind.BAD_RESPONSE, f"body is not JSON ({exc.__class__.__name__})") from exc
    if not isinstance(body, dict):
        raise AttemptError(FailureKind.BAD_RESPONSE, "body is not a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise AttemptError(FailureKind.BAD_RESPONSE, "body has no choices")
    choice = choices[0]
    reasoning = None
    if endpoint is Endpoint.CHAT:
        message = choice.get("message")
        if not isinstance(message, dict):
            raise AttemptError(FailureKind.BAD_RESPONSE, "chat choice has no message")
        text = message.get("content")
        reasoning = message.get("reasoning_content")
        if text is None and isinstance(reasoning, str):
            text = ""
    else:
        text = choice.get("text")
    if not isinstance(text, str):
        raise AttemptError(FailureKind.BAD_RESPONSE, "choice has no text")
    usage = body.get("usage")
    prompt_tokens = completion_tokens = None
    if type(usage) is dict:
        prompt_tokens, completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if type(prompt_tokens) is not int:  # (bool is not int here: JSON's true is no count)
            prompt_tokens = None
        if type(completion_tokens) is not int:
            completion_tokens = None
    finish = choice.get("finish_reason")
    model = body.get("model")
    return Completion(
        text,
        finish if type(finish) is str else None,
        prompt_tokens,
        completion_tokens,
        reasoning if type(reasoning) is str else None,
        raw,
        model if type(model) is str else None,
        engine_times(body.get("timings"), body.get("metrics")),
    )


def engine_times(timings: Any, metrics: Any = None) -> EngineTimes | None:
    """An answer's own prefill and decode times as its engine reported them: llama.cpp's `timings` (`prompt_ms`,
    `predicted_ms`, and `prompt_n`: the prompt tokens it prefilled), or vLLM's per-request `metrics` (with
    `--enable-per-request-metrics`: `time_to_first_token_ms` from its scheduling, `generation_time_ms` after the first
    token). None where a body carries neither, or carries them malformed."""
    if type(timings) is dict:
        prefill, decode, tokens = timings.get("prompt_ms"), timings.get("predicted_ms"), timings.get("prompt_n")
    elif type(metrics) is dict:
        prefill, decode, tokens = metrics.get("time_to_first_token_ms"), metrics.get("generation_time_ms"), None
    else:
        return None
    if (
        not (isinstance(prefill, int | float) and isinstance(decode, int | float))
        or type(prefill) is bool
        or type(decode) is bool
    ):
        return None
    prefill_ms, decode_ms = float(prefill), float(decode)
    if not (math.isfinite(prefill_ms) and math.isfinite(decode_ms)) or prefill_ms < 0 or decode_ms < 0:
        return None
    return EngineTimes(prefill_ms / 1000.0, decode_ms / 1000.0, tokens if type(tokens) is int and tokens >= 0 else None)


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
