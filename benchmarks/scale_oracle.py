"""A clairvoyant placement in the scale simulator: what placing every request well could reach, beside the ideal.

    python -m fedpool.benchmarks.scale_oracle [--servers 256] [--evals 64] [--seeds 1,2,3]
        [--dispatch-orders longest_answers_first,fair | none] [--timed-order longest_answers_first | none]
        [--name scale_oracle]

Not a policy and not fedpool: an upper bound on what placement alone can do, to tell a schedule's gap from the
ideal's looseness. It knows every request of every eval before the start, prices each on each server with the
engine model's own costs (which routing never sees), assigns every request to one server, and sends them all at
once to the simulated engines of `benchmarks/simulator.py` (their queues hold what a server's slots do not), in
simulated time. The worlds are `scale_sim`'s (the same `Spec`, seeds and ideal).

The assignment is the one `earliest_finish` makes of a whole wave (`federation/routing/waveplan.py`'s `assign`), here
with
the engine model's own costs and every profile its own kind: it models a server's completion as its prompt tokens'
prefill, one after another, plus its decode chain — the longest answer's steps, or the steps its answers need at a
full batch, whichever is more (a step that carries a prefill chunk takes the chunk's time, so the answers' steps
wait for the prompts: `deploy/batching.py`) — and gives servers roles, the structure the diagnosis in
docs/speedup.md ("the one-wave worlds") pointed at:

- long answers (≥ `LONG_ANSWER_TOKENS`) go only to the kinds that decode them fastest, packed a full batch to a
  server before the next is opened (once every server of the kind has one, a next batch where the least is):
  their decode chain is paid once per server, not once per request;
- a request whose decode chain on a kind is more than `CHAIN_TOLERANCE` × its chain on its fastest kind, and
  longer than `SHORT_CHAIN_STEPS` of that kind's steps, is kept off that kind (a caption's 96 tokens take 2.4 s on
  a V100, 1.0 s on an A100);
- the rest, longest first (by its time alone on its fastest kind), go where the modelled completion ends
  soonest: the least loaded server of each allowed kind, or the least loaded of it that runs no long answers.

The same knowledge handed to the real dispatcher instead (`FinishOracle`, a policy that only this benchmark uses):
each request, in the dispatcher's client order, goes to the server where the same model says it finishes
earliest — a server's prompts prefill one after another, its answers decode beside each other, and a prompt
placed there stalls the answers decoding there by its prefill — and it waits instead when a server without room
would finish it more than `HOLD_FACTOR` × sooner (plus `HOLD_SLACK_S`). Run under `longest_answers_first` (the
longest answers decided first, as the assignment decides them) and under `fair`: what the dispatcher's grant
passes, windows and client order reach when the costs and shapes are known, apart from learning them. A third
arm (`--timed-order`) learns the costs instead: it starts from the data-sheet priors (`pricing`, × the model's
`MODEL_BILLIONS`) and reads each kind's from every answer's own engine times (its prefill — admission to first
token — and its decode, what llama.cpp's `timings` report): the prefill cost a low
quantile of prefill seconds per prompt token, the step the least decode seconds per token (stalls by other prompts
only lengthen them).

Writes benchmarks/results/NAME.md, ending with
`result: mode=oracle servers=N evals=N worlds=N oracle_vs_ideal=X oracle_vs_ideal_max=X dispatch_vs_ideal=X
dispatch_fair_vs_ideal=X dispatch_timed_vs_ideal=X` (the dispatcher arms: at the engine model's costs under each order,
absent with `--dispatch-orders none`; at timed costs, absent with `--timed-order none`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import looptime

from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report
from fedpool.benchmarks.scale_sim import SHAPES, Spec, by_kind, ideal_s
from fedpool.benchmarks.simulator import (
    MODEL,
    EvalOutcome,
    SimResult,
    SimTransport,
    World,
    build_world,
    kind_counts,
    make_dispatcher,
    prompt_of,
    server_outcomes,
    simulate,
)
from fedpool.deploy.emulator import EmulatorProfile
from fedpool.federation.core.dispatcher import Dispatcher
from fedpool.federation.core.policy import DispatchState, Hold, Policy, PolicyHooks, RouteView
from fedpool.federation.core.types import DispatchConfig, Endpoint, InferenceRequest
from fedpool.federation.gateway.unpooled import UrlTarget
from fedpool.federation.routing.finish import REFIT_EVERY, EngineTimedCosts
from fedpool.federation.routing.pricing import server_cost, step_cost
from fedpool.federation.routing.waveplan import Demand, Room
from fedpool.federation.routing.waveplan import KindModel as WaveModel
from fedpool.federation.routing.waveplan import assign as assign_wave

TIMED_PROMPT_TOKENS = 200  # timed costs: answers with prompts this long measure a kind's prefill (the rest as
# `earliest_finish` learns them: federation/routing/finish.py's EngineTimedCosts)
TIMED_REFIT = REFIT_EVERY  # answers between refits of a kind
MODEL_BILLIONS = 7.0  # the simulated model's size: the data-sheet priors are for 1 B parameters
HOLD_FACTOR = 2.0  # FinishOracle: a request waits when a server without room finishes it this many times sooner ...
HOLD_SLACK_S = 0.5  # ... and by more than this (seconds from now)
DISPATCH_ORDERS = ("longest_answers_first", "fair")  # the client orders the dispatcher arm runs under
TIMED = "timed"  # (the timed-costs arm's key among a world's dispatcher makespans)
TIMED_ORDER = "longest_answers_first"  # the order the timed-costs arm runs under


@dataclass(frozen=True)
class KindModel(WaveModel):
    """One server kind's costs in the engine model: prefill seconds a prompt token, a full batch's step."""

    @classmethod
    def of(cls, profile: EmulatorProfile) -> KindModel:
        batch = max(1, profile.max_running)
        return cls(profile.prefill_s_per_token, profile.decode_s_per_token * (1 + profile.batch_slowdown * (batch - 1)),
                   batch)


@dataclass(frozen=True)
class Assignment:
    """Every request's server, in the order it was assigned, and the modelled makespan."""

    order: tuple[tuple[int, int, str], ...]  # (eval index, request index, server id)
    predicted_s: float


