"""Callers that declare their run's size (`X-Fedpool-Requests`, or `?fedpool_requests=N` for a tool that takes only
a URL): counted per caller (`DeclaredRuns`), ranked least remaining first under shortest_first (ClientBook), and
through a real gateway over a real emulated server served in that order; a bad declaration is a 400 naming it."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from fedpool.federation import DispatchConfig
from fedpool.federation.core.clientbook import BACKGROUND_RANK, ClientBook
from fedpool.federation.core.ledger import InflightLedger
from fedpool.federation.core.types import Endpoint, InferenceRequest
from fedpool.federation.gateway import PROMPT_HEADER, REQUESTS_HEADER, REQUESTS_QUERY
from fedpool.federation.gateway.state import DeclaredRuns
from tests.conftest import EmulatorFactory
from tests.test_gateway_leaks import entry, in_flight, post, rig


def test_a_declared_run_counts_what_is_left() -> None:
    said: list[tuple[str, int | None]] = []
    runs = DeclaredRuns(lambda client, left: said.append((client, left)))
    for _ in range(3):
        runs.arrive("a", 3)
    assert said == [("a", 3)] * 3  # nothing finished: all three left
    runs.finish("a", 3)
    runs.finish("a", 3)
    assert said[-1] == ("a", 1)
    runs.arrive("a", 3)  # one more than it said (a retry): never below what is outstanding
    assert said[-1] == ("a", 2)
    runs.finish("a", 3)
    runs.finish("a", 3)
    assert said[-1] == ("a", 0)
    runs.finish("a", 3)  # (nothing outstanding: not counted twice)
    assert said[-1] == ("a", 0) and len(said) == 8
    runs.arrive("a", 3)  # all it declared finished, nothing outstanding: the next request starts a new run
    assert said[-1] == ("a", 3)
    runs.arrive("a", 10)  # another size: a new run
    assert said[-1] == ("a", 10)
    runs.finish("a", 3)  # counted under the run before: not this one's
    assert said[-1] == ("a", 10)
    runs.arrive("a", None)  # it declares nothing any more: ranked by its service again
    assert said[-1][0] == "a" and said[-1][1] is None and len(runs) == 0
    runs.arrive("b", 5)
    runs.arrive("c", 5)
    runs.retain({"c"})  # b's id expired
    assert len(runs) == 1
    runs.finish("b", 5)
    assert said[-1] == ("c", 5)  # b forgotten: its late answer reports nothing


def _book(order: str = "shortest_first") -> ClientBook:
    clients = ClientBook(order, InflightLedger(clock=lambda: 0.0, wall_clock=lambda: 0.0))
    for client in ("declared", "unsaid"):
        clients.note_request(client, InferenceRequest.from_body(
            {"prompt": "x" * 80, "max_tokens": 8}, request_id=client, model="m", endpoint=Endpoint.COMPLETIONS), 0.0)
    return clients


def test_a_caller_that_declares_its_requests_is_ranked_by_them_times_one_requests_work() -> None:
    clients = _book()
    clients.declare_requests("declared", 10)
    one = clients.expected_work("declared")
    assert one > 0
    assert clients.first("declared") == 10 * one
    assert not clients.by_service("declared") and clients.by_service("unsaid")
    assert clients.served_s("declared") is None  # the broker ranks it by its remaining work, not service
    assert clients.requests_left_of("declared") == 10
    clients.note_served("declared", 20, 8, 2.0)  # its answers say what one request takes
    assert clients.first("declared") == 10 * clients.expected_work("declared")
    clients.declare_requests("declared", 3)
    assert clients.first("declared") == 3 * clients.expected_work("declared")
    clients.set_remaining("declared", 7.0)  # a client that reports its work is ranked by that
    assert clients.first("declared") == 7.0
    clients.forget("declared")
    assert clients.requests_left_of("declared") is None and clients.by_service("declared")
    clients.declare_requests("unsaid", 4)
    clients.declare_requests("unsaid", None)  # says nothing any more: by its service again
    assert clients.by_service("unsaid") and clients.requests_left_of("unsaid") is None


def test_a_background_client_ranks_after_every_other_in_every_order() -> None:
    """A Batch API batch (background) ranks after every client that is not, whatever their work or service; among
    background clients the order's criterion holds; saying nothing any more, or being forgotten, ends it."""
    for order in ("fair", "shortest_first", "longest_answers_first"):
        clients = _book(order)
        for name in ("big", "small"):
            clients.note_request(name, InferenceRequest.from_body(
                {"prompt": "x" * 80, "max_tokens": 8}, request_id=name, model="m", endpoint=Endpoint.COMPLETIONS), 0.0)
        clients.note_served("unsaid", 20, 8, 1000.0)  # an online caller that has had much service
        clients.declare_requests("declared", 10**6)  # and one with much work left
        clients.declare_requests("big", 100, background=True)
        clients.declare_requests("small", 2, background=True)
        online = max(clients.key("unsaid"), clients.key("declared"))
        assert online < clients.key("small") and online < clients.key("big"), order
        assert clients.first("small") > BACKGROUND_RANK / 2
        if order == "shortest_first":
            assert clients.key("small") < clients.key("big")
        clients.declare_requests("small", 1)  # (a declaration without the flag: in the foreground again)
        assert clients.first("small") < BACKGROUND_RANK / 2
        clients.declare_requests("big", None)
        assert clients.first("big") < BACKGROUND_RANK / 2
        clients.declare_requests("big", 5, background=True)
        clients.forget("big")
        assert clients.first("big") < BACKGROUND_RANK / 2


