"""What a client process needs of the registry (`PoolRegistry`: snapshots, capacity leases, failure reports),
met by the Ray client (registry/client.py) and the HTTP one (registry/httpclient.py), and the watcher that
keeps one process's latest snapshot by long-polling either."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fedpool.registry.leases import DemandReport, Lease
from fedpool.registry.snapshot import PoolSnapshot

log = logging.getLogger("fedpool.registry")


class PoolRegistry(Protocol):
    """The registry as a dispatcher's process uses it: never on the request path."""

    async def snapshot(self, since_version: int = -1, timeout_s: float = 0.0) -> PoolSnapshot: ...

    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease: ...

    async def release_lease(self, holder: str) -> None: ...

    async def report_failure(self, server_id: str, kind: str) -> bool: ...

    async def aclose(self) -> None:
        """Let go of what the client holds on the running event loop (connections); it stays usable."""
        ...


class SnapshotWatcher:
    """Keeps the latest PoolSnapshot for one client process by long-polling the registry.

    The registry answers only when the version changed (or the poll times out), so many clients cost it
    little. If the registry is restarting, the last snapshot stays in use and polling retries.
    """

    def __init__(
        self,
        fetch: Callable[[int, float], Awaitable[PoolSnapshot]],
        *,
        poll_timeout_s: float = 5.0,
        retry_s: float = 1.0,
        on_update: Callable[[PoolSnapshot], None] | None = None,
    ):
        self._fetch = fetch
        self._poll_timeout_s = poll_timeout_s
        self._retry_s = retry_s
        self._on_update = on_update
        self._latest: PoolSnapshot | None = None
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.Event()

    @classmethod
    def for_client(cls, client: PoolRegistry, **kwargs: Any) -> SnapshotWatcher:
        return cls(client.snapshot, **kwargs)

    @property
    def latest(self) -> PoolSnapshot | None:
        return self._latest

    async def start(self) -> PoolSnapshot:
        self._set(await self._fetch(-1, 0.0))
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self._latest  # type: ignore[return-value]

    async def refresh(self) -> PoolSnapshot:
        self._set(await self._fetch(-1, 0.0))
        return self._latest  # type: ignore[return-value]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _set(self, snapshot: PoolSnapshot) -> None:
        if self._latest is None or snapshot.version != self._latest.version:
            self._latest = snapshot
            if self._on_update is not None:
                self._on_update(snapshot)

    async def _run(self) -> None:
        while True:
            since = self._latest.version if self._latest is not None else -1
            try:
                self._set(await self._fetch(since, self._poll_timeout_s))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # registry restarting or unreachable: keep the last snapshot
                log.warning("registry snapshot poll failed (%s); keeping version %s", type(exc).__name__, since)
                await asyncio.sleep(self._retry_s)
