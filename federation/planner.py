"""Planned routing: which client's requests go to which servers, from a min-makespan linear program.

Why. Evals differ in shape: image and video prompts are thousands of tokens of compute-bound prefill
with a word or two back; chain-of-thought text is a short prompt and hundreds of decode steps. On a
continuous-batching engine with chunked prefill, every step that carries a prompt chunk is a slow step
for every sequence decoding beside it, so a long answer on a server flooded with prompts advances one
token per prefill step and becomes the run's straggler. And accelerators differ more in prefill
(compute) than in decode (bandwidth): an A100 prefills 3.1× as fast as a V100 but decodes only 2.4× as
fast. Spreading every eval over every server in proportion to capacity ignores both.

What. Every `period_s` the planner solves: minimise T subject to each client's unsent requests placed
(x[c, s] ≥ 0, Σ_s x[c, s] = unsent[c]) and each server's share of that work at most T (servers of one
kind are one column, weighted by their measured speeds). A request's cost on a server is its prefill
tokens ÷ the server's prefill rate plus its answer tokens × the server's decode cost per token at full
batch (rates from the accelerator's data sheet: dense fp16 TFLOPS and HBM bandwidth, × GPUs). The
solution is a vertex: each client lands on few servers, and decode-heavy clients end up apart from
prefill-heavy ones — the split the engines reward. The dispatcher then grants a client's request only on
a server of its plan (the kind with the most plan quota left, round-robin within it); when those are
full the request waits for them (a later plan may move it).

Shapes are learned per client from the answers' usage (prompt and completion tokens), with a prior from
the request itself (characters ÷ 4, max_tokens) until the first answer. Pure: no I/O, clock injected.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fedpool.registry import ServerEntry, accelerator_roofline

log = logging.getLogger("fedpool.planner")

PREFILL_MFU = 0.5  # share of peak tensor FLOPS a prefill reaches (long prompts, bf16)
DECODE_BW_EFFICIENCY = 0.75  # share of peak HBM bandwidth a decode step reaches
FULL_BATCH_STEP_FACTOR = 2.0  # a step at full batch costs about twice a batch-of-one step (KV reads, MLP)
CHARS_PER_TOKEN = 4.0  # prior for a prompt's tokens before any answer reported usage
MIN_SHARE = 1e-6
MAX_PHASE_VARIABLES = 20_000  # clients² × server kinds above which only the makespan plan is made


@dataclass(frozen=True, slots=True)
class ServerCost:
    """Seconds per token for a nominal model of 1 B parameters (the unit cancels in the plan)."""

    prefill_s_per_token: float
    decode_s_per_token: float  # per generated token when the batch is full

    def of(self, prompt_tokens: float, completion_tokens: float) -> float:
        return prompt_tokens * self.prefill_s_per_token + completion_tokens * self.decode_s_per_token


def server_cost(entry: ServerEntry) -> ServerCost:
    """Roofline costs from the accelerator's data sheet: prefill is compute-bound (2 FLOP per parameter
    per token), a decode step reads the weights once (2 bytes per parameter) for the whole batch."""
    tflops, hbm_tbs = accelerator_roofline(entry.record.accelerator)
    gpus = max(1, entry.record.gpu_count)
    flops = 2e9  # per token, 1 B parameters
    weight_bytes = 2e9
    prefill = flops / (tflops * 1e12 * PREFILL_MFU * gpus)
    step = weight_bytes / (hbm_tbs * 1e12 * DECODE_BW_EFFICIENCY * gpus)
    batch = max(1, entry.capacity)
    return ServerCost(prefill, step * FULL_BATCH_STEP_FACTOR / batch)


@dataclass(slots=True)
class _Shape:
    """Running means of one client's prompt and completion tokens (prior until the first answer)."""

    prior_prompt: float = 0.0
    prior_completion: float = 0.0
    prompt_sum: float = 0.0
    completion_sum: float = 0.0
    answered: int = 0
    announced: bool = False  # the prior came from the client itself (set_client_shape)

    @property
    def prompt(self) -> float:
        return self.prompt_sum / self.answered if self.answered else self.prior_prompt

    @property
    def completion(self) -> float:
        return self.completion_sum / self.answered if self.answered else self.prior_completion


