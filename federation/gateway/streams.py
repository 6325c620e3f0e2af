"""Streaming through the gateway, and streams that survive a server's death.

Before the first byte reaches the client, a failed upstream is retried elsewhere like any request (the
dispatcher does it). After tokens were sent, the stream is *migrated*: continued from another replica of the
same model, revision and engine (continuation is engine-specific), so the client sees one well-formed stream.
The continuation asks for what is left: the prompt plus the text already sent (completions), or the messages
plus an assistant message holding it (chat, where the engine can continue one: `CHAT_CONTINUATION`; llama.cpp's
server does unless started with `--no-prefill-assistant`), with the remaining `max_tokens`.

Tokens sent are counted one per streamed chunk (as vLLM, SGLang and llama.cpp stream them), so the remaining
`max_tokens` can be off where an engine batches tokens into a chunk. Where continuation is not possible (n > 1,
logprobs, echo, an engine fedpool cannot continue for chat, no other replica) the stream ends with an OpenAI-style
error event and `data: [DONE]`. A greedy continuation can still differ from an uninterrupted run (the join is
re-tokenized; batch composition changes the numerics).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web

from fedpool.federation.core.attempts import replicas
from fedpool.federation.core.dispatcher import Dispatcher
from fedpool.federation.core.errors import AttemptError, FailureKind, NoServerError, RequestFailed
from fedpool.federation.core.types import Endpoint, InferenceRequest, StreamBody
from fedpool.federation.gateway.answers import dumps, loads
from fedpool.federation.gateway.state import elsewhere_may
from fedpool.federation.gateway.unpooled import classify_exception
from fedpool.registry import Engine, PoolSnapshot, ServerEntry

log = logging.getLogger("fedpool.gateway")

MAX_MIGRATIONS = 3  # continuations of one stream before it is given up
PASSED_HEADERS = ("Content-Type", "Cache-Control", "X-Accel-Buffering")
# Engines whose chat endpoint can continue a trailing assistant message, and the fields that ask for it.
CHAT_CONTINUATION: dict[Engine, dict[str, Any]] = {
    Engine.VLLM: {"continue_final_message": True, "add_generation_prompt": False},
    Engine.SGLANG: {"continue_final_message": True},
    Engine.LLAMACPP: {},
}
UPSTREAM_BREAKS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError,
                   TimeoutError, ConnectionResetError)


class ClientGone(Exception):
    """The client closed its end of the stream."""


class _Broke(Exception):
    """The upstream stream broke; raised inside the dispatcher's stream context so it counts a failure."""

    def __init__(self, server: ServerEntry, kind: FailureKind, reached_client: bool):
        self.server, self.kind, self.reached_client = server, kind, reached_client
        super().__init__(f"{server.id}: {kind.value}")


@dataclass
class StreamOutcome:
    """What happened to one relayed stream (the gateway counts it)."""

    migrations: int = 0
    broken: str | None = None  # why the stream ended with an error event
    client_gone: bool = False
    servers: list[str] = field(default_factory=list)


@dataclass
class _Progress:
    text: str = ""  # content already sent to the client
    chunks: int = 0  # chunks with content: tokens, on the engines fedpool knows
    role_sent: bool = False
    finished: bool = False  # a finish_reason was relayed
    done_sent: bool = False
    first_id: str | None = None


