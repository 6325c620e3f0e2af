"""How a command reaches a running pool from what it was given (--address, --state-dir, --registry-url, a token):
the registry over its HTTP API where this process has the token and finds the API, else through Ray, at the
address given or the one the `fedpool up` of the state dir recorded (updir.py), never by Ray's own guess of an
address when the pool is known. A pool that does not answer is named, with the flags that point a command at one
(ConnectionError: RegistryUnavailable, or join_ray's)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedpool.deploy.raycluster import START_ADVICE, join_ray
from fedpool.deploy.updir import READY_FILE, PoolPlace
from fedpool.registry.api import read_api_file
from fedpool.registry.errors import RegistryError

if TYPE_CHECKING:
    from fedpool.registry.client import RegistryClient
    from fedpool.registry.httpclient import RegistryHttpClient


class RegistryUnavailable(ConnectionError):
    """No registry answers, or it refuses this process; the message says which, and what to do."""


@dataclass(frozen=True)
class PoolAccess:
    """What a command was given to find the pool, with the place its state dir names (updir.locate_pool)."""

    address: str  # --address; "auto": the one the state dir's `fedpool up` recorded, else Ray's own search
    place: PoolPlace
    token_file: Path | None = None
    registry_url: str | None = None
    say: Callable[[str], None] = logging.getLogger("fedpool.deploy").info  # how the pool was reached (stderr)

    def ray_address(self) -> tuple[str, str]:
        """The Ray address to join, and how it was found."""
        if self.address != "auto":
            return self.address, "--address"
        if self.place.ray_address and self.place.up_dir is not None:
            return self.place.ray_address, f"the address `fedpool up` recorded in {self.place.up_dir / READY_FILE}"
        return "auto", "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "the cluster started last on this machine"

    def advice(self) -> str:
        """What to do when nothing answers: the flags that point a command at a running pool."""
        if self.address != "auto":
            return START_ADVICE
        flags = ("--state-dir of a running pool, --address HOST:PORT of its Ray cluster or --registry-url URL of its "
                 "registry")
        if self.place.up_dir is None:
            return f"start one (`fedpool up`, or `ray start --head` and `fedpool registry start`), or pass {flags}"
        api = read_api_file(self.place.registry_dir)
        where = f" (its registry's API was at {api})" if api else ""
        return f"is the `fedpool up` of {self.place.up_dir} still running{where}? Start it again, or pass {flags}"


def join_pool_ray(access: PoolAccess) -> None:
    """Join the pool's Ray cluster (a process that reached the registry over HTTP, when it needs CPU actors)."""
    address, how = access.ray_address()
    joined = join_ray(address, how=how, advice=access.advice())
    if joined:
        access.say(joined)


def registry_over_ray(access: PoolAccess) -> RegistryClient:
    """The registry actor of the pool's Ray cluster, with the token found for it."""
    join_pool_ray(access)
    from fedpool.registry.client import RegistryClient  # (imports Ray: after a cluster answered)

    try:
        return RegistryClient.connect_blocking(token_file=access.token_file, state_dir=access.place.registry_dir)
    except RegistryError as exc:
        raise RegistryUnavailable(str(exc)) from None


def registry_over_api(access: PoolAccess) -> RegistryHttpClient | None:
    """The registry over its HTTP API when this process has its token and finds the API (--registry-url,
    FEDPOOL_REGISTRY_URL, the URL the registry wrote in its state dir), so the process is no Ray driver; else None.
    RegistryUnavailable where a URL given does not answer or refuses the token. Says which API it found."""
    from fedpool.registry.auth import resolve_client_token
    from fedpool.registry.httpclient import find_registry_api

    state = access.place.registry_dir
    token = resolve_client_token(token_file=access.token_file, state_dir=state)
    try:
        api = find_registry_api(url=access.registry_url, token=token, state_dir=state)
    except RegistryError as exc:
        raise RegistryUnavailable(str(exc)) from None
    if api is not None:
        access.say(f"registry API {api.url}")
    return api