@dataclass(slots=True)
class _Speed:
    """How fast a server really works, against its roofline price: priced work of the requests it answered
    ÷ the time it had requests in flight, both decaying with time constant `tau_s`. The data sheet gives
    ratios an engine does not reach (kernels, KV limits, chunking); this corrects them from what is seen."""

    tau_s: float
    work: float = 0.0
    busy_s: float = 0.0
    answered: int = 0
    _busy_since: float | None = None
    _at: float | None = None

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            keep = math.exp(-(now - self._at) / self.tau_s)
            if self._busy_since is not None:
                self.busy_s += now - self._busy_since
                self._busy_since = now
            self.work *= keep
            self.busy_s *= keep
        self._at = now

    def sync(self, now: float, inflight: int) -> None:
        """The server's requests in flight changed to `inflight`: busy time runs while it is above zero."""
        self._decay(now)
        if inflight > 0 and self._busy_since is None:
            self._busy_since = now
        elif inflight <= 0 and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def answered_work(self, now: float, work: float) -> None:
        self._decay(now)
        self.work += work
        self.answered += 1

    def factor(self, now: float, min_answers: int) -> float | None:
        self._decay(now)
        if self.answered < min_answers or self.busy_s <= 0 or self.work <= 0:
            return None
        return self.work / self.busy_s


@dataclass(frozen=True, slots=True)
class Plan:
    made_at: float
    makespan: float  # nominal seconds (ServerCost units)
    quotas: Mapping[str, Mapping[str, float]]  # client -> server -> requests to send there
    kind_quotas: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # client -> kind -> requests
    members: Mapping[str, Sequence[ServerEntry]] = field(default_factory=dict)  # kind -> its servers
    kind_of: Mapping[str, str] = field(default_factory=dict)  # server id -> kind


