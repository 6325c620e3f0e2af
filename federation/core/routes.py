"""A route: the servers that may serve a request (model, revision, pinned engines and servers), which of them
have room now, and the requests waiting for one of them, in the serving order.

Servers with room are an index (a list with positions) the server book keeps current as slots are taken and
given back, so a policy samples candidates in O(k) and an empty index answers "route full" at once. Waiting
requests queue FIFO per client; a heap orders the clients by their serving key (ClientBook.key, then the
arrival of their first waiting request), refreshed lazily: an entry whose client's key moved is put back with
the new key when it reaches the top, and a client whose key fell is pushed again at once (the dispatcher
calls `touch`). Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedpool.federation.core.types import InferenceRequest
from fedpool.registry import ServerEntry

if TYPE_CHECKING:
    from fedpool.federation.core.serverbook import ServerState

RouteKey = tuple[object, ...]
ClientKey = tuple[float, float]
SAMPLE_TRIES = 4  # random draws per wanted candidate that avoids a request's tried servers, before a scan
FREED = "\x00freed:"  # (the parking name of a group parked on `until_freed`: no server group is named so)


@dataclass(eq=False, slots=True)
class Waiter:
    """A request waiting for a slot on any server of its route that can take it."""

    request: InferenceRequest
    tried: set[str]
    future: asyncio.Future[Any]
    seq: int
    deadline: float
    route: Route


class Route:
    def __init__(self, key: RouteKey, model: str, revision: str | None, engines: tuple[str, ...] | None,
                 server_ids: tuple[str, ...] | None):
        self.key = key
        self.model = model
        self._model, self._revision = model, revision
        self._engines = frozenset(engines) if engines is not None else None
        self._ids = frozenset(server_ids) if server_ids is not None else None
        self.servers: list[ServerState] = []  # every routable server of the route, room or not
        self.free: list[ServerState] = []  # those with room now (unordered)
        self.kinds = 0  # how many server kinds (`ServerEntry.kind`) its servers are of
        self._pos: dict[ServerState, int] = {}
        self.memo: dict[Any, Any] = {}  # a policy's scratch for one grant pass (the dispatcher clears it)
        # Servers with room by a group a policy names (the planner: its server kinds), kept like `free`.
        self._group_of: Callable[[ServerState], str] | None = None
        self._groups: dict[str, list[ServerState]] = {}
        self._gpos: dict[ServerState, int] = {}
        # Waiting requests: per client FIFO, clients in a heap of (key..., head seq, client).
        self.queues: dict[str, deque[Waiter]] = {}
        self._heap: list[tuple[float, float, int, str]] = []
        self._pushed: dict[str, ClientKey] = {}  # the key of each client's newest heap entry
        self.waiting = 0  # live waiters
        # The client the grant pass last took slots back for (`GrantPass._take_for_order`), until it is granted one:
        # no more are taken for it meanwhile (the policy may hold it, and the slots go to others again).
        self.took_for: str | None = None
        # Clients a policy held until a server of one of these groups has room (`park`): out of the heap, so a
        # grant pass does not walk them again; back when such a server frees, the servers change, or `unpark_all`.
        # A server of a group getting room unparks only the group's first parked client in the serving order (not
        # every one: at 1,024 servers each freed slot woke ~13 clients the policy then held again); `unpark_ready`
        # wakes the next one while the group still has room after a pass. Per group, a heap of (key, serial,
        # client), stale entries dropped as met (a client parked again has a new serial).
        self.parked: dict[str, tuple[tuple[str, ...], ClientKey, int]] = {}  # (read-only to everyone else)
        self._parked_on: dict[str, list[tuple[float, float, int, str]]] = {}
        self._park_serial = 0
        self._key_of: Callable[[str], ClientKey] | None = None  # the serving order's key (from `head`)

    # ---- servers ----------------------------------------------------------------------------------
    def admits(self, entry: ServerEntry) -> bool:
        """Whether the route's requests may go to this server (routable, serving model and revision, pins)."""
        record = entry.record
        return (entry.status.routable and record.serves(self._model, self._revision)
                and (self._engines is None or record.engine.value in self._engines)
                and (self._ids is None or record.id in self._ids))

    def set_servers(self, servers: list[ServerState]) -> None:
        self.servers = servers
        self.kinds = _kinds(servers)
        self.free, self._pos = [], {}
        self._groups, self._gpos = {}, {}
        self.unpark_all()

    def set_free(self, state: ServerState, free: bool) -> None:
        """Keep the index current: O(1)."""
        pos = self._pos
        if free:
            if state not in pos:
                pos[state] = len(self.free)
                self.free.append(state)
                if self._group_of is not None:
                    name = self._group_of(state)
                    group = self._groups.setdefault(name, [])
                    self._gpos[state] = len(group)
                    group.append(state)
                    if name in self._parked_on:
                        self._unpark_first(name)
                    freed = FREED + name
                    if freed in self._parked_on:
                        self._unpark_first(freed)
            return
        index = pos.pop(state, None)
        if index is not None:
            last = self.free.pop()
            if last is not state:
                self.free[index] = last
                pos[last] = index
            if self._group_of is not None:
                group = self._groups[self._group_of(state)]
                index = self._gpos.pop(state)
                last = group.pop()
                if last is not state:
                    group[index] = last
                    self._gpos[last] = index

    def has_room_besides(self, state: ServerState) -> bool:
        """Whether a server of the route other than `state` has room now."""
        return len(self.free) > (1 if state in self._pos else 0)

    def group_by(self, group_of: Callable[[ServerState], str]) -> None:
        """Keep the servers with room also by `group_of` (once per route: a policy that wants it asks)."""
        if self._group_of is group_of:
            return
        self._group_of = group_of
        self._groups, self._gpos = {}, {}
        self.unpark_all()
        for state in self.free:
            group = self._groups.setdefault(group_of(state), [])
            self._gpos[state] = len(group)
            group.append(state)

    def free_in(self, group: str) -> list[ServerState]:
        """The servers with room in that group (a live list: do not keep it)."""
        return self._groups.get(group, _NONE)

    def remove(self, state: ServerState) -> None:
        self.set_free(state, False)
        if state in self.servers:
            self.servers.remove(state)
            self.kinds = _kinds(self.servers)

    def free_candidates(self, limit: int | None, tried: set[str], rng: random.Random) -> list[ServerState]:
        """Up to `limit` servers with room (all when None), sampled in O(limit). Servers the request failed on
        are avoided while another open server serves the route (full or not: then it waits for those)."""
        free = self.free
        if not tried:
            if limit is None or len(free) <= limit:
                return free
            return rng.sample(free, limit)
        fresh = [s for s in free if s.id not in tried] if limit is None or len(free) <= SAMPLE_TRIES * limit \
            else _sample_untried(free, limit, tried, rng)
        if fresh:
            return fresh if limit is None or len(fresh) <= limit else rng.sample(fresh, limit)
        if any(s.id not in tried and s.admits for s in self.servers):
            return []  # untried servers exist, all full: wait for them rather than go back
        return free if limit is None or len(free) <= limit else rng.sample(free, limit)

    def usable(self, server: ServerState, tried: set[str] | None = None) -> bool:
        """Whether a request may go to `server` now (room, breaker, not one it failed on)."""
        return server in self._pos and (not tried or server.id not in tried)

    # ---- waiting ---------------------------------------------------------------------------------
    def park(self, client: str, groups: tuple[str, ...], key: ClientKey, *, until_freed: bool = False) -> None:
        """`client` waits until a server in one of `groups` (see `group_by`) has room: grant passes skip it until
        then (a policy that held it for those groups says so; O(groups)). `until_freed`: until a server there that
        had no room gets some (a group with room already: the policy waits for one of its full servers), not woken
        after a pass by the room the group has."""
        if self._group_of is None or not groups or client in self.parked:
            return
        if until_freed:
            groups = tuple(FREED + g for g in groups)
        self._park_serial += 1
        serial = self._park_serial
        self.parked[client] = (groups, key, serial)
        for group in groups:
            heap = self._parked_on.setdefault(group, [])
            heapq.heappush(heap, (key[0], key[1], serial, client))
            if len(heap) > 2 * len(self.parked) + 64:  # stale entries (clients unparked through another group)
                heap[:] = [e for e in heap if (p := self.parked.get(e[3])) is not None and p[2] == e[2]]
                heapq.heapify(heap)

    def unpark_all(self) -> None:
        """Every parked client back in the order (the policy's reasons may have changed: its periodic look)."""
        for client in list(self.parked):
            self._unpark(client)
        self._parked_on.clear()

    def unpark_ready(self) -> bool:
        """Unpark the first parked client of every group that has room now (after a grant pass: the woken client
        may have gone elsewhere or been held again while the group's room stayed free). Whether any woke."""
        woke = False
        for group in list(self._parked_on):
            if self._groups.get(group):  # (a group parked `until_freed` has no servers under its name)
                woke = self._unpark_first(group) or woke
        return woke

    def _unpark_first(self, group: str) -> bool:
        """Unpark the group's first parked client by its key now (the order's key as the last grant pass read it:
        an entry whose key moved since it parked goes back with the new one, as in `head`)."""
        heap = self._parked_on[group]
        parked, key_of = self.parked, self._key_of
        woke = False
        while heap:
            first, share, serial, client = heap[0]
            entry = parked.get(client)
            if entry is None or entry[2] != serial:
                heapq.heappop(heap)
                continue
            if key_of is not None:
                key = key_of(client)
                if key != (first, share):
                    heapq.heapreplace(heap, (key[0], key[1], serial, client))
                    continue
            heapq.heappop(heap)
            self._unpark(client)
            woke = True
            break
        if not heap:
            del self._parked_on[group]
        return woke

    def _unpark(self, client: str) -> None:
        """Back in the order (its entries in other groups' heaps go stale: dropped when met)."""
        parked = self.parked.pop(client, None)
        if parked is None:
            return
        _, key, _ = parked
        queue = self.queues.get(client)
        if queue is not None:  # (emptied while parked: `head` drops it)
            self._push(client, key, queue[0].seq if queue else 0)  # `head` corrects a key that moved meanwhile

    def join(self, waiter: Waiter, key: ClientKey) -> None:
        client = waiter.request.client_id
        queue = self.queues.get(client)
        if queue is None:
            queue = self.queues[client] = deque()
        queue.append(waiter)
        self.waiting += 1
        if len(queue) == 1 or client not in self._pushed:  # (_push, inlined: every request passes here)
            self._pushed[client] = key
            heapq.heappush(self._heap, (key[0], key[1], waiter.seq, client))
            if len(self._heap) > 2 * len(self.queues) + 64:
                self._compact()

    def touch(self, client: str, key: ClientKey) -> None:
        """The client's key moved (down, perhaps): a fresh entry, so it is not served later than its due."""
        queue = self.queues.get(client)
        if queue and self._pushed.get(client) != key:
            self._push(client, key, queue[0].seq)

    def _push(self, client: str, key: ClientKey, seq: int) -> None:
        self._pushed[client] = key
        heapq.heappush(self._heap, (key[0], key[1], seq, client))
        if len(self._heap) > 2 * len(self.queues) + 64:
            self._compact()

    def head(self, key_of: Callable[[str], ClientKey], skip: set[str]) -> Waiter | None:
        """The waiter that comes first in the serving order (clients in `skip` left out; their entries are put
        back by `unskip`); cancelled waiters are dropped on the way."""
        self._key_of = key_of
        heap = self._heap
        while heap:
            first, share, seq, client = heap[0]
            queue = self.queues.get(client)
            while queue and queue[0].future.done():
                queue.popleft()
            if not queue:
                heapq.heappop(heap)
                self.queues.pop(client, None)
                self._pushed.pop(client, None)
                continue
            pushed = self._pushed.get(client)
            if pushed != (first, share):  # superseded by a newer entry of the same client
                heapq.heappop(heap)
                continue
            key = key_of(client)
            if key != pushed or seq != queue[0].seq:
                self._pushed[client] = key
                heapq.heapreplace(heap, (key[0], key[1], queue[0].seq, client))
                continue
            if client in skip or client in self.parked:
                heapq.heappop(heap)
                self._pushed.pop(client, None)
                continue
            return queue[0]
        return None

    def unskip(self, skipped: set[str], key_of: Callable[[str], ClientKey]) -> None:
        for client in skipped:
            queue = self.queues.get(client)
            if queue and client not in self.parked:
                self._push(client, key_of(client), queue[0].seq)

    def granted(self, waiter: Waiter) -> None:
        """The head was placed (or failed): out of its queue."""
        queue = self.queues.get(waiter.request.client_id)
        if queue and queue[0] is waiter:
            queue.popleft()

    def waiters(self) -> list[Waiter]:
        """Every live waiter (for deadlines; O(waiting))."""
        return [w for queue in self.queues.values() for w in queue if not w.future.done()]

    def clients(self) -> Sequence[str]:
        return list(self.queues)

    def _compact(self) -> None:
        self._heap = [(k[0], k[1], self.queues[c][0].seq, c) for c, k in self._pushed.items()
                      if self.queues.get(c)]
        heapq.heapify(self._heap)


_NONE: list[Any] = []


def _sample_untried(free: list[ServerState], limit: int, tried: set[str], rng: random.Random) -> list[ServerState]:
    picked: dict[str, ServerState] = {}
    for _ in range(SAMPLE_TRIES * limit):
        state = free[rng.randrange(len(free))]
        if state.id not in tried:
            picked[state.id] = state
            if len(picked) == limit:
                break
    return list(picked.values()) or [s for s in free if s.id not in tried]


def _kinds(servers: list[ServerState]) -> int:
    return len({s.entry.kind for s in servers if s.entry is not None})
