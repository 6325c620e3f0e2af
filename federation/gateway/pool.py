"""A client process's connection to the pool: one HTTP session, a snapshot watcher and a dispatcher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import aiohttp

from fedpool.federation.core.dispatcher import Dispatcher
from fedpool.federation.core.errors import FailureKind
from fedpool.federation.core.types import DispatchConfig
from fedpool.federation.gateway.leases import LeaseClient
from fedpool.federation.gateway.transport import HttpTransport, new_session
from fedpool.federation.routing.horizon import kind_costs
from fedpool.federation.routing.policies import make_policy
from fedpool.registry import HolderKind, HoldersSource, PoolHolders, PoolRegistry, PoolSnapshot, SnapshotWatcher

log = logging.getLogger("fedpool.pool")

MAX_PENDING_REPORTS = 256  # passive failure reports in flight to the registry; beyond this they are dropped
REPORT_FLUSH_S = 2.0  # how long a closing connection waits for its reports in flight
HOLDERS_FRESH_S = 1.0  # the holders view asked of the registry is reused this long (a page polled by many)


class PoolConnection:
    """`async with PoolConnection(registry) as pool: await pool.dispatcher.submit(...)`.

    The registry is read through long-polled snapshots, never on the request path. Failures the
    dispatcher sees are reported to the registry in the background (bounded, best effort). With `leases`
    (the default) the dispatcher works within this process's capacity lease, so several processes on the
    same servers share their slots instead of each filling them. `expect`: (client, model, requests at most) of
    the clients this process is about to run, reported as loading from its first lease report on; `holder`: this
    process's name at the lease broker (default: a new one), as a report sent before connecting named it;
    `holder_kind`: what this process is, as the pool's holders view shows it (`eval run`, `gateway`, `jobs server`,
    `batch`). `keepalive_pool=False`: every request over aiohttp's client, none over fedpool's keep-alive pool.
    """

    def __init__(
        self,
        registry: PoolRegistry,
        *,
        policy: str = "capacity_weighted",
        policy_options: dict[str, Any] | None = None,
        config: DispatchConfig | None = None,
        seed: int = 0,
        poll_timeout_s: float = 5.0,
        leases: bool = True,
        expect: Sequence[tuple[str, str, int]] = (),
        holder: str | None = None,
        keepalive_pool: bool = True,
        holder_kind: HolderKind = "other",
    ):
        self._registry = registry
        self._policy_name = policy
        self._policy_options = dict(policy_options or {})
        self._config = config or DispatchConfig()
        self._seed = seed
        self._poll_timeout_s = poll_timeout_s
        self._reports: set[asyncio.Task[None]] = set()
        self._leasing = leases
        self._expect = tuple(expect)
        self._holder = holder
        self._holder_kind: HolderKind = holder_kind
        self._keepalive_pool = keepalive_pool
        self._holders: dict[bool, tuple[float, PoolHolders]] = {}  # detail -> (asked at, the registry's answer)
        self._leases: LeaseClient | None = None
        self._watcher: SnapshotWatcher | None = None
        self._dispatcher: Dispatcher | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def dispatcher(self) -> Dispatcher:
        assert self._dispatcher is not None, "use `async with PoolConnection(...)`"
        return self._dispatcher

    @property
    def lease_holder(self) -> str | None:
        """This process's name at the registry's lease broker (None when it does not lease)."""
        return self._leases.holder if self._leases is not None else None

    @property
    def snapshot(self) -> PoolSnapshot | None:
        return self._watcher.latest if self._watcher else None

    async def __aenter__(self) -> PoolConnection:
        rng = random.Random(self._seed)
        self._session = new_session(keepalive_pool=self._keepalive_pool)
        self._watcher = SnapshotWatcher.for_client(
            self._registry, poll_timeout_s=self._poll_timeout_s, on_update=self._on_snapshot
        )
        self._dispatcher = Dispatcher(
            HttpTransport(self._session, self._config.timeouts),
            lambda: self._watcher.latest if self._watcher else None,
            make_policy(self._policy_name, rng, **self._policy_options),
            config=self._config,
            rng=rng,
            on_failure=self._report,
            price_kinds=kind_costs,
        )
        await self._watcher.start()
        if self._leasing:
            # Every process's dispatcher shares each server's slots with the others through the registry's
            # capacity leases (federation/gateway/leases.py).
            self._leases = LeaseClient(self._registry, self._dispatcher, holder=self._holder,
                                       holder_kind=self._holder_kind)
            await self._leases.start()
            # The clients this process is about to run, as loading, in its very first report (the report task has
            # not run yet: nothing awaits between here and it). Said only by each eval once connected, they came
            # a report late: of processes started together, the first to say what it wanted got every slot and
            # filled it, and the others' first requests waited for those attempts to be given back.
            for client, model, requests in self._expect:
                self._dispatcher.expect(client, model, requests, loading=True)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._leases is not None:
            await self._leases.stop()
        if self._watcher is not None:
            await self._watcher.stop()
        # Failure reports still on their way finish first (bounded): the reports of a run's last requests
        # are what tells the registry about a server that hung at the end of it.
        if self._reports:
            await asyncio.wait(list(self._reports), timeout=REPORT_FLUSH_S)
        for task in list(self._reports):
            task.cancel()
        for task in list(self._reports):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()

    async def holders(self, detail: bool = True) -> PoolHolders | None:
        """Who is on the pool, as the registry's lease broker knows it (client names included: who may see them is
        the caller's to decide, `PoolHolders.redacted`; without `detail`, no holder's rows per server); None where
        the registry client cannot say. Asked at most every HOLDERS_FRESH_S; raises what the registry call raises."""
        registry = self._registry
        if not isinstance(registry, HoldersSource):
            return None
        now = asyncio.get_running_loop().time()
        asked = self._holders.get(detail)
        if asked is None or now - asked[0] >= HOLDERS_FRESH_S:
            asked = self._holders[detail] = (now, await registry.holders(detail))
        return asked[1]

    async def refresh(self) -> PoolSnapshot:
        assert self._watcher is not None
        snapshot = await self._watcher.refresh()
        self._on_snapshot(snapshot)
        return snapshot

    def _on_snapshot(self, snapshot: PoolSnapshot) -> None:
        if self._dispatcher is not None:
            self._dispatcher.notify_snapshot()

    def _report(self, server_id: str, kind: FailureKind) -> None:
        if len(self._reports) >= MAX_PENDING_REPORTS:
            return
        task = asyncio.get_running_loop().create_task(self._send_report(server_id, kind))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _send_report(self, server_id: str, kind: FailureKind) -> None:
        try:
            await self._registry.report_failure(server_id, kind.value)
        except Exception as exc:  # the registry may be restarting; probes will find the fault anyway
            log.debug("failure report for %s not delivered: %s", server_id, type(exc).__name__)
