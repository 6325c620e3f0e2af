"""Earliest modelled finish (policy `earliest_finish`): each request goes to the server where it is expected to be
answered soonest, and waits when a server without room would answer it far sooner.

Why: on a pool of mixed accelerators the schedule is decided by where each request lands — a long answer on a slow
server can outlast the rest of the run, a long prompt on a server decoding long answers stalls all of them.

The model, per server: its placed prompts prefill one after another (`prefilled`), its answers decode beside each
other at one step a token (`decoded`), and a prompt placed there stalls them by its prefill. A decision prices, per
kind the request may use (`horizon`), a sample of servers with room and the kind's two best members (lazy heaps);
the earliest finish with room wins, unless a full server would be far sooner or the best are backlogged (held).
Costs per (model, kind) start at the data-sheet priors (`pricing`) and are learned from the answers' engine times
or latencies. No I/O, no clock of its own; every table is bounded (per client, per server, per route).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedpool.federation.core.clientbook import DEFAULT_ANSWER_TOKENS, client_size
from fedpool.federation.core.policy import DispatchState, Hold, Policy, PolicyHooks, RouteView, S
from fedpool.federation.core.types import EngineTimes, InferenceRequest
from fedpool.federation.routing.horizon import (
    MAX_ROUTES,
    Horizons,
    RouteHorizon,
    demand_on,
)
from fedpool.federation.routing.policies import LeastExpectedWait, SampledPolicy
from fedpool.federation.routing.pricing import (
    DECODE_MIN_TOKENS,
    PREFILL_MIN_TOKENS,
    EngineTimedCosts,
    kind_key,
    quantile,
    server_cost,
    step_cost,
)
from fedpool.federation.routing.wave import Waves
from fedpool.federation.routing.waveplan import KindModel
from fedpool.registry import ServerEntry

HOLD_FACTOR = 2.0  # a request waits when a kind without room would finish it this many times sooner ...
HOLD_SLACK_STEPS = 50.0  # ... and by more than this many decode steps of that kind
PREFILL_QUEUE_TOKENS = 1024.0  # a server whose placed prompts keep it prefilling more tokens than this takes no
# other now: vLLM keeps a request waiting until its first chunk is scheduled (`max_num_batched_tokens` a step), and
# a request found waiting shrinks the server's window and is taken back
HORIZON_MARGIN = 0.0  # a request may use a kind where it alone takes up to the route's fluid horizon (the hold
# rule does the rest)
RECHECK_S = 0.1  # held clients are looked at again this often (a server's backlog drains as time passes)
SAMPLE = 2  # servers with room looked at per kind and decision
LATENCY_QUANTILE = 0.1  # no engine times: this quantile of latency ÷ priced time scales the kind's priors
LATENCY_ROWS = 200
REFIT_EVERY = 10  # answers of a kind between refits of its costs
SHAPE_ALPHA = 0.2  # one answer's weight in its client's mean prompt and answer tokens
_NO_TRIED: set[str] = set()  # (shared, never changed)


@dataclass(frozen=True, slots=True)
class KindCosts:
    """One kind's costs: prefill seconds a prompt token; seconds a decode step takes at a full batch."""

    prefill_s: float
    step_s: float
    source: str  # "prior", "engine" (the engine's own times), "latency", or "scaled" (the prior on a learned scale)


@dataclass
class _Rows:
    """What one (model, kind)'s answers showed, newest last."""

    timed: EngineTimedCosts = field(default_factory=EngineTimedCosts)
    latency: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_ROWS))  # latency ÷ priced time
    answers: int = 0


@dataclass
class _RouteState:
    """A route's kinds, and per kind the lazy heaps of its members' `prefilled` and `decoded` times."""

    horizon: RouteHorizon
    members: dict[str, dict[str, Any]]  # kind -> server id -> its route state
    heaps: dict[str, tuple[list[tuple[float, str]], list[tuple[float, str]]]]


