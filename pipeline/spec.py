"""Benchmark specs (YAML): data source, prompt template, generation parameters, labels, scoring."""

from __future__ import annotations

import hashlib
import string
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedpool.pipeline.errors import SpecError
from fedpool.pipeline.metrics import METRICS
from fedpool.pipeline.postprocess import POSTPROCESSORS
from fedpool.pipeline.yamlfile import field_problems, read_yaml


class DataSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    # inferred when omitted: from the suffix, or `hf` for a directory made by datasets' save_to_disk
    format: Literal["jsonl", "csv", "parquet", "hf"] | None = None
    split: str | None = None  # hf: which split of a saved DatasetDict (required when it has several)
    limit: int | None = Field(default=None, ge=1)


class MediaSpec(BaseModel):
    """A column holding a media file's path (relative to the data file), sent with the user message."""

    model_config = ConfigDict(extra="forbid")

    field: str = Field(min_length=1)
    type: Literal["image", "audio", "video"]
    num_frames: int | None = Field(default=None, ge=1, le=256)  # video: frames sent (default 8)
    sampling: Literal["uniform", "first"] = "uniform"  # video: which frames

    @model_validator(mode="after")
    def _frames_only_for_video(self) -> MediaSpec:
        if self.type != "video" and self.num_frames is not None:
            raise ValueError(f"media field {self.field!r}: num_frames applies to video only")
        return self


class PromptSpec(BaseModel):
    """`completion`: `template` is rendered into one prompt string. `chat`: into a user message, followed
    by the sample's media (images, audio, video frames) in the order of `media`."""

    model_config = ConfigDict(extra="forbid")

    style: Literal["completion", "chat"] = "completion"
    template: str = Field(min_length=1)
    system: str | None = None
    media: list[MediaSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _media_needs_chat(self) -> PromptSpec:
        if self.media and self.style != "chat":
            raise ValueError("media parts need style: chat (a completion prompt is text only)")
        return self

    @field_validator("template")
    @classmethod
    def _check_template(cls, value: str) -> str:
        try:
            parsed = list(string.Formatter().parse(value))
        except ValueError as exc:
            raise ValueError(f"template is not a valid format string: {exc}") from exc
        for _, name, spec, conversion in parsed:
            if name is None:
                continue
            if spec or conversion:
                raise ValueError(f"template field {{{name}}} must not carry a conversion or format spec")
            if not name.isidentifier():
                raise ValueError(f"template field {{{name}}} must be a plain column name")
        return value

    def fields(self) -> list[str]:
        return [f for _, f, _, _ in string.Formatter().parse(self.template) if f]


class GenerationParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=32, ge=1, le=32768)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = 0
    # Bit-for-bit results: every answer comes from the one server the request was first sent to (never from
    # whichever of two raced copies answered first). Hedging and tail stealing are off for this benchmark.
    bit_reproducible: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class BenchmarkSpec(BaseModel):
    """Everything that decides a benchmark's score, in one inspectable object (OmniEvaluator §3.2)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    version: str = "1"
    description: str = ""
    data: DataSource
    id_field: str = "id"
    label_field: str = "answer"
    prompt: PromptSpec
    generation: GenerationParams = Field(default_factory=GenerationParams)
    postprocess: list[str] = Field(default_factory=lambda: ["strip"])
    metrics: list[str] = Field(default_factory=lambda: ["exact_match"], min_length=1)
    verifier: bool = False  # also judge every prediction with the CPU verifier (score 0–100 beside the metric)
    source_file: str | None = Field(default=None, exclude=True)

    @field_validator("postprocess")
    @classmethod
    def _known_postprocess(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in POSTPROCESSORS:
                raise ValueError(f"unknown post-processor {name!r}; known: {', '.join(sorted(POSTPROCESSORS))}")
        return value

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in METRICS:
                raise ValueError(f"unknown metric {name!r}; known: {', '.join(sorted(METRICS))}")
        return value

    @model_validator(mode="after")
    def _label_not_in_prompt(self) -> BenchmarkSpec:
        if self.label_field in self.prompt.fields():
            raise ValueError(f"prompt template shows the label field {self.label_field!r} to the model")
        if self.label_field in {m.field for m in self.prompt.media}:
            raise ValueError(f"prompt media sends the label field {self.label_field!r} to the model")
        return self

    def data_path(self) -> Path:
        path = Path(self.data.path)
        if not path.is_absolute() and self.source_file:
            path = Path(self.source_file).parent / path
        return path

    def at_once(self, concurrency: int) -> int:
        """The most requests a run of this spec has in flight at once with `concurrency` workers (fewer where its
        sample limit is smaller): what it asks the pool's capacity leases for before its samples are read."""
        return min(concurrency, self.data.limit or concurrency)

    def fingerprint(self) -> str:
        """Hash of everything that changes predictions or scores (not the file location)."""
        return hashlib.sha256(self.model_dump_json(exclude={"source_file"}).encode()).hexdigest()[:16]


def load_spec(path: str | Path) -> BenchmarkSpec:
    """Read a YAML spec; errors name the file and the offending field (or YAML line)."""
    path = Path(path)
    raw = read_yaml(path, SpecError, missing="no such benchmark spec")
    return spec_from_dict(raw, source=str(path))


def spec_from_dict(raw: Any, *, source: str) -> BenchmarkSpec:
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: a benchmark spec must be a mapping, got {type(raw).__name__}")
    try:
        return BenchmarkSpec.model_validate({**raw, "source_file": source})
    except ValidationError as exc:
        raise SpecError(f"{source}: {field_problems(exc)}") from None


def load_specs(paths: Iterable[str | Path], limit: int | None = None) -> list[BenchmarkSpec]:
    """Several specs; with `limit`, each reads only its dataset's first `limit` samples."""
    specs = [load_spec(p) for p in paths]
    if limit is not None:
        specs = [s.model_copy(update={"data": s.data.model_copy(update={"limit": limit})}) for s in specs]
    return specs