def assign(spec: Spec, servers: Sequence[tuple[str, str]]) -> Assignment:
    """Place every request of the spec's evals on one of `servers` ((id, kind)) by `federation/routing/waveplan.py`'s
    `assign`
    at the engine model's costs (see the module docstring)."""
    models = {kind: KindModel.of(profile) for kind, profile in spec.profiles().items()}
    present = {kind for _, kind in servers}
    evals = spec.eval_list()
    demand = [Demand(str(e), ev.size, ev.prompt_tokens, ev.answer_tokens) for e, ev in enumerate(evals)]
    result = assign_wave(demand, [Room(sid, kind) for sid, kind in servers], models)
    if result.unplaced:
        raise RuntimeError(f"{result.unplaced} requests found no kind that may take them")
    # (the order the assignment decided them in: the longest alone on its fastest kind first)
    first = sorted(range(len(evals)), key=lambda e: (-min(m.alone(evals[e].prompt_tokens, evals[e].answer_tokens)
                                                          for k, m in models.items() if k in present), e))
    order = tuple((e, k, sid) for e in first for k, sid in enumerate(result.servers.get(str(e), ())))
    return Assignment(order, result.predicted_s)


class FinishOracle(Policy):
    """Earliest modelled finish, with the engine model's costs and every eval's shape known (see the module
    docstring). Per server it keeps when its placed prompts will have prefilled and when its answers will have
    decoded; a server with nothing in flight starts from now. O(servers) a decision: a benchmark, not a policy."""

    name = "finish_oracle"

    def __init__(self, models: dict[str, KindModel], kind_of: dict[str, str], shapes: dict[str, tuple[int, int]]):
        super().__init__()
        self._models, self._kind_of, self._shapes = dict(models), kind_of, shapes
        self._prior = dict(models)  # (what `timing` starts from)
        self._timed: dict[str, EngineTimedCosts] = {}
        self._timed_n: dict[str, int] = {}
        self._prefilled: dict[str, float] = {}  # server -> when the prompts placed there are prefilled
        self._decoded: dict[str, float] = {}  # server -> when the answers placed there are decoded
        self._state: DispatchState | None = None

    def attach(self, state: DispatchState) -> PolicyHooks:
        self._state = state
        return PolicyHooks(plans_the_tail=True)  # (copies at the tail would run against the model)

    def costs(self, kind: str) -> KindModel:
        """The kind's costs as the policy has them now."""
        return self._models[kind]

    def timing(self, server_id: str, prompt: int, output: int, prefill_s: float, decode_s: float) -> None:
        """An answer's own engine times (`SimTransport.on_timing`): the kind's costs learned from them (see the
        module docstring); until a kind has both, the other keeps the prior's ratio to it."""
        kind = self._kind_of[server_id]
        rows = self._timed.get(kind)
        if rows is None:
            rows = self._timed[kind] = EngineTimedCosts(TIMED_PROMPT_TOKENS)
        rows.add(prompt, output, prefill_s, decode_s)
        n = self._timed_n[kind] = self._timed_n.get(kind, 0) + 1
        if n % TIMED_REFIT:
            return
        prior = self._prior[kind]
        fitted = rows.fit(prior.prefill_s, prior.step_s)
        if fitted is None:
            return
        prefill, step = fitted
        self._models[kind] = KindModel(prefill, step, prior.batch)

    def _finish(self, server: Any, prompt: int, answer: int, now: float) -> tuple[float, float]:
        """(the request's modelled finish there — when the server's answers are decoded, its own with them — and
        when its prompt is prefilled)."""
        model = self._models[self._kind_of[server.id]]
        idle = server.inflight == 0
        prefilled = now if idle else max(now, self._prefilled.get(server.id, now))
        decoded = now if idle else max(now, self._decoded.get(server.id, now))
        prefill = prompt * model.prefill_s
        own = prefilled + prefill
        finish = max(decoded + prefill, own + answer * model.step_s)  # its prompt stalls the answers decoding there
        return finish, own

    def place(self, route: RouteView, request: InferenceRequest, tried: set[str]) -> Any:
        assert self._state is not None
        now = self._state.clock()
        prompt, answer = self._shapes[request.client_id]
        best: tuple[float, Any, float] | None = None
        best_anywhere = float("inf")
        for server in route.servers:
            if server.id in tried:
                continue
            finish, own = self._finish(server, prompt, answer, now)
            best_anywhere = min(best_anywhere, finish)
            if (best is None or finish < best[0]) and route.usable(server, tried):
                best = (finish, server, own)
        if best is None:
            return Hold.ROUTE_FULL if not tried else Hold.CLIENT_HELD
        finish, server, own = best
        if finish - now > (best_anywhere - now) * HOLD_FACTOR + HOLD_SLACK_S:
            return Hold.CLIENT_HELD  # a server without room finishes it far sooner: wait for it
        self._prefilled[server.id] = own
        self._decoded[server.id] = finish
        return server


