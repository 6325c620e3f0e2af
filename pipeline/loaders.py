"""Dataset loaders: JSONL, CSV and Parquet files, and Hugging Face datasets saved to disk, become Samples;
bad rows are reported with file and line (row number for Parquet and datasets)."""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from fedpool.pipeline.errors import DataError
from fedpool.pipeline.spec import BenchmarkSpec

MAX_ROW_BYTES = 8 * 1024 * 1024
MAX_REPORTED_PROBLEMS = 20

# (line or row number, the row's fields or a description of why it could not be read)
RawRow = tuple[int, dict[str, Any] | str]


@dataclass(frozen=True, slots=True)
class Sample:
    sample_id: str
    fields: dict[str, Any]
    labels: tuple[str, ...]
    line: int
    media: Any = None  # pipeline.media.EncodedMedia once encoded (on the CPU actors), for chat with media


def dataset_sha256(path: Path) -> str:
    """Of the file, or of a dataset directory: every file's relative name and bytes, in name order."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as fh:
            for chunk in iter(partial(fh.read, 1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_samples(spec: BenchmarkSpec) -> list[Sample]:
    """All samples of a benchmark, or one DataError listing every bad row (up to 20) by line."""
    path = spec.data_path()
    if not path.exists():
        raise DataError(str(path), None, f"data file of benchmark {spec.name!r} does not exist")
    fmt = spec.data.format or ("hf" if path.is_dir() else path.suffix.lstrip(".").lower())
    if fmt == "jsonl":
        rows = list(_jsonl_rows(path))
    elif fmt == "csv":
        rows = list(_csv_rows(path))
    elif fmt == "parquet":
        rows = list(_parquet_rows(path))
    elif fmt == "hf":
        rows = list(_hf_rows(path, spec.data.split))
    else:
        raise DataError(str(path), None, f"unknown data format {fmt!r} (use jsonl, csv, parquet or hf)")
    where = (lambda n: f"{path}:{n}") if fmt in ("jsonl", "csv") else (lambda n: f"{path} row {n}")
    samples: list[Sample] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    needed = spec.prompt.fields()
    for line, row in rows:
        if isinstance(row, str):  # a parse problem already described
            problems.append(f"{where(line)}: {row}")
            continue
        try:
            sample = _to_sample(row, line, spec, needed)
        except ValueError as exc:
            problems.append(f"{where(line)}: {exc}")
            continue
        if sample.sample_id in seen:
            first = seen[sample.sample_id]
            problems.append(f"{where(line)}: duplicate id {sample.sample_id!r} (first at {first})")
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


def _jsonl_rows(path: Path) -> Iterator[RawRow]:
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


def _csv_rows(path: Path) -> Iterator[RawRow]:
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        try:
            for row in reader:
                if None in row:
                    yield reader.line_num, "more cells than header columns"
                    continue
                yield reader.line_num, dict(row)
        except UnicodeDecodeError:
            raw = path.read_bytes()  # the decoder reads ahead: find the line from the bytes themselves
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                line = raw[:exc.start].count(b"\n") + 1
                column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
                raise DataError(str(path), line, f"not UTF-8 text (byte {column} of the line cannot be "
                                "decoded)") from None
            raise
        except csv.Error as exc:
            raise DataError(str(path), reader.line_num, f"not valid CSV ({exc})") from None


def _parquet_rows(path: Path) -> Iterator[RawRow]:
    """Rows of a Parquet file, numbered from 1; read a row group at a time (large files stay bounded)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(str(path), None, f"not a readable Parquet file ({exc})") from None
    number = 0
    for group in range(reader.num_row_groups):
        for row in reader.read_row_group(group).to_pylist():
            number += 1
            yield number, row


def _hf_rows(path: Path, split: str | None) -> Iterator[RawRow]:
    """Rows of a Hugging Face dataset saved with `save_to_disk` (needs the `datasets` package)."""
    try:
        import datasets
    except ImportError:
        raise DataError(str(path), None, "format hf needs the `datasets` package (pip install datasets)") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(str(path), None, f"not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            if len(loaded) != 1:
                raise DataError(str(path), None, f"data.split is required: the dataset has splits {sorted(loaded)}")
            split = str(next(iter(loaded)))  # a split's name (Hugging Face types the keys `str | NamedSplit`)
        if split not in loaded:
            raise DataError(str(path), None, f"no split {split!r}; the dataset has {sorted(loaded)}")
        loaded = loaded[split]
    elif split is not None:
        raise DataError(str(path), None, f"data.split {split!r} given, but the saved dataset has no splits")
    for number, row in enumerate(loaded, start=1):
        yield number, dict(row)


def _to_sample(row: dict[str, Any], line: int, spec: BenchmarkSpec, needed: list[str]) -> Sample:
    if spec.id_field not in row:
        raise ValueError(f"missing id field {spec.id_field!r}")
    sample_id = row[spec.id_field]
    if not isinstance(sample_id, (str, int)) or isinstance(sample_id, bool) or str(sample_id) == "":
        raise ValueError(f"id field {spec.id_field!r} must be a non-empty string or integer")
    for name in needed:
        if name not in row:
            raise ValueError(f"missing field {name!r} used by the prompt template")
        if row[name] is None:
            raise ValueError(f"field {name!r} used by the prompt template is null")
        if isinstance(row[name], (dict, list)):
            raise ValueError(f"field {name!r} must be text or a number, not {type(row[name]).__name__}")
    for media in spec.prompt.media:
        if not isinstance(row.get(media.field), str) or not row[media.field]:
            raise ValueError(f"media field {media.field!r} must be a file path")
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
