"""Records, artifacts, data loading, prompts, post-processing and metrics. No networking here."""

from fedpool.pipeline.artifact import (
    ArtifactWriter,
    RecordSet,
    package_versions,
    read_records,
    redact,
    secrets_from_env,
    unique_records,
)
from fedpool.pipeline.errors import ArtifactError, DataError, PipelineError, SpecError
from fedpool.pipeline.loaders import Sample, dataset_sha256, load_samples
from fedpool.pipeline.metrics import METRICS, Score, aggregate
from fedpool.pipeline.postprocess import POSTPROCESSORS, apply_postprocess, split_reasoning
from fedpool.pipeline.prompts import build_messages, render, request_body
from fedpool.pipeline.schema import (
    AttemptInfo,
    ErrorKind,
    Message,
    Output,
    Provenance,
    Record,
    TextOutput,
    TextPart,
)
from fedpool.pipeline.scoring import finish_record, rescore_record, summarize_records
from fedpool.pipeline.spec import BenchmarkSpec, GenerationParams, PromptSpec, load_spec, load_specs, spec_from_dict

__all__ = [
    "METRICS",
    "POSTPROCESSORS",
    "ArtifactError",
    "ArtifactWriter",
    "AttemptInfo",
    "BenchmarkSpec",
    "DataError",
    "ErrorKind",
    "GenerationParams",
    "Message",
    "Output",
    "PipelineError",
    "PromptSpec",
    "Provenance",
    "Record",
    "RecordSet",
    "Sample",
    "Score",
    "SpecError",
    "TextOutput",
    "TextPart",
    "aggregate",
    "apply_postprocess",
    "build_messages",
    "dataset_sha256",
    "finish_record",
    "load_samples",
    "load_spec",
    "load_specs",
    "package_versions",
    "read_records",
    "redact",
    "render",
    "request_body",
    "rescore_record",
    "secrets_from_env",
    "spec_from_dict",
    "split_reasoning",
    "summarize_records",
    "unique_records",
]
