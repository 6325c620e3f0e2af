"""Who is on the pool (registry/holders.py): holders reported by real lease clients over real dispatchers appear with
their kind, host and pid, their clients' progress, rate and ETA, and their slots against their fair share; finished
clients stay listed with their outcome, then age out, and everything kept for a holder goes with it; the registry's
`GET /v1/holders` and both registry clients; the gateway's view, whole for an operator's key and without names for
any other; the lease metrics (parsed with prometheus_client's parser), the over-capacity counter 0 through
tests/test_lease_capacity.py's traffic, and per-client series capped."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
import looptime
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from fedpool.clients.poolapp import PoolHistory, holders_state
from fedpool.federation import Dispatcher, PoolConnection
from fedpool.federation.gateway.auth import ApiKey, parse_api_keys, visible_holders
from fedpool.federation.gateway.handlers import HOLDERS_PATH, Gateway, serving
from fedpool.federation.gateway.leases import LeaseClient
from fedpool.federation.routing.policies import make_policy
from fedpool.registry import (
    ClientDemand,
    DemandReport,
    HolderInfo,
    Lease,
    ModelDemand,
    PoolHolders,
    PoolSnapshot,
    RegistryClient,
)
from fedpool.registry.exporter import pool_metrics_text
from fedpool.registry.holders import FINISHED_KEEP_S, MAX_CLIENT_SERIES, MAX_FINISHED, servers_over_capacity
from fedpool.registry.leases import LeaseBroker, LeaseServer, LeaseService
from fedpool.registry.snapshot import server_kind
from tests.conftest import TEST_TOKEN, EmulatorFactory
from tests.fakes import FakePool
from tests.test_dispatcher import request, snapshot_of
from tests.test_lease_capacity import TTL_S, World, apply, costs_st, event_st
from tests.test_lease_capacity import Network as CapacityNetwork
from tests.test_registry_api import api_of, register_two

MODEL = "emu-model"


class InProcessRegistry:
    """The registry's lease calls and holders view as a process reaches them, in process: the real broker behind
    its service (the lease client's `LeaseRegistry`, and `HoldersSource`)."""

    def __init__(self, service: LeaseService):
        self.service = service

    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease:
        return await self.service.lease(report, known_version, wait_s)

    async def release_lease(self, holder: str) -> None:
        await self.service.release(holder)

    async def holders(self) -> PoolHolders:
        return self.service.broker.holders_view()


def metrics_of(service: LeaseService) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The registry's exposition with this lease service's figures, parsed: (sample name, labels) -> value."""
    text = pool_metrics_text(PoolSnapshot(1, 0.0, ()), {}, service.figures()).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def work(dispatcher: Dispatcher, client: str, n: int, workers: int, *, declared: bool) -> None:
    """`n` requests of `client` through `workers` workers, saying what is left as an eval does (its work and
    requests: `declared` False) or a gateway caller (its requests only), and that it has sent its last."""
    left = n

    def say() -> None:
        if declared:
            dispatcher.set_client_requests_left(client, left)
        else:
            dispatcher.set_client_remaining(client, float(left), left)

    queue = list(range(n))
    say()

    async def worker() -> None:
        nonlocal left
        while queue:
            i = queue.pop()
            if not queue:
                dispatcher.client_done_sending(client)
            await dispatcher.submit(request(i, client_id=client))
            left -= 1
            say()

    await asyncio.gather(*(worker() for _ in range(workers)))


@pytest.mark.looptime
async def test_holders_reported_by_real_lease_clients_appear_with_their_clients_progress_and_slots(
        fakes: FakePool) -> None:
    loop = asyncio.get_running_loop()
    servers = [fakes.start(decode_s=0.1) for _ in range(2)]  # 4 tokens a request: 0.4 s each, 4 slots each
    snap = snapshot_of(servers, capacity=4)
    service = LeaseService(LeaseBroker(loop.time, restarted=False, wall_clock=loop.time))
    service.set_servers([LeaseServer(e.id, e.record.model, e.capacity, server_kind(e.record, e.capacity))
                         for e in snap.entries])
    registry = InProcessRegistry(service)
    (kind_name,) = {server_kind(e.record, e.capacity) for e in snap.entries}  # (both servers are alike)
    dispatchers, clients = [], []
    for name, kind in (("eval-process", "eval run"), ("gateway-process", "gateway")):
        dispatcher = fakes.dispatcher(lambda: snap, make_policy("least_inflight"))
        dispatcher.notify_snapshot()
        client = LeaseClient(registry, dispatcher, holder=name, clock=loop.time, holder_kind=kind)  # type: ignore[arg-type]
        await client.start()
        dispatchers.append(dispatcher)
        clients.append(client)
    runs = asyncio.gather(work(dispatchers[0], "arith", 40, 6, declared=False),
                          work(dispatchers[1], "team-a", 30, 6, declared=True))
    try:
        await asyncio.sleep(2.5)
        view = await registry.holders()
        holders = {h.holder: h for h in view.holders}
        assert {h: v.kind for h, v in holders.items()} == {"eval-process": "eval run", "gateway-process": "gateway"}
        for h in holders.values():
            assert (h.host, h.pid, h.state) == (socket.gethostname(), os.getpid(), "active")
            assert sum(s.slots for s in h.servers) == h.slots > 0
            assert h.fair_share == 4  # each server's 4 slots ÷ 2 holders, over 2 servers
            (by_kind,) = h.kinds
            assert (by_kind.model, by_kind.kind, by_kind.capacity, by_kind.fair_share) == (MODEL, kind_name, 8, 4)
        assert all(s.leased <= s.capacity == 4 for s in view.servers) and len(view.servers) == 2
        (arith,) = holders["eval-process"].clients
        assert (arith.client, arith.model, arith.state) == ("arith", MODEL, "running")
        assert 0 < arith.done < 40 and arith.requests_left is not None
        assert 40 <= arith.done + arith.requests_left <= 46  # (an answer may be counted before its worker says so)
        assert arith.rate_per_s is not None and arith.rate_per_s > 0
        assert arith.eta_s == pytest.approx(arith.requests_left / arith.rate_per_s)
        (caller,) = holders["gateway-process"].clients
        assert caller.client == "team-a" and caller.requests_left is not None and caller.done > 0
        await runs
        await asyncio.sleep(1.0)  # (the reports that no longer name them)
        view = await registry.holders()
        assert all(h.clients == () for h in view.holders) and len(view.holders) == 2
        finished = {f.client: f for f in view.finished}
        assert {c: (f.outcome, f.done, f.requests_left, f.holder) for c, f in finished.items()} == {
            "arith": ("done", 40, 0, "eval-process"), "team-a": ("done", 30, 0, "gateway-process")}
        assert finished["arith"].holder_kind == "eval run"
    finally:
        runs.cancel()
        await asyncio.gather(runs, return_exceptions=True)
        for client in clients:
            await client.stop()
    view = await registry.holders()
    assert view.holders == () and len(view.finished) == 2  # they said goodbye; their clients are still listed
    await asyncio.sleep(FINISHED_KEEP_S + 1.0)
    assert (await registry.holders()).finished == ()  # aged out


@pytest.mark.looptime
async def test_a_client_that_ends_between_two_renewals_is_listed_with_its_last_progress(fakes: FakePool) -> None:
    """Its requests all answered between two reports, the last report naming it says nothing of them: the report
    that first leaves it out says how it ended."""
    loop = asyncio.get_running_loop()
    snap = snapshot_of([fakes.start(decode_s=0.01)], capacity=4)
    service = LeaseService(LeaseBroker(loop.time, restarted=False, wall_clock=loop.time))
    service.set_servers([LeaseServer("s0", MODEL, 4, "k")])
    registry = InProcessRegistry(service)
    dispatcher = fakes.dispatcher(lambda: snap, make_policy("least_inflight"))
    dispatcher.notify_snapshot()
    client = LeaseClient(registry, dispatcher, holder="p", clock=loop.time, holder_kind="batch")
    await client.start()
    try:
        await asyncio.sleep(1.0)
        await work(dispatcher, "quick", 3, 1, declared=True)  # 3 × 40 ms, one after another
        assert loop.time() < 1.5  # (within one renewal)
        await asyncio.sleep(2.0)
        (quick,) = (await registry.holders()).finished
        assert (quick.client, quick.outcome, quick.done, quick.holder_kind) == ("quick", "done", 3, "batch")
    finally:
        await client.stop()


def report(holder: str, clients: Sequence[ClientDemand], *, kind: str = "eval run") -> DemandReport:
    return DemandReport(holder=holder, info=HolderInfo(kind=kind, host="h", pid=7, started_at=1.0),  # type: ignore[arg-type]
                        models=(ModelDemand(model="m", clients=tuple(clients)),) if clients else ())


def test_finished_clients_keep_their_outcome_a_while_and_a_gone_holder_is_forgotten() -> None:
    now = [100.0]
    broker = LeaseBroker(lambda: now[0], restarted=False, wall_clock=lambda: now[0], ttl_s=TTL_S)
    broker.set_servers([LeaseServer("s0", "m", 4, "k")])

    def clients_of(holder: str) -> dict[str, str]:
        view = broker.holders_view()
        return {c.client: c.state for h in view.holders if h.holder == holder for c in h.clients}

    def finished() -> dict[str, str | None]:
        return {f.client: f.outcome for f in broker.holders_view().finished}

    running = [ClientDemand(client="done-eval", wanted=2, answered=8, requests_left=2, sent_all=True),
               ClientDemand(client="cancelled-eval", wanted=2, answered=3, requests_left=7),
               ClientDemand(client="caller", wanted=1, answered=5)]
    broker.report(report("a", running))
    assert clients_of("a") == {"done-eval": "running", "cancelled-eval": "running", "caller": "running"}
    now[0] += 1.0
    broker.report(report("a", []))
    assert finished() == {"done-eval": "done", "cancelled-eval": "stopped", "caller": "idle"}
    done = next(f for f in broker.holders_view().finished if f.client == "done-eval")
    assert (done.done, done.requests_left, done.ended_at) == (10, 0, 101.0)  # its last 2 in flight ended too
    now[0] += 1.0
    broker.report(report("a", [running[2]]))  # the caller is back from its pause: running again, not finished
    assert clients_of("a") == {"caller": "running"} and "caller" not in finished()
    # A holder that stops reporting is silent after a TTL, then forgotten: its clients with work left are lost.
    broker.report(report("b", [ClientDemand(client="b-eval", wanted=4, requests_left=9)]))
    now[0] += TTL_S + 0.5
    broker.report(report("a", [running[2]]))
    broker.expire()
    assert {h.holder: h.state for h in broker.holders_view().holders} == {"a": "active", "b": "silent"}
    now[0] += TTL_S
    broker.report(report("a", [running[2]]))
    broker.expire()
    assert [h.holder for h in broker.holders_view().holders] == ["a"] and finished()["b-eval"] == "lost"
    assert broker.release("a")
    assert broker.holders_view().holders == () and finished()["caller"] == "idle"
    now[0] += FINISHED_KEEP_S + 1.0
    assert broker.holders_view().finished == ()


def test_the_finished_list_is_bounded_newest_first() -> None:
    now = [0.0]
    broker = LeaseBroker(lambda: now[0], restarted=False, wall_clock=lambda: now[0])
    for i in range(MAX_FINISHED + 50):
        now[0] += 0.01
        broker.report(report(f"h{i}", [ClientDemand(client=f"c{i}", wanted=1, requests_left=0)]))
        broker.release(f"h{i}")
    view = broker.holders_view()
    assert view.holders == () and len(view.finished) == MAX_FINISHED
    assert view.finished[0].client == f"c{MAX_FINISHED + 49}" and view.finished[-1].client == "c50"


def test_names_are_aliased_for_whoever_is_not_an_operator() -> None:
    broker = LeaseBroker(lambda: 0.0, restarted=False)
    broker.report(report("node-7:123:abc", [ClientDemand(client="team-secret-eval", wanted=1)], kind="gateway"))
    broker.report(report("node-7:124:def", [ClientDemand(client="gone-eval", wanted=1)]))
    broker.report(report("node-7:124:def", []))
    view = broker.holders_view()
    hidden = view.redacted(b"k" * 16)
    text = hidden.model_dump_json()
    assert hidden.names_hidden and not view.names_hidden
    for name in ("team-secret-eval", "gone-eval", "node-7", '"h"'):
        assert name not in text and name.strip('"') in view.model_dump_json()
    assert hidden.holders[0].kind == "gateway" and hidden.holders[0].host is None and hidden.holders[0].pid is None
    assert hidden == view.redacted(b"k" * 16)  # the same alias for the same name while the secret is kept
    assert hidden.holders[0].clients[0].client != view.redacted(b"j" * 16).holders[0].clients[0].client
    operator, member = ApiKey("sk-operator-0123456789", "ops", operator=True), ApiKey("sk-member-0123456789", "m")
    keys = [operator, member]
    assert visible_holders(view, keys, operator.secret.encode(), b"k" * 16) == view
    assert visible_holders(view, keys, member.secret.encode(), b"k" * 16) == hidden
    assert visible_holders(view, keys, None, b"k" * 16) is None
    assert visible_holders(view, keys, b"sk-wrong-0123456789", b"k" * 16) is None
    assert visible_holders(view, [], None, b"k" * 16) == view  # no keys: a gateway open on loopback only


def test_an_operator_key_is_marked_in_the_key_file() -> None:
    assert parse_api_keys("ops:sk-0123456789abcdef:operator\nt:sk-abcdefghijklmnop:2:operator\n"
                          "u:sk-qrstuvwxyz012345:3\n") == [
        ApiKey("sk-0123456789abcdef", "ops", 1.0, operator=True), ApiKey("sk-abcdefghijklmnop", "t", 2.0, True),
        ApiKey("sk-qrstuvwxyz012345", "u", 3.0)]
    with pytest.raises(ValueError, match=r"line 1: expected client:secret\[:weight\]\[:operator\]"):
        parse_api_keys("operator:sk-0123456789abcdef:2:admin\n")


def test_per_client_series_are_capped_and_the_rest_folded_into_other() -> None:
    broker = LeaseBroker(lambda: 0.0, restarted=False)
    service = LeaseService(broker)
    n = MAX_CLIENT_SERIES + 15
    broker.report(report("a", [ClientDemand(client=f"c{i:02d}", wanted=1, requests_left=100 + i) for i in range(n)]))
    broker.report(report("b", [ClientDemand(client="c00", wanted=1, requests_left=1000)]))  # one name, two holders
    series = {dict(labels)["client"]: v for (name, labels), v in metrics_of(service).items()
              if name == "fedpool_lease_client_requests_left"}
    assert len(series) == MAX_CLIENT_SERIES + 1
    assert series["c00"] == 1100  # summed over its holders, and first
    kept = sorted(((100 + i, f"c{i:02d}") for i in range(1, n)), reverse=True)[:MAX_CLIENT_SERIES - 1]
    assert {c for _, c in kept} | {"c00", "other"} == set(series)
    assert series["other"] == sum(100 + i for i in range(1, n)) - sum(v for v, _ in kept)


def test_the_over_capacity_check_counts_a_server_leased_past_its_slots() -> None:
    servers = [LeaseServer("s0", "m", 2), LeaseServer("s1", "m", 4)]
    assert servers_over_capacity(servers, [{"s0": 1, "s1": 4}, {"s0": 1}]) == 0
    assert servers_over_capacity(servers, [{"s0": 2, "s1": 2}, {"s0": 1, "s1": 2}]) == 1


class CountingNetwork(CapacityNetwork):
    """test_lease_capacity's network, keeping every broker incarnation it was given."""

    def __init__(self) -> None:
        self.services: list[LeaseService] = []
        super().__init__()

    def __setattr__(self, name: str, value: object) -> None:
        if name == "service" and isinstance(value, LeaseService):
            self.services.append(value)
        super().__setattr__(name, value)


async def traffic(caps: list[int], costs: list[dict[str, float]], events: list[tuple[object, ...]],
                  seed: int) -> World:
    """test_lease_capacity's `run`, on a network that keeps every broker."""
    world = World({f"s{i}": cap for i, cap in enumerate(caps)}, random.Random(seed), network=CountingNetwork())
    world.start_registry(restarted=False)
    watch = asyncio.ensure_future(world.watch())
    for c in costs:
        await world.join(c)
    try:
        for event in events:
            await apply(world, event)
        await asyncio.sleep(2 * TTL_S)
    finally:
        watch.cancel()
        for process in world.processes.values():
            process.kill()
        for client in world.clients:
            await client.stop()
    return world


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(caps=st.lists(st.integers(1, 4), min_size=1, max_size=3), costs=st.lists(costs_st, min_size=1, max_size=5),
       events=st.lists(event_st, min_size=1, max_size=30), seed=st.integers(0, 2**16))
def test_the_over_capacity_counter_is_exported_and_stays_0_through_lease_traffic(
        caps: list[int], costs: list[dict[str, float]], events: list[tuple[object, ...]], seed: int) -> None:
    check_counters(caps, costs, events, seed)


def check_counters(caps: list[int], costs: list[dict[str, float]], events: list[tuple[object, ...]],
                   seed: int) -> int:
    """Run the traffic; every broker incarnation's exported counters are its own, the over-capacity one 0.
    Returns the re-shares of every incarnation."""
    loop = looptime.new_event_loop(start=0.0)
    try:
        world = loop.run_until_complete(traffic(caps, costs, events, seed))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    network = world.network
    assert isinstance(network, CountingNetwork) and network.services and not world.violations
    for service in network.services:
        samples = metrics_of(service)
        assert samples[("fedpool_lease_over_capacity_total", ())] == 0 == service.broker.over_capacity
        assert samples[("fedpool_lease_calls_total", ())] == service.calls
        assert samples[("fedpool_lease_reshares_total", ())] == service.broker.recomputes
        assert samples[("fedpool_lease_reshare_seconds_count", ())] <= service.broker.recomputes
        for sid, cap in world.caps.items():
            leased = samples.get(("fedpool_lease_server_leased", (("model", "m"), ("server_id", sid))))
            assert leased is None or leased <= cap
    return sum(service.broker.recomputes for service in network.services)


def test_the_over_capacity_counter_stays_0_through_busy_holders_cut_off_and_a_restart() -> None:
    even = {"a": 1.0, "b": 1.0}
    busy = [("work", i, 30) for i in range(4)]
    events: list[tuple[object, ...]] = [*busy, ("wait", 2.0), ("cut", 1, "reports"), ("wait", 4.0),
                                        ("restart", True, 1.0), ("join", even, 20), ("heal", 1), ("kill", 2),
                                        ("wait", 6.0), *busy, ("wait", 3.0)]
    assert check_counters([2, 3, 4], [even, {"a": 1.0, "b": 5.0}, even, {"a": 2.0, "b": 1.0}], events, 7) > 20


# ---- through the real registry ----------------------------------------------------------------------------------
async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    """Poll `check` until it says yes (an assertion error after `timeout_s`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        assert loop.time() < deadline, f"not in {timeout_s:g} s"
        await asyncio.sleep(0.1)


async def send(pool: PoolConnection, client: str, n: int) -> None:
    dispatcher = pool.dispatcher
    dispatcher.set_client_remaining(client, float(n), n)
    for i in range(n):
        await dispatcher.submit(request(i, client_id=client))
        dispatcher.set_client_remaining(client, float(n - i - 1), n - i - 1)


@pytest.mark.ray
async def test_the_holders_api_needs_the_token_and_both_registry_clients_see_every_holder(
        registry: RegistryClient, emulators: EmulatorFactory) -> None:
    await register_two(registry, emulators)
    api, _ = await api_of(registry)
    try:
        async with (PoolConnection(registry, holder_kind="eval run") as evals,
                    PoolConnection(api, holder_kind="gateway") as gateway):
            await evals.refresh()
            await gateway.refresh()
            await asyncio.gather(send(evals, "arith", 12), send(gateway, "team-a", 12))
            names = {evals.lease_holder: "eval run", gateway.lease_holder: "gateway"}

            async def both_done() -> bool:
                return {f.client for f in (await registry.holders()).finished} >= {"arith", "team-a"}

            await until(both_done)
            over_ray, over_http = await registry.holders(), await api.holders()
            for view in (over_ray, over_http):
                assert {h.holder: h.kind for h in view.holders} == names
                assert {(f.client, f.holder, f.outcome, f.done) for f in view.finished} >= {
                    ("arith", evals.lease_holder, "done", 12), ("team-a", gateway.lease_holder, "done", 12)}
                assert {s.server for s in view.servers} == {"emu-0", "emu-1"}
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in
                       text_string_to_metric_families(await registry.metrics_text()) for s in family.samples}
            assert samples[("fedpool_lease_over_capacity_total", ())] == 0
            assert samples[("fedpool_lease_holders", (("kind", "eval run"), ("state", "active")))] == 1
            assert samples[("fedpool_lease_holders", (("kind", "gateway"), ("state", "active")))] == 1
            assert samples[("fedpool_lease_calls_total", ())] > 0
            assert samples[("fedpool_lease_server_slots", (("model", MODEL), ("server_id", "emu-0")))] == 4
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{api.url}/v1/holders") as response:
                assert response.status == 401
            async with session.get(f"{api.url}/v1/holders", headers={"Authorization": "Bearer " + "x" * 32}) as r:
                assert r.status == 401
            async with session.get(f"{api.url}/v1/holders", headers={"Authorization": f"Bearer {TEST_TOKEN}"}) as r:
                assert r.status == 200
                shown = PoolHolders.model_validate(await r.json())
                assert {"arith", "team-a"} <= {f.client for f in shown.finished} and not shown.names_hidden
    finally:
        await api.aclose()


KEYS = [ApiKey("sk-team-a-0123456789", "team-a"), ApiKey("sk-operator-0123456789", "ops", operator=True)]


@pytest.mark.ray
async def test_the_gateway_shows_the_holders_to_a_key_and_client_names_to_an_operator_key(
        registry: RegistryClient, emulators: EmulatorFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="fedpool")
    await register_two(registry, emulators)
    async with PoolConnection(registry, holder_kind="gateway") as pool:
        await pool.refresh()
        gateway = Gateway(pool.dispatcher, lambda: pool.snapshot, api_keys=KEYS, holders=pool.holders)
        open_gateway = Gateway(pool.dispatcher, lambda: pool.snapshot, holders=pool.holders)
        async with (serving(gateway.app()) as base, serving(open_gateway.app()) as open_base,
                    aiohttp.ClientSession() as session):

            async def get(url: str, key: str | None) -> tuple[int, str]:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with session.get(url + HOLDERS_PATH, headers=headers) as response:
                    return response.status, await response.text()

            body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            for _ in range(6):
                async with session.post(f"{base}/v1/completions", json=body, headers={
                        "Authorization": f"Bearer {KEYS[0].secret}", "X-Fedpool-Requests": "6"}) as response:
                    assert response.status == 200

            async def listed() -> bool:
                return "team-a" in (await get(base, KEYS[1].secret))[1]

            await until(listed)
            assert (await get(base, None))[0] == 401 and (await get(base, "sk-wrong-0123456789"))[0] == 401
            status, text = await get(base, KEYS[1].secret)
            full = PoolHolders.model_validate_json(text)
            assert status == 200 and not full.names_hidden
            ((holder, host),) = {(h.holder, h.host) for h in full.holders}
            assert (holder, host) == (pool.lease_holder, socket.gethostname())
            status, text = await get(base, KEYS[0].secret)
            hidden = PoolHolders.model_validate_json(text)
            assert status == 200 and hidden.names_hidden and hidden.holders[0].kind == "gateway"
            assert "team-a" not in text and str(pool.lease_holder) not in text and socket.gethostname() not in text
            assert len(hidden.finished) + sum(len(h.clients) for h in hidden.holders) >= 1
            assert PoolHolders.model_validate_json((await get(base, KEYS[0].secret))[1]).holders == hidden.holders
            status, text = await get(open_base, None)  # no keys: open on loopback, everything shown
            assert status == 200 and "team-a" in text
            # The pool page's data (clients/poolapp.py): the same rules, each holder under a label that names nobody
            history = PoolHistory(pool)
            history.sample(full)
            assert holders_state(history, gateway, None) == {"holders": None, "holders_state": "key"}
            page = holders_state(history, gateway, KEYS[0].secret.encode())
            assert page["names_hidden"] and "team-a" not in json.dumps(page) and page["holders_state"] == "ok"
            page = holders_state(history, gateway, KEYS[1].secret.encode())
            assert "team-a" in json.dumps(page) and [h["label"] for h in page["holders"]] == ["gateway 1"]
            assert history.series()["holders"] == {}  # (one point: no rate yet, nothing charted)
    said = [r.getMessage() for r in caplog.records if r.levelno <= 20]  # INFO and below: no client's name
    assert not [line for line in said if "team-a" in line or "team-b" in line], said


def test_without_detail_the_view_has_each_holders_kinds_but_no_rows_per_server() -> None:
    """The pool page and the metrics ask for the view without a holder's rows per server (most of its cost at
    1,000 holders over 10,000 servers); the kinds, slots and fair shares are the same."""
    broker = LeaseBroker(lambda: 0.0, restarted=False)
    broker.set_servers([LeaseServer(f"s{i}", "m", 4, "A100:vllm" if i % 2 else "V100:vllm") for i in range(6)])
    for name in ("a", "b"):
        broker.report(report(name, [ClientDemand(client=f"eval-{name}", wanted=12, requests_left=12)]))
    broker.reshare()
    full, light = broker.holders_view(), broker.holders_view(detail=False)
    for whole, part in zip(full.holders, light.holders, strict=True):
        assert whole.servers and part.servers == ()
        assert whole.model_dump(exclude={"servers", "last_report_s"}) == part.model_dump(
            exclude={"servers", "last_report_s"})
        assert {k.kind for k in part.kinds} == {"A100:vllm", "V100:vllm"} and part.slots > 0