@dataclass
class Planner:
    """Makes and follows the plan. The dispatcher tells it what it sends and what comes back."""

    clock: Callable[[], float]
    period_s: float = 1.0
    # Clients in this order finish one after another ("phases"), at no more than makespan_slack over the
    # shortest makespan; None: one phase, every client ends with the makespan.
    order: Callable[[str], float] | None = None
    makespan_slack: float = 0.02
    _shapes: dict[str, _Shape] = field(default_factory=dict)
    _remaining: dict[str, int] = field(default_factory=dict)  # client -> requests not yet answered
    _inflight: Counter[str] = field(default_factory=Counter)  # client -> requests on servers
    _on_server: dict[str, Counter[str]] = field(default_factory=dict)  # server -> client -> in flight there
    _sent: dict[str, Counter[str]] = field(default_factory=dict)  # since the plan: client -> kind -> n
    _cursor: dict[tuple[str, str], int] = field(default_factory=dict)  # round-robin position per client, kind
    _route_ref: Sequence[ServerEntry] | None = None
    # The first plan waits (at most warmup_s after the first request) for every client that said how much
    # it has to send its first request: a plan made for the first client alone would hand it every server.
    warmup_s: float = 0.5
    _plan: Plan | None = None
    _first_request_at: float | None = None
    _servers_key: tuple[str, ...] = ()
    plans_made: int = 0
    # Interference: a chunked-prefill step carrying a long prompt is a slow step for every sequence decoding
    # beside it, so a long answer co-located with a stream of long prompts advances one token per prompt
    # chunk. A server running long answers (mean ≥ long_answer_tokens) takes no long prompts
    # (≥ long_prompt_tokens) until they drain; the prompts wait for their other planned servers. None: off.
    long_answer_tokens: float | None = 128.0
    long_prompt_tokens: float = 512.0
    # What servers already hold is not priced into the plan: a server holding a long queue made every plan
    # degenerate (it fixed T, and the LP put all unsent work of a client on any one server that stayed under
    # it while the rest idled). The admission windows keep a loaded server from taking more; the plan splits
    # the unsent work by rate.
    calibrate: bool = True  # correct each server's roofline price by the speed it shows (see _Speed)
    calibration_answers: int = 20  # answers a server needs before its own speed is trusted
    _speed: dict[str, _Speed] = field(default_factory=dict)

    # ---- what the dispatcher reports ---------------------------------------------------------------
    def set_remaining(self, client_id: str, requests: int) -> None:
        self._remaining[client_id] = max(0, requests)

    def note_prior(self, client_id: str, prompt_tokens: float, max_tokens: float | None) -> None:
        """What the client says it will send (prompt tokens, answer budget), before it sends."""
        shape = self._shapes.setdefault(client_id, _Shape())
        shape.prior_prompt = max(1.0, prompt_tokens)
        shape.prior_completion = max(1.0, 0.75 * max_tokens) if max_tokens else 256.0
        shape.announced = True

    def note_request(self, client_id: str, prompt_chars: int, max_tokens: float | None) -> None:
        if self._first_request_at is None:
            self._first_request_at = self.clock()
        shape = self._shapes.setdefault(client_id, _Shape())
        if not shape.answered and not shape.announced:
            shape.prior_prompt = max(1.0, prompt_chars / CHARS_PER_TOKEN)
            shape.prior_completion = max(1.0, 0.75 * max_tokens) if max_tokens else 256.0

    def note_answer(self, client_id: str, server: ServerEntry, prompt_tokens: int | None,
                    completion_tokens: int | None) -> None:
        shape = self._shapes.setdefault(client_id, _Shape())
        if prompt_tokens is None or completion_tokens is None:
            return
        shape.prompt_sum += prompt_tokens
        shape.completion_sum += completion_tokens
        shape.answered += 1
        self._speed_of(server.id).answered_work(self.clock(), server_cost(server).of(prompt_tokens, completion_tokens))

    def _speed_of(self, server_id: str) -> _Speed:
        speed = self._speed.get(server_id)
        if speed is None:
            speed = self._speed[server_id] = _Speed(tau_s=20 * self.period_s)
        return speed

    def speed_factors(self, servers: Sequence[ServerEntry]) -> dict[str, float]:
        """Each server's price divisor: its measured speed against the roofline, relative to the others;
        servers not measured yet get the mean of those that are (1.0 when none is)."""
        now = self.clock()
        known = {s.id: f for s in servers
                 if self.calibrate and (f := self._speed_of(s.id).factor(now, self.calibration_answers)) is not None}
        mean = sum(known.values()) / len(known) if known else 1.0
        return {s.id: known.get(s.id, mean) / mean for s in servers}

    def on_sent(self, client_id: str, server_id: str) -> None:
        self._inflight[client_id] += 1
        kind = self._plan.kind_of.get(server_id) if self._plan is not None else None
        if kind is not None:
            self._sent.setdefault(client_id, Counter())[kind] += 1
        self._on_server.setdefault(server_id, Counter())[client_id] += 1
        self._speed_of(server_id).sync(self.clock(), sum(self._on_server[server_id].values()))

    def on_done(self, client_id: str, server_id: str) -> None:
        self._inflight[client_id] -= 1
        if self._inflight[client_id] <= 0:
            del self._inflight[client_id]
        there = self._on_server.get(server_id)
        if there is not None:
            there[client_id] -= 1
            if there[client_id] <= 0:
                del there[client_id]
        self._speed_of(server_id).sync(self.clock(), sum(there.values()) if there else 0)

    # ---- routing -----------------------------------------------------------------------------------
    def pick(self, client_id: str, route: Sequence[ServerEntry], waiting: Mapping[str, int],
             usable: Callable[[ServerEntry], bool], full: set[str] | None = None) -> ServerEntry | None:
        """A server of this client's plan that is `usable` (a free slot, breaker closed, not tried), from the
        kind with the most of the client's quota left, round-robin within the kind; None: its planned
        servers are full, so the request waits for them. `waiting` counts each client's queued requests.
        Costs O(kinds + servers looked at), not O(pool): a kind's scan stops at its first usable server, and
        a kind found with no usable server is added to `full` (the caller's, for one grant pass) and skipped
        by later picks of the pass."""
        if self.warming_up():
            return None
        plan = self._current_plan(route, waiting, client_id)
        quotas = plan.kind_quotas.get(client_id)
        if not quotas:
            return None
        sent = self._sent.get(client_id, Counter())
        kinds = sorted((k for k, q in quotas.items() if q > MIN_SHARE),
                       key=lambda k: (sent.get(k, 0) - quotas[k]) / quotas[k])  # most quota left first
        for kind in kinds:
            if full is not None and (kind in full or (f"{kind}\0long" in full and self._long_prompt(client_id))):
                continue
            members = plan.members[kind]
            start = self._cursor.get((client_id, kind), 0)
            for i in range(len(members)):
                server = members[(start + i) % len(members)]
                if usable(server) and not self._interferes(client_id, server.id):
                    self._cursor[client_id, kind] = (start + i + 1) % len(members)
                    return server
            if full is not None:
                # Nothing here for this client in this pass: for a long-prompt client that may be the rule
                # below, so only long-prompt clients skip the kind from now on; for others it is full.
                full.add(kind if not self._long_prompt(client_id) else f"{kind}\0long")
        return None

    def _long_prompt(self, client_id: str) -> bool:
        shape = self._shapes.get(client_id)
        return self.long_answer_tokens is not None and shape is not None and shape.prompt >= self.long_prompt_tokens

    def _interferes(self, client_id: str, server_id: str) -> bool:
        """Would this client's long prompts stall long answers running on the server?"""
        if self.long_answer_tokens is None:
            return False
        shape = self._shapes.get(client_id)
        if shape is None or shape.prompt < self.long_prompt_tokens:
            return False
        for other, n in self._on_server.get(server_id, Counter()).items():
            theirs = self._shapes.get(other)
            if n > 0 and other != client_id and theirs is not None and theirs.completion >= self.long_answer_tokens:
                return True
        return False

    def plan(self) -> Plan | None:
        return self._plan

    def warming_up(self) -> bool:
        if self._plan is not None or self.wait_s() <= 0:
            return False
        return any(n > 0 and c not in self._shapes for c, n in self._remaining.items())

    def wait_s(self) -> float:
        """Seconds until the first plan may be made (0 once it may)."""
        if self._first_request_at is None:
            return 0.0
        return max(0.0, self._first_request_at + self.warmup_s - self.clock())

    def _current_plan(self, route: Sequence[ServerEntry], waiting: Mapping[str, int], client_id: str) -> Plan:
        now = self.clock()
        if route is not self._route_ref:  # the dispatcher keeps one list per route and snapshot version
            key = tuple(sorted(s.id for s in route))
            if key != self._servers_key:
                self._plan = None
            self._servers_key, self._route_ref = key, route
        newcomer = self._plan is not None and client_id not in self._plan.quotas and client_id in self._shapes
        if self._plan is None or now - self._plan.made_at >= self.period_s or newcomer:
            self._plan = self._solve(route, waiting, now)
            self._sent = {}
            self.plans_made += 1
            log.debug("plan %d: %s", self.plans_made, {c: {k: round(n) for k, n in q.items()}
                                                       for c, q in self._plan.kind_quotas.items()})
        return self._plan

    def _unsent(self, waiting: Mapping[str, int]) -> dict[str, int]:
        clients = set(self._remaining) | set(waiting)
        out = {}
        for cid in clients:
            if cid in self._remaining:
                n = self._remaining[cid] - self._inflight.get(cid, 0)
            else:  # a client that never said how much it has: plan what it has queued
                n = waiting.get(cid, 0)
            n = max(n, waiting.get(cid, 0))
            if n > 0:
                out[cid] = n
        return out

    def _solve(self, route: Sequence[ServerEntry], waiting: Mapping[str, int], now: float) -> Plan:
        unsent = self._unsent(waiting)
        clients = sorted(c for c in unsent if c in self._shapes)
        servers = list(route)
        if not clients or not servers:
            return Plan(now, 0.0, {})  # nothing to plan: every client waits for the next plan
        # Servers of one kind (accelerator, GPUs, capacity) form one LP column weighted by their measured
        # speeds: the LP is as small as the number of kinds, and identical servers cannot swap roles from one
        # plan to the next (a degenerate LP flipped a client between two equal V100s every period).
        speed = self.speed_factors(servers)
        kinds: dict[tuple[str, int, int], list[ServerEntry]] = {}
        for server in servers:
            kinds.setdefault((server.record.accelerator, server.record.gpu_count, server.capacity), []).append(server)
        columns = {f"{k[0]}x{k[1]}/{k[2]}": members for k, members in kinds.items()}
        weight = {col: sum(speed[m.id] for m in members) for col, members in columns.items()}
        cost = {}
        for col, members in columns.items():
            unit = server_cost(members[0])
            for c in clients:
                cost[c, col] = max(1e-12, unit.of(self._shapes[c].prompt, self._shapes[c].completion))
        ids = sorted(columns)
        counts = {c: unsent[c] for c in clients}
        makespan, by_kind = solve_plan(clients, ids, counts, cost, None, weight)
        if self.order is not None and 1 < len(clients) and len(clients) ** 2 * len(ids) <= MAX_PHASE_VARIABLES:
            ranked = sorted(clients, key=lambda c: (self.order(c), c))  # type: ignore[misc]
            phased = solve_phased_plan(ranked, ids, counts, cost, {}, makespan * (1 + self.makespan_slack), weight)
            if phased is not None:
                by_kind = phased
        x: dict[str, dict[str, float]] = {}
        for c, quotas in by_kind.items():
            for col, n in quotas.items():
                for member in columns[col]:  # a kind's share split by each member's speed
                    x.setdefault(c, {})[member.id] = n * speed[member.id] / weight[col]
        kind_of = {m.id: col for col, members in columns.items() for m in members}
        return Plan(now, makespan, x, by_kind, columns, kind_of)


