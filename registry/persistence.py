"""Registry state saved as one JSON file, replaced atomically (write temp, fsync, rename)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

STATE_FILE = "registry.json"


class StateStore:
    """Reads and atomically writes the registry's state file in `state_dir`."""

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.dir = Path(state_dir)
        self.path = self.dir / STATE_FILE

    def load(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.path}: corrupt registry state at line {exc.lineno}: {exc.msg}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{self.path}: registry state must be a JSON object")
        return data

    def save(self, data: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".registry-", suffix=".json", dir=self.dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
