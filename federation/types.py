"""Requests and results on the dispatcher's path (frozen; built by clients, filled by the dispatcher)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fedpool.federation.errors import FailureKind


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One OpenAI-compatible request. `body` holds prompt or messages and generation parameters."""

    request_id: str
    model: str
    endpoint: Endpoint
    body: dict[str, Any]
    revision: str | None = None
    client_id: str = "default"
    pinned_engines: tuple[str, ...] | None = None
    pinned_servers: tuple[str, ...] | None = None

    def payload(self) -> dict[str, Any]:
        return {**self.body, "model": self.model, "stream": False}

    def prompt_chars(self) -> int:
        """Characters of prompt text (content parts other than text are not counted)."""
        if "prompt" in self.body:
            return len(str(self.body["prompt"]))
        total = 0
        for message in self.body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
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
        if "prompt" in self.body:
            return str(self.body["prompt"])[:length]
        messages = self.body.get("messages") or []
        return repr(messages)[:length]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try at one server."""

    server_id: str
    started_at: float
    latency_s: float
    failure: FailureKind | None = None
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_content: str | None = None
    body: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # the server's JSON, as sent


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
