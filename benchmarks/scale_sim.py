"""The scheduler at scale, in simulated time: fedpool's dispatcher and policies driving hundreds to thousands of
modelled engines for tens to a thousand concurrent evals, against the ideal and the best simple baseline.

    python -m fedpool.benchmarks.scale_sim [--servers 256] [--evals 64] [--policy capacity_weighted]
        [--client-order fair] [--planned] [--processes 1] [--churn] [--agreement] [--name scale_sim]

Mode `virtual` (the default; benchmarks/simulator.py): the real `Dispatcher`, policies, windows, learning and
planner against the emulator's continuous-batching engine model, through an in-process transport, on a virtual
clock — the makespan is the schedule's, not this machine's. The decision cost is CPU time (process time) inside
the dispatcher's grant step per slot granted, with the pool saturated. `--agreement` also runs the same shapes
at 32 servers × 8 evals both ways — simulated, and on the wall clock against real emulated HTTP servers in
another process (`mode wall`, the check that the simulator and the emulator agree) — and reports how far
apart the two makespans are.

The pool mixes the emulator's data-sheet profiles (`deploy/emulator.py`: vLLM and SGLang on A100-80GB,
vLLM on V100-32GB, and with `--kinds 5` vLLM and SGLang on H100-80GB), max running sequences capped at
`--max-running` so the evals keep the pool saturated. Each eval is a stream of requests shaped like one of the
Table 7 modalities (text: short prompts, long answers; image: ~1k prompt tokens, short answers; caption; video:
~7k prompt tokens), `--concurrency` in flight per eval, reporting its work left as fedpool's evals do.

Baselines beside fedpool: the ideal (the LP bound: every request anywhere at saturated cost; and no request
faster than alone on the fastest server), and least outstanding work — every request sent at once to the
server with the least outstanding work per unit of speed, its own included, priced by the data-sheet prior
(what a router could know), the engines queueing the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import multiprocessing.synchronize
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fedpool.benchmarks.assignment import Workload, ideal_makespan, saturated_cost
from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report
from fedpool.benchmarks.simulator import (
    GATEWAY_HOP_S,
    MODEL,
    PROBE_S,
    Eval,
    Kind,
    SimResult,
    SimServer,
    SimTransport,
    World,
    build_world,
    delegating,
    kind_counts,
    leasing,
    least_work_baseline,
    make_dispatcher,
    simulate,
)
from fedpool.deploy.emulator import PROFILES, EmulatorProfile
from fedpool.federation import DispatchConfig, Dispatcher, Policy, make_policy
from fedpool.federation.gateway.transport import HttpTransport
from fedpool.federation.routing.pricing import server_cost
from fedpool.registry import Engine, ServerEntry, ServerStatus, prior_weight
from fedpool.registry.leases import PLACEMENT, PLACEMENTS

SHAPES = {  # modality: (prompt tokens, answer tokens), as benchmarks/configs/table7_evals.yaml
    "text": (250, 384),
    "image": (1100, 24),
    "caption": (900, 96),
    "video": (7000, 32),
}
KINDS_3 = {
    "vllm-a100-80gb-7b": Kind("vllm-a100-80gb-7b", "A100", Engine.VLLM, 0.25),
    "sglang-a100-80gb-7b": Kind("sglang-a100-80gb-7b", "A100", Engine.SGLANG, 0.25),
    "vllm-v100-32gb-7b": Kind("vllm-v100-32gb-7b", "V100", Engine.VLLM, 0.5),
}
KINDS_5 = {
    "vllm-h100-80gb-7b": Kind("vllm-h100-80gb-7b", "H100", Engine.VLLM, 0.1),
    "sglang-h100-80gb-7b": Kind("sglang-h100-80gb-7b", "H100", Engine.SGLANG, 0.1),
    "vllm-a100-80gb-7b": Kind("vllm-a100-80gb-7b", "A100", Engine.VLLM, 0.2),
    "sglang-a100-80gb-7b": Kind("sglang-a100-80gb-7b", "A100", Engine.SGLANG, 0.2),
    "vllm-v100-32gb-7b": Kind("vllm-v100-32gb-7b", "V100", Engine.VLLM, 0.4),
}


@dataclass(frozen=True)
class Spec:
    """One simulated world and how fedpool runs in it."""

    servers: int
    evals: int
    kinds: int = 3
    max_running: int = 16
    concurrency: int = 200
    min_size: int = 60
    max_size: int = 180
    processes: int = 1
    policy: str = "capacity_weighted"
    client_order: str = "fair"
    churn: bool = False
    leases: bool = False
    engine_times: bool = False  # answers carry the engine's own prefill and decode times (llama.cpp's `timings`)
    lease_placement: str = PLACEMENT  # how the lease broker shares slots over server kinds (registry/leases.py)
    planned_pick: str = "quota"  # policy `planned`: which server within a client's planned kinds
    delegate: bool = False  # the processes hand their placement to one gateway (`eval run --gateway`), no leases
    seed: int = 7

    def make_policy(self, rng: random.Random) -> Policy:
        return make_policy(self.policy, rng, **({"pick": self.planned_pick} if self.policy == "planned" else {}))

    @property
    def kind_table(self) -> dict[str, Kind]:
        return KINDS_5 if self.kinds == 5 else KINDS_3

    def profiles(self) -> dict[str, EmulatorProfile]:
        return {name: replace(PROFILES[name], max_running=self.max_running, output_spread=0.0)
                for name in self.kind_table}

    def eval_list(self) -> list[Eval]:
        rng = random.Random(self.seed)
        modalities = list(SHAPES)
        out = []
        for i in range(self.evals):
            modality = modalities[i % len(modalities)]
            prompt, answer = SHAPES[modality]
            out.append(Eval(f"eval-{i:04d}-{modality}", prompt, answer, rng.randint(self.min_size, self.max_size),
                            concurrency=self.concurrency, process=i % self.processes))
        return out

    def config(self) -> DispatchConfig:
        return DispatchConfig(client_order=self.client_order)


def ideal_s(spec: Spec) -> tuple[float, float, float]:
    """(ideal, LP bound, longest single request) in engine seconds."""
    profiles = spec.profiles()
    work = [Workload(e.name, e.size, float(e.prompt_tokens), float(e.answer_tokens)) for e in spec.eval_list()]
    lp, _ = ideal_makespan(work, profiles, kind_counts(spec.kind_table, spec.servers))
    longest = max(min(p.prefill_s_per_token * pt + p.decode_s_per_token * at for p in profiles.values())
                  for pt, at in SHAPES.values())
    return max(lp, longest), lp, longest


async def churn(world: World) -> None:
    """Servers fail, rejoin, join and leave while the run goes: every 2 s one of them changes."""
    rng = random.Random(11)
    ids = sorted(world.servers)
    down: list[str] = []
    kinds = {sim.kind: sim for sim in world.servers.values()}
    step = 0
    while True:
        await asyncio.sleep(2.0)
        step += 1
        if step % 4 == 1:
            victim = rng.choice([i for i in ids if i in world.servers and world.servers[i].alive])
            down.append(victim)
            await world.kill(victim)
        elif step % 4 == 2 and down:
            world.revive(down.pop(0))
        elif step % 4 == 3:
            template = rng.choice(list(kinds.values()))
            kind = KINDS_5.get(template.kind) or KINDS_3[template.kind]
            world.add(template.kind, kind, template.profile)
        else:
            leaving = rng.choice([i for i in world.servers if world.servers[i].alive])
            world.remove(leaving)


def run_virtual(spec: Spec, *, scrapes: bool = True) -> SimResult:
    """`scrapes`: the registry's probe cycle publishes each engine's load every 2 s (off: a static snapshot, as
    the wall-clock arm runs)."""
    kinds, profiles = spec.kind_table, spec.profiles()

    def dispatchers(transport: SimTransport, world: World, clock: Any) -> list[Dispatcher]:
        transport.engine_times = spec.engine_times
        return [make_dispatcher(transport, world, spec.make_policy(random.Random(p)), spec.config(), clock,
                                seed=p) for p in range(1 if spec.delegate else spec.processes)]

    # Delegating, the gateway holds every eval's requests at once (its --max-inflight at their total concurrency).
    senders = delegating(spec.processes, max_inflight=spec.evals * spec.concurrency) if spec.delegate else None
    return simulate(lambda clock: build_world(kinds, profiles, spec.servers, clock), spec.eval_list(), dispatchers,
                    events=churn if spec.churn else None,
                    setup=functools.partial(leasing, placement=spec.lease_placement) if spec.leases else None,
                    probe_s=PROBE_S if scrapes else None, senders_of=senders)


def run_baseline(spec: Spec) -> SimResult:
    prices: dict[tuple[str, int, int], float] = {}  # servers of a kind price alike: once per kind and shape

    def price(sim: SimServer, prompt: int, answer: int) -> float:
        known = prices.get((sim.kind, prompt, answer))
        if known is None:
            known = prices[sim.kind, prompt, answer] = server_cost(sim.healthy_entry()).of(prompt, answer)
        return known

    kinds, profiles = spec.kind_table, spec.profiles()
    return least_work_baseline(lambda clock: build_world(kinds, profiles, spec.servers, clock), spec.eval_list(), price)


# ---- wall clock: the same world against real emulated HTTP servers ---------------------------------------
def _farm(counts: dict[str, int], profiles_json: str, speedup: float, out: mp.Queue[list[tuple[str, str]]],
          stop: multiprocessing.synchronize.Event, per_request_metrics: bool = False) -> None:
    from fedpool.deploy.emulator import EmulatedServer

    profiles = {k: EmulatorProfile(**v) for k, v in json.loads(profiles_json).items()}

    async def main() -> None:
        servers = [(name, EmulatedServer(model=MODEL, profile=profiles[name], speedup=speedup, seed=i,
                                         per_request_metrics=per_request_metrics))
                   for name, n in counts.items() for i in range(n)]
        for _, server in servers:
            await server.start()
        out.put([(name, server.url) for name, server in servers])
        await asyncio.to_thread(stop.wait)
        for _, server in servers:
            await server.stop()

    asyncio.run(main())


def run_wall(spec: Spec, speedup: float) -> float:
    """The makespan in engine seconds (wall seconds × speedup) against emulated servers in another process."""
    from fedpool.benchmarks.simulator import EvalOutcome, run_eval
    from fedpool.federation import new_session
    from fedpool.registry import PoolSnapshot, ServerRecord

    kinds, profiles = spec.kind_table, spec.profiles()
    counts = kind_counts(kinds, spec.servers)
    ctx = mp.get_context("spawn")
    out: mp.Queue[list[tuple[str, str]]] = ctx.Queue()
    stop = ctx.Event()
    farm = ctx.Process(target=_farm, args=(counts, json.dumps({k: asdict(v) for k, v in profiles.items()}), speedup,
                                           out, stop, spec.engine_times), daemon=True)
    farm.start()
    try:
        urls = out.get(timeout=300)

        async def drive() -> float:
            entries = []
            for i, (name, url) in enumerate(urls):
                record = ServerRecord(id=f"{name}-{i}", url=url, engine=kinds[name].engine, model=MODEL, revision="r1",
                                      accelerator=kinds[name].accelerator, gpu_count=1, capacity=spec.max_running)
                entries.append(ServerEntry(record, ServerStatus.HEALTHY, spec.max_running, prior_weight(record)))
            snapshot = PoolSnapshot(1, time.time(), tuple(entries))
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with new_session() as session:
                config = spec.config()
                dispatchers = [Dispatcher(HttpTransport(session, config.timeouts), lambda: snapshot,
                                          spec.make_policy(random.Random(p)), config=config, rng=random.Random(p))
                               for p in range(spec.processes)]
                outcomes = {e.name: EvalOutcome() for e in spec.eval_list()}
                await asyncio.gather(*(run_eval(dispatchers[e.process], e, loop.time, outcomes[e.name])
                                       for e in spec.eval_list()))
            return (loop.time() - started) * speedup

        return asyncio.run(drive())
    finally:
        stop.set()
        farm.join(30)


# ---- the report -----------------------------------------------------------------------------------------
def describe(result: SimResult, ideal: float, spec: Spec) -> dict[str, Any]:
    finished = sorted(o.finished_s for o in result.outcomes.values())
    return {"makespan_s": result.makespan_s, "vs_ideal": result.makespan_s / ideal,
            "decision_us": result.decision_cpu_s / result.decisions * 1e6 if result.decisions else 0.0,
            "first_s": finished[0], "median_s": statistics.median(finished), "completed": result.completed,
            "failed": result.failed, "inflight_end": result.inflight_end, "wall_s": result.wall_s,
            "cpu_s": result.process_cpu_s, "kinds": by_kind(result, spec), "waves": result.extra.get("waves", [])}


def by_kind(result: SimResult, spec: Spec) -> dict[str, dict[str, Any]]:
    """Where the time went, per server kind: its servers, the requests it answered per modality, the work that
    is at saturated cost (engine seconds per server: what the ideal charges), that work ÷ the makespan, and when
    its servers answered their last request (median and latest)."""
    profiles = spec.profiles()
    shape = {e.name: (e.prompt_tokens, e.answer_tokens) for e in spec.eval_list()}
    modality = {e.name: e.name.rsplit("-", 1)[-1] for e in spec.eval_list()}
    out: dict[str, dict[str, Any]] = {}
    for server in result.servers:
        row = out.setdefault(server.kind, {"servers": 0, "requests": Counter(), "work_s": 0.0, "last": []})
        row["servers"] += 1
        row["last"].append(server.last_answer_s)
        for client, n in server.answered_by.items():
            row["requests"][modality[client]] += n
            row["work_s"] += n * saturated_cost(profiles[server.kind], *shape[client])
    for row in out.values():
        last = sorted(row.pop("last"))
        row["work_per_server_s"] = row.pop("work_s") / row["servers"]
        row["busy_share"] = row["work_per_server_s"] / result.makespan_s if result.makespan_s > 0 else 0.0
        row["last_median_s"], row["last_max_s"] = statistics.median(last), last[-1]
        row["requests"] = dict(row["requests"])
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedpool.benchmarks.scale_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=256)
    parser.add_argument("--evals", type=int, default=64)
    parser.add_argument("--kinds", type=int, choices=(3, 5), default=3)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=200, help="requests in flight per eval")
    parser.add_argument("--processes", type=int, default=1, help="client processes (a dispatcher each)")
    parser.add_argument("--delegate", action="store_true",
                        help="with --processes: each process hands its placement to one gateway (`eval run "
                             "--gateway`) instead of leasing slots and placing its own requests")
    parser.add_argument("--also-leases", action="store_true",
                        help="with --delegate: also run every world with the processes leasing (the other design)")
    parser.add_argument("--no-leases", action="store_true",
                        help="several processes without capacity leases (each believes it owns every window)")
    parser.add_argument("--lease-placement", choices=PLACEMENTS, default=PLACEMENT,
                        help="with --processes: how the lease broker shares slots over kinds (registry/leases.py)")
    parser.add_argument("--policy", default="capacity_weighted")
    parser.add_argument("--client-order", default="fair")
    parser.add_argument("--planned", action="store_true", help="route by the dispatcher's makespan plan")
    parser.add_argument("--planned-pick", choices=("quota", "finish"), default="quota",
                        help="--planned: within a client's planned kinds, the server with the most quota left (quota) "
                             "or where earliest_finish's engine model answers it soonest (finish)")
    parser.add_argument("--churn", action="store_true", help="servers fail, rejoin, join and leave as it runs")
    parser.add_argument("--engine-times", action="store_true",
                        help="each answer carries its engine's own prefill and decode times, as llama.cpp's `timings` "
                             "do (off: vLLM and SGLang answers, which carry none)")
    parser.add_argument("--seeds", default="1,2,3", help="worlds to run (eval sizes drawn from each seed)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the least-outstanding-work baseline")
    parser.add_argument("--agreement", action="store_true",
                        help="also compare simulated and wall-clock makespans at 32 servers × 8 evals")
    parser.add_argument("--speedup", type=float, default=2.0, help="wall mode: engine seconds per wall second")
    parser.add_argument("--name", default="scale_sim", help="report name: results/NAME.md")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the report is written")
    args = parser.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    base = Spec(args.servers, args.evals, args.kinds, args.max_running, args.concurrency,
                processes=args.processes, policy="planned" if args.planned else args.policy,
                client_order=args.client_order, churn=args.churn,
                leases=args.processes > 1 and not args.no_leases and not args.delegate, delegate=args.delegate,
                engine_times=args.engine_times, planned_pick=args.planned_pick, lease_placement=args.lease_placement)
    counts = kind_counts(base.kind_table, base.servers)
    worlds = []
    for seed in seeds:
        spec = replace(base, seed=seed)
        ideal, lp, longest = ideal_s(spec)
        requests = sum(e.size for e in spec.eval_list())
        print(f"world {seed}: {spec.servers} servers ({counts}), {spec.evals} evals, {requests} requests; ideal "
              f"{ideal:.1f} s", flush=True)
        fedpool = describe(run_virtual(spec), ideal, spec)
        leasing_ = None
        if args.also_leases and spec.delegate:
            other = replace(spec, delegate=False, leases=True)
            leasing_ = describe(run_virtual(other), ideal, other)
        baseline = describe(run_baseline(spec), ideal, spec) if not args.no_baseline else None
        for name, described in (("fedpool", fedpool), ("leasing", leasing_), ("least outstanding work", baseline)):
            if described is not None:  # (the per-kind table goes to the report)
                print(f"  {name}: { {k: v for k, v in described.items() if k != 'kinds'} }", flush=True)
        worlds.append(WorldOutcome(seed, requests, ideal, lp, longest, fedpool, baseline, leasing_))
    agreement = None
    if args.agreement:
        small = replace(base, servers=32, evals=8, churn=False, seed=seeds[0])
        simulated = run_virtual(small, scrapes=False).makespan_s  # as the wall-clock arm: no prober
        walled = run_wall(small, args.speedup)
        agreement = (simulated, walled, abs(simulated - walled) / walled * 100)
        print(f"agreement at 32 × 8: simulated {simulated:.1f} s, wall-clock {walled:.1f} s", flush=True)
    write_report(args.name, f"The scheduler at scale, in simulated time: {base.servers} servers, {base.evals} evals",
                 _body(base, counts, worlds, agreement, args.speedup), _result(base, worlds, agreement),
                 results_dir=args.results_dir)


@dataclass(frozen=True)
class WorldOutcome:
    """One simulated world's outcome."""

    seed: int
    requests: int
    ideal: float
    lp: float
    longest: float
    fedpool: dict[str, Any]
    baseline: dict[str, Any] | None
    leasing: dict[str, Any] | None = None  # the same processes leasing slots (with --delegate --also-leases)


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    mean = sum(values) / len(values)
    if len(values) == 1:
        return fmt.format(mean)
    return f"{fmt.format(mean)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def _body(spec: Spec, counts: dict[str, int], worlds: list[WorldOutcome], agreement: tuple[float, float, float] | None,
          speedup: float) -> str:
    how = (f"policy `{spec.policy}`" + (f" (pick `{spec.planned_pick}`)" if spec.policy == "planned" else "")
           + f", client order `{spec.client_order}`, {spec.processes} client process"
           f"{'es' if spec.processes != 1 else ''}"
           + (" sharing each server's slots by capacity leases" if spec.leases else
              " each handing its placement to one gateway (`eval run --gateway`: the real gateway app in process, "
              f"{GATEWAY_HOP_S * 1e3:g} ms each way, its --max-inflight at the evals' total concurrency, "
              f"{spec.evals * spec.concurrency}), whose one dispatcher places every eval's requests"
              if spec.delegate else " each filling every window (no leases)" if spec.processes > 1 else "")
           + f", {spec.concurrency} requests in flight per eval, the dispatcher's defaults otherwise (hedging on, "
           "where the policy does not place the tail itself)"
           + ("; answers carry their engine's own prefill and decode times where the engine reports them (vLLM with "
              "`--enable-per-request-metrics`, llama.cpp's `timings`; SGLang's do not)" if spec.engine_times else "")
           + ("; servers fail, rejoin, join and leave every 2 s" if spec.churn else ""))
    rows = []
    leased = all(w.leasing is not None for w in worlds)
    for w in worlds:
        f, b, le = w.fedpool, w.baseline, w.leasing
        rows.append((w.seed, w.requests, f"{w.ideal:.1f} s (LP {w.lp:.1f}, longest {w.longest:.2f})",
                     f"{f['makespan_s']:.1f} s ({f['vs_ideal']:.3f})",
                     *((f"{le['makespan_s']:.1f} s ({le['vs_ideal']:.3f})",) if le is not None and leased else ()),
                     f"{b['makespan_s']:.1f} s ({b['vs_ideal']:.3f})" if b is not None else "—",
                     f"{f['first_s']:.1f} / {f['median_s']:.1f}", f"{f['decision_us']:.0f} µs",
                     f"{f['completed']} / {f['failed']} / {f['inflight_end']}", f"{f['wall_s']:.0f} s"))
    pool = ", ".join(f"{n} × {k}" for k, n in counts.items())
    vs = [w.fedpool["vs_ideal"] for w in worlds]
    text = (f"World: {spec.servers} servers ({pool}), max running {spec.max_running} each; {spec.evals} evals of "
            f"{spec.min_size}–{spec.max_size} requests each (sizes drawn from each world's seed), shaped as the "
            f"Table 7 modalities. fedpool: {how}. Simulated time (benchmarks/simulator.py: the real dispatcher and "
            "policies against the emulator's engine model, the registry's probe cycle scraping every engine every "
            "2 s); the decision cost is process CPU time inside the dispatcher's grant step per slot granted. "
            "Baselines: the ideal (the LP bound at saturated cost; no request faster than alone on the fastest "
            "server) and least outstanding work (every request sent at once to the server with the least "
            "outstanding priced work per unit of speed, its own included; the engines queue the rest).\n\n"
            + markdown_table(("world", "requests", "ideal", "fedpool (÷ ideal)",
                              *(("the same processes leasing slots (÷ ideal)",) if leased else ()),
                              "least outstanding work (÷ ideal)", "eval done: first / median", "decision",
                              "completed / failed / in flight at end", "machine time"), rows)
            + f"\n\nfedpool ÷ ideal over the worlds: {_spread(vs)} (mean, then the lowest and highest world)"
            + (f"; the same processes leasing slots: {_spread([w.leasing['vs_ideal'] for w in worlds if w.leasing])}"
               if leased else "")
            + (f"; least outstanding work: {_spread([w.baseline['vs_ideal'] for w in worlds if w.baseline])}"
               if all(w.baseline for w in worlds) else "")
            + f". Decision cost: {_spread([w.fedpool['decision_us'] for w in worlds], '{:.0f}')} µs per grant.")
    waves = [(w.seed, wave) for w in worlds for wave in w.fedpool.get("waves", ())]
    if waves:
        text += ("\n\nOne wave (federation/routing/wave.py: every request fit the pool's room at once, so each server "
                 "kind was probed by one request alone, the long answers placed at once, the rest assigned together "
                 "once the probes answered): " + "; ".join(
                     f"world {seed}: {w['probes']} probes, {w['assigned']} requests assigned, {w['followed']} placed "
                     f"as assigned, {w['dropped']} given up, held {w['held']} times (full or still prefilling), "
                     f"modelled makespan {w['predicted_s']:.1f} s" for seed, w in waves) + ".")
    text += "\n\n" + _where_time_goes(worlds)
    if agreement is not None:
        simulated, walled, pct = agreement
        text += (f"\n\nAgreement with the wall clock (world {worlds[0].seed}'s shapes at 32 servers × 8 evals, "
                 f"emulated HTTP servers in another process at {speedup:g}× real time, both without the probe "
                 f"cycle): simulated {simulated:.1f} s, wall-clock {walled:.1f} s (engine seconds): {pct:.1f}% apart.")
    return text


