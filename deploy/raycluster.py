"""Joining a running Ray cluster from a command (`fedpool gateway`, `fedpool eval run`, `fedpool server ...`):
checked for reachability first, so a wrong address is named at once, then joined on a thread of its own that the
command waits for with a deadline: Ray's connect loop retries for a minute and lets no signal through, so the
command answers SIGTERM and Ctrl-C meanwhile and names a cluster that does not answer. Ray is imported on first
use: `ray_token_auth_if_available` must run before. And what a Ray driver prints about the cluster goes to stderr
while a command runs (`command_stdout`): its stdout is the command's."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TextIO, cast

log = logging.getLogger("fedpool.deploy")

JOIN_TIMEOUT_S = 8.0  # joining a live cluster takes well under a second; Ray's own retries take a minute
WAIT_SLICE_S = 0.1  # how often the wait for Ray's connect looks at the signals that arrived
START_ADVICE = "start one with `ray start --head` or pass --address HOST:PORT of a running head node"


def ray_token_auth_if_available() -> None:
    """Ray 2.60's `ray start` turns token authentication on by itself when a token exists
    (~/.ray/auth_token, made by any earlier local `ray.init()`), but a driver joining with
    `ray.init(address=...)` only sends the token when RAY_AUTH_MODE=token: it is then refused with
    "InvalidAuthToken". Sending a token to a cluster without authentication does no harm, so a driver
    that has a token sends it, unless RAY_AUTH_MODE says otherwise (a local cluster that `ray.init()`
    starts uses token authentication by default anyway). Ray reads the mode once, at import."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def join_ray(address: str, *, how: str = "--address", advice: str = START_ADVICE,
             timeout_s: float = JOIN_TIMEOUT_S) -> str | None:
    """Join the Ray cluster at `address` (`auto`: RAY_ADDRESS, else the cluster started last on this machine), found
    as `how` says, and say which one it is; None when this process has joined one already. ConnectionError, naming
    the address and ending with `advice`, when none answers there within `timeout_s`."""
    joined = sys.modules.get("ray")  # (not imported for a cluster that is not there: it takes seconds)
    if joined is not None and joined.is_initialized():
        return None
    if address != "auto" and not _tcp_reachable(address):
        raise ConnectionError(f"cannot reach a Ray cluster at {address!r} ({how}); {advice}")
    import ray

    from fedpool.deploy.localpool import is_loopback_address, loopback_ray_mode

    if is_loopback_address(address):  # a loopback-only cluster (`fedpool up`): join it on loopback
        loopback_ray_mode()
    # Ctrl-C raises while the join waits, whatever handler an event loop set (asyncio's only cancels its task,
    # which the blocking wait does not yield to): set before saying so, so a Ctrl-C from then on is acted on.
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, signal.default_int_handler) if main else None
    try:
        log.debug("joining the Ray cluster at %s (%s)", address, how)
        _init_within(address, timeout_s)
    except TimeoutError:
        raise ConnectionError(f"no Ray cluster answered at {address!r} ({how}) within {timeout_s:g} s; {advice}"
                              ) from None
    except ConnectionError as exc:
        raise ConnectionError(f"cannot reach a Ray cluster at {address!r} ({how}: {exc}); {advice}") from None
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)
    return f"Ray cluster {ray.get_runtime_context().gcs_address} (found by {how})"


def _init_within(address: str, timeout_s: float) -> None:
    """`ray.init` on a thread this one waits for up to `timeout_s` (TimeoutError after; the thread is left to Ray,
    a daemon that does not hold the process). Its error, where it failed, is raised here."""
    import ray

    from fedpool.deploy.localpool import _RAY_SETTINGS

    done = threading.Event()
    failed: list[BaseException] = []

    def connect() -> None:
        try:
            ray.init(address=address, **_RAY_SETTINGS)
        except BaseException as exc:  # handed to the waiting thread
            failed.append(exc)
        finally:
            done.set()

    # Off the main thread Ray sets no SIGTERM handler and warns about it: the handler is set below instead.
    ray_worker_log = logging.getLogger("ray._private.worker")
    level = ray_worker_log.level
    ray_worker_log.setLevel(logging.ERROR)
    # The wait wakes every WAIT_SLICE_S, so a signal the kernel handed to one of Ray's threads is acted on at once,
    # not at the deadline (the main thread handles Python's signals; `join_ray` set Ctrl-C to raise).
    try:
        threading.Thread(target=connect, name="fedpool-ray-join", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not done.wait(WAIT_SLICE_S):
            if time.monotonic() >= deadline:
                raise TimeoutError(address)
    finally:
        ray_worker_log.setLevel(level)
    if failed:
        raise failed[0]
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """What Ray's driver does on SIGTERM: exit, running the exit hooks (Ray's own disconnect among them)."""
    sys.exit(signum)


def _tcp_reachable(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


# The thread every Ray driver runs (ray._private.worker.listen_error_messages) to print what the cluster reports
# about its tasks and workers ("(raylet) Task ... failed"), to sys.stdout whatever `log_to_driver` says.
RAY_MESSAGE_THREADS = frozenset({"ray_listen_error_messages"})


class CommandStdout:
    """sys.stdout while a command runs: the command's own output goes to the process's stdout, and what Ray's
    driver thread prints about the cluster goes to stderr, so `--json` piped to a parser reads JSON only (a raylet
    line written between a print's text and its newline put the figure in the middle of its line)."""

    def __init__(self, out: TextIO):
        self._out = out

    def _sink(self) -> TextIO:
        return sys.stderr if threading.current_thread().name in RAY_MESSAGE_THREADS else self._out

    def write(self, text: str) -> int:
        return self._sink().write(text)

    def flush(self) -> None:
        self._sink().flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer, ...: the process's stdout's
        return getattr(self._out, name)


@contextlib.contextmanager
def command_stdout() -> Iterator[None]:
    """`CommandStdout` over sys.stdout while inside (sys.stdout as it was, after)."""
    saved = sys.stdout
    if isinstance(saved, CommandStdout):
        yield
        return
    wrapper = cast(TextIO, CommandStdout(saved))
    sys.stdout = wrapper
    try:
        yield
    finally:
        if sys.stdout is wrapper:
            sys.stdout = saved
