"""Seconds this process's event loop could not run, so that a stalled client does not read as a slow server.

A dispatcher measures a server's speed by the time its attempts spend in flight. When the client's own loop
stops (a long callback, a garbage-collection pause, the process descheduled on a busy machine), answers that
arrived meanwhile wait unread and every attempt in flight is charged the wait: one 150 ms stall at a light
load made one of two identical servers measure several times slower than its twin. `LoopStalls` notices
stalls with a timer due every `interval_s`: one that runs more than `tolerance_s` late means the loop was
stopped for the excess. Its `clock` is the dispatcher's clock with those seconds taken out; the in-flight
ledger measures busy time and occupancy on it. The timer runs only while `active()` (attempts in flight),
so an idle dispatcher schedules nothing. What the loop did not see is unknown either way: an attempt that
was running on the server through the stall loses the stall from its time (a small error against a long
attempt), where one that ended during it would otherwise be charged all of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LoopStalls:
    def __init__(self, active: Callable[[], bool], *, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = 0.01, tolerance_s: float = 0.005):
        self._active = active
        self._inner = clock
        self._interval = interval_s
        self._tolerance = tolerance_s
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self.stalled_s = 0.0  # stall seconds seen so far (beyond the tolerance), cumulative
        self.stalls = 0  # how many late timers those were

    @property
    def watching(self) -> bool:
        return self._handle is not None

    def clock(self) -> float:
        """The inner clock less every stall, including one the timer has not yet run to count: continuous
        and never decreasing (it stands still while the loop is stopped)."""
        now = self._inner()
        return now - self.stalled_s - self._pending(now)

    def arm(self) -> None:
        """Watch from now on while `active()`; a no-op when already watching or outside a running loop."""
        if self._handle is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._schedule(loop)

    def _pending(self, now: float) -> float:
        return max(0.0, now - self._due - self._tolerance) if self._handle is not None else 0.0

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = self._inner() + self._interval
        self._handle = loop.call_later(self._interval, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        late = self._pending(self._inner())
        if late > 0:
            self.stalled_s += late
            self.stalls += 1
        self._handle = None
        if self._active():
            self._schedule(loop)
