"""The horizon on a route of mixed kinds (federation/horizon.py), on plain servers and routes: which kinds a
client's requests may use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedpool.federation.horizon import HORIZON_MARGIN, Horizons
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


def test_one_kind_or_unknown_shapes_keep_nothing_off() -> None:
    horizons = Horizons()
    route = Route([server(i, "A100") for i in range(3)], queues={"text": [0] * 10})
    assert len(horizons.of(route).kinds) == 1 and route.group is None
    mixed = Route([server(0, "A100"), server(1, "V100")], key="m2", queues={"stranger": [0] * 10})
    assert set(allowed(horizons, mixed, "stranger")) == {"A100x1/16", "V100x1/16"}
