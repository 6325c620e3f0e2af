"""The in-flight ledger: every attempt a dispatcher has on a server, counted once.

Counted per server, per client and per server × client in the same step as the choice that sends it
(`take`) and given back when the attempt ends however it ends (`release`), so nothing else counts: the
admission windows and the index of servers with room, the planner's unsent work and interference rule, tail
stealing's drain estimates and the learned rates all read it. Each server's figures live on one object,
`ServerSlots` (the dispatcher's per-server state extends it), so the hot path reads attributes, not dicts:

- `inflight` and `by_client`: attempts there now, in total and per client;
- a coarse wall-clock history of the count, to line up with the registry's scrapes (stamped with wall time
  and up to a probe interval old): `at(t)`;
- busy seconds (monotonic time with at least one attempt in flight), the one busy-time measurement every
  rate is computed from, and occupancy (attempt-seconds: ∫ count dt), for per-sequence speeds.

A server's slots are forgotten (`forget`) once it has left the pool and nothing of it is in flight.

Busy time and occupancy are what server speeds are measured on, so they are kept on a `StallClock`: the
monotonic clock less the seconds this process's own loop stood still. When the client's loop stops (a long
callback, a garbage-collection pause, the process descheduled on a busy machine), answers that arrived
meanwhile wait unread and every attempt in flight is charged the wait: one 150 ms stall at a light load made
one of two identical servers measure several times slower than its twin. The probe is the dispatcher's own
grant pass, scheduled with `call_soon` whenever requests arrive: one that runs more than a tolerance late
means the loop was stopped (or busy) for the excess, and the clock stands still for it. No timer of its own:
a stall is seen when a grant pass is pending (under load, nearly always); an idle dispatcher schedules nothing.
Pure bookkeeping: clocks injected, no I/O.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Mapping

HISTORY_BUCKET_S = 0.05  # the count's history keeps one entry per this much wall time (the largest count seen)
HISTORY_S = 30.0  # ... over this much of the past: scrapes are at most a few probe intervals old


class ServerSlots:
    """One server's in-flight figures (mutated only by the ledger)."""

    __slots__ = ("busy_since", "busy_total", "by_client", "history", "id", "inflight", "occupancy_at",
                 "occupancy_total", "trimmed")

    def __init__(self, server_id: str):
        self.id = server_id
        self.inflight = 0
        self.by_client: dict[str, int] = {}
        self.busy_total = 0.0
        self.busy_since: float | None = None
        self.occupancy_total = 0.0
        self.occupancy_at: float | None = None
        # (bucket start, largest count in the bucket, count at its end): appended when a new bucket starts.
        self.history: deque[list[float]] = deque()
        self.trimmed = False

    def at(self, wall_time: float) -> int:
        """The count at that wall-clock time (the largest within its bucket: others' load is never
        overestimated); 0 before the first change; the oldest kept where the history no longer reaches."""
        history = self.history
        if not history:
            return 0
        index = bisect.bisect_right(history, wall_time, key=lambda b: b[0]) - 1
        if index < 0:
            return int(history[0][1]) if self.trimmed else 0
        bucket = history[index]
        return int(bucket[1] if wall_time < bucket[0] + HISTORY_BUCKET_S else bucket[2])


class StallClock:
    """The monotonic clock less every stall the dispatcher's grant passes saw (see the module docstring);
    continuous and never decreasing: it stands still while a pending grant pass is late."""

    def __init__(self, inner: Callable[[], float] = time.monotonic, tolerance_s: float = 0.005):
        self._inner = inner
        self.tolerance_s = tolerance_s
        self.stalled_s = 0.0  # stall seconds seen so far (beyond the tolerance), cumulative
        self.stalls = 0
        self.pending_since: float | None = None  # when the pending grant pass was scheduled (inner time)

    def now(self) -> float:
        now = self._inner()
        since = self.pending_since
        if since is not None and now - since > self.tolerance_s:
            return since + self.tolerance_s - self.stalled_s
        return now - self.stalled_s

    def ran(self, now: float) -> float:
        """The pending grant pass runs at `now` (inner time): its lateness beyond the tolerance is a stall.
        Returns the lateness (the loop's lag)."""
        since, self.pending_since = self.pending_since, None
        if since is None:
            return 0.0
        lag = now - since
        if lag > self.tolerance_s:
            self.stalled_s += lag - self.tolerance_s
            self.stalls += 1
        return lag


