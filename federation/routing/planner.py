"""Planned routing (policy `planned`): which client's requests go to which servers, from a min-makespan plan.

Why: evals differ in shape (long compute-bound prompts against long decode chains), a prompt chunk slows every
sequence decoding beside it, and accelerators differ more in prefill than in decode; spreading every eval over
every server in proportion to capacity ignores both.

What. Every `period_s` the policy makes each route's plan (`plans`, `plan_lp`): each client's unsent requests
split over server kinds at the least makespan, priced by `pricing`. A client's request is then placed only on a
server of its plan (the kind with the most of its quota left, at the pace of the others planned there), and held
while those are full (a later plan may move it). Shapes are learned per client from the answers' usage, with the
client's announced or guessed shape (`ClientBook`) until then; in-flight counts and busy time are the dispatcher's
ledger. No I/O.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedpool.federation.core.clientbook import DEFAULT_ANSWER_TOKENS
from fedpool.federation.core.policy import DispatchState, Hold, Policy, PolicyHooks, RouteView, S
from fedpool.federation.core.types import EngineTimes, InferenceRequest
from fedpool.federation.routing.finish import RECHECK_S, EarliestFinish
from fedpool.federation.routing.plan_lp import MIN_SHARE, preload_solver
from fedpool.federation.routing.plans import (
    Plan,
    RoutePlan,
    due_kinds,
    held_work,
    kind_columns,
    kind_paces,
    make_plan,
)
from fedpool.federation.routing.pricing import CostFit, ServerCost, SpeedCalibration, kind_key
from fedpool.registry import ServerEntry

log = logging.getLogger("fedpool.planner")

MAX_ROUTE_PLANS = 64  # routes planned at once (a gateway's callers pick models and revisions at will)
PICK_SAMPLE = 16  # servers with room of one kind a pick compares


@dataclass(slots=True)
class _Shape:
    """Running sums of one client's answered prompt and completion tokens."""
    prompt_sum: float = 0.0
    completion_sum: float = 0.0
    answered: int = 0


_NO_TRIED: set[str] = set()


def _kind_of_state(server: Any) -> str:
    """The plan's column for a server with room (a route's ServerState): `kind_key` of its registry entry."""
    return kind_key(server.entry)


