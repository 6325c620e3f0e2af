"""What every `fedpool` command shares: exit codes, the error it reports, reaching the pool (deploy/reach.py),
printing --json or a table."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

from fedpool.options import Options, RayOptions, UpOptions

if TYPE_CHECKING:
    from fedpool.deploy.reach import PoolAccess

EXIT_OK = 0
EXIT_FAILED = 1  # the command failed (a registry error, a job that failed)
EXIT_USAGE = 2  # bad input: flags, specs, datasets, artifacts; the message names the culprit
EXIT_UNAVAILABLE = 3  # Ray, the registry, a server or the model it needs is not there
EXIT_INCOMPLETE = 4  # the run finished but some records failed (their errors are in the artifact)
EXIT_BUSY = 5  # the directory is owned by another process (a second resume, a second jobs server)


T = TypeVar("T")


def run_server(main: Coroutine[Any, Any, T]) -> T:
    """Run a long-lived server (the gateway, `fedpool up`) on uvloop's event loop where it is installed (less CPU
    a request than asyncio's), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED):
        self.code = code
        super().__init__(message)


def pool_access(args: RayOptions) -> PoolAccess:
    """Where the command finds the pool: its flags, and the pool its --state-dir names (deploy/updir.py); what it
    says about how it reached it goes to stderr, unless --quiet."""
    from fedpool.deploy.reach import PoolAccess
    from fedpool.deploy.updir import locate_pool

    place = locate_pool(args.state_dir, RayOptions.model_fields["state_dir"].default,
                        UpOptions.model_fields["state_dir"].default)
    return PoolAccess(args.address, place, args.token_path, getattr(args, "registry_url", None),
                      lambda line: None if args.quiet else print(f"fedpool: {line}", file=sys.stderr))


def connect_ray(args: RayOptions) -> None:
    """Join the pool's Ray cluster, and say on stderr which one and how it was found (unless --quiet)."""
    from fedpool.deploy.reach import join_pool_ray

    join_pool_ray(pool_access(args))


def registry_client(args: RayOptions) -> Any:
    """The registry through Ray (deploy/reach.py)."""
    from fedpool.deploy.reach import registry_over_ray

    return registry_over_ray(pool_access(args))


def pool_registry(args: RayOptions) -> Any:
    """The registry over its HTTP API where this process has its token and finds the API, so the process is no
    Ray driver; else through Ray, as `registry_client`. A command that later needs Ray (CPU actors) joins it then
    (`connect_ray`)."""
    from fedpool.deploy.reach import registry_over_api

    return registry_over_api(pool_access(args)) or registry_client(args)


def ask(client: Any, call: Callable[[Any], Awaitable[T]]) -> T:
    """One call of the registry (`call(client)`), its connections let go after."""

    async def once() -> T:
        try:
            return await call(client)
        finally:
            await client.aclose()

    return asyncio.run(once())


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
