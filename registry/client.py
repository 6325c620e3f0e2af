"""The registry's public Python API: start or find the actor, register, drain, watch snapshots."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pickle
from pathlib import Path
from typing import Any

import ray
import ray.actor
import ray.exceptions

from fedpool.registry.actor import NAMESPACE, RegistryConfig, create_registry_actor, get_registry_actor
from fedpool.registry.auth import TOKEN_FILE, ensure_token, read_saved_token, resolve_client_token, token_digest
from fedpool.registry.errors import AuthError, RegistryError
from fedpool.registry.holders import PoolHolders
from fedpool.registry.leases import DemandReport, Lease
from fedpool.registry.records import ServerRecord
from fedpool.registry.snapshot import PoolSnapshot, ServerEntry
from fedpool.registry.weights import prior_weight

log = logging.getLogger("fedpool.registry")

# RegistryActor.snapshot_wire's answer: (version, taken_at, membership version, pickled records, pickled rows).
SnapshotWire = tuple[int, float, int, bytes | None, bytes | None]


async def _unwrapped(ref: Any) -> Any:
    """Await an actor call; a deliberate registry error comes back as itself, not wrapped in Ray's
    RayTaskError with the remote traceback (which users should not have to read)."""
    try:
        return await ref
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RegistryError):
            raise cause from None
        raise


def _find_actor(namespace: str) -> ray.actor.ActorHandle | None:
    """The running registry actor, or None (a blocking Ray call: run it in a thread from async code)."""
    try:
        return get_registry_actor(namespace)
    except ValueError:
        return None


async def _check_token(handle: ray.actor.ActorHandle, token: str | None, state: Path, given: bool) -> None:
    """Refuse, naming the token files, when `token` is not the running registry's."""
    try:
        await _unwrapped(handle.check_token.remote(token))
    except AuthError:
        info = await _unwrapped(handle.ping.remote())
        theirs = Path(info["state_dir"]) / TOKEN_FILE
        ours = "the token given (--token or FEDPOOL_REGISTRY_TOKEN)" if given else f"the token in {state / TOKEN_FILE}"
        raise RegistryError(
            f"a registry already runs in this Ray cluster (state dir {info['state_dir']}) and {ours} is not its "
            f"token: use the token in {theirs} (for example with --state-dir {info['state_dir']}), or stop that "
            "registry first") from None


