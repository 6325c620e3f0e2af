"""Straggler hedging: race a slow attempt against a duplicate on an idle server; first answer wins.

Only used where a duplicate cannot change the result (greedy decoding, same model revision) and only at
the tail (nothing else waiting for that model), so hedges spend idle capacity, never someone's share.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fedpool.federation.errors import AttemptError
from fedpool.federation.types import Completion
from fedpool.registry import ServerEntry

Launch = Callable[[], "tuple[asyncio.Task[Completion], ServerEntry, float] | None"]


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    server: ServerEntry
    started: float
    finished: float
    completion: Completion | None = None
    error: AttemptError | None = None
    cancelled: bool = False


class HedgeTimer:
    """When to hedge: `factor` × the median latency of recent successes for a model, never sooner than
    `min_delay_s`, and not at all before `min_samples` successes have been seen."""

    def __init__(self, factor: float = 2.0, min_delay_s: float = 0.2, min_samples: int = 8, window: int = 200):
        self._factor = factor
        self._min_delay_s = min_delay_s
        self._min_samples = min_samples
        self._window = window
        self._latencies: dict[str, deque[float]] = {}

    def observe(self, model: str, latency_s: float) -> None:
        self._latencies.setdefault(model, deque(maxlen=self._window)).append(latency_s)

    def delay(self, model: str) -> float | None:
        seen = self._latencies.get(model)
        if not seen or len(seen) < self._min_samples:
            return None
        return max(self._min_delay_s, self._factor * statistics.median(seen))


async def race(
    primary: asyncio.Task[Completion],
    server: ServerEntry,
    started: float,
    *,
    launch: Launch | None,
    delay_s: float | None,
    recheck_s: float,
    clock: Callable[[], float],
    wake: Callable[[], asyncio.Future[None] | None] | None = None,
) -> tuple[AttemptOutcome | None, list[AttemptOutcome], bool]:
    """(winner or None, every other finished attempt, whether a hedge was launched). Losers are cancelled
    and awaited, so their slots are released before this returns; so are all attempts if the caller is
    cancelled. `wake()` gives a future that completes when an idle server has started a copy (tail
    stealing); the copy is then raced against this one.
    (Moving instead, cancelling the queued copy at once, was measured worse: it also cancels copies the
    slow engine had half done.)"""
    running: dict[asyncio.Task[Completion], tuple[ServerEntry, float]] = {primary: (server, started)}
    outcomes: list[AttemptOutcome] = []
    winner: AttemptOutcome | None = None
    hedged = False
    next_try = started + delay_s if delay_s is not None else None
    try:
        while running and winner is None:
            timeout = None
            if launch is not None and not hedged and next_try is not None:
                timeout = max(0.0, next_try - clock())
            waiting: set[asyncio.Future[object]] = set(running)  # type: ignore[arg-type]
            woken = wake() if wake is not None and launch is not None and not hedged else None
            if woken is not None:
                waiting.add(woken)  # type: ignore[arg-type]
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            stolen = woken is not None and woken in done
            if stolen:
                done.discard(woken)  # type: ignore[arg-type]
            if not done:
                extra = launch() if launch is not None and not hedged else None
                if extra is not None:
                    running[extra[0]] = (extra[1], extra[2])
                    hedged = True
                elif next_try is not None and not stolen:
                    next_try = clock() + recheck_s  # no idle server yet: look again shortly
                continue
            for task in done:
                attempt_server, attempt_started = running.pop(task)
                exc = task.exception()
                if exc is None and winner is None:
                    winner = AttemptOutcome(attempt_server, attempt_started, clock(), completion=task.result())
                elif isinstance(exc, AttemptError):
                    outcomes.append(AttemptOutcome(attempt_server, attempt_started, clock(), error=exc))
                elif exc is not None:
                    raise exc
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        outcomes.extend(AttemptOutcome(s, t, clock(), cancelled=True) for s, t in running.values())
    return winner, outcomes, hedged
