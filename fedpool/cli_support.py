"""What every `fedpool` command shares: exit codes, the error it reports, joining Ray and the registry,
printing --json or a table."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedpool.options import Options, RayOptions

EXIT_OK = 0
EXIT_FAILED = 1  # the command failed (a registry error, a job that failed)
EXIT_USAGE = 2  # bad input: flags, specs, datasets, artifacts; the message names the culprit
EXIT_UNAVAILABLE = 3  # Ray, the registry, a server or the model it needs is not there
EXIT_INCOMPLETE = 4  # the run finished but some records failed (their errors are in the artifact)
EXIT_BUSY = 5  # the directory is owned by another process (a second resume, a second jobs server)


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


def connect_ray(address: str, quiet: bool = False) -> None:
    """Join the Ray cluster, and say on stderr which one and how it was found (unless `quiet`): with two
    clusters on a host, `auto` finds the one started last."""
    import ray

    from fedpool.deploy.localpool import is_loopback_address, loopback_ray_mode

    if ray.is_initialized():
        return
    if address != "auto" and not _tcp_reachable(address):
        raise CliError(
            f"cannot reach a Ray cluster at {address!r}; start one with `ray start --head` "
            "or pass --address HOST:PORT of a running head node", EXIT_UNAVAILABLE,
        )
    how = ("--address" if address != "auto" else
           "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "the cluster started last on this machine")
    if is_loopback_address(address):  # a loopback-only cluster (`fedpool up`): join it on loopback
        loopback_ray_mode()
    try:
        ray.init(address=address, namespace="fedpool", logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as exc:
        raise CliError(
            f"cannot reach a Ray cluster at {address!r} ({exc}); start one with `ray start --head`", EXIT_UNAVAILABLE
        ) from None
    if not quiet:
        print(f"fedpool: Ray cluster {ray.get_runtime_context().gcs_address} (found by {how})", file=sys.stderr)


def _tcp_reachable(address: str, timeout_s: float = 2.0) -> bool:
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def registry_client(args: RayOptions) -> Any:
    from fedpool.registry import RegistryClient, RegistryError

    connect_ray(args.address)
    try:
        return RegistryClient.connect_blocking(token_file=args.token_path, state_dir=args.state_dir.expanduser())
    except RegistryError as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from None


def emit(args: Options, data: dict[str, Any], human: Callable[[dict[str, Any]], str]) -> None:
    """`data` as JSON with --json, else as `human` writes it."""
    print(json.dumps(data, indent=2, default=str) if getattr(args, "json_output", False) else human(data))


def validation_message(exc: Any) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}" for err in exc.errors()
    )
