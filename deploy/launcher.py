"""Run an engine as a pool member: start it, wait healthy, register, heartbeat, deregister on exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from fedpool.deploy.process import EngineProcess
from fedpool.registry import (
    RegistryClient,
    RegistryError,
    ServerEntry,
    ServerRecord,
    ServerStatus,
    UnknownServerError,
    adapter_for,
)

log = logging.getLogger("fedpool.deploy")


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    ttl_s: float = 30.0
    heartbeat_s: float = 10.0


class ServerLauncher:
    """Owns one engine process and its registration. `await launcher.start()`; `await launcher.stop()`."""

    def __init__(
        self,
        process: EngineProcess,
        record: ServerRecord,
        registry: RegistryClient,
        *,
        lease: LeaseSettings | None = None,
        start_deadline_s: float = 300.0,
    ):
        self.process = process
        self.record = record
        self._registry = registry
        self._lease = lease or LeaseSettings()
        self._deadline_s = start_deadline_s
        self._tasks: list[asyncio.Task[None]] = []
        self._registered = False
        self.exited = asyncio.Event()
        self.removed = asyncio.Event()  # an operator removed the server: its engine is stopped, not registered again
        self.draining = False  # an operator drained it (the registry's answer to the last heartbeat)

    async def start(self) -> float:
        """Start the engine and register it; returns seconds until healthy."""
        await self.process.start()
        try:
            health = self.record.url + adapter_for(self.record.engine).health_path
            took = await self.process.wait_healthy(health, deadline_s=self._deadline_s)
            await self._registry.register(self.record, lease_ttl_s=self._lease.ttl_s, replace=True)
        except BaseException:
            await self.process.stop()
            raise
        self._registered = True
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._heartbeat(), name=f"heartbeat-{self.record.id}"),
            loop.create_task(self._watch_exit(), name=f"watch-{self.record.id}"),
        ]
        log.info("server %s healthy in %.1fs and registered at %s", self.record.id, took, self.record.url)
        return took

    async def _heartbeat(self) -> None:
        """Heartbeats until an operator removes the server; then its engine is stopped (its watcher sees it end)."""
        while not self.removed.is_set():
            await asyncio.sleep(self._lease.heartbeat_s)
            await self._beat()
        await self.process.stop()

    async def _beat(self) -> None:
        """One heartbeat. A server an operator removed (`fedpool server remove`) is not registered again: `removed`
        is set. One that a registry started afresh does not know is registered again."""
        try:
            self._note(await self._registry.heartbeat(self.record.id, self._lease.ttl_s))
        except UnknownServerError as exc:
            if exc.removed:
                log.warning("%s was removed from the pool (`fedpool server remove`): stopping its engine",
                            self.record.id)
                self._registered = False
                self.removed.set()
                return
            log.warning("registry does not know %s any more; registering it again", self.record.id)
            try:
                await self._registry.register(self.record, lease_ttl_s=self._lease.ttl_s, replace=True)
            except Exception as exc:
                log.warning("re-registering %s failed (%s); will retry", self.record.id, type(exc).__name__)
        except RegistryError as exc:
            log.warning("heartbeat of %s refused: %s", self.record.id, exc)
        except Exception as exc:  # registry restarting: the lease covers a few missed beats
            log.warning("heartbeat of %s failed (%s); will retry", self.record.id, type(exc).__name__)

    def _note(self, entry: ServerEntry) -> None:
        """Say once that an operator drained the server: it stays registered, draining, and gets no new requests."""
        draining = entry.status is ServerStatus.DRAINING
        if draining and not self.draining:
            log.warning("%s is draining (`fedpool server drain`): no new requests; it stays registered, draining, "
                        "until removed or stopped", self.record.id)
        self.draining = draining

    async def _watch_exit(self) -> None:
        code = await self.process.wait()
        log.warning("engine of %s exited with code %s", self.record.id, code)
        self.exited.set()
        await self._deregister()

    async def _deregister(self) -> None:
        if not self._registered:
            return
        self._registered = False
        try:
            await self._registry.deregister(self.record.id)
        except Exception as exc:
            log.warning("could not deregister %s (%s); its lease will expire", self.record.id, type(exc).__name__)

    async def serve_until(self, stop: asyncio.Event) -> bool:
        """Once started: wait until `stop` is set or the engine exits (by itself, or stopped because an operator
        removed the server), then stop it and deregister. Whether the engine exited by itself."""
        stopped = asyncio.create_task(stop.wait())
        died = asyncio.create_task(self.exited.wait())
        await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
        for task in (stopped, died):
            task.cancel()
        await self.stop()
        return self.exited.is_set() and not stop.is_set() and not self.removed.is_set()

    async def stop(self) -> None:
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for task in self._tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tasks = []
        await self._deregister()
        await self.process.stop()
