"""A `fedpool up`'s state dir: its pid, ready and log files and its registry's state; claimed by the `fedpool up`
that runs from it, started in the background and stopped again (background.py supervises the processes); and
where a command given a state dir finds that pool: its registry's token and API file, and its Ray address."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpool.deploy.background import running_pid, start_detached, stop_all
from fedpool.registry.api import API_FILE
from fedpool.registry.auth import TOKEN_FILE

PID_FILE = "up.pid"
READY_FILE = "up.json"  # the pool's URL, model and Ray address, once it is up (client commands look for it)
LOG_FILE = "up.log"
REGISTRY_DIR = "registry"  # the registry's state dir inside a `fedpool up` state dir


class PoolAlreadyUp(RuntimeError):
    """A `fedpool up` of this state dir is running."""


@dataclass(frozen=True)
class PoolPlace:
    """Where a command finds the pool of the state dir it was given."""

    registry_dir: Path  # where the registry keeps its token and the URL of its HTTP API
    up_dir: Path | None = None  # the running `fedpool up` whose registry that is
    ray_address: str | None = None  # the Ray address that `fedpool up` recorded
    gateway_url: str | None = None  # and its gateway's base URL


def _holds_registry(path: Path) -> bool:
    return (path / TOKEN_FILE).is_file() or (path / API_FILE).is_file()


def _up_place(up: Path) -> PoolPlace | None:
    """The pool of the `fedpool up` of `up` while it is up (its ready file there) and its registry keeps its state
    inside; None otherwise."""
    inner = up / REGISTRY_DIR
    if not (up / READY_FILE).is_file() or not _holds_registry(inner):
        return None
    try:
        ready = json.loads((up / READY_FILE).read_text(encoding="utf-8"))
        address, url = ready.get("ray_address"), ready.get("url")
    except (OSError, ValueError, AttributeError):
        address = url = None
    return PoolPlace(inner, up, address if isinstance(address, str) and address else None,
                     url if isinstance(url, str) and url else None)


def locate_pool(state_dir: Path, default_state_dir: Path, default_up_dir: Path) -> PoolPlace:
    """The pool of `state_dir`: a registry's own state dir (inside a running `fedpool up`'s: that pool's); a
    running `fedpool up`'s state dir (`fedpool up --state-dir X`, then `fedpool pool status --state-dir X`); and
    for the default state dir, while no registry keeps its state there, the default `fedpool up`'s pool when it is
    up. So a command beside `fedpool up` reaches its registry over its HTTP API, or its Ray cluster at the address
    it recorded, rather than by Ray's guess of an address."""
    state = state_dir.expanduser()
    if _holds_registry(state):
        outer = _up_place(state.parent) if state.name == REGISTRY_DIR else None
        return outer if outer is not None and outer.registry_dir == state else PoolPlace(state)
    place = _up_place(state)
    if place is None and state == default_state_dir.expanduser():
        place = _up_place(default_up_dir.expanduser())
    return place or PoolPlace(state)


def refuse_running(state: Path) -> None:
    """PoolAlreadyUp, naming it, where another process runs a pool from `state`."""
    other = running_pid(state / PID_FILE)
    if other is not None and other != os.getpid():
        raise PoolAlreadyUp(f"a pool is already up from {state} (pid {other}); `fedpool down --state-dir {state}` "
                            "stops it")


def claim_state_dir(state: Path) -> None:
    """This process's pid in STATE/up.pid; PoolAlreadyUp, naming it, where another process runs from there."""
    refuse_running(state)
    (state / PID_FILE).write_text(f"{os.getpid()}\n")


def write_ready(state: Path, ready: dict[str, Any]) -> None:
    """Say the pool is up (written whole: a client never reads half of it)."""
    tmp = state / f".{READY_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(ready, indent=2) + "\n")
    os.replace(tmp, state / READY_FILE)


def release_state_dir(state: Path) -> None:
    """The pool is down: its pid and ready files go."""
    for name in (PID_FILE, READY_FILE):
        with contextlib.suppress(FileNotFoundError):
            (state / name).unlink()


def start_up_detached(command: list[str], state: Path, timeout_s: float) -> tuple[int, dict[str, Any]]:
    """Run `command` (a `fedpool up` of `state`) in the background until it is up: its pid and ready file.
    PoolAlreadyUp where one runs from there; RuntimeError, with its log's tail, where it did not come up."""
    if running_pid(state / PID_FILE) is not None:
        raise PoolAlreadyUp(f"a pool is already up from {state}; `fedpool down --state-dir {state}` stops it")
    with contextlib.suppress(FileNotFoundError):
        (state / READY_FILE).unlink()
    log_path = state / LOG_FILE
    try:
        proc, ready = start_detached(command, log_path, state / READY_FILE, timeout_s)
    except TimeoutError:
        raise RuntimeError(f"the pool was not up after {timeout_s:g} s; see {log_path}") from None
    if ready is None:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"`fedpool up` exited with {proc.returncode} before the pool was up; {log_path}:\n{tail}")
    return proc.pid, ready


def stop_pool(state: Path, timeout_s: float) -> tuple[int | None, int | None]:
    """Stop the `fedpool up` of `state` and every process of its pool (background.stop_all): its pid (None when
    none was up) and how many processes were left to kill after `timeout_s` (None: they stopped by themselves)."""
    pid = running_pid(state / PID_FILE)
    if pid is None:
        return None, None
    killed = stop_all(pid, timeout_s)
    return pid, None if killed is None else len(killed)