class StreamRelay:
    """Relays one streaming request, migrating it when its server dies mid-stream."""

    def __init__(self, dispatcher: Dispatcher, snapshot: Callable[[], PoolSnapshot | None],
                 request: web.Request, req: InferenceRequest, model_name: str):
        self._dispatcher = dispatcher
        self._snapshot = snapshot
        self._request = request
        self._req = req
        self._model = model_name
        self._out: web.StreamResponse | None = None
        self._progress = _Progress()
        self.outcome = StreamOutcome()

    @property
    def started(self) -> bool:
        return self._out is not None

    async def run(self) -> web.StreamResponse:
        """The response (prepared on the first upstream chunk). RequestFailed / NoServerError before it are the
        caller's to answer as JSON errors; after it, the stream ends with an error event.

        Each stream is counted once by the dispatcher: submitted when it starts (a continuation is not a new
        submission), then completed or failed (`stream_ended`, or the dispatcher's own count when its retries
        run out); a client that goes away is neither. The slot is the dispatcher's `stream` context's to give
        back, on every exit from it (cancellation included)."""
        current = self._req
        first = True
        while True:
            try:
                async with self._dispatcher.stream(current, continuation=not first) as upstream:
                    first = False
                    self.outcome.servers.append(upstream.server.id)
                    try:
                        await self._relay(upstream.response, upstream.server)
                    except UPSTREAM_BREAKS as exc:
                        kind = classify_exception(exc, reused_connection=False)
                        raise _Broke(upstream.server, kind, self.started) from exc
                response = await self._finish()
                self._dispatcher.stream_ended(ok=self.outcome.broken is None)
                return response
            except ClientGone:
                self.outcome.client_gone = True  # the client's doing, not a failure of the pool
                return self._out or web.Response(status=499)
            except (RequestFailed, NoServerError) as exc:
                if not self.started and current.pinned_servers is not None and elsewhere_may(exc):
                    current = replace(current, pinned_servers=None)  # (steered, state.py `Steer`: once more, anywhere)
                    continue
                if not self.started:
                    raise
                # A continuation found no replica to run on in time (the dispatcher counted a RequestFailed).
                if isinstance(exc, NoServerError):
                    self._dispatcher.stream_ended(ok=False)
                return await self._end_with_error(f"its continuation failed: {exc}")
            except _Broke as broke:
                self._dispatcher.note_stream_failure(broke.server.id, broke.kind)
                if not broke.reached_client:  # nothing reached the client yet: retried elsewhere, invisibly
                    try:
                        current = self._elsewhere(current, broke)
                    except RequestFailed:
                        self._dispatcher.stream_ended(ok=False)
                        raise
                    continue
                following = self._continuation(broke.server)
                if following is None:
                    self._dispatcher.stream_ended(ok=False)
                    return await self._end_with_error(f"{broke.server.id} died mid-stream and no replica could "
                                                      "continue it")
                current = following
                self.outcome.migrations += 1
                log.warning("stream %s: %s died after %d chunks; continuing on another replica",
                            self._req.request_id, broke.server.id, self._progress.chunks)

    def _elsewhere(self, req: InferenceRequest, broke: _Broke) -> InferenceRequest:
        """The same request, on any other server of its route; where its pins (an online request steered to the
        servers held for it, state.py `Steer`) leave none, on any other of its model (RequestFailed when there is
        none)."""
        snapshot = self._snapshot()
        others: tuple[str, ...] = ()
        for pins in (req.pinned_servers, None) if req.pinned_servers is not None else (None,):
            view = snapshot.filter(model=req.model, revision=req.revision, engines=req.pinned_engines,
                                   server_ids=pins, routable_only=True) if snapshot else None
            others = others or tuple(s.id for s in (view.entries if view else ()) if s.id != broke.server.id)
        if not others:
            err = AttemptError(broke.kind, "the stream broke before its first byte and no other server serves it")
            raise RequestFailed(f"request {req.request_id}: {err}", (), broke.kind, err, broke.server.id)
        return replace(req, pinned_servers=others)

    async def _relay(self, response: StreamBody, server: ServerEntry) -> None:
        content = response.content
        while True:
            line = await content.readline()
            if not line:
                break
            if not line.startswith(b"data:"):
                continue  # comments, other fields, the blank line between events
            event = line[5:].strip()
            if self._out is None:  # the client's response starts with the first upstream event, not before:
                # a server that breaks before sending anything is retried elsewhere, unseen by the client
                headers = {name: response.headers[name] for name in PASSED_HEADERS if name in response.headers}
                headers.setdefault("Content-Type", "text/event-stream")
                headers.setdefault("Cache-Control", "no-cache")
                headers["X-Fedpool-Server"] = server.id
                self._out = web.StreamResponse(headers=headers)
                await self._send(None)
            if event == b"[DONE]":
                await self._send(b"data: [DONE]\n\n")
                self._progress.done_sent = True
                return
            try:
                chunk = loads(event)
            except (ValueError, UnicodeDecodeError):
                continue  # not ours to judge; the engine's next chunk decides
            if isinstance(chunk, dict) and "error" in chunk:
                await self._send(b"data: " + event + b"\n\n")  # the engine's own error event
                self.outcome.broken = "engine error event"
                return
            rewritten = self._rewrite(chunk, event)
            if rewritten is not None:
                await self._send(b"data: " + rewritten + b"\n\n")
        if not self._progress.finished:
            raise aiohttp.ClientPayloadError("the stream ended before a finish_reason")

    def _rewrite(self, chunk: Any, event: bytes) -> bytes | None:
        """One engine chunk as the client's stream has it: the first stream's id and the model it asked for,
        no second `role` delta after a migration; content accumulated for a continuation. The engine's bytes
        (`event`) when nothing changes, as on every chunk of a stream that has not moved."""
        if not isinstance(chunk, dict):
            return None
        progress = self._progress
        progress.first_id = progress.first_id or chunk.get("id")
        same = chunk.get("id") == progress.first_id and chunk.get("model") == self._model
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if self._req.endpoint is Endpoint.CHAT:
                delta = choice.get("delta")
                if not isinstance(delta, dict):
                    delta = {}
                if "role" in delta:
                    if progress.role_sent:
                        choice["delta"] = {k: v for k, v in delta.items() if k != "role"}
                        same = False
                    progress.role_sent = True
                text = delta.get("content")
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                progress.text += text
                progress.chunks += 1
            if choice.get("finish_reason"):
                progress.finished = True
        if same:
            return event
        return dumps({**chunk, "id": progress.first_id, "model": self._model})

    def _continuation(self, dead: ServerEntry) -> InferenceRequest | None:
        """The request that continues the stream on another replica, or None where that is not possible."""
        req, progress = self._req, self._progress
        if self.outcome.migrations >= MAX_MIGRATIONS or progress.finished:
            return None
        extra = req.params.extra
        if any(extra.get(k) for k in ("logprobs", "echo", "top_logprobs")) or (extra.get("n") or 1) != 1:
            return None
        snapshot = self._snapshot()
        others = tuple(s.id for s in (snapshot.entries if snapshot else ())
                       if s.id != dead.id and s.status.routable and replicas(dead, s))
        if not others:
            return None
        left = None if req.params.max_tokens is None else req.params.max_tokens - progress.chunks
        if left is not None and left < 1:
            return None
        params = replace(req.params, max_tokens=left)
        if req.endpoint is Endpoint.COMPLETIONS:
            if not isinstance(req.prompt, str):
                return None
            return replace(req, prompt=req.prompt + progress.text, params=params, pinned_servers=others,
                           revision=dead.record.revision)
        fields = CHAT_CONTINUATION.get(dead.engine)
        if fields is None or not req.messages:
            return None
        messages = (*req.messages, {"role": "assistant", "content": progress.text})
        params = replace(params, extra={**params.extra, **fields})
        return replace(req, messages=messages, params=params, pinned_servers=others, revision=dead.record.revision)

    async def _finish(self) -> web.StreamResponse:
        assert self._out is not None
        if not self._progress.done_sent:
            await self._send(b"data: [DONE]\n\n")
        with_eof = self._out
        try:
            await with_eof.write_eof()
        except (ConnectionResetError, RuntimeError):
            self.outcome.client_gone = True
        return with_eof

    async def _end_with_error(self, why: str) -> web.StreamResponse:
        self.outcome.broken = why
        log.warning("stream %s: %s", self._req.request_id, why)
        error = {"error": {"message": why, "type": "upstream_error", "param": None, "code": "stream_broken"}}
        try:
            await self._send(b"data: " + dumps(error) + b"\n\n")
            await self._send(b"data: [DONE]\n\n")
            assert self._out is not None
            await self._out.write_eof()
        except ClientGone:
            self.outcome.client_gone = True
        assert self._out is not None
        return self._out

    async def _send(self, data: bytes | None) -> None:
        """Prepare (data None) or write to the client; ClientGone when it went away."""
        assert self._out is not None
        try:
            if data is None:
                await self._out.prepare(self._request)
            else:
                await self._out.write(data)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError) as exc:
            raise ClientGone() from exc
