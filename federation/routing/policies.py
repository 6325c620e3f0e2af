"""Routing policies: small pure strategy classes behind one interface, registered by name.

The dispatcher asks a policy to `place` one waiting request on a view of its route; the policy answers
with one of the route's servers, or with a `Hold` (nothing free for this route, or for this client); the
dispatcher acts on it. Most policies only `choose` among a few candidates with a free admission-window slot
(the default `place` samples them from the route's index of servers with room, in O(k)); planned routing
(`federation/routing/planner.py`) looks at the whole route. A policy hands back the server object it was given, never
an id to look up. No I/O, no clock reads of their own, randomness from an injected Random.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from fedpool.federation.routing.horizon import HORIZON_MARGIN, Horizons, client_size, demand_on, free_in_kinds
from fedpool.federation.core.types import EngineTimes, InferenceRequest
from fedpool.registry import ServerEntry

if TYPE_CHECKING:
    from fedpool.federation.core.clientbook import ClientBook
    from fedpool.federation.core.ledger import InflightLedger

_POLICIES: dict[str, type[Policy]] = {}
_NO_TRIED: set[str] = set()


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


class RoundRobin(Policy, name="round_robin"):
    def __init__(self, rng: random.Random | None = None):
        super().__init__(rng)
        self._next = 0

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        ordered = sorted(candidates, key=lambda c: c.id)
        pick = ordered[self._next % len(ordered)]
        self._next += 1
        return pick


class RandomChoice(Policy, name="random"):
    candidate_limit = 1

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        return self._rng.choice(candidates)


class LeastInflight(Policy, name="least_inflight"):
    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        return self._least(candidates, _inflight)


class PowerOfTwo(Policy, name="power_of_two"):
    candidate_limit = 2

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        pair = self._rng.sample(list(candidates), min(2, len(candidates))) if len(candidates) > 2 else candidates
        return self._least(pair, _load)


class CapacityWeighted(Policy, name="capacity_weighted"):
    """On a route of mixed server kinds, a request goes only to a kind where it cannot outlast the run
    (`federation/routing/horizon.py`: at most 0.8 × the route's fluid horizon there, or its cheapest kind); else it is
    held and the free slot goes to the next client that may use it. Among those servers with room:

    Lowest expected wait, (in-flight + waiting + 1) / weight, over a sample of candidates. Expected waits
    within `tie_tolerance` of the lowest are a tie: learned weights of identical servers always differ a
    little, and an exact comparison sent every request that found both idle to the one that happened to
    measure faster (92/8 between two equal servers at 100 req/s).

    Idle servers, and near-equal waits, take turns in proportion to speed by stride scheduling over a virtual clock:
    each server has a pass, the pick is the lowest, and a pick advances its pass by 1 / weight *at that
    moment*. A server's pass is never behind the clock (one that sat out, new or busy, rejoins at the clock:
    no burst of catch-up turns). Counting turns since the start instead (fewest picks per unit of the
    current weight) made every past turn count at today's weight: one slow measurement after 200 turns
    gave a server no turn for the rest of a run, so its speed was never measured again (276/24 between two
    equal servers at a light load)."""

    def __init__(self, rng: random.Random | None = None, sample_size: int = 4, tie_tolerance: float = 0.1,
                 horizon: bool = True, horizon_margin: float = HORIZON_MARGIN):
        super().__init__(rng)
        self._sample_size = sample_size
        self._tolerance = tie_tolerance
        self.candidate_limit = sample_size
        self._clock = 0.0  # virtual time: the pass of the latest turn
        self._pass: dict[str, float] = {}  # server -> its next turn on the virtual clock (one entry per server)
        self._horizons = Horizons(margin=horizon_margin) if horizon else None
        self._state: DispatchState | None = None

    def attach(self, state: DispatchState) -> None:
        self._state = state

    def place(self, route: RouteView, request: InferenceRequest, tried: set[str]) -> Any:
        state, horizons = self._state, self._horizons
        if horizons is None or state is None or tried:
            return super().place(route, request, tried)
        kinds, servers = horizons.routes.get(route.key), route.servers
        if kinds is None or kinds.servers_ref is not servers or kinds.servers_len != len(servers):  # (inlined)
            kinds = horizons.of(route)
        if len(kinds.kinds) < 2:  # one kind: nothing to keep off
            return super().place(route, request, tried)
        clients, inflight = state.clients, state.ledger.clients
        allowed = horizons.allowed(kinds, request.client_id, lambda c: client_size(clients.shape(c)), state.clock(),
                                   lambda: demand_on(route, inflight))
        memo = route.memo  # within one grant pass servers only fill: kinds found full stay full
        held = memo.get(allowed)
        if held is None:
            free = free_in_kinds(route, allowed, self._sample_size, self._rng)
            if free:
                return self.choose(free, request)
            held = memo[allowed] = (Hold.CLIENT_HELD if route.free_candidates(1, _NO_TRIED, self._rng)
                                    else Hold.ROUTE_FULL)
        if held is Hold.CLIENT_HELD:  # out of the grant passes until one of its kinds has room
            route.park(request.client_id, allowed, clients.key(request.client_id))
        return held

    def forget_client(self, client_id: str) -> None:
        if self._horizons is not None:
            self._horizons.forget_client(client_id)

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        pool = candidates
        if len(pool) > self._sample_size:
            pool = self._rng.sample(list(pool), self._sample_size)
        idle, waits, best = [], [], float("inf")
        for c in pool:
            if c.inflight == 0 and c.scraped_waiting <= 0:
                idle.append(c)
            wait = c.expected_wait
            waits.append(wait)
            if wait < best:
                best = wait
        if len(idle) > 1:
            # Several idle servers: each would start the request at once, so they take turns in proportion
            # to speed, not the fastest always (that starved the other of the answers that measure it).
            return self._take_turn(idle)
        limit = best * (1 + self._tolerance)
        near = [c for c, wait in zip(pool, waits, strict=True) if wait <= limit]
        return near[0] if len(near) == 1 else self._take_turn(near)

    def forget_server(self, server_id: str) -> None:
        self._pass.pop(server_id, None)

    def _take_turn(self, tied: Sequence[V]) -> V:
        """The tied server whose turn it is (equal passes: a random one of them). Only ties take turns: a
        request that had one place to go (the others busy) is no turn of anyone's. Counted as turns, those
        moved the clock between ties, so the order in which the forced picks came decided who won the next
        tie: one of two equal servers got two thirds of the turns."""
        clock, passes = self._clock, self._pass
        first, due = float("inf"), []
        for c in tied:
            turn = passes.get(c.id, clock)
            if turn < clock:
                turn = clock
            if turn < first:
                first, due = turn, [c]
            elif turn == first:
                due.append(c)
        pick = due[0] if len(due) == 1 else self._rng.choice(due)
        self._clock = first
        passes[pick.id] = first + 1.0 / max(pick.weight, 1e-12)
        return pick


class PrefixAffinity(Policy, name="prefix_affinity"):
    """Consistent hashing of the prompt prefix with bounded load (≤ (1+ε) × average in-flight)."""

    VIRTUAL_NODES = 64

    def __init__(self, rng: random.Random | None = None, epsilon: float = 0.25):
        super().__init__(rng)
        self._epsilon = epsilon

    def choose(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        ring: list[tuple[int, int]] = sorted(
            (_hash(f"{c.id}#{i}"), n) for n, c in enumerate(candidates) for i in range(self.VIRTUAL_NODES)
        )
        keys = [k for k, _ in ring]
        total = sum(c.inflight for c in candidates) + 1
        bound = max(1.0, (1 + self._epsilon) * total / len(candidates))
        start = bisect.bisect(keys, _hash(request.prefix_text()))
        seen: set[int] = set()
        for offset in range(len(ring)):
            n = ring[(start + offset) % len(ring)][1]
            if n in seen:
                continue
            seen.add(n)
            if candidates[n].inflight + 1 <= bound:
                return candidates[n]  # the prefix's home, or the next on the ring when the home is full
        return self._least(candidates, _expected_wait)  # all over the bound


def _inflight(c: ServerView) -> float:
    return c.inflight


def _load(c: ServerView) -> float:
    return c.inflight + c.scraped_waiting


def _expected_wait(c: ServerView) -> float:
    return c.expected_wait


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def make_policy(name: str, rng: random.Random | None = None, **options: Any) -> Policy:
    """Build a policy by its registered name; unknown names list the known ones."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_POLICIES))}") from None
    return cls(rng, **options)


def prepare_policy(name: str) -> None:
    """What the named policy's first decision needs, loading in the background from now (a process that will
    route by it calls this before its slower start-up steps: joining Ray, starting its CPU actors). Unknown
    names are left to `make_policy` to refuse."""
    cls = _POLICIES.get(name)
    if cls is not None:
        cls.prepare()


def policy_names() -> list[str]:
    return sorted(_POLICIES)