class PlannedRouting(Policy, name="planned"):
    """Routes by the plan; the dispatcher tells it, through the ledger and the client book, what it sends. The
    plan makes every server kind finish together, so the tail's hedging and stealing are off under it (they moved
    and copied requests against the plan)."""


    def __init__(self, rng: random.Random | None = None, *, period_s: float = 1.0, warmup_periods: float = 5.0,
                 makespan_slack: float = 0.02, long_answer_tokens: float | None = 128.0,
                 long_prompt_tokens: float = 512.0, calibrate: bool = True, calibration_answers: int = 20,
                 pick: str = "quota"):
        super().__init__(rng)
        if pick not in ("quota", "finish"):
            raise ValueError(f"planned: pick must be 'quota' or 'finish', not {pick!r}")
        # Within a client's planned kinds, which server: "quota" — the kind with the most of its quota left, the
        # server with the least priced work there; "finish" — where `earliest_finish`'s engine model answers it
        # soonest (and its hold rules: it waits for a far better full server, or a server's prompt backlog).
        self._finish = EarliestFinish(self._rng, horizon=False) if pick == "finish" else None
        self.period_s = period_s
        # The first plan waits (at most warmup_s after the first request) for every client that said how
        # much it has to say its shape or send: a plan made for the first client alone hands it every server.
        self.warmup_s = warmup_periods * period_s
        self.makespan_slack = makespan_slack
        # Interference: a server running long answers (mean ≥ long_answer_tokens) takes no long prompts
        # (≥ long_prompt_tokens) until they drain; the prompts wait for their other planned servers. None: off.
        self.long_answer_tokens = long_answer_tokens
        self.long_prompt_tokens = long_prompt_tokens
        self._calibrate = calibrate
        self._calibration_answers = calibration_answers
        self._state: DispatchState | None = None
        self._speed: SpeedCalibration | None = None
        self._fit: CostFit | None = None
        self._shapes: dict[str, _Shape] = {}
        self._routes: dict[object, RoutePlan] = {}  # one plan per route (model, revision, pins)
        self._placed: set[str] = set()  # clients that have sent on some route
        # Interference, by shape: clients whose prompts are long, and those whose answers are (kept current at
        # each plan and answer, so a pick reads a set, not a shape).
        self._long_prompts: set[str] = set()
        self._long_answers: set[str] = set()
        self._plan: Plan | None = None  # the newest plan made (for describe)
        self._first_place_at: float | None = None
        self.plans_made = 0
        self.solve_s = 0.0  # CPU seconds spent making plans off the grant path

    @classmethod
    def prepare(cls) -> None:
        preload_solver()

    def attach(self, state: DispatchState) -> PolicyHooks:
        self._state = state
        self.prepare()  # (the first plan is made on the grant path: the solver is imported by then)
        if self._finish is not None:
            self._finish.attach(state)
        self._speed = SpeedCalibration(state.ledger, state.clock, tau_s=20 * self.period_s,
                                       min_answers=self._calibration_answers, enabled=self._calibrate)
        self._fit = CostFit(state.ledger, state.clock, tau_s=20 * self.period_s, enabled=self._calibrate)
        # The plan makes every kind finish together: no copies at the tail (they would run against it).
        return PolicyHooks(on_answer=self.observe_answer, recheck_s=self.recheck_s, forget_client=self.forget_client,
                           forget_server=self.forget_server, plans_the_tail=True, describe=self.describe)

    @property
    def _st(self) -> DispatchState:
        assert self._state is not None, "a planned policy is used by a dispatcher (attach)"
        return self._state

    # ---- the policy interface ----------------------------------------------------------------------
    def place(self, route: RouteView[S], request: InferenceRequest, tried: set[str]) -> S | Hold:
        now = self._st.clock()
        if self._first_place_at is None:
            self._first_place_at = now
        servers = route.servers
        if not servers:
            return Hold.ROUTE_FULL
        if self._plan is None and self.warming_up():
            return Hold.CLIENT_HELD
        client_id = request.client_id
        if self._st.clients.before_background(client_id):
            return self._foreground(route, request, tried)
        plans = self._routes.get(route.key) or self._route_plan(route)
        plans.route = route
        if client_id not in plans.clients:
            plans.clients.add(client_id)
            self._placed.add(client_id)
        plan = self._kept_plan(plans, servers)
        if plan is None:
            plan = self._current_plan(plans, servers, client_id, now)  # nothing to follow yet: now
        elif now - plan.made_at >= self.period_s or (client_id not in plan.quotas and not plans.replanning):
            # Made again off the grant path (the LP runs in a callback of its own, at most once a period per
            # route); until then the plan in hand is followed, and a client it does not cover waits for it.
            self._replan_soon(plans, servers, client_id)
        quotas = plan.kind_quotas.get(client_id)
        if not quotas:
            return Hold.CLIENT_HELD
        if self._finish is not None:
            placed = self._finish.place_within(route, request, tried,
                                               tuple(k for k, q in quotas.items() if q > MIN_SHARE))
            if not isinstance(placed, Hold) and (kind := plan.kind_of.get(placed.id)) is not None:
                plans.sent.setdefault(client_id, Counter())[kind] += 1
            return placed
        route.group_by(_kind_of_state)  # (the route keeps its servers with room by kind: picks and paces read it)
        due = self._due(client_id, plans, quotas, route)
        pick = self._pick(client_id, plans, due, route, tried, avoid_tried=True) if due else None
        if pick is None and tried and due:
            pick = self._pick(client_id, plans, due, route, tried, avoid_tried=False)
        if pick is None:  # held for its planned servers (which are full); other clients may go on
            kinds = tuple(k for k, q in quotas.items() if q > MIN_SHARE)
            if not any(route.free_in(k) for k in kinds):  # out of the grant passes until one has room
                route.park(client_id, kinds, self._st.clients.key(client_id))
            return Hold.CLIENT_HELD
        plans.sent.setdefault(client_id, Counter())[plan.kind_of[pick.id]] += 1
        route.memo.clear()  # the pick may have filled its server
        return pick

    @staticmethod
    def _kept_plan(plans: RoutePlan, servers: Sequence[Any]) -> Plan | None:
        """The route's plan, unless a new snapshot changed its servers: a rebuilt list of the same servers keeps
        it (new scrapes every probe cycle must not re-solve it on the grant path); other servers need one now."""
        plan = plans.plan
        if servers is not plans.servers_ref and plan is not None:
            if tuple(sorted(s.id for s in servers)) == plans.servers_key:
                plans.servers_ref = servers
            else:
                plans.plan = plan = None
        return plan

    def _foreground(self, route: RouteView[S], request: InferenceRequest, tried: set[str]) -> S | Hold:
        """An online caller beside background batches is neither planned nor paced (a plan paces each client to
        end with the others: its one request went out at the batches' end): the server its request finishes on
        soonest (`pick="finish"`), else the least expected wait among those with room. Its slot comes first (the
        client order) and its answers still teach the plan's costs."""
        if self._finish is not None:
            return self._finish.place(route, request, tried)
        free = route.free_candidates(PICK_SAMPLE, tried, self._rng) or route.free_candidates(PICK_SAMPLE, set(),
                                                                                              self._rng)
        return min(free, key=lambda s: s.expected_wait) if free else Hold.ROUTE_FULL

    def observe_answer(self, client_id: str, server: ServerEntry, prompt_tokens: int | None,
                       completion_tokens: int | None, latency_s: float = 0.0, times: EngineTimes | None = None) -> None:
        if self._finish is not None:
            self._finish.observe_answer(client_id, server, prompt_tokens, completion_tokens, latency_s, times)
        if prompt_tokens is None or completion_tokens is None:
            return
        shape = self._shapes.setdefault(client_id, _Shape())
        shape.prompt_sum += prompt_tokens
        shape.completion_sum += completion_tokens
        shape.answered += 1
        self._classify(client_id)
        if self._speed is not None and self._fit is not None:
            self._speed.observe(server, prompt_tokens, completion_tokens)
            self._fit.observe(server, kind_key(server), prompt_tokens, completion_tokens)

    def recheck_s(self) -> float | None:
        """Quotas move with time (a new plan every period), and the first plan waits for the warm-up."""
        if self.warming_up():
            return min(self.wait_s() + 1e-3, self.period_s / 5)
        return self.period_s / 2 if self._finish is None else min(self.period_s / 2, RECHECK_S)

    def describe(self) -> dict[str, Any] | None:
        """The current plan (client -> server -> requests to send there) and the fitted speed factor per server
        kind (busy seconds per prior-priced second)."""
        if self._plan is None:
            return None
        fitted = self._fit.fitted_kinds() if self._fit is not None else {}
        described: dict[str, Any] = {
            "plans_made": self.plans_made,
            "quotas": {c: {s: round(n, 1) for s, n in q.items()} for c, q in self._plan.quotas.items()},
            "fitted": {k: round(f, 3) for k, f in fitted.items()}}
        if self._finish is not None:
            described["finish"] = (self._finish.describe() or {}).get("costs", {})
        return described

    # ---- shapes and state ---------------------------------------------------------------------------
    def shape(self, client_id: str) -> tuple[float, float] | None:
        """(prompt tokens, completion tokens) expected per request: answered means, else the book's prior."""
        learned = self._shapes.get(client_id)
        if learned is not None and learned.answered:
            return learned.prompt_sum / learned.answered, learned.completion_sum / learned.answered
        prior = self._st.clients.shape(client_id)
        if prior is None:
            return None
        answer = max(1.0, 0.75 * prior.max_tokens) if prior.max_tokens else DEFAULT_ANSWER_TOKENS
        return prior.prompt_tokens, answer

    def plan(self) -> Plan | None:
        return self._plan

    def warming_up(self) -> bool:
        if self._plan is not None or self.wait_s() <= 0:
            return False
        return any(n > 0 and self.shape(c) is None for c, n in self._st.clients.requests_left().items())

    def wait_s(self) -> float:
        """Seconds until the first plan may be made (0 once it may)."""
        if self._first_place_at is None:
            return 0.0
        return max(0.0, self._first_place_at + self.warmup_s - self._st.clock())

    # ---- following the plan -------------------------------------------------------------------------
    def _pick(self, client_id: str, plans: RoutePlan, quotas: Mapping[str, float], route: RouteView,
              tried: set[str], *, avoid_tried: bool) -> Any:
        """A server with room of the kind with the most of this client's quota left (the one with the least priced
        work among a sample of that kind's servers with room), not one whose long answers its long prompts would
        stall. The route keeps its servers with room by kind (`group_by`), so a pick costs O(kinds + sample),
        whatever the pool's size, and a client whose kinds are all full is held at once."""
        with_room = [k for k, q in quotas.items() if q > MIN_SHARE and route.free_in(k)]
        if not with_room:
            return None  # every kind of its plan is full: held (the common answer in a full pool, so cheap)
        pool: list[Any] = []
        for kind in with_room:
            free = route.free_in(kind)
            if avoid_tried and tried:
                free = [s for s in free if s.id not in tried]
            pool.extend(free if len(free) <= PICK_SAMPLE else self._rng.sample(free, PICK_SAMPLE))
        return self._best(client_id, plans, quotas, pool, route.memo)

    def _due(self, client_id: str, plans: RoutePlan, quotas: Mapping[str, float],
             route: RouteView) -> Mapping[str, float]:
        """The client's planned kinds where it is not ahead of its plan's pace: a kind's slots go to the waiting
        clients planned on it in proportion to their quotas there (the one whose next request there is the
        smallest share of its quota goes first), not in the client order alone, so that a plan giving a kind many
        of one client's quick prompts beside another's few long ones is carried out. Outside the pace (neither
        held nor holding): clients with long answers (paced, their last long chains started last and ended after
        everything else) and open-ended callers (`ClientBook.open_ended`: their quota is what they have waiting,
        so one sending a request at a time waited plan after plan: 78 s for a 16-token probe beside SDK clients)."""
        if client_id in self._long_answers or self._st.clients.open_ended(client_id):
            return quotas
        plan = plans.plan
        assert plan is not None
        memo = route.memo
        paces = memo.get("pace")
        if paces is None:
            paces = memo["pace"] = self._paces(plans, plan, route)
        return due_kinds(quotas, plans.sent.get(client_id), paces)

    def _paces(self, plans: RoutePlan, plan: Plan, route: RouteView) -> dict[str, float]:
        """Kind -> its pace (`plans.kind_paces`). Clients whose long prompts the interference rule may hold set no
        pace (a slot they cannot take would stay empty), nor do those outside it (`_due`)."""
        book, long_answers = self._st.clients, self._long_answers
        return kind_paces(plan, plans.sent, lambda c: bool(book.waiting.get(c)) and not self._stalls(c)
                          and c not in long_answers and not book.open_ended(c), route.free_in)

    def _best(self, client_id: str, plans: RoutePlan, quotas: Mapping[str, float], servers: Sequence[Any],
              memo: dict[str, Any]) -> Any:
        plan = plans.plan
        assert plan is not None
        sent = plans.sent.get(client_id)
        # Whether long answers decode on a server, found once per server and pass (for long prompts only).
        busy: dict[str, bool] | None = memo.setdefault("busy", {}) if self._stalls(client_id) else None
        best, best_key = None, (float("inf"), float("inf"))
        for server in servers:
            kind = plan.kind_of.get(server.id)
            if kind is None:
                continue
            quota = quotas.get(kind, 0.0)
            if quota <= MIN_SHARE:
                continue
            key = ((sent.get(kind, 0) if sent else 0) / quota, self._work(server.id, kind, plan, memo))
            if key >= best_key:
                continue
            if busy is not None:
                stalls = busy.get(server.id)
                if stalls is None:
                    stalls = busy[server.id] = self._runs_long_answers(client_id, server.id)
                if stalls:
                    continue
            best, best_key = server, key
        return best

    def _work(self, server_id: str, kind: str, plan: Plan, memo: dict[str, Any]) -> float:
        """The priced work in flight on the server (its clients' requests at their prices on its kind), once per
        server and pass: within a kind, the server with the least goes first (counting requests instead put one
        client's long prompts on one replica and another's short answers on its twin)."""
        works = memo.setdefault("work", {})
        work = works.get(server_id)
        if work is None:
            work = 0.0
            for client, n in self._st.ledger.clients_on(server_id).items():
                work += n * plan.cost.get((client, kind), 0.0)
            works[server_id] = work
        return work

    def _stalls(self, client_id: str) -> bool:
        """Whether the client's prompts are long and its answers short (a prefill-heavy eval: video, documents),
        the prompts the interference rule keeps off servers decoding long answers. A client whose own answers are
        long is not held by it: its requests are the run's longest chains, and holding them until the other long
        answers drained put them at the run's end, while their prefill costs the answers beside them little."""
        return client_id in self._long_prompts and client_id not in self._long_answers

    def _runs_long_answers(self, client_id: str, server_id: str) -> bool:
        """Whether long answers of another client decode on the server (a long prompt there would stall them)."""
        for other in self._st.ledger.clients_on(server_id):
            if other != client_id and other in self._long_answers:
                return True
        return False

    def _interferes(self, client_id: str, server_id: str) -> bool:
        """Would this client's long prompts stall long answers running on the server? (From the shapes as they
        are now; picks read the sets as the last plan or answer left them.)"""
        for client in (client_id, *self._st.ledger.clients_on(server_id)):
            self._classify(client)
        return self._stalls(client_id) and self._runs_long_answers(client_id, server_id)

    def _classify(self, client_id: str) -> None:
        """Keep the client's place in the long-prompt and long-answer sets current with its shape."""
        shape = self.shape(client_id) if self.long_answer_tokens is not None else None
        for members, long in ((self._long_prompts, shape is not None and shape[0] >= self.long_prompt_tokens),
                              (self._long_answers, shape is not None and self.long_answer_tokens is not None
                               and shape[1] >= self.long_answer_tokens)):
            if long:
                members.add(client_id)
            else:
                members.discard(client_id)

    # ---- making the plan ----------------------------------------------------------------------------
    def _route_plan(self, route: RouteView) -> RoutePlan:
        plans = self._routes.get(route.key)
        if plans is None:
            if len(self._routes) >= MAX_ROUTE_PLANS:  # the route planned longest ago gives way
                oldest = min(self._routes, key=lambda k: self._routes[k].made_at)
                del self._routes[oldest]
            plans = self._routes[route.key] = RoutePlan()
        return plans

    def _replan_soon(self, plans: RoutePlan, servers: Sequence[Any], client_id: str) -> None:
        if plans.replanning:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test driving the policy by hand): at once
            self._current_plan(plans, servers, client_id, self._st.clock())
            return
        plans.replanning = True

        def replan() -> None:
            plans.replanning = False
            began = time.process_time()
            self._current_plan(plans, plans.servers_ref or servers, client_id, self._st.clock())
            self.solve_s += time.process_time() - began
            if plans.route is not None:  # new quotas: every held client is looked at again
                plans.route.unpark_all()

        loop.call_soon(replan)

    def _current_plan(self, plans: RoutePlan, servers: Sequence[Any], client_id: str, now: float) -> Plan:
        """The route's plan, made again when a period has passed, its servers changed or a client it does not
        cover has a shape: at most once per period per route, whatever other routes do."""
        if servers is not plans.servers_ref:  # the dispatcher keeps one list per route and snapshot
            key = tuple(sorted(s.id for s in servers))
            if key != plans.servers_key:
                plans.plan = None
            plans.servers_key, plans.servers_ref = key, servers
        plan = plans.plan
        newcomer = plan is not None and client_id not in plan.quotas and self.shape(client_id) is not None
        if plan is None or now - plan.made_at >= self.period_s or newcomer:
            plan = plans.plan = self._plan = self._solve(servers, plans.clients, now)
            plans.made_at = now
            plans.sent = {}
            self.plans_made += 1
            log.debug("plan %d: %s", self.plans_made, plan.kind_quotas)
        return plan

    def _unsent(self, clients: set[str]) -> dict[str, int]:
        """Requests each of the route's clients has not sent yet: what it said it has left less what is in
        flight, and at least what it has waiting (a client that said nothing: what it has waiting). A client
        that has sent nowhere yet counts on every route (it will send on one of them)."""
        left, waiting, ledger = self._st.clients.requests_left(), self._st.clients.waiting, self._st.ledger
        out = {}
        for cid in clients | {c for c in left if c not in self._placed}:
            n = max(left[cid] - ledger.of_client(cid) if cid in left else 0, waiting.get(cid, 0))
            if n > 0:
                out[cid] = n
        return out

    def _solve(self, route: Sequence[Any], route_clients: set[str], now: float) -> Plan:
        """A new plan for the route's servers and its clients' unsent requests (`plans.make_plan`)."""
        unsent = self._unsent(route_clients)
        shapes = {c: s for c in unsent if (s := self.shape(c)) is not None}
        clients = sorted(shapes)
        for client in clients:
            self._classify(client)
        # Only servers taking requests: one without a window (no lease there, tripped) planned as capacity held a
        # client for it while the others ran (a small batch planned onto V100s its gateway held no lease on waited
        # for ever, and the grant pass took slots for it from the others at every turn).
        servers = [s for s in route if s.window > 0]
        if not clients or not servers:
            return Plan(now, 0.0, {})  # nothing to plan: every client waits for the next plan
        assert self._speed is not None
        columns = kind_columns(servers)
        speed = self._speed.factors([s.entry for s in servers])
        kind_cost = self._kind_costs(columns)
        # What the kinds hold now counts: a kind busy for seconds with long answers is not free capacity for the
        # unsent work.
        held = held_work(columns, shapes, kind_cost, self._st.ledger.clients_on, self.shape)
        book = self._st.clients
        phase_key = None if book.order == "fair" else (lambda c: (book.first(c), c))
        return make_plan(now, columns, {c: unsent[c] for c in clients}, shapes, kind_cost, held, speed, phase_key,
                         self.makespan_slack)

    def _kind_costs(self, columns: Mapping[str, Sequence[Any]]) -> dict[str, ServerCost]:
        """Each kind's cost per request: fitted from its members' answers (`CostFit`, the data sheet's prior until
        then), or with `pick="finish"` the costs its picks use, once learned from answers."""
        assert self._fit is not None
        kind_cost = self._fit.costs({col: [s.entry for s in members] for col, members in columns.items()})
        if self._finish is not None:  # (learned from the answers' engine times or latencies)
            model = next(iter(columns.values()))[0].entry.record.model
            timed = {col: self._finish.kind_costs(model, members[0].entry) for col, members in columns.items()}
            if any(c.source != "prior" and c.source != "scaled" for c in timed.values()):
                kind_cost = {col: ServerCost(c.prefill_s, c.step_s / max(1, columns[col][0].capacity))
                             for col, c in timed.items()}
        return kind_cost

    # ---- bounded state --------------------------------------------------------------------------------
    def forget_server(self, server_id: str) -> None:
        if self._finish is not None:
            self._finish.forget_server(server_id)

    def forget_client(self, client_id: str) -> None:
        if self._finish is not None:
            self._finish.forget_client(client_id)
        self._shapes.pop(client_id, None)
        self._placed.discard(client_id)
        self._long_prompts.discard(client_id)
        self._long_answers.discard(client_id)
        for plans in self._routes.values():
            plans.clients.discard(client_id)
            plans.sent.pop(client_id, None)


class PlannedFinish(PlannedRouting, name="planned_finish"):
    """`planned` choosing the server by `earliest_finish`'s engine model (`pick="finish"`): the plan decides which
    kinds each client uses (comparative advantage: prompt-heavy evals where prefill is fastest, long answers where
    they may run), the model which server of them answers each request soonest."""

    def __init__(self, rng: random.Random | None = None, **options: Any):
        options.setdefault("pick", "finish")
        super().__init__(rng, **options)
