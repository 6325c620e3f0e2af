"""Which servers may serve a request: the current snapshot filtered by the request's route (model, revision,
pinned engines and servers), computed once per snapshot and route; and a server as the newest snapshot has
it. Pure bookkeeping over the snapshot source, no I/O."""

from __future__ import annotations

from collections.abc import Callable

from fedpool.federation.types import InferenceRequest
from fedpool.registry import PoolSnapshot, ServerEntry


class Routes:
    def __init__(self, snapshots: Callable[[], PoolSnapshot | None],
                 on_new_snapshot: Callable[[], None] | None = None):
        self._snapshots = snapshots
        self._on_new_snapshot = on_new_snapshot
        self._cache: dict[tuple[object, ...], list[ServerEntry]] = {}
        self._version = -1
        self._snapshot: PoolSnapshot | None = None

    def servers_for(self, request: InferenceRequest) -> list[ServerEntry]:
        """Routable servers for the request's route in the current snapshot."""
        snapshot = self._snapshots()
        if snapshot is None:
            return []
        if self._version != snapshot.version or self._snapshot is not snapshot:
            self._cache.clear()
            self._version, self._snapshot = snapshot.version, snapshot
            if self._on_new_snapshot is not None:
                self._on_new_snapshot()
        key = request.route_key()
        servers = self._cache.get(key)
        if servers is None:
            view = snapshot.filter(model=request.model, revision=request.revision, engines=request.pinned_engines,
                                   server_ids=request.pinned_servers, routable_only=True)
            servers = self._cache[key] = list(view.entries)
        return servers

    def current(self, server: ServerEntry) -> ServerEntry:
        """The server as the newest snapshot has it (its latest scrape): a slot holds the entry of the
        snapshot it was granted from, which can be many probes old when the answer comes back."""
        snapshot = self._snapshots()
        newest = snapshot.get(server.id) if snapshot is not None else None
        return newest if newest is not None else server
