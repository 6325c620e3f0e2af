"""The registration wire format: what an operator (or a launcher) tells the registry about a server."""

from __future__ import annotations

import re
import time
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator

SERVER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
LABEL_KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")

# Canonical accelerator names; anything else is kept as given (upper-cased) so new chips need no release.
_ACCELERATOR_ALIASES = {
    "a100": "A100",
    "a100-80gb": "A100",
    "a100-40gb": "A100",
    "v100": "V100",
    "v100-32gb": "V100",
    "v100-16gb": "V100",
    "h100": "H100",
    "h200": "H200",
    "l4": "L4",
    "l40s": "L40S",
    "a10g": "A10G",
    "t4": "T4",
    "cpu": "cpu",
}


class Engine(StrEnum):
    """Inference engines the registry has adapters for."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    OPENAI = "openai"


ACCELERATOR_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,31}$")


def normalize_accelerator(value: str) -> str:
    """Map 'a100-80gb', 'A100' … to one canonical spelling so pools group and weigh them alike. Anything else
    must look like an accelerator name (letters, digits, `._+-`, at most 32): it is shown in tables, logs and
    metrics labels."""
    key = value.strip().lower()
    if not key:
        raise ValueError("accelerator must not be empty (use 'cpu' for CPU-only servers)")
    if not ACCELERATOR_PATTERN.match(value.strip()):
        raise ValueError(f"accelerator {value.strip()[:40]!r} is not a device name (letters, digits and ._+- only, "
                         "at most 32 characters; e.g. A100, H100, cpu)")
    return _ACCELERATOR_ALIASES.get(key, value.strip().upper())


class ServerRecord(BaseModel):
    """One inference server as registered. Identity is `id`, never the URL."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: Annotated[str, Field(pattern=SERVER_ID_PATTERN, description="stable id chosen by the operator")]
    url: str = Field(description="base URL of the OpenAI-compatible server, e.g. http://10.0.0.5:8000")
    engine: Engine
    model: Annotated[str, Field(min_length=1, max_length=256, description="served model name")]
    revision: Annotated[str, Field(min_length=1, max_length=128)] = "unspecified"
    accelerator: str = "cpu"
    gpu_count: Annotated[int, Field(ge=0, le=1024)] = 0
    capacity: Annotated[int | None, Field(ge=1, le=100_000)] = Field(
        default=None, description="max concurrent sequences; None = discover from the engine"
    )
    kv_cache_tokens: Annotated[int | None, Field(ge=1)] = Field(
        default=None, description="KV cache size in tokens; None = discover from the engine where it says "
        "(vLLM's cache_config_info, SGLang's max_total_num_tokens)")
    labels: dict[str, str] = Field(default_factory=dict)
    registered_at: float = Field(default_factory=time.time)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parsed = HttpUrl(value)
        if parsed.scheme not in ("http", "https"):
            raise ValueError("url must be http:// or https://")
        if parsed.query or parsed.fragment:
            raise ValueError("url must not carry a query or fragment")
        if parsed.username or parsed.password:
            raise ValueError("url must not carry credentials; pass API keys separately")
        return str(parsed).rstrip("/")

    @field_validator("accelerator")
    @classmethod
    def _check_accelerator(cls, value: str) -> str:
        return normalize_accelerator(value)

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if not LABEL_KEY_PATTERN.match(key):
                raise ValueError(f"label key {key!r} must match {LABEL_KEY_PATTERN.pattern}")
            if len(label) > 256:
                raise ValueError(f"label {key!r} is longer than 256 characters")
        return value

    def serves(self, model: str, revision: str | None = None) -> bool:
        """True when this server answers for `model` (and `revision`, when one is asked for)."""
        return self.model == model and (revision is None or self.revision == revision)
