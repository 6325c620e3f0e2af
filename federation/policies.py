"""Routing policies: small pure strategy classes behind one interface, registered by name.

The dispatcher asks a policy to `place` one waiting request on a view of its route; the policy answers
with a server id, or with a `Hold` (nothing free for this route, or for this client); the dispatcher acts
on it. Most policies only `choose` among a few candidates with a free admission-window slot (the default
`place` samples them); planned routing (`federation/planner.py`) looks at the whole route. No I/O, no
clock reads of their own, randomness from an injected Random.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fedpool.registry import ServerEntry

if TYPE_CHECKING:
    from fedpool.federation.clientbook import ClientBook
    from fedpool.federation.ledger import InflightLedger

_POLICIES: dict[str, type[Policy]] = {}


@dataclass(frozen=True, slots=True)
class Candidate:
    """A server as a policy sees it at one decision."""

    server_id: str
    inflight: int  # this dispatcher's own requests there, counted at the moment of choosing
    window: int  # admission window: how many this dispatcher may keep there
    capacity: int  # max concurrent sequences the engine runs
    weight: float  # relative throughput: prior from the accelerator, corrected by observation
    scraped_waiting: float = 0.0  # the engine's own queue (all clients), from the registry
    scraped_running: float = 0.0

    @property
    def expected_wait(self) -> float:
        """(in-flight + queued) per unit of throughput: lower is sooner."""
        return (self.inflight + self.scraped_waiting + 1) / max(self.weight, 1e-9)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    server_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class RouteContext:
    """What a policy may know about the request itself."""

    request_id: str
    prefix: str = ""
    client_id: str = "default"


class Hold(StrEnum):
    """Why a waiting request was not placed now."""

    ROUTE_FULL = "route_full"  # no server of its route can take a request: no client of that route goes now
    CLIENT_HELD = "client_held"  # this client waits for its own (planned) servers; others of the route may go


class RouteView(Protocol):
    """One waiting request's route as the dispatcher shows it to a policy, for one decision."""

    @property
    def servers(self) -> Sequence[ServerEntry]:
        """Every routable server of the route (model, revision, pins), room or not."""

    @property
    def memo(self) -> set[str]:
        """Scratch a policy may fill during one grant pass (cleared between passes)."""

    def free_candidates(self, limit: int | None) -> list[Candidate]:
        """Servers with a free window slot and a closed breaker, untried by this request where possible;
        at most `limit` of them, sampled without visiting every server."""

    def usable(self, server: ServerEntry, *, avoid_tried: bool = True) -> bool:
        """Whether the request may be sent to `server` now (room, breaker, not already failed on it)."""


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

    def attach(self, state: DispatchState) -> None:
        """Called once by the dispatcher that uses this policy. Policies that need more than the candidates
        (the planner) keep the state."""
        return None

    def place(self, route: RouteView, context: RouteContext) -> str | Hold:
        """The server for one waiting request, or why it waits. Default: `choose` among sampled candidates."""
        free = route.free_candidates(self.candidate_limit)
        if not free:
            return Hold.ROUTE_FULL
        return self.choose(free, context).server_id

    def observe_answer(self, client_id: str, server: ServerEntry, prompt_tokens: int | None,
                       completion_tokens: int | None) -> None:
        """An answer came back (usage as the engine reported it). Default: nothing to learn."""
        return None

    def recheck_s(self) -> float | None:
        """While requests wait, look again within this many seconds (None: on events and the usual poll)."""
        return None

    def describe(self) -> dict[str, Any] | None:
        """The policy's own state worth logging (JSON-able), if it keeps any."""
        return None

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
            _POLICIES[name] = cls

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random(0)

    @abstractmethod
    def choose(self, candidates: Sequence[Candidate], context: RouteContext) -> RouteDecision:
        """`candidates` is never empty."""

    def _least(self, candidates: Sequence[Candidate], key: Any) -> Candidate:
        """Lowest key; ties broken at random so no server always wins a tie."""
        best = min(key(c) for c in candidates)
        tied = [c for c in candidates if key(c) == best]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


class RoundRobin(Policy, name="round_robin"):
    def __init__(self, rng: random.Random | None = None):
        super().__init__(rng)
        self._next = 0

    def choose(self, candidates: Sequence[Candidate], context: RouteContext) -> RouteDecision:
        ordered = sorted(candidates, key=lambda c: c.server_id)
        pick = ordered[self._next % len(ordered)]
        self._next += 1
        return RouteDecision(pick.server_id, "round robin")


class RandomChoice(Policy, name="random"):
    candidate_limit = 1

    def choose(self, candidates: Sequence[Candidate], context: RouteContext) -> RouteDecision:
        return RouteDecision(self._rng.choice(list(candidates)).server_id, "uniform random")


