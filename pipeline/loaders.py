"""Dataset loaders: JSONL and CSV rows become Samples; bad rows are reported with file and line."""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import DataError
from pipeline.spec import BenchmarkSpec

MAX_ROW_BYTES = 8 * 1024 * 1024
MAX_REPORTED_PROBLEMS = 20


@dataclass(frozen=True, slots=True)
class Sample:
    sample_id: str
    fields: dict[str, Any]
    labels: tuple[str, ...]
    line: int


def dataset_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_samples(spec: BenchmarkSpec) -> list[Sample]:
    """All samples of a benchmark, or one DataError listing every bad row (up to 20) by line."""
    path = spec.data_path()
    if not path.exists():
        raise DataError(str(path), None, f"data file of benchmark {spec.name!r} does not exist")
    fmt = spec.data.format or path.suffix.lstrip(".").lower()
    if fmt == "jsonl":
        rows = list(_jsonl_rows(path))
    elif fmt == "csv":
        rows = list(_csv_rows(path))
    else:
        raise DataError(str(path), None, f"unknown data format {fmt!r} (use jsonl or csv)")
    samples: list[Sample] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    needed = spec.prompt.fields()
    for line, row in rows:
        if isinstance(row, str):  # a parse problem already described
            problems.append(f"{path}:{line}: {row}")
            continue
        try:
            sample = _to_sample(row, line, spec, needed)
        except ValueError as exc:
            problems.append(f"{path}:{line}: {exc}")
            continue
        if sample.sample_id in seen:
            first = seen[sample.sample_id]
            problems.append(f"{path}:{line}: duplicate id {sample.sample_id!r} (first on line {first})")
            continue
        seen[sample.sample_id] = line
        samples.append(sample)
        if spec.data.limit is not None and len(samples) >= spec.data.limit:
            break
    if problems:
        shown = problems[:MAX_REPORTED_PROBLEMS]
        more = len(problems) - len(shown)
        text = "\n  ".join(shown) + (f"\n  … and {more} more" if more else "")
        raise DataError(str(path), None, f"{len(problems)} bad row(s):\n  {text}")
    if not samples:
        raise DataError(str(path), None, "no samples (the file is empty)")
    return samples


def _jsonl_rows(path: Path):
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if len(raw) > MAX_ROW_BYTES:
                yield number, f"row is larger than {MAX_ROW_BYTES // (1024 * 1024)} MiB"
                continue
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield number, f"malformed JSON ({getattr(exc, 'msg', exc)})"
                continue
            yield number, row if isinstance(row, dict) else f"row is a JSON {type(row).__name__}, not an object"


def _csv_rows(path: Path):
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        for row in reader:
            if None in row:
                yield reader.line_num, "more cells than header columns"
                continue
            yield reader.line_num, dict(row)


def _to_sample(row: dict[str, Any], line: int, spec: BenchmarkSpec, needed: list[str]) -> Sample:
    if spec.id_field not in row:
        raise ValueError(f"missing id field {spec.id_field!r}")
    sample_id = row[spec.id_field]
    if not isinstance(sample_id, (str, int)) or isinstance(sample_id, bool) or str(sample_id) == "":
        raise ValueError(f"id field {spec.id_field!r} must be a non-empty string or integer")
    for name in needed:
        if name not in row:
            raise ValueError(f"missing field {name!r} used by the prompt template")
        if isinstance(row[name], (dict, list)):
            raise ValueError(f"field {name!r} must be text or a number, not {type(row[name]).__name__}")
    if spec.label_field not in row:
        raise ValueError(f"missing label field {spec.label_field!r}")
    return Sample(str(sample_id), row, _labels(row[spec.label_field], spec.label_field), line)


def _labels(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, bool):
        raise ValueError(f"label field {name!r} must be text, a number or a list of them")
    if isinstance(value, (str, int, float)):
        return (str(value),)
    if isinstance(value, list) and value and all(isinstance(v, (str, int, float)) for v in value):
        return tuple(str(v) for v in value)
    raise ValueError(f"label field {name!r} must be text, a number or a non-empty list of them")
