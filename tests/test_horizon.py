"""The horizon on a route of mixed kinds (federation/routing/horizon.py), on plain servers and routes: which kinds a
client's requests may use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedpool.federation.routing.horizon import HORIZON_MARGIN, Horizons
from fedpool.registry import Engine, ServerEntry, ServerRecord, ServerStatus, prior_weight


@dataclass(eq=False)
class State:
    entry: ServerEntry
    capacity: int = 16
    admits: bool = True
    lease: int | None = None  # slots leased to this process there (None: not leasing)


@dataclass(eq=False)
class Route:
    servers: list[State]
    key: str = "m"
    queues: dict[str, list[int]] = field(default_factory=dict)
    group: Any = None

    def group_by(self, group_of: Any) -> None:
        self.group = group_of


def server(i: int, accelerator: str) -> State:
    record = ServerRecord(id=f"{accelerator}-{i}", url=f"http://127.0.0.1:{9000 + i}", engine=Engine.VLLM, gpu_count=1,
                          model="m", revision="r1", accelerator=accelerator)
    return State(ServerEntry(record, ServerStatus.HEALTHY, 16, prior_weight(record)))


SHAPES = {"text": (250.0, 384.0), "image": (1100.0, 24.0)}


def allowed(horizons: Horizons, route: Route, client: str, now: float = 0.0) -> tuple[str, ...]:
    kinds = horizons.of(route)
    return horizons.allowed(kinds, client, SHAPES.get, now, lambda: ((c, len(q)) for c, q in route.queues.items()))


def test_long_answers_stay_off_the_slow_kind_until_it_is_all_that_serves() -> None:
    route = Route([server(i, "A100") for i in range(4)] + [server(i, "V100") for i in range(4)],
                  queues={"text": [0] * 100, "image": [0] * 100})
    horizons = Horizons(margin=HORIZON_MARGIN)
    assert allowed(horizons, route, "text") == ("A100x1/16",)  # 2.3x slower by the data sheet: would outlast
    assert set(allowed(horizons, route, "image")) == {"A100x1/16", "V100x1/16"}
    assert route.group is not None  # the route keeps its servers with room by kind
    # Every A100's breaker opens: the V100s are all that serves, and the next estimate lets text onto them.
    for state in route.servers[:4]:
        state.admits = False
    assert allowed(horizons, route, "text", now=0.1) == ("A100x1/16",)  # until the next estimate
    assert allowed(horizons, route, "text", now=1.0) == ("V100x1/16",)


def test_a_leasing_process_holds_nothing_for_a_kind_it_leases_nothing_on() -> None:
    # The broker placed this process's slots on the V100s only (its work suits them best beside the others'):
    # long answers are not held for the A100s, where it may send nothing.
    route = Route([server(i, "A100") for i in range(4)] + [server(i, "V100") for i in range(4)],
                  queues={"text": [0] * 100})
    for state in route.servers:
        state.lease = 0 if state.entry.record.accelerator == "A100" else 16
    horizons = Horizons(margin=HORIZON_MARGIN)
    assert allowed(horizons, route, "text") == ("V100x1/16",)
    # Leased one A100 slot, its horizon is that of its own slots, mostly V100s: both kinds take its text.
    route.servers[0].lease = 1
    assert set(allowed(horizons, route, "text", now=1.0)) == {"A100x1/16", "V100x1/16"}
    # Leased the A100s and not the V100s: only the A100s.
    for state in route.servers:
        state.lease = 16 if state.entry.record.accelerator == "A100" else 0
    assert allowed(horizons, route, "text", now=2.0) == ("A100x1/16",)


def test_one_kind_or_unknown_shapes_keep_nothing_off() -> None:
    horizons = Horizons()
    route = Route([server(i, "A100") for i in range(3)], queues={"text": [0] * 10})
    assert len(horizons.of(route).kinds) == 1 and route.group is None
    mixed = Route([server(0, "A100"), server(1, "V100")], key="m2", queues={"stranger": [0] * 10})
    assert set(allowed(horizons, mixed, "stranger")) == {"A100x1/16", "V100x1/16"}