class InflightLedger:
    def __init__(self, *, clock: Callable[[], float], wall_clock: Callable[[], float]):
        self.clock = clock  # busy time and occupancy are measured on it
        self._clock = clock
        self._wall_clock = wall_clock
        self._servers: dict[str, ServerSlots] = {}
        self.clients: dict[str, int] = {}  # client -> attempts in flight (read-only to everyone else)
        self._total = 0

    def slots(self, server_id: str, factory: Callable[[str], ServerSlots] = ServerSlots) -> ServerSlots:
        """The server's figures, made (by `factory`) on first use."""
        slots = self._servers.get(server_id)
        if slots is None:
            slots = self._servers[server_id] = factory(server_id)
        return slots

    def forget(self, server_id: str) -> bool:
        """Drop a server's figures if nothing of it is in flight; True when dropped."""
        slots = self._servers.get(server_id)
        if slots is None or slots.inflight:
            return slots is None
        del self._servers[server_id]
        return True

    # ---- changes ------------------------------------------------------------------------------------
    def take(self, slots: ServerSlots, client_id: str) -> int:
        """One more attempt of `client_id` there; returns the server's count after it."""
        now = self._clock()
        n = slots.inflight
        if slots.occupancy_at is not None:
            slots.occupancy_total += n * (now - slots.occupancy_at)
        slots.occupancy_at = now
        if n == 0:
            slots.busy_since = now
        slots.inflight = n = n + 1
        slots.by_client[client_id] = slots.by_client.get(client_id, 0) + 1
        self.clients[client_id] = self.clients.get(client_id, 0) + 1
        self._total += 1
        # The count's coarse history (one bucket per HISTORY_BUCKET_S of wall time; inlined here and in
        # release: it runs for every attempt).
        wall, history = self._wall_clock(), slots.history
        if history and wall < history[-1][0] + HISTORY_BUCKET_S:
            last = history[-1]
            last[2] = n
            if n > last[1]:
                last[1] = n
        else:
            self._new_bucket(slots, wall, n)
        return n

    def release(self, slots: ServerSlots, client_id: str) -> int:
        """That attempt ended (answered, failed or cancelled); returns the server's count after it."""
        now = self._clock()
        n = slots.inflight
        if slots.occupancy_at is not None:
            slots.occupancy_total += n * (now - slots.occupancy_at)
        slots.occupancy_at = now
        slots.inflight = n = n - 1
        if n == 0 and slots.busy_since is not None:
            slots.busy_total += now - slots.busy_since
            slots.busy_since = None
        left = slots.by_client[client_id] - 1
        if left:
            slots.by_client[client_id] = left
        else:
            del slots.by_client[client_id]
        left = self.clients[client_id] - 1
        if left:
            self.clients[client_id] = left
        else:
            del self.clients[client_id]
        self._total -= 1
        wall, history = self._wall_clock(), slots.history
        if history and wall < history[-1][0] + HISTORY_BUCKET_S:
            history[-1][2] = n
        else:
            self._new_bucket(slots, wall, n)
        return n

    @staticmethod
    def _new_bucket(slots: ServerSlots, wall: float, n: int) -> None:
        history = slots.history
        history.append([wall, n, n])
        while wall - history[0][0] > HISTORY_S and len(history) > 1:
            history.popleft()
            slots.trimmed = True

    # ---- reads --------------------------------------------------------------------------------------
    def on_server(self, server_id: str) -> int:
        slots = self._servers.get(server_id)
        return slots.inflight if slots is not None else 0

    def of_client(self, client_id: str) -> int:
        return self.clients.get(client_id, 0)

    def clients_on(self, server_id: str) -> Mapping[str, int]:
        """Client -> attempts in flight on that server (a live view: do not keep it)."""
        slots = self._servers.get(server_id)
        return slots.by_client if slots is not None else _EMPTY

    def by_server(self) -> dict[str, int]:
        return {sid: s.inflight for sid, s in self._servers.items() if s.inflight}

    def total(self) -> int:
        return self._total

    def servers(self) -> set[str]:
        """Servers with attempts in flight."""
        return {sid for sid, s in self._servers.items() if s.inflight}

    def known(self) -> int:
        """Servers the ledger holds figures for (in flight or not)."""
        return len(self._servers)

    def busy_s(self, server_id: str) -> float:
        """Seconds (monotonic clock) this dispatcher has had at least one attempt on the server, up to now."""
        slots = self._servers.get(server_id)
        if slots is None:
            return 0.0
        return slots.busy_total + (self._clock() - slots.busy_since if slots.busy_since is not None else 0.0)

    def occupancy_s(self, server_id: str) -> float:
        """Attempt-seconds on the server so far (∫ count dt): per-sequence speeds divide by it, so a server's
        speed does not grow with the traffic it is given (tokens per busy second does, with its batch)."""
        slots = self._servers.get(server_id)
        if slots is None or slots.occupancy_at is None:
            return 0.0
        return slots.occupancy_total + slots.inflight * (self._clock() - slots.occupancy_at)

    def at(self, server_id: str, wall_time: float) -> int:
        """The server's count at that wall-clock time (see ServerSlots.at)."""
        slots = self._servers.get(server_id)
        return slots.at(wall_time) if slots is not None else 0


_EMPTY: Mapping[str, int] = {}