def _where_time_goes(worlds: list[WorldOutcome]) -> str:
    """Per world and server kind: what fedpool (and the baseline) gave it, and when its servers went idle."""
    rows = []
    for w in worlds:
        for kind, f in sorted(w.fedpool["kinds"].items()):
            b = w.baseline["kinds"].get(kind) if w.baseline is not None else None
            requests = ", ".join(f"{m} {n}" for m, n in sorted(f["requests"].items())) or "none"
            rows.append((w.seed, kind, f["servers"], requests,
                         f"{f['work_per_server_s']:.1f} s ({f['busy_share']:.0%})",
                         f"{f['last_median_s']:.1f} / {f['last_max_s']:.1f} s",
                         f"{b['work_per_server_s']:.1f} s ({b['busy_share']:.0%})" if b is not None else "—",
                         f"{b['last_median_s']:.1f} / {b['last_max_s']:.1f} s" if b is not None else "—"))
    return ("Where the time goes, per server kind: the requests fedpool sent there by modality; the work they are, "
            "priced at saturated cost, per server (as the ideal prices it; in brackets its share of the makespan: "
            "the ideal keeps every kind at 100% to its end); and when the kind's servers answered their last "
            "request (median / latest).\n\n"
            + markdown_table(("world", "kind", "servers", "fedpool: requests", "fedpool: work per server",
                              "fedpool: last answer", "least outstanding work: work per server",
                              "least outstanding work: last answer"), rows))