@dataclass(slots=True)
class _Look:
    """One decision: the request's shape, and the earliest finishes its look over the kinds found."""

    now: float
    model: str
    prompt: float
    answer: float
    tried: set[str]
    best: float = float("inf")  # the earliest finish on a server that may take it now ...
    best_own: float = float("inf")  # ... and its prompt's prefill there
    pick: Any = None
    pick_kind: str = ""
    anywhere: float = float("inf")  # the earliest finish seen anywhere, and its kind
    anywhere_kind: str = ""
    anywhere_full: bool = False
    backlogged: bool = False  # a server with room was passed over: its placed prompts keep it prefilling
    slack: float = 0.0


class EarliestFinish(Policy, name="earliest_finish"):
    """Earliest modelled finish (see the module docstring)."""


    def __init__(self, rng: random.Random | None = None, sample: int = SAMPLE, hold_factor: float = HOLD_FACTOR,
                 hold_slack_steps: float = HOLD_SLACK_STEPS, horizon: bool = True,
                 horizon_margin: float = HORIZON_MARGIN, queue_tokens: float = PREFILL_QUEUE_TOKENS,
                 waves: bool = True):
        super().__init__(rng)
        self._queue_tokens = queue_tokens
        self._horizon = horizon
        self._sample = sample
        # Outside the model (no dispatcher's state, or only servers it failed on): a sample of the servers with
        # room, the lowest expected wait.
        self._fallback = SampledPolicy(LeastExpectedWait(self._rng), self._rng, sample=sample)
        self._hold_factor = hold_factor
        self._hold_slack = hold_slack_steps
        self._state: DispatchState | None = None
        self._horizons = Horizons(margin=horizon_margin)  # (and its grouping of a route's servers by kind)
        self._routes: dict[Any, _RouteState] = {}
        self._priors: dict[str, KindCosts] = {}
        # (model, kind) -> its learned costs and what its answers showed (the registry's models and kinds: bounded)
        self._costs: dict[tuple[str, str], KindCosts] = {}
        self._rows: dict[tuple[str, str], _Rows] = {}
        self._prefilled: dict[str, float] = {}  # server -> when the prompts placed there will have prefilled
        self._decoded: dict[str, float] = {}  # server -> when the answers placed there will have decoded
        self._shapes: dict[str, tuple[float, float]] = {}  # client -> mean (prompt, answer) tokens of its answers
        # A route whose clients' every request fits its servers' room at once: probed, then assigned together
        self.waves = Waves(self, min_prompt=PREFILL_MIN_TOKENS, min_answer=DECODE_MIN_TOKENS) if waves else None

    def attach(self, state: DispatchState) -> PolicyHooks:
        self._state = state
        # It places a run's last requests itself (a copy at the tail would run against the model's placement).
        return PolicyHooks(on_answer=self.observe_answer, recheck_s=self.recheck_s, forget_client=self.forget_client,
                           forget_server=self.forget_server, plans_the_tail=True, describe=self.describe)

    # ---- placing ----------------------------------------------------------------------------------
    def place(self, route: RouteView[S], request: InferenceRequest, tried: set[str]) -> S | Hold:
        state = self._state
        if state is None:
            return self._fallback.place(route, request, tried)
        now = state.clock()
        client = request.client_id
        known = self._route(route)
        allowed: tuple[str, ...] | None = None
        if self._horizon and len(known.members) > 1 and not state.clients.open_ended(client):
            allowed = self._horizons.cached(known.horizon, client, now)
            if allowed is None:
                clients, inflight = state.clients, state.ledger.clients
                allowed = self._horizons.allowed(known.horizon, client, lambda c: client_size(clients.shape(c)), now,
                                                 lambda: demand_on(route, inflight, clients.requests_left_of))
        if self.waves is not None and not tried and len(known.members) > 1:
            placed = self.waves.place(route, request, now, known.members, known)
            if placed is not None:
                return placed
        return self._place(route, request, tried, known, allowed, now)

    def place_within(self, route: RouteView, request: InferenceRequest, tried: set[str],
                     kinds: tuple[str, ...]) -> Any:
        """`place`, among the given server kinds of the route only (a plan's: `planned` with `pick="finish"`)."""
        state = self._state
        assert state is not None, "place_within is used by a policy attached to a dispatcher"
        known = self._route(route)
        return self._place(route, request, tried, known, kinds if len(known.members) > 1 else None, state.clock())

    def _place(self, route: RouteView, request: InferenceRequest, tried: set[str], known: _RouteState,
               allowed: tuple[str, ...] | None, now: float) -> Any:
        """The server that finishes the request soonest among those the kinds' looks price, or a Hold."""
        state = self._state
        assert state is not None
        client = request.client_id
        look = _Look(now, request.model, *self._shape(request), tried)
        kinds = known.members
        for kind in (kinds if allowed is None else allowed):
            members = kinds.get(kind)
            if members is not None:
                self._price_kind(route, known, kind, members, look)
        pick = look.pick
        if pick is None:
            return self._no_pick(route, request, tried, tuple(kinds), allowed, look.backlogged)
        if look.best - now > (look.anywhere - now) * self._hold_factor + look.slack:
            # A server without room finishes it far sooner: wait for it (parked until its kind has room, when the
            # whole kind is full; else until one of its full servers frees a slot, or the next look).
            route.park(client, (look.anywhere_kind,), state.clients.key(client), until_freed=not look.anywhere_full)
            return Hold.CLIENT_HELD
        sid = pick.id
        self._prefilled[sid] = look.best_own
        self._decoded[sid] = look.best
        self._push(known, look.pick_kind, sid, look.best_own, look.best)
        return pick

    def _price_kind(self, route: RouteView, known: _RouteState, kind: str, members: Mapping[str, Any],
                    look: _Look) -> None:
        """Price the request on the servers `_looked` picks of the kind; `look` keeps the earliest finishes."""
        costs = self._costs.get((look.model, kind)) or self._unlearned(look.model, kind, members)
        prefill, chain = look.prompt * costs.prefill_s, look.answer * costs.step_s
        queue_s = self._queue_tokens * costs.prefill_s
        if len(known.members) > 1:
            free = route.free_in(kind)
        else:
            free = route.free_candidates(None, _NO_TRIED, self._rng)
        looked, sampled = self._looked(known, kind, members, free)
        prefilled, decoded, now, tried = self._prefilled, self._decoded, look.now, look.tried
        for n, server in enumerate(looked):
            sid = server.id
            if server.inflight == 0:
                start = done = now
            else:
                start, done = max(prefilled.get(sid, now), now), max(decoded.get(sid, now), now)
            own = start + prefill
            finish = max(own + chain, done + prefill)  # (its prompt stalls the answers decoding there)
            if finish < look.anywhere:
                look.anywhere, look.anywhere_kind, look.anywhere_full = finish, kind, not free
                look.slack = self._hold_slack * costs.step_s
            if finish < look.best and (n < sampled or route.usable(server)) and not (tried and sid in tried):
                if start - now > queue_s:
                    look.backlogged = True
                else:
                    look.best, look.best_own, look.pick, look.pick_kind = finish, own, server, kind

    def _looked(self, known: _RouteState, kind: str, members: Mapping[str, Any],
                free: Sequence[Any]) -> tuple[list[Any], int]:
        """`sample` servers with room (drawn with replacement: a repeat only costs a look), then the kind's members
        that prefill and decode soonest (the heaps' tops, checked for room); and how many were sampled."""
        n_free, sample, draw = len(free), self._sample, self._rng.random
        looked: list[Any] = list(free) if n_free <= sample else [free[int(draw() * n_free)] for _ in range(sample)]
        sampled = len(looked)
        heaps = known.heaps.get(kind) or self._rebuild(known, kind)
        for heap, times in ((heaps[0], self._prefilled), (heaps[1], self._decoded)):
            while heap:  # (stale entries, departed servers and ones not taking requests are dropped on the way)
                t, sid = heap[0]
                top = members.get(sid)
                if top is not None and times.get(sid) == t and top.window > 0 and top.open_until is None:
                    looked.append(top)
                    break
                heapq.heappop(heap)
        return looked, sampled

    def _no_pick(self, route: RouteView, request: InferenceRequest, tried: set[str], kinds: tuple[str, ...],
                 allowed: tuple[str, ...] | None, backlogged: bool) -> Any:
        """No server with room may take the request now: the interface's way, or held, or the route is full."""
        if tried:  # (only servers it failed on looked good, or none had room: outside the model)
            return self._fallback.place(route, request, tried)
        assert self._state is not None
        client = request.client_id
        if backlogged:  # until a server frees a slot, or the next look (their prompts prefill meanwhile)
            route.park(client, allowed or kinds, self._state.clients.key(client), until_freed=True)
            return Hold.CLIENT_HELD
        if allowed is not None and route.free_candidates(1, _NO_TRIED, self._rng):
            route.park(client, allowed, self._state.clients.key(client))
            return Hold.CLIENT_HELD  # the kinds it may use are full; others have room for other clients
        return Hold.ROUTE_FULL

    def recheck_s(self) -> float | None:
        return RECHECK_S

    def _push(self, known: _RouteState, kind: str, sid: str, prefilled: float, decoded: float) -> None:
        heaps = known.heaps.get(kind)
        if heaps is None:
            return  # (built from the tables when first read)
        heapq.heappush(heaps[0], (prefilled, sid))
        heapq.heappush(heaps[1], (decoded, sid))
        if len(heaps[0]) > 4 * len(known.members[kind]) + 64:
            self._rebuild(known, kind)

    def _rebuild(self, known: _RouteState, kind: str) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
        members = known.members[kind]
        heaps = ([(self._prefilled[s], s) for s in members if s in self._prefilled],
                 [(self._decoded[s], s) for s in members if s in self._decoded])
        heapq.heapify(heaps[0])
        heapq.heapify(heaps[1])
        known.heaps[kind] = heaps
        return heaps

    def _route(self, route: RouteView) -> _RouteState:
        known = self._routes.get(route.key)
        if known is not None and known.horizon.current(route.servers):
            return known
        horizon = self._horizons.of(route)  # (groups the route's servers with room by kind)
        if route.key not in self._routes and len(self._routes) >= MAX_ROUTES:
            del self._routes[next(iter(self._routes))]
        members = {name: {s.id: s for s in kind.members} for name, kind in horizon.kinds.items()}
        known = self._routes[route.key] = _RouteState(horizon, members, {})
        return known

    def _prior(self, kind: str, members: Mapping[str, Any]) -> KindCosts:
        prior = self._priors.get(kind)
        if prior is None:
            prior = self._priors[kind] = _prior_of(next(iter(members.values())).entry)
        return prior

    def _unlearned(self, model: str, kind: str, members: Mapping[str, Any]) -> KindCosts:
        """A kind none of whose answers has priced it yet for the model: its data-sheet prior, on the scale of the
        model's learned kinds (the prior × their mean learned ÷ prior ratio). The priors are for 1 B parameters:
        unscaled beside a larger model's learned costs, a kind not heard from yet looked faster than it is, and
        took every request until its own answers came back."""
        costs = self._on_learned_scale(model, self._prior(kind, members))
        if costs.source == "scaled":
            self._costs[(model, kind)] = costs  # (until the learned scale moves: `_refit`)
        return costs

    def _on_learned_scale(self, model: str, prior: KindCosts) -> KindCosts:
        ratio = self._ratio(model)
        if ratio is None:
            return prior  # (nothing learned for the model: every kind on the priors' one scale)
        return KindCosts(prior.prefill_s * ratio[0], prior.step_s * ratio[1], "scaled")

    def _ratio(self, model: str) -> tuple[float, float] | None:
        """The model's learned kinds' mean (prefill, step) cost ÷ their priors' (None: none learned yet)."""
        prefill = step = 0.0
        n = 0
        for (m, kind), costs in self._costs.items():
            prior = self._priors.get(kind)
            if m == model and costs.source != "scaled" and prior is not None:
                prefill += costs.prefill_s / prior.prefill_s
                step += costs.step_s / prior.step_s
                n += 1
        return (prefill / n, step / n) if n else None

    def kind_costs(self, model: str, server: ServerEntry) -> KindCosts:
        """The costs a decision uses for the model on the server's kind: learned, else the prior on the learned
        scale."""
        kind = kind_key(server)
        learned = self._costs.get((model, kind))
        if learned is not None:
            return learned
        if kind not in self._priors:
            self._priors[kind] = _prior_of(server)
        return self._on_learned_scale(model, self._priors[kind])

    def _shape(self, request: InferenceRequest) -> tuple[float, float]:
        """(prompt tokens, answer tokens) expected of the request (see the module docstring)."""
        seen = self._shapes.get(request.client_id)
        if seen is not None:
            return seen
        assert self._state is not None
        shape = self._state.clients.shape(request.client_id)
        prompt = shape.prompt_tokens if shape is not None else max(1.0, request.prompt_chars() / 4.0)
        asked = request.params.max_tokens
        if asked is not None:
            return prompt, float(asked)
        return prompt, (shape.max_tokens if shape is not None and shape.max_tokens is not None
                        else DEFAULT_ANSWER_TOKENS)

    # ---- waves (federation/routing/wave.py) ---------------------------------------------------------------
    def wave_model(self, model: str, kind: str, members: Mapping[str, Any]) -> KindModel:
        costs = self._costs.get((model, kind)) or self._unlearned(model, kind, members)
        batch = max(1, next(iter(members.values())).capacity) if members else 1
        return KindModel(costs.prefill_s, costs.step_s, batch)

    def wave_prior(self, kind: str) -> tuple[float, float] | None:
        prior = self._priors.get(kind)
        return None if prior is None else (prior.prefill_s, prior.step_s)

    def wave_inflight(self) -> int:
        assert self._state is not None
        return self._state.ledger.total()

    def wave_shape(self, client: str) -> tuple[float, float] | None:
        seen = self._shapes.get(client)
        if seen is not None:
            return seen
        assert self._state is not None
        return client_size(self._state.clients.shape(client))

    def wave_key(self, client: str) -> Any:
        assert self._state is not None
        return self._state.clients.key(client)

    def wave_sent_all(self, client: str, waiting: int) -> bool:
        assert self._state is not None
        left = self._state.clients.requests_left_of(client)
        return left is not None and left <= waiting + self._state.ledger.clients.get(client, 0)

    def wave_busy(self, server_id: str) -> tuple[float, float] | None:
        if server_id not in self._decoded:
            return None
        return self._prefilled.get(server_id, self._decoded[server_id]), self._decoded[server_id]

    def wave_placed(self, context: Any, kind: str, server: Any, prefilled: float, decoded: float) -> None:
        self._prefilled[server.id] = prefilled
        self._decoded[server.id] = decoded
        self._push(context, kind, server.id, prefilled, decoded)

    # ---- learning ---------------------------------------------------------------------------------
    def observe_answer(self, client_id: str, server: ServerEntry, prompt_tokens: int | None,
                       completion_tokens: int | None, latency_s: float = 0.0, times: EngineTimes | None = None) -> None:
        if prompt_tokens is not None and completion_tokens is not None:
            seen = self._shapes.get(client_id)
            if seen is None:
                self._shapes[client_id] = (float(prompt_tokens), float(completion_tokens))
            else:
                self._shapes[client_id] = (seen[0] + SHAPE_ALPHA * (prompt_tokens - seen[0]),
                                           seen[1] + SHAPE_ALPHA * (completion_tokens - seen[1]))
        kind = kind_key(server)
        state = self._state
        if state is not None and state.ledger.on_server(server.id) == 0 and server.id in self._decoded:
            now = state.clock()  # nothing of ours there now: whatever the model still had running is done
            self._prefilled[server.id] = self._decoded[server.id] = now
            for known in self._routes.values():
                members = known.members.get(kind)
                if members is not None and server.id in members:
                    self._push(known, kind, server.id, now, now)
        if kind not in self._priors:
            self._priors[kind] = _prior_of(server)
        rows = self._rows.get((server.record.model, kind))
        if rows is None:
            rows = self._rows[(server.record.model, kind)] = _Rows()
        if times is not None:
            rows.timed.add(times.prefill_tokens if times.prefill_tokens is not None else prompt_tokens,
                           completion_tokens, times.prefill_s, times.decode_s)
        elif prompt_tokens is not None and completion_tokens is not None and latency_s > 0:
            prior = self._priors[kind]
            priced = prompt_tokens * prior.prefill_s + completion_tokens * prior.step_s
            if priced > 0:
                rows.latency.append(latency_s / priced)
        rows.answers += 1
        if rows.answers % REFIT_EVERY == 0:
            self._refit(server.record.model, kind, rows)
        if self.waves is not None and self.waves.probed(server.id):
            self.waves.measured(server.id, server.record.model, kind,
                                _alone(self._priors[kind], prompt_tokens, completion_tokens, latency_s, times))

    def _refit(self, model: str, kind: str, rows: _Rows) -> None:
        prior = self._priors.get(kind)
        if prior is None:
            return
        fitted = rows.timed.fit(prior.prefill_s, prior.step_s)
        if fitted is not None:
            self._costs[(model, kind)] = KindCosts(*fitted, "engine")
        elif rows.latency:
            factor = quantile(rows.latency, LATENCY_QUANTILE)
            self._costs[(model, kind)] = KindCosts(prior.prefill_s * factor, prior.step_s * factor, "latency")
        else:
            return
        for key in [k for k, c in self._costs.items() if k[0] == model and c.source == "scaled"]:
            del self._costs[key]  # (rescaled when next read: the learned scale moved)

    def costs(self) -> dict[tuple[str, str], KindCosts]:
        """Each (model, kind)'s costs as learned so far (a pair not here is priced at its kind's data-sheet prior, on
        the scale of the model's learned kinds: `kind_costs`)."""
        return {key: c for key, c in self._costs.items() if c.source != "scaled"}

    def describe(self) -> dict[str, Any] | None:
        out: dict[str, Any] = {"costs": {f"{m} on {k}": {"prefill_s_per_token": c.prefill_s, "step_s": c.step_s,
                                                         "source": c.source} for (m, k), c in self._costs.items()}}
        if self.waves is not None and self.waves.stats.waves:
            out["waves"] = dataclasses.asdict(self.waves.stats)
        return out

    def known(self) -> tuple[int, int]:
        """(clients, servers) the policy keeps anything for."""
        return len(self._shapes), len(self._prefilled.keys() | self._decoded.keys())

    # ---- forgetting -------------------------------------------------------------------------------
    def forget_server(self, server_id: str) -> None:
        self._prefilled.pop(server_id, None)
        self._decoded.pop(server_id, None)

    def forget_client(self, client_id: str) -> None:
        self._shapes.pop(client_id, None)
        if self.waves is not None:
            self.waves.forget_client(client_id)


def _prior_of(entry: ServerEntry) -> KindCosts:
    """A server's kind's costs by the data-sheet priors (`pricing`): prefill a token, a full batch's step."""
    return KindCosts(server_cost(entry).prefill_s_per_token, step_cost(entry, max(1, entry.capacity)), "prior")


def _alone(prior: KindCosts, prompt_tokens: int | None, completion_tokens: int | None, latency_s: float,
           times: EngineTimes | None) -> tuple[float, float] | None:
    """(prefill seconds a prompt token, a step's seconds) from one answer that had its server alone (a wave's
    probe): its engine times as `EngineTimedCosts` reads them, else its latency against its priced time scaling
    the priors (None: it tells neither)."""
    if times is not None:
        one = EngineTimedCosts()
        one.add(times.prefill_tokens if times.prefill_tokens is not None else prompt_tokens, completion_tokens,
                times.prefill_s, times.decode_s)
        if one.prefill and one.decode:
            return one.prefill[0], one.decode[0]
    if prompt_tokens is None or completion_tokens is None or latency_s <= 0:
        return None
    priced = prompt_tokens * prior.prefill_s + completion_tokens * prior.step_s
    return None if priced <= 0 else (prior.prefill_s * latency_s / priced, prior.step_s * latency_s / priced)

