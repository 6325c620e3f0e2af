"""What an engine's answers say, read apart from how they came: JSON in and out, an error's own message, the
engine's timings, and an OpenAI event stream assembled into one completion (federation/gateway/transport.py
sends the requests; a whole answer's body is read there, on every request's path)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from fedpool.federation.core.errors import AttemptError, FailureKind
from fedpool.federation.core.types import Completion, Endpoint, EngineTimes, StreamProgress

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
MAX_ERROR_MESSAGE_CHARS = 2000
STREAM_USAGE = {"include_usage": True}  # OpenAI's stream option: the last event carries the token counts


def loads(raw: bytes | str) -> Any:
    """JSON in, Python out: orjson (several times json's speed on completion bodies), falling back to json for what
    only json accepts (NaN, Infinity, a byte-order mark), so no engine's answer is refused for its dialect.
    Raises json.JSONDecodeError (orjson's error is a subclass) or UnicodeDecodeError."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(value: Any) -> bytes:
    """Compact JSON bytes (orjson, much faster than json on request bodies); json for what orjson refuses
    (integers past 64 bits, keys that are not strings)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()


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


async def assemble_stream(
    content: aiohttp.StreamReader, endpoint: Endpoint, progress: StreamProgress | None = None
) -> Completion:
    """Read an OpenAI event stream (`data: {...}` lines, `data: [DONE]` last) to its end into one completion:
    the text of every event joined, the last finish_reason, the usage of the event that carries it. Without a
    usage event the completion tokens are the events that carried text (one token an event on the engines in
    `STREAMED_ENGINES`) and the prompt tokens are unknown. An error event, a body past MAX_RESPONSE_BYTES, or a
    stream that ends before its last event is an AttemptError. `progress` is marked at the first bytes."""
    assembly = _Assembly(endpoint is Endpoint.CHAT)
    size = 0
    buffer = b""
    async for chunk in content.iter_any():
        if progress is not None:
            progress.mark()
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
                return assembly.completion(done=True)
            assembly.add(payload)
    return assembly.completion(done=False)


@dataclass(slots=True)
class _Assembly:
    """The events of one stream so far (`assemble_stream`)."""

    chat: bool
    parts: list[str] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    timings: dict[str, Any] | None = None
    events: int = 0  # events that carried text (or reasoning)

    def add(self, payload: bytes) -> None:
        """One `data:` event's JSON."""
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
        if self.model is None and type(event.get("model")) is str:
            self.model = event["model"]
        if type(event.get("usage")) is dict:
            self.usage = event["usage"]
        if type(event.get("timings")) is dict:
            self.timings = event["timings"]
        choices = event.get("choices")
        if not choices:
            return  # the usage event has none
        choice = choices[0] if type(choices) is list else None
        if type(choice) is not dict:
            raise AttemptError(FailureKind.BAD_RESPONSE, "stream event has no choice")
        self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        if self.chat:
            delta = choice.get("delta")
            if type(delta) is dict:
                text, thought = delta.get("content"), delta.get("reasoning_content")
                if type(thought) is str and thought:
                    self.thoughts.append(thought)
                    self.events += 1
                if type(text) is str and text:
                    self.parts.append(text)
                    self.events += 1
        elif type(text := choice.get("text")) is str and text:
            self.parts.append(text)
            self.events += 1
        if type(choice.get("finish_reason")) is str:
            self.finish = choice["finish_reason"]

    def completion(self, *, done: bool) -> Completion:
        """The completion the events make (`done`: `data: [DONE]` came); a stream cut short is a BAD_RESPONSE."""
        if not done and self.finish is None:
            raise AttemptError(FailureKind.BAD_RESPONSE, "stream ended before its last event")
        usage = self.usage
        prompt_tokens: int | None = None
        completion_tokens: int | None = self.events
        if usage is not None:
            prompt_tokens = usage.get("prompt_tokens") if type(usage.get("prompt_tokens")) is int else None
            if type(usage.get("completion_tokens")) is int:
                completion_tokens = usage["completion_tokens"]
        return Completion(
            "".join(self.parts),
            self.finish,
            prompt_tokens,
            completion_tokens,
            "".join(self.thoughts) if self.thoughts else None,
            None,
            self.model,
            engine_times(self.timings),
        )