def _result(spec: Spec, worlds: list[WorldOutcome], agreement: tuple[float, float, float] | None) -> dict[str, object]:
    vs = [w.fedpool["vs_ideal"] for w in worlds]
    decisions = [w.fedpool["decision_us"] for w in worlds]
    values: dict[str, object] = {"mode": "virtual", "servers": spec.servers, "evals": spec.evals,
                                 "vs_ideal": f"{sum(vs) / len(vs):.3f}", "vs_ideal_max": f"{max(vs):.3f}",
                                 "decision_us": f"{sum(decisions) / len(decisions):.0f}", "worlds": len(worlds)}
    if spec.processes != 1:
        values["processes"] = spec.processes
    if spec.delegate:
        values["design"] = "gateway"
        leased = [w.leasing["vs_ideal"] for w in worlds if w.leasing is not None]
        if leased:
            values["leases_vs_ideal"] = f"{sum(leased) / len(leased):.3f}"
        below = [w.fedpool["vs_ideal"] < w.baseline["vs_ideal"] for w in worlds if w.baseline is not None]
        if below:
            values["below_least_work_worlds"] = f"{sum(below)}/{len(below)}"
    if agreement is not None:
        values["agreement_pct"] = f"{agreement[2]:.1f}"
    values["machine_s"] = f"{sum(w.fedpool['wall_s'] for w in worlds):.0f}"
    return values


if __name__ == "__main__":
    main()