def prior_models(world: World) -> dict[str, KindModel]:
    """Each kind's costs by the data-sheet priors (`pricing`), for the simulated model's size."""
    models = {}
    for sim in world.servers.values():
        if sim.kind not in models:
            entry = sim.healthy_entry()
            batch = max(1, sim.profile.max_running)
            models[sim.kind] = KindModel(server_cost(entry).prefill_s_per_token * MODEL_BILLIONS,
                                         step_cost(entry, batch) * MODEL_BILLIONS, batch)
    return models


def run_dispatch(spec: Spec, *, timed: bool = False) -> SimResult:
    """The real dispatcher with `FinishOracle` placing, under the spec's client order, in simulated time: at the
    engine model's costs, or (`timed`) at costs learned from each answer's engine times."""
    shapes = {e.name: (e.prompt_tokens, e.answer_tokens) for e in spec.eval_list()}

    def dispatchers(transport: SimTransport, world: World, clock: Any) -> list[Dispatcher]:
        models = prior_models(world) if timed else {kind: KindModel.of(p) for kind, p in spec.profiles().items()}
        policy = FinishOracle(models, {sim.id: sim.kind for sim in world.servers.values()}, shapes)
        if timed:
            transport.on_timing = policy.timing
        return [make_dispatcher(transport, world, policy, DispatchConfig(client_order=spec.client_order), clock,
                                seed=spec.seed)]

    return simulate(lambda clock: build_world(spec.kind_table, spec.profiles(), spec.servers, clock),
                    spec.eval_list(), dispatchers)


def run_oracle(spec: Spec) -> tuple[SimResult, float]:
    """(the simulated run of the assignment, its modelled makespan)."""
    loop = looptime.new_event_loop(start=0.0)
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(_run(loop.time, spec))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