def solve_plan(clients: Sequence[str], servers: Sequence[str], counts: Mapping[str, float],
               cost: Mapping[tuple[str, str], float], held: Mapping[str, float] | None = None,
               capacity: Mapping[str, float] | None = None) -> tuple[float, dict[str, dict[str, float]]]:
    """min T s.t. Σ_s x[c,s] = counts[c], held[s] + Σ_c x[c,s]·cost[c,s] ≤ capacity[s]·T, x ≥ 0 (HiGHS).
    `capacity` (default 1): how many servers' worth of work a column stands for."""
    from scipy.optimize import linprog

    nc, ns = len(clients), len(servers)
    nvar = nc * ns + 1
    objective = [0.0] * nvar
    objective[-1] = 1.0
    a_eq, b_eq = [], []
    for i, c in enumerate(clients):
        row = [0.0] * nvar
        for j in range(ns):
            row[i * ns + j] = 1.0
        a_eq.append(row)
        b_eq.append(float(counts[c]))
    a_ub, b_ub = [], []
    for j, s in enumerate(servers):
        row = [0.0] * nvar
        for i, c in enumerate(clients):
            row[i * ns + j] = cost[c, s]
        row[-1] = -float((capacity or {}).get(s, 1.0))
        a_ub.append(row)
        b_ub.append(-float((held or {}).get(s, 0.0)))
    result = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * nvar,
                     method="highs")
    if not result.success:
        raise RuntimeError(f"routing plan LP failed: {result.message}")
    plan = {c: {s: float(result.x[i * ns + j]) for j, s in enumerate(servers) if result.x[i * ns + j] > MIN_SHARE}
            for i, c in enumerate(clients)}
    return float(result.x[-1]), plan