def test_the_work_a_client_says_it_has_left_is_known_whatever_the_order() -> None:
    """What the lease broker rounds shares by: reported work, else declared requests × one request's work, else
    nothing — under `fair` too, whose own criterion is 0 for everyone."""
    for order in ("fair", "shortest_first"):
        clients = _book(order)
        assert clients.work_left("declared") is None and clients.work_left("unsaid") is None
        clients.declare_requests("declared", 10)
        assert clients.work_left("declared") == 10 * clients.expected_work("declared")
        clients.set_remaining("unsaid", 42.0)
        assert clients.work_left("unsaid") == 42.0


async def test_the_gateway_serves_the_caller_with_the_fewest_requests_left_first(emulators: EmulatorFactory) -> None:
    """One slot, held: two callers' requests queue, the larger one's first. The caller that declared 2 requests
    (on the URL) goes before the one that declared 100 (in the header); both unsaid, they would tie at no service
    and go in arrival order."""
    server = await emulators.start(max_running=1, decode_s=0.01)
    config = DispatchConfig(client_order="shortest_first", adaptive_windows=False, no_server_timeout_s=2.0)
    async with rig([entry("s", server.url, capacity=1)], config=config) as pool, aiohttp.ClientSession() as session:
        body = {"model": "emu-model", "prompt": "count", "max_tokens": 4}
        warm = asyncio.create_task(post(session, pool.url, {**body, "max_tokens": 40}, {"X-Fedpool-Client": "warm"}))
        await in_flight(pool.dispatcher)
        done: list[str] = []

        async def one(who: str, path: str, headers: dict[str, str]) -> None:
            async with session.post(pool.url + path, json=body, headers={"X-Fedpool-Client": who, **headers}) as resp:
                assert resp.status == 200, await resp.text()
            done.append(who)

        big = [asyncio.create_task(one("big", "/v1/completions", {REQUESTS_HEADER: "100"})) for _ in range(2)]
        await asyncio.sleep(0.05)  # big's requests wait first
        small = [asyncio.create_task(one("small", f"/v1/completions?{REQUESTS_QUERY}=2", {})) for _ in range(2)]
        await asyncio.gather(warm, *big, *small)
        assert done == ["small", "small", "big", "big"], done
        assert len(pool.gateway.runs) == 2


async def test_the_run_size_may_ride_on_the_url_and_a_bad_one_is_a_400_naming_it(
        emulators: EmulatorFactory) -> None:
    server = await emulators.start()
    async with rig([entry("s", server.url)], config=DispatchConfig(client_order="shortest_first")) as pool, \
            aiohttp.ClientSession() as session:
        body = {"model": "emu-model", "prompt": "count", "max_tokens": 2}
        async with session.post(f"{pool.url}/v1/completions?{REQUESTS_QUERY}=60", json=body,
                                headers={"X-Fedpool-Client": "lm-eval"}) as resp:
            assert resp.status == 200, await resp.text()
        assert len(pool.gateway.runs) == 1
        async with session.get(pool.url + "/metrics") as resp:
            assert "fedpool_gateway_declared_runs 1.0" in await resp.text()
        plain = "/v1/completions"
        for headers, url in (({REQUESTS_HEADER: "many"}, plain), ({REQUESTS_HEADER: "0"}, plain),
                             ({}, f"{plain}?{REQUESTS_QUERY}=-3")):
            async with session.post(pool.url + url, json=body, headers=headers) as resp:
                assert resp.status == 400
                error = json.loads(await resp.read())["error"]
            assert error["code"] == "invalid_declared_requests"
            assert error["param"] == (REQUESTS_HEADER if headers else REQUESTS_QUERY)
            assert error["param"] in error["message"]
        for prompt in ("-1", "lots", "1e9"):  # a run's mean prompt tokens, said beside its size
            async with session.post(pool.url + plain, json=body, headers={REQUESTS_HEADER: "5",
                                                                          PROMPT_HEADER: prompt}) as resp:
                assert resp.status == 400
                error = json.loads(await resp.read())["error"]
            assert error["param"] == PROMPT_HEADER and prompt in error["message"]
        async with session.post(pool.url + plain, json=body, headers={REQUESTS_HEADER: "5", PROMPT_HEADER: "812.5",
                                                                      "X-Fedpool-Client": "evals"}) as resp:
            assert resp.status == 200
        shape = pool.dispatcher._clients.shape("evals")
        assert shape is not None and shape.announced and shape.prompt_tokens == 812.5 and shape.max_tokens == 2
        assert pool.dispatcher.inflight() == {}
