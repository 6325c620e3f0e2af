"""This process's capacity lease: what its dispatcher may keep in flight on each server, shared with every
other process by the registry's broker (registry/leases.py; docs/architecture.md, "Many processes, one pool").

The lease client reports the dispatcher's demand and what it holds, and applies the lease that comes back; the
dispatcher decides locally within it, so nothing on the request path waits for the registry. Calls are long polls,
answered at once when this process's slots changed, else after `renew_s`. The dispatcher pokes the client when
it goes from idle to wanting slots, and when it lets go of a slot its lease no longer covers. An idle process
reports its last demand for `IDLE_HOLD_S` more, then nothing; clients that sent their last request are not held for.

A lease runs `ttl_s` from when the report that earned it was *sent* (the broker stops sharing with a silent
holder `ttl_s` after it *received* it, later). A lease that runs out unrenewed leaves the process its safe share
(what it held, capped) for one more TTL — the broker counts it as in use that long — and then nothing; a process
holds nothing until its first lease. A lease from the registry replaces the fallback when it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from fedpool.registry import (
    ClientDemand,
    DemandReport,
    HolderKind,
    Lease,
    ModelDemand,
    Served,
    holder_id,
    holder_info,
)

log = logging.getLogger("fedpool.leases")

RENEW_S = 0.5  # a steady process renews its lease this often (the broker's TTL is a few renewals)
CALL_TIMEOUT_S = 5.0  # a lease call that takes longer than its wait plus this is given up (the registry is away)
RETRY_S = 0.5  # after a failed call, the next one waits this long
MIN_POKE_S = 0.05  # pokes closer than this share one report
# A process that goes idle keeps asking for what it last wanted this long: giving the lease back at once made a
# gateway between two callers' requests wait a registry round trip for the next one.
IDLE_HOLD_S = 1.0
MAX_ENDED = 256  # clients a report says have ended (the holders view's last word on them), at most


def _read_outcome(future: asyncio.Future[Any]) -> None:
    """A done callback for a future nobody awaits any more: its error, if any, is read (and dropped)."""
    if not future.cancelled():
        future.exception()


class LeaseRegistry(Protocol):
    """What the lease client needs of the registry (its Ray or HTTP client; the simulator's in-process broker)."""

    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease: ...

    async def release_lease(self, holder: str) -> None: ...


class LeaseHolder(Protocol):
    """What the lease client needs of its process's dispatcher (`Dispatcher`)."""

    on_demand: Callable[[bool], None] | None
    on_over_lease_release: Callable[[], None] | None

    def demand(self) -> tuple[ModelDemand, ...]: ...

    def inflight(self) -> dict[str, int]: ...

    def held(self) -> dict[str, int]: ...

    def apply_lease(self, slots: Mapping[str, int] | None) -> None: ...

    def done_sending(self, client_id: str) -> bool: ...

    def served_totals(self) -> Served: ...

    def price_by_pool(self, served: Served) -> None: ...


@runtime_checkable
class ProgressSource(Protocol):
    """What the lease client also asks of a dispatcher that can say it (`Dispatcher`): a client's progress once it
    has nothing waiting or in flight, reported as it ends (without it, the holders view has the client's last
    demand)."""

    def client_progress(self, client_id: str) -> ClientDemand: ...


class LeaseClient:
    def __init__(self, registry: LeaseRegistry, dispatcher: LeaseHolder, *, holder: str | None = None,
                 renew_s: float = RENEW_S, clock: Callable[[], float] = time.monotonic,
                 holder_kind: HolderKind = "other"):
        """`holder_kind`: what this process is, as the pool's holders view shows it (`eval run`, `gateway`, ...)."""
        self._registry = registry
        self._dispatcher = dispatcher
        self.holder = holder or holder_id()
        self.info = holder_info(holder_kind)  # who this process is, in every report (a restarted broker learns it)
        self._progress = dispatcher.client_progress if isinstance(dispatcher, ProgressSource) else None
        self._reported: set[tuple[str, str]] = set()  # (model, client) of the last report
        self._renew_s = renew_s
        self._clock = clock
        self._version = -1
        self._broker: str | None = None
        self._expires_at: float | None = None
        self._safe: Mapping[str, int] | None = None
        self._fallback = False
        self._poked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._late: dict[asyncio.Future[Lease], float] = {}  # long polls superseded by a poked report -> sent at
        self._held: Mapping[str, int] = {}  # the lease last applied
        self._wanted: tuple[ModelDemand, ...] = ()  # the last demand that was not nothing ...
        self._wanted_at = float("-inf")  # ... and when it last wanted anything
        self.calls = 0
        self.failures = 0
        self.lapses = 0  # leases that ran out unrenewed

    async def start(self) -> None:
        """Hold no slots until the first lease comes (a round trip): no broker keeps anything free for a holder it
        has not heard of, so any share taken without a lease may be another's (it used to go uncapped after
        CALL_TIMEOUT_S)."""
        self._dispatcher.on_demand = self.poke
        self._dispatcher.on_over_lease_release = self._poked.set
        self._dispatcher.apply_lease({})
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_later(CALL_TIMEOUT_S, self._never_leased)
        self._task = loop.create_task(self._run(), name=f"lease-{self.holder}")

    def _never_leased(self) -> None:
        self._expiry = None
        if self._version < 0:
            log.warning("no capacity lease from the registry in %.0f s: waiting for one (start with leasing off to "
                        "work without)", CALL_TIMEOUT_S)

    async def stop(self) -> None:
        """Stop renewing and give the slots back (best effort: the broker forgets a silent holder at its TTL)."""
        self._dispatcher.on_demand = None
        self._dispatcher.on_over_lease_release = None
        if self._expiry is not None:
            self._expiry.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for call in list(self._late):
            call.cancel()
        await asyncio.gather(*list(self._late), return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._farewell(), 1.0)

    async def _farewell(self) -> None:
        """The last word on the clients it reported (the holders view shows how each ended: an eval run's process
        exits right after its last answer, before another renewal would say so), then the slots go back."""
        if self._progress is not None and self._reported:
            ended = self._ended(())
            dispatcher = self._dispatcher
            await self._registry.lease(DemandReport(holder=self.holder, inflight=dispatcher.inflight(),
                                                    broker=self._broker, info=self.info, ended=ended), -1, 0.0)
        await self._registry.release_lease(self.holder)

    def poke(self, busy: bool = True) -> None:
        """The dispatcher's demand went from nothing to something (report now, unless the last report still asked
        for slots) or back (nothing to do: renewals report the last demand for IDLE_HOLD_S, then nothing)."""
        if busy:
            if not self._wanted:  # (else the last report still asks for its slots, held for IDLE_HOLD_S: a paced
                self._poked.set()  # gateway going idle between requests would report at every request)
        else:
            self._wanted_at = self._clock()  # it wanted slots until now: the hold counts from here
            if self._wanted and not self._coming(self._wanted):
                # Every client it asked for has sent its last request (finished evals): nothing will come to use
                # a held slot, so the slots go back now (held for IDLE_HOLD_S, a finished eval's process kept
                # its slots idle while the others' requests waited).
                self._wanted = ()
                self._poked.set()

    def _coming(self, demand: tuple[ModelDemand, ...]) -> tuple[ModelDemand, ...]:
        """`demand` less the clients that have sent their last request (`Dispatcher.client_done_sending`)."""
        done = self._dispatcher.done_sending
        out = []
        for model in demand:
            clients = tuple(c for c in model.clients if not done(c.client))
            if len(clients) == len(model.clients):
                out.append(model)
            elif clients:
                out.append(model.model_copy(update={"clients": clients}))
        return tuple(out)

    def report(self) -> DemandReport:
        dispatcher = self._dispatcher
        demand, now = dispatcher.demand(), self._clock()
        if demand:
            self._wanted, self._wanted_at = demand, now
        elif now - self._wanted_at < IDLE_HOLD_S:
            demand = self._wanted = self._coming(self._wanted)
        else:
            self._wanted = ()
        served = dispatcher.served_totals()
        return DemandReport(holder=self.holder, models=demand, inflight=dispatcher.inflight(),
                            held=dispatcher.held(), broker=self._broker, served_work=served.work,
                            served_slot_s=served.slot_s, served_answer_tokens=served.answer_tokens, info=self.info,
                            ended=self._ended(demand))

    def _ended(self, demand: tuple[ModelDemand, ...]) -> tuple[ModelDemand, ...]:
        """The clients of the last report that this one leaves out, with their progress now."""
        reported = {(m.model, c.client) for m in demand for c in m.clients}
        gone, self._reported = self._reported - reported, reported
        if not gone or self._progress is None:
            return ()
        by_model: dict[str, list[ClientDemand]] = {}
        for model, client in sorted(gone)[:MAX_ENDED]:
            by_model.setdefault(model, []).append(self._progress(client))
        return tuple(ModelDemand(model=model, clients=tuple(clients)) for model, clients in by_model.items())

    async def _run(self) -> None:
        reported_at = float("-inf")
        while True:
            if self._poked.is_set():  # at most one poked report per MIN_POKE_S (a light load toggles per request)
                await asyncio.sleep(max(0.0, reported_at + MIN_POKE_S - self._clock()))
            self._poked.clear()
            reported_at = self._clock()
            report = self.report()
            poke = asyncio.ensure_future(self._poked.wait())
            call = asyncio.ensure_future(asyncio.wait_for(
                self._registry.lease(report, self._version, self._renew_s), self._renew_s + CALL_TIMEOUT_S))
            try:
                done, _ = await asyncio.wait({poke, call}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                for future in (poke, call):
                    future.cancel()
                    # (a call that failed as it was cancelled ends with its error, not cancelled: read it, or
                    # asyncio logs "Task exception was never retrieved" when it is collected)
                    future.add_done_callback(_read_outcome)
                raise
            poke.cancel()
            if call not in done:  # poked while the long poll waits: report again now, keep the answer coming
                self._late[call] = reported_at
                call.add_done_callback(self._late_answer)
                continue
            self.calls += 1
            try:
                self._apply(call.result(), reported_at)
            except Exception as exc:  # the registry is away or restarting: keep the lease until it expires
                self.failures += 1
                log.debug("capacity lease not renewed: %s", type(exc).__name__)
                await asyncio.sleep(RETRY_S)

    def _late_answer(self, call: asyncio.Future[Lease]) -> None:
        sent_at = self._late.pop(call, self._clock())
        if not call.cancelled() and call.exception() is None:
            lease = call.result()
            if lease.version > self._version or lease.broker != self._broker:
                self._apply(lease, sent_at)

    def _apply(self, lease: Lease, sent_at: float) -> None:
        """Work within `lease`, valid until `ttl_s` after the report it answers was sent (one that comes later
        than that is not applied). Its pool figures are taken whatever its age."""
        self._dispatcher.price_by_pool(lease.pool_served)
        if sent_at + lease.ttl_s <= self._clock():
            return
        if lease.broker != self._broker and self._broker is not None:
            log.info("the registry's lease broker changed (%s -> %s)", self._broker, lease.broker)
        self._broker, self._version, self._safe = lease.broker, lease.version, lease.safe
        self._held = lease.slots
        self._expires_at = sent_at + lease.ttl_s
        self._fallback = False
        self._dispatcher.apply_lease(lease.slots)
        self._expire_in(self._expires_at - self._clock(), lease.ttl_s)

    def _expire_in(self, delay: float, ttl_s: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(max(0.0, delay), self._expired, ttl_s)

    def _expired(self, ttl_s: float) -> None:
        """The lease ran out unrenewed (the registry away, or the call too slow). For one TTL from then keep at
        most what was held, capped by the safe share; after that, nothing: the broker counts a silent holder's
        slots in use that long and no longer (a share kept for good would be another's once it forgets us)."""
        self._expiry = None
        now = self._clock()
        if self._expires_at is None or now < self._expires_at or self._safe is None:
            return
        if not self._fallback:
            self.lapses += 1
            self._fallback = True
            if now < self._expires_at + ttl_s:
                log.warning("capacity lease not renewed in time: keeping at most what was held for %.0f s", ttl_s)
                safe = self._safe
                self._dispatcher.apply_lease({s: min(n, safe[s]) for s, n in self._held.items() if s in safe})
                self._expire_in(self._expires_at + ttl_s - now, ttl_s)
                return
        log.warning("capacity lease still not renewed (registry unreachable): holding nothing until it answers")
        self._dispatcher.apply_lease({})

    @property
    def in_fallback(self) -> bool:
        return self._fallback