def solve_phased_plan(ranked: Sequence[str], servers: Sequence[str], counts: Mapping[str, float],
                      cost: Mapping[tuple[str, str], float], held: Mapping[str, float], limit: float,
                      capacity: Mapping[str, float] | None = None) -> dict[str, dict[str, float]] | None:
    """Clients finish in the order given: phase k ends when client k is done. Variables x[c,s,k] (client c's
    requests on server s during phase k ≤ rank(c)) and phase lengths L_k; each server's work in a phase
    (held work counted in the first) ≤ L_k; every client done by the end of its phase; Σ L_k ≤ limit.
    Minimises Σ_c finish(c) = Σ_k (K − k + 1)·L_k. None when infeasible (the caller keeps the makespan plan)."""
    from scipy.optimize import linprog

    k_count, ns = len(ranked), len(servers)
    index: dict[tuple[int, int, int], int] = {}
    for i in range(k_count):
        for k in range(i + 1):
            for j in range(ns):
                index[i, j, k] = len(index)
    base = len(index)
    nvar = base + k_count
    objective = [0.0] * nvar
    for k in range(k_count):
        objective[base + k] = float(k_count - k)
    a_eq, b_eq = [], []
    for i, c in enumerate(ranked):
        row = [0.0] * nvar
        for k in range(i + 1):
            for j in range(ns):
                row[index[i, j, k]] = 1.0
        a_eq.append(row)
        b_eq.append(float(counts[c]))
    a_ub, b_ub = [], []
    for k in range(k_count):
        for j, s in enumerate(servers):
            row = [0.0] * nvar
            for i in range(k, k_count):
                row[index[i, j, k]] = cost[ranked[i], s]
            row[base + k] = -float((capacity or {}).get(s, 1.0))
            a_ub.append(row)
            b_ub.append(-float(held.get(s, 0.0)) if k == 0 else 0.0)
    row = [0.0] * nvar
    for k in range(k_count):
        row[base + k] = 1.0
    a_ub.append(row)
    b_ub.append(limit)
    result = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * nvar,
                     method="highs")
    if not result.success:
        return None
    plan: dict[str, dict[str, float]] = {}
    for (i, j, _k), v in index.items():
        if result.x[v] > MIN_SHARE:
            plan.setdefault(ranked[i], {}).setdefault(servers[j], 0.0)
            plan[ranked[i]][servers[j]] += float(result.x[v])
    return plan
