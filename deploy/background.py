"""A command kept running in the background (its pid in a file, its output in a log, a session of its own) and
stopped again with every process it started — what `fedpool up --detach` and `fedpool down` do with a local
pool. Process supervision, beside the engine processes of process.py; it imports no other room."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psutil

READY_POLL_S = 0.5
DOWN_POLL_S = 0.1
KILL_WAIT_S = 10.0  # after SIGKILL, how long `stop_all` waits for the processes to be gone


def running_pid(pid_file: Path) -> int | None:
    """The pid in `pid_file`, if that process is still running."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def start_detached(argv: list[str], log_path: Path, ready_file: Path,
                   timeout_s: float) -> tuple[subprocess.Popen[bytes], dict[str, Any] | None]:
    """Start `argv` in a session of its own (its output appended to `log_path`) and wait until it writes
    `ready_file` (JSON): the process and what it wrote, or None there when it exited first. TimeoutError (the
    process terminated) when it is not ready in `timeout_s`."""
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc, None
        if ready_file.exists():
            return proc, json.loads(ready_file.read_text())
        time.sleep(READY_POLL_S)
    proc.terminate()
    raise TimeoutError(f"not ready after {timeout_s:g} s")


def stop_all(pid: int, timeout_s: float) -> list[psutil.Process] | None:
    """SIGTERM `pid` and return once it and every process of its pool (`PoolProcesses`) are gone: None when they
    stopped by themselves, else the processes still running after `timeout_s`, killed (SIGKILL)."""
    pool = PoolProcesses(pid)
    pool.scan()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool.scan()  # processes started since (Ray's workers and agents come and go while it shuts down)
        if not pool.alive():
            return None
        time.sleep(DOWN_POLL_S)
    return pool.kill_all()


class PoolProcesses:
    """Every process of the pool a `fedpool up` runs: itself, every process of its session (the detached `up` leads
    a session of its own, so Ray's processes and workers and the servers stay in it when their parent has died
    and they are re-parented, or when they start after `down` began), and its descendants seen so far (an `up`
    run in the foreground shares its terminal's session, which is not the pool's). Waiting only for the
    children seen when `down` began let `down` return while the `up` process itself, a Ray process re-parented
    mid-shutdown or a worker started after that snapshot was still running."""

    def __init__(self, pid: int):
        import psutil

        self.pid = pid
        self.seen: dict[int, psutil.Process] = {}
        self.own_session = _session_of(pid) == pid
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen[pid] = psutil.Process(pid)

    def scan(self) -> None:
        """Add the processes of the pool running now."""
        import psutil

        leader = self.seen.get(self.pid)
        if leader is None:
            return
        found: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            if leader.is_running():  # (its pid not yet taken by another process)
                found.extend(leader.children(recursive=True))
        if self.own_session:
            for proc in psutil.process_iter():
                if proc.pid not in self.seen and _session_of(proc.pid) == self.pid:
                    found.append(proc)
        for proc in found:
            self.seen.setdefault(proc.pid, proc)

    def alive(self) -> list[psutil.Process]:
        """The pool's processes still running (a zombie has exited: it only waits for its parent to reap it)."""
        import psutil

        running = []
        for proc in self.seen.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    running.append(proc)
            except psutil.NoSuchProcess:
                pass
        return running

    def kill_all(self) -> list[psutil.Process]:
        """SIGKILL every process of the pool still running and wait until they are gone; those that were."""
        import psutil

        self.scan()
        left = self.alive()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        deadline = time.monotonic() + KILL_WAIT_S
        while self.alive() and time.monotonic() < deadline:
            time.sleep(DOWN_POLL_S)
        return left


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone (or not ours to ask about)
        return None
