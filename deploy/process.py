"""A child engine process: started with its output in a log file, awaited until healthy, stopped cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import aiohttp

log = logging.getLogger("fedpool.deploy")

PR_SET_PDEATHSIG = 1


class EngineStartError(RuntimeError):
    """The engine exited or stayed unhealthy past its deadline; the message carries its log tail."""


# Ports handed to child servers come from below the kernel's ephemeral range and above Ray's worker
# ports (10002-19999): a port from the ephemeral range, free when picked, can be taken before the child
# binds it by any process binding port 0 (Ray's gRPC servers do) or by any outgoing connection.
_PICK_FLOOR = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def port_problem(host: str, port: int, flag: str = "--port") -> str | None:
    """Why a server of ours could not listen on host:port now (something listens there already, or the port is
    privileged), as a sentence naming `flag`; None when it can. Bound as the server will bind (SO_REUSEADDR: a port
    a closed connection still holds in TIME_WAIT is free)."""
    try:
        places = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"{host}: not an address of this machine ({exc.strerror})"
    for family, kind, proto, _, address in places:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except PermissionError:
                return f"{flag} {port}: this user may not listen on ports below 1024; pass {flag} with another port"
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (f"{flag} {port}: {address[0]}:{port} is already in use (another `fedpool up`, gateway or "
                            f"server listens there); pass {flag} with a free port, or stop what listens there")
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now for a child server to bind, outside the range other processes pick ports from."""
    ceiling = _ephemeral_low()
    if ceiling - _PICK_FLOOR >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_PICK_FLOOR, ceiling)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


# fedpool's own credentials: an engine never needs them, so its process never sees them.
WITHHELD_FROM_ENGINES = frozenset({"FEDPOOL_REGISTRY_TOKEN", "FEDPOOL_JOBS_TOKEN", "RAY_AUTH_TOKEN"})


def child_environment(extra: dict[str, str] | None = None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """An engine's environment: this process's, less fedpool's credentials, plus what the operator asked for
    (`--env`): secrets reach the engine through its environment, never its argv."""
    base = dict(os.environ if environ is None else environ)
    for name in WITHHELD_FROM_ENGINES:
        base.pop(name, None)
    return {**base, **(extra or {})}


def key_values(items: Sequence[str], flag: str = "--label") -> dict[str, str]:
    """KEY=VALUE items (a server's labels, an engine's variables); ValueError naming the flag and the item."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def engine_variables(items: Sequence[str], env_file: Path | None,
                     environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the operator adds to an engine's environment: `--env-file` lines, then `--env KEY=VALUE` and
    `--env KEY` (passed on from `environ`, so that a secret stays off every command line), later ones winning.
    ValueError naming the file and line, or the item."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    if env_file is not None:
        for number, line in enumerate(env_file.read_text(encoding="utf-8").splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{env_file}:{number}: expected KEY=VALUE")
            env[key.strip()] = value
    for item in items:
        if "=" in item:
            env.update(key_values([item], "--env"))
        elif item in environ:
            env[item] = environ[item]
        else:
            raise ValueError(f"--env {item}: no such variable in this environment (give KEY=VALUE)")
    return env


class EngineProcess:
    """One engine child process. It is killed with SIGTERM when this (parent) process dies."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._env = env
        self._clock = clock
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=child_environment(self._env),
                preexec_fn=_die_with_parent,
            )
        log.info("%s started (pid %s); log: %s", self.name, self._proc.pid, self.log_path)

    async def wait_healthy(self, url: str, *, deadline_s: float, interval_s: float = 0.5) -> float:
        """Poll `url` until HTTP 200. Raises EngineStartError with the log tail on exit or deadline."""
        assert self._proc is not None, "start() first"
        started = self._clock()
        async with aiohttp.ClientSession() as session:
            while True:
                if self._proc.returncode is not None:
                    raise EngineStartError(
                        f"{self.name} exited with code {self._proc.returncode} before becoming healthy; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        if resp.status == 200:
                            return self._clock() - started
                if self._clock() - started > deadline_s:
                    raise EngineStartError(
                        f"{self.name} not healthy at {url} after {deadline_s:g}s; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                await asyncio.sleep(interval_s)

    async def wait(self) -> int:
        assert self._proc is not None
        return await self._proc.wait()

    async def stop(self, grace_s: float = 10.0) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    def kill(self) -> None:
        """SIGKILL, for fault-injection tests."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