async def _run(clock: Any, spec: Spec) -> tuple[SimResult, float]:
    world = build_world(spec.kind_table, spec.profiles(), spec.servers, clock)
    assignment = assign(spec, [(sim.id, sim.kind) for sim in world.servers.values()])
    evals = spec.eval_list()
    transport = SimTransport(world.servers)
    outcomes = {ev.name: EvalOutcome() for ev in evals}

    async def one(e: int, k: int, sid: str) -> None:
        ev, sim = evals[e], world.servers[sid]
        request = InferenceRequest.from_body(
            {"prompt": prompt_of(ev, k), "max_tokens": ev.answer_tokens, "ignore_eos": True},
            request_id=f"{ev.name}/{k}", model=MODEL, endpoint=Endpoint.COMPLETIONS, client_id=ev.name)
        await transport.complete(UrlTarget(sim.id, sim.record.url), request)
        outcome = outcomes[ev.name]
        outcome.answered += 1
        outcome.finished_s = clock()

    await asyncio.gather(*(one(e, k, sid) for e, k, sid in assignment.order))
    result = SimResult(makespan_s=clock(), outcomes=outcomes, decisions=0, decision_cpu_s=0.0, process_cpu_s=0.0,
                       wall_s=0.0, inflight_end=0, completed=sum(o.answered for o in outcomes.values()), failed=0,
                       attempts=transport.attempts, servers=server_outcomes(world))
    await world.close()
    return result, assignment.predicted_s


@dataclass(frozen=True)
class OracleWorld:
    seed: int
    requests: int
    ideal: float
    makespan: float
    predicted: float
    kinds: dict[str, dict[str, Any]]
    dispatch: dict[str, float]  # client order -> the dispatcher arm's makespan


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedpool.benchmarks.scale_oracle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=256)
    parser.add_argument("--evals", type=int, default=64)
    parser.add_argument("--kinds", type=int, choices=(3, 5), default=3)
    parser.add_argument("--seeds", default="1,2,3", help="worlds to run (eval sizes drawn from each seed)")
    parser.add_argument("--dispatch-orders", default=",".join(DISPATCH_ORDERS),
                        help="client orders the dispatcher arm runs under ('none': no dispatcher arm; it decides in "
                             "O(servers), minutes a world at 256 servers)")
    parser.add_argument("--timed-order", default=TIMED_ORDER,
                        help="client order the timed-costs dispatcher arm runs under ('none', or --dispatch-orders "
                             "none: no such arm)")
    parser.add_argument("--name", default="scale_oracle", help="report name: results/NAME.md")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the report is written")
    args = parser.parse_args(argv)
    base = Spec(args.servers, args.evals, args.kinds)
    orders = () if args.dispatch_orders == "none" else tuple(o for o in args.dispatch_orders.split(",") if o)
    timed = None if args.timed_order == "none" or not orders else args.timed_order
    worlds = []
    for seed in (int(x) for x in args.seeds.split(",")):
        spec = replace(base, seed=seed)
        ideal = ideal_s(spec)[0]
        result, predicted = run_oracle(spec)
        requests = sum(e.size for e in spec.eval_list())
        dispatch = {}
        arms = [(order, order, False) for order in orders] + ([(TIMED, timed, True)] if timed is not None else [])
        for arm, order, learns in arms:
            run = run_dispatch(replace(spec, client_order=order), timed=learns)
            if run.completed != requests or run.failed:
                raise RuntimeError(f"world {seed}, {arm}: {run.completed} of {requests} answered, {run.failed} "
                                   "failed")
            dispatch[arm] = run.makespan_s
        worlds.append(OracleWorld(seed, requests, ideal, result.makespan_s, predicted, by_kind(result, spec),
                                  dispatch))
        print(f"world {seed}: {requests} requests, ideal {ideal:.2f} s, oracle {result.makespan_s:.2f} s "
              f"({result.makespan_s / ideal:.3f}), modelled {predicted:.2f} s"
              + "".join(f"; dispatcher, {o} {m:.2f} s ({m / ideal:.3f})" for o, m in dispatch.items()), flush=True)
    write_report(args.name, f"A clairvoyant placement at scale, in simulated time: {base.servers} servers, "
                 f"{base.evals} evals", _body(base, worlds, orders, timed), _result(base, worlds, orders, timed),
                 results_dir=args.results_dir)


