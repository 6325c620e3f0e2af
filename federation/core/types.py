"""Requests and results on the dispatcher's path (frozen; built by clients, filled by the dispatcher)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fedpool.federation.core.errors import FailureKind


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


# OpenAI generation fields fedpool reads itself; every other field of a body is passed through as given.
TYPED_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Generation parameters, typed where fedpool reads them (the hot path never looks into a dict)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # other OpenAI fields, sent as given

    @property
    def greedy(self) -> bool:
        """Temperature 0: a second copy of the request gives the same answer (modulo batch numerics)."""
        return self.temperature == 0

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> SamplingParams:
        """From a body's generation fields. Values of the wrong type raise ValueError naming the field."""
        return cls._read(fields, _TYPED)

    @classmethod
    def _read(cls, fields: Mapping[str, Any], not_extra: frozenset[str]) -> SamplingParams:
        get = fields.get
        stop = get("stop")
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        elif stop is not None:
            raise ValueError("field 'stop' must be a string or a list of strings")
        return cls(_number(get("max_tokens"), "max_tokens", int), _number(get("temperature"), "temperature", float),
                   _number(get("top_p"), "top_p", float), _number(get("seed"), "seed", int), stop,
                   {k: v for k, v in fields.items() if k not in not_extra})


def _number(value: Any, name: str, kind: type) -> Any:
    if value is None or type(value) is kind:
        return value
    try:
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
            raise ValueError
    except (ValueError, OverflowError):  # (int() of an infinity overflows)
        raise ValueError(f"field {name!r} must be {'an integer' if kind is int else 'a number'}") from None
    return kind(value)


_TYPED = frozenset(TYPED_FIELDS)
_NOT_PARAMS = frozenset(("prompt", "messages", "model", "stream", *TYPED_FIELDS))  # of a whole body


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One OpenAI-compatible request: a prompt (completions) or messages (chat), with typed parameters."""

    request_id: str
    model: str
    endpoint: Endpoint
    prompt: str | tuple[Any, ...] | None = None  # a string, or a batch/token list as OpenAI allows (sent as given)
    messages: tuple[Mapping[str, Any], ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    revision: str | None = None
    client_id: str = "default"
    pinned_engines: tuple[str, ...] | None = None
    pinned_servers: tuple[str, ...] | None = None
    reproducible: bool = False  # bit-for-bit results asked for: never raced against a copy elsewhere

    @classmethod
    def from_body(cls, body: Mapping[str, Any], **fields: Any) -> InferenceRequest:
        """Split an OpenAI body (without `model` and `stream`) into prompt or messages and parameters."""
        prompt = body.get("prompt")
        messages = body.get("messages")
        return cls(prompt=tuple(prompt) if isinstance(prompt, list) else prompt,
                   messages=tuple(messages) if isinstance(messages, list | tuple) else messages,
                   params=SamplingParams._read(body, _NOT_PARAMS), **fields)

    @property
    def hedgeable(self) -> bool:
        """A copy elsewhere cannot change what is recorded: greedy decoding, and no bit-reproducibility asked."""
        return self.params.greedy and not self.reproducible

    def prompt_chars(self) -> int:
        """Characters of prompt text (content parts other than text are not counted)."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        if self.prompt is not None:
            return sum(len(p) for p in self.prompt if isinstance(p, str))
        total = 0
        for message in self.messages or ():
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
        return total

    def route_key(self) -> tuple[object, ...]:
        """What decides which servers may serve it: model, revision, pinned engines and servers."""
        return (self.model, self.revision, self.pinned_engines, self.pinned_servers)

    def prefix_text(self, length: int = 256) -> str:
        """The start of the prompt, for prefix-affinity routing."""
        if self.prompt is not None:
            return (self.prompt if isinstance(self.prompt, str) else repr(list(self.prompt)))[:length]
        return repr(list(self.messages or ()))[:length]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try at one server."""

    server_id: str
    started_at: float
    latency_s: float
    failure: FailureKind | None = None
    detail: str | None = None
    lost_race: bool = False  # a copy raced against another that answered first, cancelled unfinished


@dataclass(frozen=True, slots=True)
class EngineTimes:
    """An answer's own times as its engine reported them (llama.cpp's `timings`): seconds prefilling its prompt and
    seconds decoding its answer after the first token, and how many prompt tokens it prefilled (a prefix cache hit
    prefills fewer than the prompt has; None: not said)."""

    prefill_s: float
    decode_s: float
    prefill_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """One answer, read from the engine's body. The body itself is kept as the engine sent it (`raw`, with its
    `model` field beside it), so a proxy passes the bytes through instead of re-encoding them."""

    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_content: str | None = None
    raw: bytes | None = field(default=None, compare=False, repr=False)  # the engine's JSON body, as sent
    model: str | None = field(default=None, compare=False, repr=False)  # that body's `model` field
    engine_times: EngineTimes | None = field(default=None, compare=False, repr=False)  # where the engine said them


@dataclass(frozen=True, slots=True)
class InferenceResult:
    """A completed request with its provenance."""

    request_id: str
    completion: Completion
    server_id: str
    engine: str
    accelerator: str
    model_revision: str
    latency_s: float
    attempts: tuple[Attempt, ...] = field(default_factory=tuple)
    hedged: bool = False