class RegistryClient:
    """Async access to the registry actor. Holds the token for mutations; reads need none."""

    def __init__(self, handle: ray.actor.ActorHandle, token: str | None = None, *, namespace: str = NAMESPACE):
        self._handle = handle
        self._token = token
        self._namespace = namespace
        self._members: tuple[int, dict[str, ServerRecord]] | None = None
        self._last: PoolSnapshot | None = None

    @classmethod
    async def start(
        cls,
        state_dir: str | Path,
        *,
        token: str | None = None,
        **settings: Any,
    ) -> RegistryClient:
        """Get or create the registry actor (needs `ray.init()` first); returns a client holding the token.

        A registry already running in the cluster keeps the token it was started with, so the token given
        (or saved in STATE_DIR/registry.token) is checked against it before anything is written: a mismatch
        is refused with an error naming both token files, never a client whose every mutation fails."""
        state = await asyncio.to_thread(lambda: Path(state_dir).expanduser().resolve())
        namespace = settings.get("namespace", NAMESPACE)
        running = await asyncio.to_thread(_find_actor, namespace)
        if running is not None:
            given = token if token is not None else await asyncio.to_thread(read_saved_token, state)
            await _check_token(running, given, state, token is not None)
            return cls(running, given, namespace=namespace)
        real_token = await asyncio.to_thread(ensure_token, state, token)
        config = RegistryConfig(state_dir=str(state), token_sha256=token_digest(real_token), **settings)
        handle = await asyncio.to_thread(create_registry_actor, config)
        # Another process may have created it under the same name in the meantime, with its own token.
        await _check_token(handle, real_token, state, token is not None)
        return cls(handle, real_token, namespace=config.namespace)

    @classmethod
    async def connect(
        cls, *, token: str | None = None, token_file: str | Path | None = None, state_dir: Path | None = None,
        namespace: str = NAMESPACE,
    ) -> RegistryClient:
        """Find the running registry actor; the token comes from the arguments or the environment. Raises
        RegistryError when no registry runs in this Ray cluster."""
        return await asyncio.to_thread(cls.connect_blocking, token=token, token_file=token_file,
                                       state_dir=state_dir, namespace=namespace)

    @classmethod
    def connect_blocking(
        cls, *, token: str | None = None, token_file: str | Path | None = None, state_dir: Path | None = None,
        namespace: str = NAMESPACE,
    ) -> RegistryClient:
        """`connect` for code with no event loop yet (the CLI before it starts one): blocks on Ray."""
        handle = _find_actor(namespace)
        if handle is None:
            raise RegistryError(f"no fedpool registry runs in this Ray cluster (namespace {namespace!r}); start one "
                                "with `fedpool registry start`")
        return cls(handle, resolve_client_token(token=token, token_file=token_file, state_dir=state_dir),
                   namespace=namespace)

    @property
    def handle(self) -> ray.actor.ActorHandle:
        return self._handle

    @property
    def has_token(self) -> bool:
        return bool(self._token)

    async def check_token(self) -> None:
        """AuthError unless this client's token is the registry's."""
        await self._call("check_token", self._token)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One actor call. If the actor this client knew is gone for good (killed without restart, then
        started again with `fedpool registry start`), find the new one by name and try once more; while
        Ray restarts an actor, the same handle keeps working."""
        try:
            return await _unwrapped(getattr(self._handle, method).remote(*args, **kwargs))
        except ray.exceptions.ActorDiedError:
            await self._reconnect()
            return await _unwrapped(getattr(self._handle, method).remote(*args, **kwargs))

    async def _reconnect(self) -> None:
        """Swap in the registry actor now registered under the name, or raise why there is none."""
        fresh = await asyncio.to_thread(_find_actor, self._namespace)
        if fresh is None:
            raise RegistryError("the registry actor is gone and no new one runs; start it with "
                                "`fedpool registry start`")
        if fresh._actor_id == self._handle._actor_id:
            raise RegistryError("the registry actor died and Ray will not restart it; start a new one with "
                                "`fedpool registry start`")
        log.warning("the registry actor was replaced; reconnected to the new one")
        self._handle = fresh
        self._members = None
        self._last = None

    async def register(
        self, record: ServerRecord, *, lease_ttl_s: float | None = None, replace: bool = False, verify: bool = True
    ) -> ServerEntry:
        return await self._call("register", record.model_dump(mode="json"), self._token, lease_ttl_s=lease_ttl_s,
                                replace=replace, verify=verify)

    async def terminate(self, *, wait_s: float = 5.0) -> None:
        """End the registry this process started (its prober first), for runs that own their registry
        (the speedup benchmark, tests). Waits until the actor's name is free for the next one."""
        with contextlib.suppress(Exception):
            await _unwrapped(self._handle.shutdown_prober.remote())
        with contextlib.suppress(ValueError):
            await asyncio.to_thread(ray.kill, self._handle, no_restart=True)
        for _ in range(max(1, int(wait_s / 0.05))):
            if await asyncio.to_thread(_find_actor, self._namespace) is None:
                return
            await asyncio.sleep(0.05)

    async def deregister(self, server_id: str) -> ServerRecord:
        return await self._call("deregister", server_id, self._token)

    async def drain(self, server_id: str) -> ServerEntry:
        return await self._call("drain", server_id, self._token)

    async def heartbeat(self, server_id: str, ttl_s: float | None = None) -> ServerEntry:
        return await self._call("heartbeat", server_id, self._token, ttl_s)

    async def report_failure(self, server_id: str, kind: str) -> bool:
        return await self._call("report_failure", server_id, kind)

    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease:
        """This holder's capacity lease for what it reports (registry/leases.py); waits up to `wait_s` for its slots
        to change when they are still `known_version`."""
        return await self._call("lease", report.model_dump(), known_version, wait_s)

    async def release_lease(self, holder: str) -> None:
        await self._call("release_lease", holder)

    async def leases(self) -> dict[str, Any]:
        return await self._call("leases")

    async def holders(self, detail: bool = True) -> PoolHolders:
        """Who is on the pool: every holder, its clients and their progress, its slots against its fair share, and
        the clients finished lately (registry/holders.py; without `detail`, no holder's rows per server)."""
        view: PoolHolders = await self._call("holders", detail)
        return view

    async def snapshot(self, since_version: int = -1, timeout_s: float = 0.0) -> PoolSnapshot:
        """The pool now, or once it is newer than `since_version` (waiting up to `timeout_s`).

        A version check: when the registry's version is the one this client already holds, the registry
        answers with a few bytes and the held snapshot (immutable, same version, same content) is returned."""
        try:
            held, wire = await self._snapshot_wire(since_version, timeout_s)
        except ray.exceptions.ActorDiedError:
            await self._reconnect()
            held, wire = await self._snapshot_wire(since_version, timeout_s)
        version, taken_at, membership, records, rows = wire
        if rows is None:  # only when `held` is of this very version
            assert held is not None and held.version == version
            return held
        # Both blobs are pickled by the registry actor itself (our own code in the same Ray cluster, which
        # pickles every actor call anyway), never by a server or an outside client.
        if records is not None:
            self._members = (membership, {r.id: r for r in pickle.loads(records)})
        assert self._members is not None
        members = self._members[1]
        # Unpickled on first use of the entries: a poll that only learns that a newer version exists costs the
        # caller nothing more.
        self._last = PoolSnapshot.from_rows(version, taken_at, functools.partial(pickle.loads, rows), members,
                                            prior_weight, count=len(members))
        return self._last

    async def _snapshot_wire(self, since_version: int, timeout_s: float) -> tuple[PoolSnapshot | None, SnapshotWire]:
        """The snapshot held now and the actor's `snapshot_wire` answer to what this client holds."""
        known = self._members[0] if self._members is not None else -1
        held = self._last
        wire: SnapshotWire = await _unwrapped(self._handle.snapshot_wire.remote(
            since_version, timeout_s, known, held.version if held is not None else -1
        ))
        return held, wire

    async def get(self, server_id: str) -> ServerEntry:
        return await self._call("get", server_id)

    async def ping(self) -> dict[str, Any]:
        return await self._call("ping")

    async def aclose(self) -> None:
        """Nothing to let go: Ray holds the connection for the process."""

    async def metrics_text(self) -> str:
        return (await self._call("metrics_text")).decode("utf-8")
