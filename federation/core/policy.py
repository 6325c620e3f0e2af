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
S = TypeVar("S", bound=ServerView)


class Hold(StrEnum):
    """Why a waiting request was not placed now."""

    ROUTE_FULL = "route_full"  # no server of its route can take a request: no client of that route goes now
    CLIENT_HELD = "client_held"  # this client waits (for its own planned servers, or untried ones); others may go


class RouteView(Protocol[S]):
    """One waiting request's route as the dispatcher shows it to a policy (federation/core/routes.py's Route, whose
    servers are the dispatcher's `ServerState`s)."""

    @property
    def key(self) -> Any:
        """What identifies the route (model, revision, pins): stable across snapshots."""
        ...

    @property
    def servers(self) -> Sequence[S]:
        """Every routable server of the route (ServerViews with `entry`, the registry's ServerEntry), room or not."""
        ...

    @property
    def memo(self) -> dict[Any, Any]:
        """Scratch a policy may fill during one grant pass (cleared between passes)."""
        ...

    @property
    def kinds(self) -> int:
        """How many server kinds (`ServerEntry.kind`) the route's servers are of."""
        ...

    @property
    def free(self) -> Sequence[S]:
        """The route's servers with room (window and breaker) now: its index (a live list: do not keep it)."""
        ...

    def free_candidates(self, limit: int | None, tried: set[str], rng: random.Random) -> Sequence[S]:
        """Servers with room (window and breaker), avoiding the request's tried servers where others can serve;
        at most `limit` of them, sampled in O(limit)."""
        ...

    def usable(self, server: S, tried: set[str] | None = None) -> bool:
        """Whether the request may be sent to `server` now (room, breaker, not one it failed on)."""
        ...

    def group_by(self, group_of: Callable[[S], str]) -> None:
        """Also keep the servers with room by `group_of` (the same function every time: it is done once)."""
        ...

    def free_in(self, group: str) -> Sequence[S]:
        """The servers with room in that group (after `group_by`)."""
        ...

    @property
    def queues(self) -> Mapping[str, Sized]:
        """Client -> its requests waiting on this route."""
        ...

    @property
    def waiting(self) -> int:
        """Requests waiting on this route (every client)."""
        ...

    def park(self, client: str, groups: tuple[str, ...], key: Any, *, until_freed: bool = False) -> None:
        """The client's requests wait until a server in one of `groups` (of `group_by`) has room: grant passes skip
        it until then, or until the dispatcher's next periodic look (`key`: its place in the serving order).
        `until_freed`: until a server there that had none gets room (the group's room is no use to it)."""
        ...

    def unpark_all(self) -> None:
        """Every parked client back in the order (the policy's reasons changed: a new plan, say)."""
        ...


@dataclass(frozen=True, slots=True)
class DispatchState:
    """What a dispatcher shares with its policy when it adopts it: read-only views of its books."""

    ledger: InflightLedger
    clients: ClientBook
    clock: Callable[[], float]


AnswerHook = Callable[[str, ServerEntry, int | None, int | None, float, EngineTimes | None], None]


@dataclass(frozen=True, slots=True)
class PolicyHooks:
    """What a policy asks of its dispatcher besides `place`, each optional (what `Policy.attach` returns).

    `on_answer(client, server, prompt_tokens, completion_tokens, latency_s, engine_times)`: told of every answer.
    `recheck_s()`: while requests wait, look again within this many seconds (None: on events and the usual poll).
    `forget_client` / `forget_server`: the client or server is gone for good; drop what is kept about it.
    `plans_the_tail`: the policy places a run's last requests itself: no copies at the tail (hedging, stealing).
    `pick(candidates, request)` with `sample`: how a copy at the tail picks among replicas with room (default: the
    lowest expected wait). `describe()`: the policy's own state worth logging (JSON-able)."""

    on_answer: AnswerHook | None = None
    recheck_s: Callable[[], float | None] | None = None
    forget_client: Callable[[str], None] | None = None
    forget_server: Callable[[str], None] | None = None
    plans_the_tail: bool = False
    pick: Callable[[Sequence[Any], InferenceRequest], Any] | None = None
    sample: int | None = None
    describe: Callable[[], dict[str, Any] | None] | None = None


class Policy(ABC):
    """Where a waiting request goes. Subclasses implement `place`, register with `name=`, and say in `attach` what
    else they need of the dispatcher."""

    name: ClassVar[str]

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
            _POLICIES[name] = cls

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random(0)

    @abstractmethod
    def place(self, route: RouteView[S], request: InferenceRequest, tried: set[str]) -> S | Hold:
        """The server for one waiting request (one of `route.servers`, handed back as given), or why it waits."""

    def attach(self, state: DispatchState) -> PolicyHooks:
        """Called once by the dispatcher that adopts this policy, with read-only views of its books; returns what
        else the policy wants of it (default: nothing)."""
        return PolicyHooks()

    @classmethod
    def prepare(cls) -> None:
        """Start loading, in the background, what this policy's first decision needs (the planner: SciPy's
        solver); called as early as a process knows its policy. Default: nothing."""
        return None


def least_expected_wait(candidates: Sequence[V], request: InferenceRequest) -> V:
    """The candidate with the lowest expected wait (the first of equals): how a copy at the tail picks among
    replicas where the policy names no picker of its own."""
    return min(candidates, key=_expected_wait)


def _expected_wait(c: ServerView) -> float:
    return c.expected_wait


def registered_policies() -> Mapping[str, type[Policy]]:
    """Every policy registered so far, by name (the built-in ones register as federation/routing/ is imported)."""
    return _POLICIES
