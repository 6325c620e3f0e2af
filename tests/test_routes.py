"""A route's waiting order (federation/core/routes.py) on real server states: clients a policy parked are out of the
grant passes until a server of a group they wait for has room, the servers change, or the periodic look."""

from __future__ import annotations

import asyncio

from fedpool.federation.core.routes import Route, Waiter
from fedpool.federation.core.serverbook import ServerState
from fedpool.federation.core.types import Endpoint, InferenceRequest

KEY = (0.0, 0.0)


def waiter(route: Route, client: str, seq: int, loop: asyncio.AbstractEventLoop) -> Waiter:
    request = InferenceRequest.from_body({"prompt": "x"}, request_id=f"{client}-{seq}", model="m",
                                          endpoint=Endpoint.COMPLETIONS, client_id=client)
    return Waiter(request, set(), loop.create_future(), seq, float("inf"), route)


def grouped_route(servers: list[ServerState], keys: dict[str, tuple[float, float]],
                  loop: asyncio.AbstractEventLoop) -> Route:
    """A route over `servers`, grouped by the kind before the dash in their ids, one waiter per client of `keys`."""
    route = Route(("m", None, None, None), "m", None, None, None)
    route.set_servers(servers)
    route.group_by(lambda s: s.id.split("-")[0])
    for seq, client in enumerate(keys):
        route.join(waiter(route, client, seq, loop), keys[client])
    return route


def test_a_parked_client_waits_out_of_the_order_until_its_group_has_room() -> None:
    loop = asyncio.new_event_loop()
    try:
        fast, slow = ServerState("fast-0"), ServerState("slow-0")
        route = grouped_route([fast, slow], {"text": (0.0, 0.0), "image": (1.0, 0.0)}, loop)
        key = {"text": (0.0, 0.0), "image": (1.0, 0.0)}.__getitem__
        first = route.head(key, set())
        assert first is not None and first.request.client_id == "text"
        route.park("text", ("fast",), key("text"))  # held by its policy until a fast server has room
        second = route.head(key, set())
        assert second is not None and second.request.client_id == "image"  # text is not walked again
        route.granted(second)
        assert route.head(key, set()) is None
        route.set_free(slow, True)  # room on a kind text does not wait for: still parked
        assert route.head(key, set()) is None
        route.set_free(fast, True)
        back = route.head(key, set())
        assert back is not None and back.request.client_id == "text"
        route.park("text", ("fast",), key("text"))
        assert route.head(key, set()) is None
        route.unpark_all()  # the dispatcher's tick: every reason looked at again
        again = route.head(key, set())
        assert again is not None and again.request.client_id == "text"
        route.park("text", ("fast",), key("text"))
        route.set_servers([fast, slow])  # the servers changed
        assert route.head(key, set()) is not None
    finally:
        loop.close()


def test_a_server_getting_room_wakes_its_groups_first_parked_client_only() -> None:
    loop = asyncio.new_event_loop()
    try:
        fast, slow = ServerState("fast-0"), ServerState("slow-0")
        keys = {"a": (2.0, 0.0), "b": (0.0, 0.0), "c": (1.0, 0.0)}
        route = grouped_route([fast, slow], keys, loop)
        for client in keys:
            route.park(client, ("fast",), keys[client])
        assert route.head(keys.__getitem__, set()) is None
        assert not route.unpark_ready()  # no fast server has room: nobody wakes
        route.set_free(fast, True)  # one server: the first parked in the serving order, not all three
        assert set(route.parked) == {"a", "c"}
        first = route.head(keys.__getitem__, set())
        assert first is not None and first.request.client_id == "b"
        route.granted(first)  # (b's only request: placed elsewhere, say; fast still has room)
        assert route.head(keys.__getitem__, set()) is None
        assert route.unpark_ready() and set(route.parked) == {"a"}  # the next in order, while the room lasts
        nxt = route.head(keys.__getitem__, set())
        assert nxt is not None and nxt.request.client_id == "c"
        route.set_free(fast, False)
        assert not route.unpark_ready() and set(route.parked) == {"a"}
    finally:
        loop.close()


def test_the_parked_client_woken_is_first_by_its_key_now_not_when_it_parked() -> None:
    loop = asyncio.new_event_loop()
    try:
        fast = ServerState("fast-0")
        keys = {"a": (0.0, 0.0), "b": (1.0, 0.0)}
        route = grouped_route([fast], keys, loop)
        assert route.head(keys.__getitem__, set()) is not None  # (the grant pass's key)
        for client in keys:
            route.park(client, ("fast",), keys[client])
        keys["a"] = (2.0, 0.0)  # a got served meanwhile: b comes first now
        route.set_free(fast, True)
        assert set(route.parked) == {"a"}
    finally:
        loop.close()


def test_a_client_parked_until_freed_wakes_on_a_full_server_getting_room_not_on_the_groups_room() -> None:
    """A policy that waits for one of a group's full servers (its servers with room are no use to the request)
    parks `until_freed`: the room the group already has wakes nobody after a pass; a server of it that had none
    getting some does."""
    loop = asyncio.new_event_loop()
    try:
        busy, idle = ServerState("fast-0"), ServerState("fast-1")
        route = grouped_route([busy, idle], {"text": KEY}, loop)
        route.set_free(idle, True)  # the group has room all along
        route.park("text", ("fast",), KEY, until_freed=True)
        assert route.head(lambda c: KEY, set()) is None
        assert not route.unpark_ready()  # the group's standing room is no reason to look again
        assert set(route.parked) == {"text"}
        route.set_free(busy, True)  # a full server frees a slot
        assert not route.parked
        back = route.head(lambda c: KEY, set())
        assert back is not None and back.request.client_id == "text"
    finally:
        loop.close()