def _body(spec: Spec, worlds: list[OracleWorld], orders: Sequence[str], timed: str | None) -> str:
    arms = [*orders, *([TIMED] if timed is not None else [])]
    label = {**{o: f"dispatcher, {o}" for o in orders}, TIMED: f"dispatcher, timed costs, {timed}"}
    counts = kind_counts(spec.kind_table, spec.servers)
    shapes = ", ".join(f"{m} {p}/{a}" for m, (p, a) in SHAPES.items())
    ratios = [w.makespan / w.ideal for w in worlds]
    rows = [(w.seed, w.requests, f"{w.ideal:.2f} s", f"{w.makespan:.2f} s ({w.makespan / w.ideal:.3f})",
             f"{w.predicted:.2f} s",
             *(f"{w.dispatch[o]:.2f} s ({w.dispatch[o] / w.ideal:.3f})" for o in arms)) for w in worlds]
    spread = {label[o]: [w.dispatch[o] / w.ideal for w in worlds] for o in arms}
    kinds = []
    for w in worlds:
        for kind, row in sorted(w.kinds.items()):
            requests = ", ".join(f"{m} {n}" for m, n in sorted(row["requests"].items())) or "none"
            kinds.append((w.seed, kind, row["servers"], requests,
                          f"{row['work_per_server_s']:.1f} s ({row['busy_share']:.0%})",
                          f"{row['last_median_s']:.1f} / {row['last_max_s']:.1f} s"))
    return (f"World: the `scale_sim` world of the same size and seeds: {spec.servers} servers "
            f"({', '.join(f'{n} × {k}' for k, n in counts.items())}), max running {spec.max_running} each; "
            f"{spec.evals} evals of {spec.min_size}–{spec.max_size} requests (prompt/answer tokens: {shapes}). "
            "The oracle (see the module docstring) knows every request up front and prices it with the engine "
            "model's own costs, which routing never sees: it is an upper bound on what placement can do, not a "
            "policy. The ideal is `scale_sim`'s (the LP bound at saturated cost; no request faster than alone on "
            "the fastest server).\n\n"
            + ("The dispatcher arms run the real dispatcher (grant passes, windows, client order) with `FinishOracle` "
            "placing: the same costs and shapes, decided one request at a time as slots free, in the client order "
            f"named; a request waits when a server without room would finish it over {HOLD_FACTOR:g}× sooner "
            "(module docstring). The timed-costs arm learns the costs from each answer's engine times, starting "
            "from the data-sheet priors (module docstring).\n\n" if arms else "No dispatcher arm in this run.\n\n")
            + markdown_table(("world", "requests", "ideal", "oracle (÷ ideal)", "oracle's own model",
                              *(f"{label[o]} (÷ ideal)" for o in arms)), rows)
            + f"\n\nOracle ÷ ideal over the worlds: {statistics.mean(ratios):.3f} ({min(ratios):.3f}–"
            f"{max(ratios):.3f}) (mean, then the lowest and highest world)"
            + "".join(f"; {name}: {statistics.mean(v):.3f} ({min(v):.3f}–{max(v):.3f})"
                      for name, v in spread.items()) + ".\n\n"
            "Per server kind: the requests placed there by modality, their work at saturated cost per server (in "
            "brackets its share of the makespan) and when the kind's servers answered their last request (median "
            "/ latest).\n\n"
            + markdown_table(("world", "kind", "servers", "requests", "work per server", "last answer"), kinds))


def _result(spec: Spec, worlds: list[OracleWorld], orders: Sequence[str], timed: str | None) -> dict[str, object]:
    ratios = [w.makespan / w.ideal for w in worlds]
    out: dict[str, object] = {"mode": "oracle", "servers": spec.servers, "evals": spec.evals, "worlds": len(worlds),
                              "oracle_vs_ideal": f"{statistics.mean(ratios):.3f}",
                              "oracle_vs_ideal_max": f"{max(ratios):.3f}"}
    keys = {"longest_answers_first": "dispatch_vs_ideal", "fair": "dispatch_fair_vs_ideal"}
    for order in orders:
        out[keys.get(order, f"dispatch_{order}_vs_ideal")] = \
            f"{statistics.mean(w.dispatch[order] / w.ideal for w in worlds):.3f}"
    if timed is not None:
        out["dispatch_timed_vs_ideal"] = f"{statistics.mean(w.dispatch[TIMED] / w.ideal for w in worlds):.3f}"
    return out


if __name__ == "__main__":
    main()
