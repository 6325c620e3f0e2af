"""The in-flight ledger: every attempt a dispatcher has on a server, counted once.

Counted per server, per client and per server × client in the same step as the choice that sends it
(`take`) and given back when the attempt ends however it ends (`release`), so nothing else counts:
the server book's windows, the planner's unsent work and interference rule, tail stealing's drain
estimates and the learned rates all read it. It also keeps what those readers need of the past:

- a wall-clock history of each server's count, to line up with the registry's scrapes (which are
  stamped with wall time and up to a probe interval old): `at(server, t)`;
- each server's busy seconds (monotonic time with at least one attempt in flight), cumulative, the one
  busy-time measurement every rate is computed from: `busy_s(server)`; and its occupancy (attempt-seconds:
  the integral of its count over time), for per-sequence speeds: `occupancy_s(server)`.

Pure bookkeeping: clocks injected, no I/O.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Mapping

HISTORY_LEN = 4096  # (wall time, count) changes kept per server; trimmed in halves


class InflightLedger:
    def __init__(self, *, clock: Callable[[], float], wall_clock: Callable[[], float],
                 history_len: int = HISTORY_LEN):
        self._clock = clock
        self._wall_clock = wall_clock
        self._history_len = history_len
        self._server: Counter[str] = Counter()
        self._client: Counter[str] = Counter()
        self._pair: dict[str, Counter[str]] = {}  # server -> client -> in flight there
        self._history: dict[str, list[tuple[float, int]]] = {}
        self._trimmed: set[str] = set()
        self._busy_total: dict[str, float] = {}
        self._busy_since: dict[str, float] = {}
        self._occupancy: dict[str, tuple[float, float]] = {}  # server -> (attempt-seconds so far, as of time)

    # ---- changes ------------------------------------------------------------------------------------
    def take(self, server_id: str, client_id: str) -> int:
        """One more attempt of `client_id` on `server_id`; returns the server's count after it."""
        now = self._clock()
        self._accrue(server_id, now)
        self._server[server_id] += 1
        self._client[client_id] += 1
        self._pair.setdefault(server_id, Counter())[client_id] += 1
        if server_id not in self._busy_since:
            self._busy_since[server_id] = now
        self._log(server_id)
        return self._server[server_id]

    def release(self, server_id: str, client_id: str) -> int:
        """That attempt ended (answered, failed or cancelled); returns the server's count after it."""
        now = self._clock()
        self._accrue(server_id, now)
        _decrement(self._server, server_id)
        _decrement(self._client, client_id)
        pair = self._pair.get(server_id)
        if pair is not None:
            _decrement(pair, client_id)
            if not pair:
                del self._pair[server_id]
        if server_id not in self._server and server_id in self._busy_since:
            self._busy_total[server_id] = self._busy_total.get(server_id, 0.0) + now - self._busy_since.pop(server_id)
        self._log(server_id)
        return self._server.get(server_id, 0)

    # ---- reads --------------------------------------------------------------------------------------
    def on_server(self, server_id: str) -> int:
        return self._server.get(server_id, 0)

    def of_client(self, client_id: str) -> int:
        return self._client.get(client_id, 0)

    def clients_on(self, server_id: str) -> Mapping[str, int]:
        """Client -> attempts in flight on that server (a live view: do not keep it)."""
        return self._pair.get(server_id, _EMPTY)

    def by_server(self) -> dict[str, int]:
        return dict(self._server)

    def total(self) -> int:
        return sum(self._server.values())

    def servers(self) -> set[str]:
        return set(self._server)

    def busy_s(self, server_id: str) -> float:
        """Seconds (monotonic clock) this dispatcher has had at least one attempt on the server, up to now."""
        total = self._busy_total.get(server_id, 0.0)
        since = self._busy_since.get(server_id)
        return total + (self._clock() - since if since is not None else 0.0)

    def occupancy_s(self, server_id: str) -> float:
        """Attempt-seconds on the server so far (∫ count dt): per-sequence speeds divide by it, so a server's
        speed does not grow with the traffic it is given (tokens per busy second does, with its batch)."""
        total, at = self._occupancy.get(server_id, (0.0, self._clock()))
        return total + self._server.get(server_id, 0) * (self._clock() - at)

    def _accrue(self, server_id: str, now: float) -> None:
        total, at = self._occupancy.get(server_id, (0.0, now))
        self._occupancy[server_id] = (total + self._server.get(server_id, 0) * (now - at), now)

    def at(self, server_id: str, wall_time: float) -> int:
        """The server's count at that wall-clock time. Before the first logged change it was 0, unless the
        history was trimmed: then the largest count it holds (so other clients' load is never overestimated)."""
        history = self._history.get(server_id)
        if not history:
            return 0
        index = bisect.bisect_right(history, (wall_time, float("inf"))) - 1
        if index < 0:
            return max(n for _, n in history) if server_id in self._trimmed else 0
        return history[index][1]

    def _log(self, server_id: str) -> None:
        history = self._history.get(server_id)
        if history is None:
            history = self._history[server_id] = []
        history.append((self._wall_clock(), self._server.get(server_id, 0)))
        if len(history) > 2 * self._history_len:  # a list (bisect needs O(1) indexing), trimmed in halves
            del history[:self._history_len]
            self._trimmed.add(server_id)


_EMPTY: Mapping[str, int] = {}


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
