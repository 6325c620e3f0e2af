"""Exclusive ownership of a directory (a run directory, a benchmark's artifact, a jobs directory): one process at
a time, by an OS file lock held for the owner's life. The kernel releases it when the process dies however it
dies, so a crash never leaves a stale lock; a second owner is refused at once and told who holds it."""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from fedpool.pipeline.errors import OwnershipError

LOCK_FILE = ".fedpool.lock"
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) for fedpool's own data: the directory itself is 0700."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, PRIVATE_DIR)
    return path


class DirectoryLock:
    """`with DirectoryLock(run_dir, "fedpool eval resume"):` — raises OwnershipError naming the holder."""

    def __init__(self, directory: Path, purpose: str):
        self.directory = directory
        self.purpose = purpose
        self.path = directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        private_dir(self.directory)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OwnershipError(
                f"{self.directory} is in use by {_describe(holder)}; two processes must not write one artifact "
                "(wait for it to finish, or stop it and run again)") from None
        except BaseException:
            os.close(fd)
            raise
        command = os.path.basename(sys.argv[0])  # the whole command line: the holder named in full
        info = {"pid": os.getpid(), "host": platform.node(), "purpose": self.purpose, "since": time.time(),
                "argv": ["fedpool" if command in ("cli.py", "__main__.py") else command, *sys.argv[1:]]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 1 << 20, 0)
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "another process (it has just taken the lock)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", 0))))
    return (f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('purpose')}, since {since}: "
            f"`{shlex.join(map(str, holder.get('argv') or []))}`)")
