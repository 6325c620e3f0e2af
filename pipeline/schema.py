"""The Record schema of OmniEvaluator §3.1, plus fedpool's per-record provenance."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Part):
    type: Literal["text"] = "text"
    value: str


class ImagePart(_Part):
    type: Literal["image"] = "image"
    value: str  # file path or URL


class AudioPart(_Part):
    type: Literal["audio"] = "audio"
    value: str
    sampling_rate: int | None = None


class VideoPart(_Part):
    type: Literal["video"] = "video"
    value: str
    num_frames: int | None = None
    sampling_strategy: str | None = None


ContentPart = Annotated[TextPart | ImagePart | AudioPart | VideoPart, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: list[ContentPart]


class TextOutput(BaseModel):
    prediction: list[str] = Field(default_factory=list)
    prediction_postprocessed: list[str] = Field(default_factory=list)


class Output(BaseModel):
    text: TextOutput = Field(default_factory=TextOutput)
    reasoning_content: str | None = None


class ErrorKind(StrEnum):
    """Why a record has no prediction: how its last attempt failed (the dispatcher's failure kinds, same
    values) or, for `data`, its own input (a media file that cannot be read)."""

    CONNECT = "connect"
    RESET = "reset"
    DROPPED = "dropped"
    TIMEOUT = "timeout"
    STALLED = "stalled"
    RATE_LIMITED = "rate_limited"
    SERVER_ERROR = "server_error"
    BAD_RESPONSE = "bad_response"
    REQUEST_ERROR = "request_error"
    NO_SERVER = "no_server"
    UNEXPECTED = "unexpected"
    DATA = "data"


class AttemptInfo(BaseModel):
    server_id: str
    latency_s: float
    failure: ErrorKind | None = None
    detail: str | None = None
    lost_race: bool = False  # a copy cancelled because another copy answered first


class Provenance(BaseModel):
    """Where and how the prediction was produced."""

    server_id: str | None = None
    engine: str | None = None
    accelerator: str | None = None
    model: str | None = None
    model_revision: str | None = None
    attempts: int = 0
    attempt_log: list[AttemptInfo] = Field(default_factory=list)
    latency_s: float | None = None
    hedged: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    completed_at: float | None = None


class Record(BaseModel):
    """One sample of one benchmark, end to end: input, label, raw and post-processed output, metrics."""

    model_config = ConfigDict(extra="forbid")

    benchmark: str
    sample_id: str
    messages: list[Message]
    prompt: str | None = None  # the completion prompt actually sent, for completion-style benchmarks
    label: list[str]
    sample: dict[str, Any] = Field(default_factory=dict)  # the dataset row, for rescoring without the data
    output: Output = Field(default_factory=Output)
    metrics: dict[str, float] = Field(default_factory=dict)
    verifier: dict[str, Any] | None = None  # the judge's rating, explanation and whether it parsed
    provenance: Provenance = Field(default_factory=Provenance)

    @property
    def failed(self) -> bool:
        return self.provenance.error is not None
