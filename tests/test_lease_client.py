"""The lease client (federation/gateway/leases.py) against a registry that answers and then goes away, in simulated
time: when a lease runs out, what the process may keep in flight, and when."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from fedpool.federation.core.attempts import PREEMPT_MAX_AGE_S
from fedpool.federation.core.dispatcher import Dispatcher
from fedpool.federation.core.grants import EXPECT_HOLD_S
from fedpool.federation.core.types import DispatchConfig, Endpoint, InferenceRequest
from fedpool.federation.gateway.leases import IDLE_HOLD_S, LeaseClient
from fedpool.federation.routing.policies import make_policy
from fedpool.registry import DemandReport, Lease, Served
from fedpool.registry.leases import LeaseBroker, LeaseServer, LeaseService
from tests.fakes import FakePool
from tests.test_dispatcher import request, snapshot_of

pytestmark = pytest.mark.looptime
TTL_S = 3.0


class Registry:
    """Answers lease calls with `slots` while up (a long poll: an unchanged lease after the call's wait); while
    down, a call never answers. Notes when each report was received."""

    def __init__(self, slots: dict[str, int], safe: dict[str, int]):
        self.slots, self.safe = slots, safe
        self.up = True
        self.received: list[float] = []
        self.reports: list[tuple[float, DemandReport]] = []
        self.released: list[str] = []

    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease:
        loop = asyncio.get_running_loop()
        if not self.up:
            await asyncio.sleep(3600)
        self.received.append(loop.time())
        self.reports.append((loop.time(), report))
        if known_version == 1:
            await asyncio.sleep(wait_s)
        return Lease(report.holder, "b1", 1, TTL_S, dict(self.slots), dict(self.safe), 2)

    async def release_lease(self, holder: str) -> None:
        self.released.append(holder)


async def one_server_leased(fakes: FakePool, decode_s: float) -> tuple[Dispatcher, Registry, LeaseClient]:
    """One fake 4-slot server, a dispatcher over it and its lease client (started) against a registry that leases
    all 4 slots."""
    server = fakes.start(decode_s=decode_s)
    snap = snapshot_of([server], capacity=4)
    dispatcher = fakes.dispatcher(lambda: snap, make_policy("least_inflight"))
    dispatcher.notify_snapshot()
    registry = Registry({"s0": 4}, safe={"s0": 4})
    client = LeaseClient(registry, dispatcher, holder="h", clock=asyncio.get_running_loop().time)
    await client.start()
    return dispatcher, registry, client


async def test_a_lapsed_lease_keeps_at_most_what_was_held_for_a_ttl_then_nothing(fakes: FakePool) -> None:
    servers = [fakes.start(), fakes.start()]
    snap = snapshot_of(servers, capacity=4)
    dispatcher = fakes.dispatcher(lambda: snap, make_policy("least_inflight"))
    dispatcher.notify_snapshot()
    registry = Registry({"s0": 1, "s1": 3}, safe={"s0": 2, "s1": 2})
    client = LeaseClient(registry, dispatcher, holder="h", clock=asyncio.get_running_loop().time)
    await client.start()
    try:
        await asyncio.sleep(2.0)
        assert dispatcher.held() == {"s0": 1, "s1": 3} and not client.in_fallback
        registry.up = False
        await asyncio.sleep(0.01)
        # The last report that was answered was sent (and received: no network here) at this time; its lease
        # runs TTL_S from then, not from when its answer came (a long poll answers up to 0.5 s later).
        sent = registry.received[-1]
        loop = asyncio.get_running_loop()
        await asyncio.sleep(sent + TTL_S - 0.05 - loop.time())
        assert dispatcher.held() == {"s0": 1, "s1": 3} and client.lapses == 0
        await asyncio.sleep(0.1)
        # Lapsed: nothing more than it held on any server (s0 stays at 1 though its safe share is 2), capped by
        # the safe share (s1: 3 -> 2). The broker may already have given its slots away if it is alive.
        assert client.in_fallback and client.lapses == 1
        assert dispatcher.held() == {"s0": 1, "s1": 2}
        await asyncio.sleep(TTL_S)
        # One more TTL: the broker, if alive, no longer counts it as in use; nothing is safe to keep.
        assert dispatcher.held() == {}
        registry.up, registry.slots = True, {"s0": 4}
        await asyncio.sleep(10.0)  # the hung call times out, the next one is answered
        assert dispatcher.held() == {"s0": 4} and not client.in_fallback and client.lapses == 1
    finally:
        await client.stop()
    assert registry.released == ["h"]


async def test_a_process_that_goes_idle_asks_for_its_last_demand_a_little_longer_then_nothing(
        fakes: FakePool) -> None:
    """A gateway between two callers' requests keeps its slots (the next request needs no round trip); a process
    idle for longer than IDLE_HOLD_S reports that it wants nothing (and the broker gives its slots away)."""
    dispatcher, registry, client = await one_server_leased(fakes, decode_s=0.05)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.sleep(1.0)
        assert not any(r.models for _, r in registry.reports)  # nothing wanted yet
        await asyncio.gather(*(dispatcher.submit(request(i)) for i in range(4)))  # 4 tokens × 0.05 s
        idle_at = loop.time()
        await asyncio.sleep(IDLE_HOLD_S + 1.0)
        busy = [t for t, r in registry.reports if r.models]
        assert busy and max(busy) >= idle_at + IDLE_HOLD_S - 0.5  # still asking for a while after going idle
        assert registry.reports[-1][1].models == ()  # then nothing
        assert all(t <= idle_at + IDLE_HOLD_S for t in busy)
    finally:
        await client.stop()


async def test_a_process_whose_evals_sent_their_last_request_gives_its_slots_back_with_the_last_answer(
        fakes: FakePool) -> None:
    """A finished eval will send nothing more: its process does not hold its slots for IDLE_HOLD_S (held, a
    finished eval's process kept 2 slots idle about a second while other processes' requests waited)."""
    dispatcher, registry, client = await one_server_leased(fakes, decode_s=0.05)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.sleep(1.0)
        requests = [asyncio.ensure_future(dispatcher.submit(request(i, client_id="eval-a"))) for i in range(4)]
        await asyncio.sleep(0.01)
        dispatcher.client_done_sending("eval-a")  # its last request is out
        await asyncio.gather(*requests)
        answered_at = loop.time()
        await asyncio.sleep(0.2)  # a poked report (MIN_POKE_S), not the next renewal (0.5 s) or the hold (1 s)
        after = [r for t, r in registry.reports if t >= answered_at]
        assert after and all(r.models == () for r in after)
        # A client that has not said so is held for as before.
        dispatcher.client_done_sending("eval-a", False)
        await asyncio.gather(*(dispatcher.submit(request(i, client_id="eval-a")) for i in range(4, 8)))
        answered_at = loop.time()
        await asyncio.sleep(IDLE_HOLD_S - 0.2)
        assert [r for t, r in registry.reports if t > answered_at + 0.1 and r.models]
    finally:
        await client.stop()


async def test_a_caller_paced_between_idle_spells_costs_renewals_only(fakes: FakePool) -> None:
    """A gateway at a steady light load goes idle between requests (each answered before the next comes): each
    return to work is within IDLE_HOLD_S of the last, the lease it holds still covers it, and it reports at the
    renewal rate, not once per request (it used to report every MIN_POKE_S: 20 registry calls a second)."""
    dispatcher, registry, client = await one_server_leased(fakes, decode_s=0.001)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.sleep(1.0)
        began, before = loop.time(), len(registry.reports)
        for i in range(200):  # 4 s at one request every 20 ms, each done in a few ms
            await dispatcher.submit(request(i))
            await asyncio.sleep(0.02)
        seconds, reports = loop.time() - began, len(registry.reports) - before
        assert dispatcher.inflight() == {}
        assert reports <= seconds / 0.5 + 2, (reports, seconds)  # renewals (every 0.5 s), and the first poke
        assert all(r.models for _, r in registry.reports[before + 1:])  # it kept asking for its slots
    finally:
        await client.stop()


async def test_a_process_over_its_shrunk_lease_reports_each_slot_it_lets_go_at_once(fakes: FakePool) -> None:
    """Another process wants slots: the broker shrinks this one's lease below what it has in flight, and each slot
    moves once this process says it let it go. It says so when the request ends (within MIN_POKE_S), not at its
    next renewal — up to half a second later for every slot that moves."""
    dispatcher, registry, client = await one_server_leased(fakes, decode_s=0.05)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.sleep(1.0)
        lengths = (40, 46, 52, 58)  # tokens: done about 0.3 s apart, from 2 s after they start
        calls = [asyncio.ensure_future(dispatcher.submit(InferenceRequest.from_body(
            {"prompt": f"q{n}", "max_tokens": n, "ignore_eos": True}, request_id=f"r{n}", model="emu-model",
            endpoint=Endpoint.COMPLETIONS))) for n in lengths]
        await asyncio.sleep(0.1)
        assert dispatcher.inflight() == {"s0": 4}
        await asyncio.sleep(PREEMPT_MAX_AGE_S)  # too old to give their slots back (tests/test_preempt.py)
        registry.slots = {"s0": 1}  # the next answer shrinks the lease: 3 of its 4 slots are wanted elsewhere
        await asyncio.sleep(0.6)  # (the renewal in flight answers, the shrunk lease applies)
        assert dispatcher.held() == {"s0": 1} and dispatcher.inflight() == {"s0": 4}
        drops: list[tuple[float, int]] = []  # (when, in flight after) as each request ends
        while not all(call.done() for call in calls):
            n = dispatcher.inflight().get("s0", 0)
            if n < (drops[-1][1] if drops else 4):
                drops.append((loop.time(), n))
            await asyncio.sleep(0.005)
        assert [n for _, n in drops][:3] == [3, 2, 1]
        for at, n in drops[:3]:  # each release while over the lease (4 -> 3 -> 2 -> 1): reported at once
            # (the loop above sees a drop up to one 5 ms poll after it happened)
            assert any(at - 0.01 <= t <= at + 0.06 and r.inflight.get("s0", 0) == n for t, r in registry.reports), \
                (at, n, [(t, r.inflight) for t, r in registry.reports])
    finally:
        await client.stop()


async def test_a_client_ranked_by_service_reports_its_requests_in_flight_as_they_run(fakes: FakePool) -> None:
    """Under shortest_first a caller that reports no work left is ranked by the service it has attained, and the
    lease report counts its requests in flight by the seconds they have held their slots so far (before an answer
    of its own), then by what its answers held on average from when each takes its slot: counted only when an
    answer lands, a long answer moved its rank all at once, and two processes' callers swapped places. Before any
    answer anywhere there are no seconds to count in: it reports none, and the broker ranks it by its shapes."""
    server = fakes.start(decode_s=0.05)
    snap = snapshot_of([server], capacity=4)
    dispatcher = fakes.dispatcher(lambda: snap, make_policy("least_inflight"),
                                  config=DispatchConfig(client_order="shortest_first"))
    dispatcher.notify_snapshot()

    def served() -> float | None:
        (model,) = dispatcher.demand()
        (client,) = model.clients
        return client.served_s

    calls = [asyncio.ensure_future(dispatcher.submit(InferenceRequest.from_body(
        {"prompt": f"q{n}", "max_tokens": 40, "ignore_eos": True}, request_id=f"r{n}", model="emu-model",
        endpoint=Endpoint.COMPLETIONS, client_id="tool"))) for n in range(2)]
    await asyncio.sleep(0.01)
    assert served() is None  # nothing answered anywhere: no seconds yet
    dispatcher.price_by_pool(Served(1e6, 1.0, 1e6))  # another holder's answers: short, so held seconds count
    await asyncio.sleep(0.99)
    assert dispatcher.inflight() == {"s0": 2}
    assert served() == pytest.approx(2.0, abs=0.1)  # two slots held for a second each, nothing answered here yet
    await asyncio.sleep(0.5)
    assert served() == pytest.approx(3.0, abs=0.1)  # still rising with the time that passes
    answers = await asyncio.gather(*calls)
    assert dispatcher.demand() == ()  # answered: nothing wanted
    held = sum(a.latency_s for a in answers)
    # One more request: its rank is what the two answered held, counted once, and the new one in flight as the
    # mean of those two from the moment it takes its slot — not nothing until it is answered.
    calls = [asyncio.ensure_future(dispatcher.submit(InferenceRequest.from_body(
        {"prompt": "q2", "max_tokens": 40, "ignore_eos": True}, request_id="r2", model="emu-model",
        endpoint=Endpoint.COMPLETIONS, client_id="tool")))]
    await asyncio.sleep(0.01)
    assert served() == pytest.approx(1.5 * held, abs=0.02)
    await asyncio.gather(*calls)


class SlowBroker:
    """The real broker (registry/leases.py) behind a registry call that takes `trip_s` each way."""

    def __init__(self, clock: Callable[[], float], servers: list[LeaseServer], trip_s: float):
        self.service = LeaseService(LeaseBroker(clock))
        self.service.set_servers(servers)
        self.trip_s = trip_s

    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease:
        await asyncio.sleep(self.trip_s)
        lease = await self.service.lease(report, known_version, wait_s)
        await asyncio.sleep(self.trip_s)
        return lease

    async def release_lease(self, holder: str) -> None:
        await self.service.release(holder)


async def test_an_eval_about_to_send_is_leased_its_slots_before_its_first_request(fakes: FakePool) -> None:
    """An eval that has loaded its samples says so (`expect`) while the others load: the lease is asked for then,
    so its first requests are granted at once instead of a registry round trip later; a client that says so and
    never sends is demand for EXPECT_HOLD_S only (an idle process holds nothing)."""
    server = fakes.start(decode_s=0.01)
    snap = snapshot_of([server], capacity=4)
    dispatcher = fakes.dispatcher(lambda: snap, make_policy("least_inflight"))
    dispatcher.notify_snapshot()
    loop = asyncio.get_running_loop()
    registry = SlowBroker(loop.time, [LeaseServer("s0", "emu-model", 4)], trip_s=0.1)
    client = LeaseClient(registry, dispatcher, holder="h", clock=loop.time)
    await client.start()
    try:
        await asyncio.sleep(2 * TTL_S + 1.0)  # (a broker just started learns who holds what for two TTLs first)
        assert dispatcher.held() == {}  # nothing wanted, nothing held
        dispatcher.expect("eval-a", "emu-model", 3)
        await asyncio.sleep(0.3)  # the poked report's round trip (0.2 s), not a renewal (0.5 s) later
        assert dispatcher.held() == {"s0": 4}  # (the slot nobody wants goes to whoever wants something)
        sent = loop.time()
        results = await asyncio.gather(*(dispatcher.submit(request(i, client_id="eval-a")) for i in range(3)))
        assert all(r.server_id == "s0" for r in results)
        assert loop.time() - sent < 0.1  # 4 tokens × 10 ms each, no lease round trip (0.2 s) before them

        dispatcher.expect("eval-b", "emu-model", 2)  # says it will send, never does
        await asyncio.sleep(0.3)
        assert dispatcher.held() == {"s0": 4}
        # An eval still reading its samples says so: reported as loading, with no rank of its own yet.
        dispatcher.expect("eval-c", "emu-model", 64, loading=True)
        (model,) = dispatcher.demand()
        by_client = {c.client: c for c in model.clients}
        assert by_client["eval-c"].loading and by_client["eval-c"].wanted == 64
        assert not by_client["eval-b"].loading
        dispatcher.expect("eval-c", "emu-model", 0)  # (its load failed: taken back at once)
        assert "eval-c" not in {c.client for m in dispatcher.demand() for c in m.clients}
        await asyncio.sleep(EXPECT_HOLD_S + IDLE_HOLD_S + 1.0)
        assert dispatcher.held() == {} and dispatcher.demand() == ()
        assert client.report().models == ()
    finally:
        await client.stop()
