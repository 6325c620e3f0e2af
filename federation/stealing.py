"""Tail stealing's bookkeeping: the hedgeable requests in flight on each server, so that a server that
frees a slot can take a straggler queued on a server that will drain slower (the dispatcher decides when
and races the copy; this only keeps the book and picks the candidate)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fedpool.federation.serverbook import ServerBook
from fedpool.federation.types import Completion, InferenceRequest
from fedpool.registry import ServerEntry


@dataclass(eq=False, slots=True)
class Racer:
    """A hedgeable request in flight on `server`; an idle server may steal it at the tail."""

    request: InferenceRequest
    server: ServerEntry
    wake: asyncio.Future[None]  # completed when an idle server has started a copy (a plain future: no task)
    stolen: tuple[asyncio.Task[Completion], ServerEntry, float] | None = None  # the copy an idle server started


class RaceBook:
    """Racers per server id, oldest first."""

    def __init__(self) -> None:
        self._by_server: dict[str, dict[Racer, None]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_server)

    def add(self, racer: Racer) -> None:
        self._by_server.setdefault(racer.server.id, {})[racer] = None

    def forget(self, racer: Racer) -> None:
        racers = self._by_server.get(racer.server.id)
        if racers is not None:
            racers.pop(racer, None)
            if not racers:
                del self._by_server[racer.server.id]

    def slowest_other(self, thief_id: str, slower_than: float, drain_of: Callable[[ServerEntry], float]) -> str | None:
        """The server (not the thief) with racers whose queue drains slowest, if slower than `slower_than`."""
        victim_id, worst = None, slower_than
        for sid, racers in self._by_server.items():
            if sid == thief_id or not racers:
                continue
            drain = drain_of(next(iter(racers)).server)
            if drain > worst:
                victim_id, worst = sid, drain
        return victim_id

    def take_last(self, server_id: str, eligible: Callable[[Racer], bool]) -> Racer | None:
        """The racer queued last on `server_id` that is not stolen yet and is eligible, out of the book."""
        racers = self._by_server.get(server_id, {})
        victim = next((r for r in reversed(racers) if r.stolen is None and eligible(r)), None)
        if victim is not None:
            self.forget(victim)
        return victim

    def stealable(self, thief: ServerEntry, book: ServerBook, eligible: Callable[[Racer], bool]) -> Iterator[Racer]:
        """The racers `thief` should copy, out of the book, one at a time while it has room in its window:
        each time the one queued last on the server whose queue drains slowest (in flight ÷ learned rate),
        if that is slower than the thief would drain with one more. The caller takes the thief's slot for
        each before asking for the next."""
        if book.weight_of(thief) <= 0:
            return
        while book.has_room(thief):
            victim_id = self.slowest_other(thief.id, book.drain_s(thief, extra=1), book.drain_s)
            if victim_id is None:
                return
            victim = self.take_last(victim_id, eligible)
            if victim is None:
                return
            yield victim
