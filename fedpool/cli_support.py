"""What every `fedpool` command shares: exit codes, the error it reports, joining Ray and the registry,
printing --json or a table."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from importlib import resources
from pathlib import Path
from typing import Any, TextIO, TypeVar

from fedpool.options import Options, PoolApiOptions, RayOptions, UpOptions

EXIT_OK = 0
EXIT_FAILED = 1  # the command failed (a registry error, a job that failed)
EXIT_USAGE = 2  # bad input: flags, specs, datasets, artifacts; the message names the culprit
EXIT_UNAVAILABLE = 3  # Ray, the registry, a server or the model it needs is not there
EXIT_INCOMPLETE = 4  # the run finished but some records failed (their errors are in the artifact)
EXIT_BUSY = 5  # the directory is owned by another process (a second resume, a second jobs server)


T = TypeVar("T")


def run_server(main: Coroutine[Any, Any, T]) -> T:
    """Run a long-lived server (the gateway, `fedpool up`) on uvloop's event loop where it is installed, else on
    asyncio's: the gateway's CPU a request, saturated, was 3-7% lower on uvloop than on asyncio's loop in the
    same composition (benchmarks/results/gateway_capacity.md, two runs of 3 repeats: 316 against 339 µs, 339
    against 350)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


UP_READY_FILE = "up.json"  # `fedpool up` writes it in its state dir once the pool is up and removes it at the end
UP_REGISTRY_DIR = "registry"  # the registry's state dir inside a `fedpool up` state dir

# The thread every Ray driver runs (ray._private.worker.listen_error_messages) to print what the cluster reports
# about its tasks and workers ("(raylet) Task ... failed"), to sys.stdout whatever `log_to_driver` says.
RAY_MESSAGE_THREADS = frozenset({"ray_listen_error_messages"})


class CommandStdout(io.TextIOBase):
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

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._out.isatty()

    def fileno(self) -> int:
        return self._out.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._out.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return self._out.errors

    @property
    def buffer(self) -> Any:
        return self._out.buffer


@contextlib.contextmanager
def command_stdout() -> Iterator[None]:
    """`CommandStdout` over sys.stdout while inside (sys.stdout as it was, after)."""
    saved = sys.stdout
    if isinstance(saved, CommandStdout):
        yield
        return
    wrapper = CommandStdout(saved)
    sys.stdout = wrapper
    try:
        yield
    finally:
        if sys.stdout is wrapper:
            sys.stdout = saved


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED):
        self.code = code
        super().__init__(message)


def ray_token_auth_if_available() -> None:
    """Ray 2.60's `ray start` turns token authentication on by itself when a token exists
    (~/.ray/auth_token, made by any earlier local `ray.init()`), but a driver joining with
    `ray.init(address=...)` only sends the token when RAY_AUTH_MODE=token: it is then refused with
    "InvalidAuthToken". Sending a token to a cluster without authentication does no harm, so a driver
    that has a token sends it, unless RAY_AUTH_MODE says otherwise (a local cluster that `ray.init()`
    starts uses token authentication by default anyway)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def connect_ray(args: RayOptions) -> None:
    """Join the Ray cluster of --address, and say on stderr which one and how it was found (unless --quiet)."""
    from fedpool.deploy.raycluster import join_ray

    joined = join_ray(args.address)
    if joined and not args.quiet:
        print(f"fedpool: {joined}", file=sys.stderr)


def registry_state_dir(state_dir: Path) -> Path:
    """Where a client command finds the registry's token and API URL for --state-dir STATE_DIR: STATE_DIR itself
    where a registry keeps them there; the registry's directory inside it where STATE_DIR is a running `fedpool
    up`'s (`fedpool up --state-dir X`, then `fedpool eval run --state-dir X`); and for the default STATE_DIR, while
    no registry keeps its state there, the registry of the default `fedpool up` when that pool is up. So `fedpool
    up` followed by `fedpool eval run` reaches the registry over its HTTP API, not as one more Ray driver
    (0.5 CPU-s and about 1.5 s of start-up less an eval process on 2 cores)."""
    from fedpool.registry.api import API_FILE
    from fedpool.registry.auth import TOKEN_FILE

    def holds_registry(path: Path) -> bool:
        return (path / TOKEN_FILE).is_file() or (path / API_FILE).is_file()

    def registry_of_up(up: Path) -> Path | None:
        inner = up / UP_REGISTRY_DIR
        return inner if (up / UP_READY_FILE).is_file() and holds_registry(inner) else None

    state = state_dir.expanduser()
    if holds_registry(state):
        return state
    inner = registry_of_up(state)
    if inner is not None:
        return inner
    if state == RayOptions.model_fields["state_dir"].default.expanduser():
        inner = registry_of_up(UpOptions.model_fields["state_dir"].default.expanduser())
        if inner is not None:
            return inner
    return state


def registry_client(args: RayOptions) -> Any:
    from fedpool.registry import RegistryClient, RegistryError

    connect_ray(args)
    try:
        return RegistryClient.connect_blocking(token_file=args.token_path, state_dir=registry_state_dir(args.state_dir))
    except RegistryError as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from None


def pool_registry(args: PoolApiOptions) -> Any:
    """The registry for a command that only uses the pool (snapshots, leases, failure reports): over its HTTP API
    when this process has the token and finds the API (--registry-url, FEDPOOL_REGISTRY_URL, the URL the registry
    wrote in the state dir), so the process is no Ray driver — 0.8-0.9 CPU-s less a process (docs/architecture.md);
    else through Ray, as `registry_client`. A command that later needs Ray (CPU actors) joins it then
    (`connect_ray`)."""
    from fedpool.registry import RegistryError
    from fedpool.registry.auth import resolve_client_token
    from fedpool.registry.httpclient import find_registry_api

    state = registry_state_dir(args.state_dir)
    try:
        token = resolve_client_token(token_file=args.token_path, state_dir=state)
        api = find_registry_api(url=args.registry_url, token=token, state_dir=state)
    except RegistryError as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from None
    if api is not None:
        if not args.quiet:
            print(f"fedpool: registry API {api.url}", file=sys.stderr)
        return api
    return registry_client(args)


def stop_on_signals() -> asyncio.Event:
    """An event SIGINT or SIGTERM sets (Ctrl-C, `kill`, `fedpool down`), for a command that serves until told to
    stop: set up before it starts anything, so a signal while it starts stops it cleanly once it has."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def pool_page() -> str:
    """The pool page's HTML (fedpool/static/pool.html; its data is clients.poolapp's /pool.json)."""
    return resources.files("fedpool").joinpath("static/pool.html").read_text(encoding="utf-8")


def emit(args: Options, data: dict[str, Any], human: Callable[[dict[str, Any]], str]) -> None:
    """`data` as JSON with --json, else as `human` writes it."""
    print(json.dumps(data, indent=2, default=str) if getattr(args, "json_output", False) else human(data))


def validation_message(exc: Any) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}" for err in exc.errors()
    )
