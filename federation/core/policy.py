"""The policy interface: what the dispatcher asks a routing policy, and what it shows it.

The dispatcher asks one question, `Policy.place(route, request, tried)`, and gets a typed answer: one of the
route's servers (the object it was given, never an id), or a `Hold` saying why the request waits. Everything
else a policy may want (the dispatcher's books, answers as they come, a timer, forgetting) it asks for in
`attach`, so a policy implements only what it uses. Policies register by name (`Policy.__init_subclass__`);
the built-in ones live in federation/routing/. No I/O, no clock reads of their own, randomness injected.
"""


from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from fedpool.federation.core.types import EngineTimes, InferenceRequest
from fedpool.registry import ServerEntry

if TYPE_CHECKING:
    from fedpool.federation.core.clientbook import ClientBook
    from fedpool.federation.core.ledger import InflightLedger

_POLICIES: dict[str, type[Policy]] = {}


class ServerView(Protocol):
    """A server as a policy sees it at one decision (the dispatcher's ServerState; tests use `Candidate`)."""

    @property
    def id(self) -> str: ...
    @property
    def inflight(self) -> int: ...  # this dispatcher's own requests there, counted at the moment of choosing
    @property
    def window(self) -> int: ...  # admission window: how many this dispatcher may keep there
    @property
    def capacity(self) -> int: ...  # max concurrent sequences the engine runs
    @property
    def weight(self) -> float: ...  # relative throughput: prior from the accelerator, corrected by observation
    @property
    def scraped_waiting(self) -> float: ...  # the engine's own queue (all clients), from the registry
    @property
    def scraped_running(self) -> float: ...
    @property
    def expected_wait(self) -> float: ...  # (in-flight + queued + 1) / weight: lower is sooner


@dataclass(frozen=True, slots=True)
class Candidate:
    """A plain ServerView (for tests and offline use of a policy)."""

    id: str
    inflight: int
    window: int
    capacity: int
    weight: float
    scraped_waiting: float = 0.0
    scraped_running: float = 0.0

    @property
    def expected_wait(self) -> float:
        return (self.inflight + self.scraped_waiting + 1) / max(self.weight, 1e-9)


V = TypeVar("V", bound=ServerView)


class Hold(StrEnum):
    """Why a waiting request was not placed now."""

    ROUTE_FULL = "route_full"  # no server of its route can take a request: no client of that route goes now
    CLIENT_HELD = "client_held"  # this client waits (for its own planned servers, or untried ones); others may go


class RouteView(Protocol):
    """One waiting request's route as the dispatcher shows it to a policy (federation/core/routes.py's Route)."""

    @property
    def key(self) -> Any:
        """What identifies the route (model, revision, pins): stable across snapshots."""

    @property
    def servers(self) -> Sequence[Any]:
        """Every routable server of the route (ServerViews with `entry`, the registry's ServerEntry), room or not."""

    @property
    def memo(self) -> dict[Any, Any]:
        """Scratch a policy may fill during one grant pass (cleared between passes)."""

    def free_candidates(self, limit: int | None, tried: set[str], rng: random.Random) -> Sequence[Any]:
        """Servers with room (window and breaker), avoiding the request's tried servers where others can serve;
        at most `limit` of them, sampled in O(limit)."""

    def usable(self, server: Any, tried: set[str] | None = None) -> bool:
        """Whether the request may be sent to `server` now (room, breaker, not one it failed on)."""

    def group_by(self, group_of: Callable[[Any], str]) -> None:
        """Also keep the servers with room by `group_of` (the same function every time: it is done once)."""

    def free_in(self, group: str) -> Sequence[Any]:
        """The servers with room in that group (after `group_by`)."""

    @property
    def queues(self) -> Mapping[str, Sized]:
        """Client -> its requests waiting on this route."""

    @property
    def waiting(self) -> int:
        """Requests waiting on this route (every client)."""

    def park(self, client: str, groups: tuple[str, ...], key: Any, *, until_freed: bool = False) -> None:
        """The client's requests wait until a server in one of `groups` (of `group_by`) has room: grant passes skip
        it until then, or until the dispatcher's next periodic look (`key`: its place in the serving order).
        `until_freed`: until a server there that had none gets room (the group's room is no use to it)."""

    def unpark_all(self) -> None:
        """Every parked client back in the order (the policy's reasons changed: a new plan, say)."""


@dataclass(frozen=True, slots=True)
class DispatchState:
    """What a dispatcher shares with its policy when it adopts it: read-only views of its books."""

    ledger: InflightLedger
    clients: ClientBook
    clock: Callable[[], float]


class Policy(ABC):
    """Choose one of the candidates. Subclasses register with `name=`."""

    name: ClassVar[str]
    candidate_limit: int | None = None  # a policy that looks at a random sample of k servers says k
    # A policy that places by a makespan plan balances the finish itself: the tail's hedging and stealing
    # (which move and copy requests against the plan) stay off under it.
    plans_the_tail: ClassVar[bool] = False
    observes_answers: ClassVar[bool] = False  # whether the dispatcher tells it of every answer (observe_answer)

    @classmethod
    def prepare(cls) -> None:
        """Start loading, in the background, what this policy's first decision needs (the planner: SciPy's
        solver); `prepare_policy` calls it as early as a process knows its policy. Default: nothing."""
        return None

    def attach(self, state: DispatchState) -> None:
        """Called once by the dispatcher that uses this policy. Policies that need more than the candidates
        (the planner) keep the state."""
        return None

    def place(self, route: RouteView, request: InferenceRequest, tried: set[str]) -> Any:
        """The server for one waiting request (one of `route.servers`), or why it waits (a `Hold`). Default:
        `choose` among sampled candidates."""
        free = route.free_candidates(self.candidate_limit, tried, self._rng)
        if not free:
            return Hold.CLIENT_HELD if tried and route.free_candidates(None, set(), self._rng) else Hold.ROUTE_FULL
        return self.choose(free, request)

    def observe_answer(self, client_id: str, server: ServerEntry, prompt_tokens: int | None,
                       completion_tokens: int | None, latency_s: float = 0.0, times: EngineTimes | None = None) -> None:
        """An answer came back (usage and, where it says them, its own times as the engine reported them; how long
        the attempt took). Default: nothing
        to learn (the dispatcher calls it only for policies that set `observes_answers`)."""
        return None

    def recheck_s(self) -> float | None:
        """While requests wait, look again within this many seconds (None: on events and the usual poll)."""
        return None

    def describe(self) -> dict[str, Any] | None:
        """The policy's own state worth logging (JSON-able), if it keeps any."""
        return None

    def forget_server(self, server_id: str) -> None:
        """The server left the pool for good: drop what the policy keeps about it."""
        return None

    def forget_client(self, client_id: str) -> None:
        """The client has gone (nothing in flight or waiting for a while): drop what the policy keeps about it."""
        return None

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
            _POLICIES[name] = cls

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random(0)

    @abstractmethod
    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        """One of `candidates` (never empty), handed back as given."""

    def _least(self, candidates: Sequence[V], key: Callable[[V], float]) -> V:
        """Lowest key; ties broken at random so no server always wins a tie."""
        best, tied = None, []
        for c in candidates:
            k = key(c)
            if best is None or k < best:
                best, tied = k, [c]
            elif k == best:
                tied.append(c)
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)