class LeastInflight(Policy, name="least_inflight"):
    def choose(self, candidates: Sequence[Candidate], context: RouteContext) -> RouteDecision:
        pick = self._least(candidates, lambda c: c.inflight)
        return RouteDecision(pick.server_id, f"fewest in flight ({pick.inflight})")


class PowerOfTwo(Policy, name="power_of_two"):
    candidate_limit = 2

    def choose(self, candidates: Sequence[Candidate], context: RouteContext) -> RouteDecision:
        pair = self._rng.sample(list(candidates), min(2, len(candidates)))
        pick = self._least(pair, lambda c: c.inflight + c.scraped_waiting)
        return RouteDecision(pick.server_id, "less loaded of two random")


class CapacityWeighted(Policy, name="capacity_weighted"):
    """Lowest expected wait, (in-flight + waiting + 1) / weight, over a sample of candidates. Expected waits
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

    def __init__(self, rng: random.Random | None = None, sample_size: int = 4, tie_tolerance: float = 0.1):
        super().__init__(rng)
        self._sample_size = sample_size
        self._tolerance = tie_tolerance
        self.candidate_limit = sample_size
        self._clock = 0.0  # virtual time: the pass of the latest turn
        self._pass: dict[str, float] = {}  # server -> its next turn on the virtual clock (one entry per server)

    def choose(self, candidates: Sequence[Candidate], context: RouteContext) -> RouteDecision:
        pool = list(candidates)
        if len(pool) > self._sample_size:
            pool = self._rng.sample(pool, self._sample_size)
        idle = [c for c in pool if c.inflight == 0 and c.scraped_waiting <= 0]
        if len(idle) > 1:
            # Several idle servers: each would start the request at once, so they take turns in proportion
            # to speed, not the fastest always (that starved the other of the answers that measure it).
            pick = self._take_turn(idle)
            return RouteDecision(pick.server_id, f"idle, chosen in proportion to speed ({pick.weight:.3g})")
        best = min(c.expected_wait for c in pool)
        near = [c for c in pool if c.expected_wait <= best * (1 + self._tolerance)]
        pick = near[0] if len(near) == 1 else self._take_turn(near)
        return RouteDecision(pick.server_id, f"lowest expected wait ({pick.expected_wait:.3g})")

    def _take_turn(self, tied: Sequence[Candidate]) -> Candidate:
        """The tied server whose turn it is (equal passes: a random one of them). Only ties take turns: a
        request that had one place to go (the others busy) is no turn of anyone's. Counted as turns, those
        moved the clock between ties, so the order in which the forced picks came decided who won the next
        tie: one of two equal servers got two thirds of the turns."""
        def turn(c: Candidate) -> float:
            return max(self._pass.get(c.server_id, self._clock), self._clock)

        first = min(turn(c) for c in tied)
        due = [c for c in tied if turn(c) == first]
        pick = due[0] if len(due) == 1 else self._rng.choice(due)
        self._clock = first
        self._pass[pick.server_id] = self._clock + 1.0 / max(pick.weight, 1e-12)
        return pick


class PrefixAffinity(Policy, name="prefix_affinity"):
    """Consistent hashing of the prompt prefix with bounded load (≤ (1+ε) × average in-flight)."""

    VIRTUAL_NODES = 64

    def __init__(self, rng: random.Random | None = None, epsilon: float = 0.25):
        super().__init__(rng)
        self._epsilon = epsilon

    def choose(self, candidates: Sequence[Candidate], context: RouteContext) -> RouteDecision:
        ring: list[tuple[int, Candidate]] = sorted(
            (_hash(f"{c.server_id}#{i}"), c) for c in candidates for i in range(self.VIRTUAL_NODES)
        )
        keys = [k for k, _ in ring]
        total = sum(c.inflight for c in candidates) + 1
        bound = max(1.0, (1 + self._epsilon) * total / len(candidates))
        start = bisect.bisect(keys, _hash(context.prefix))
        seen: set[str] = set()
        for offset in range(len(ring)):
            cand = ring[(start + offset) % len(ring)][1]
            if cand.server_id in seen:
                continue
            seen.add(cand.server_id)
            if cand.inflight + 1 <= bound:
                why = "prefix home" if len(seen) == 1 else "prefix home full; next on ring"
                return RouteDecision(cand.server_id, why)
        pick = self._least(candidates, lambda c: c.expected_wait)
        return RouteDecision(pick.server_id, "all over bound; least expected wait")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def make_policy(name: str, rng: random.Random | None = None, **options: Any) -> Policy:
    """Build a policy by its registered name; unknown names list the known ones."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_POLICIES))}") from None
    return cls(rng, **options)


def policy_names() -> list[str]:
    return sorted(_POLICIES)
