"""From a Sample and its spec to the Record's messages and the OpenAI request body."""

from __future__ import annotations

from typing import Any

from fedpool.pipeline.loaders import Sample
from fedpool.pipeline.schema import Message, TextPart
from fedpool.pipeline.spec import BenchmarkSpec


def render(spec: BenchmarkSpec, sample: Sample) -> str:
    return spec.prompt.template.format(**{name: sample.fields[name] for name in spec.prompt.fields()})


def build_messages(spec: BenchmarkSpec, sample: Sample) -> list[Message]:
    """The Record's messages: media parts keep their paths and modality fields, never the encoded bytes."""
    messages = []
    if spec.prompt.system:
        messages.append(Message(role="system", content=[TextPart(value=spec.prompt.system)]))
    media = list(sample.media.record_parts) if sample.media is not None else []
    messages.append(Message(role="user", content=[TextPart(value=render(spec, sample)), *media]))
    return messages


def request_body(spec: BenchmarkSpec, sample: Sample) -> dict[str, Any]:
    """The OpenAI-compatible body (without model): prompt for completion style, messages for chat."""
    gen = spec.generation
    body: dict[str, Any] = {"max_tokens": gen.max_tokens, "temperature": gen.temperature, "top_p": gen.top_p}
    if gen.stop:
        body["stop"] = list(gen.stop)
    if gen.seed is not None:
        body["seed"] = gen.seed
    if spec.prompt.style == "completion":
        body["prompt"] = render(spec, sample)
    else:
        if spec.prompt.media and sample.media is None:
            raise ValueError(f"{spec.name}/{sample.sample_id}: media not encoded (pipeline.media encodes it)")
        body["messages"] = []
        if spec.prompt.system:
            body["messages"].append({"role": "system", "content": spec.prompt.system})
        if sample.media is None:
            body["messages"].append({"role": "user", "content": render(spec, sample)})
        else:
            body["messages"].append({"role": "user", "content": [
                {"type": "text", "text": render(spec, sample)}, *sample.media.request_parts]})
    return body
