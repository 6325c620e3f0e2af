"""Routing policies side by side on a heterogeneous emulated pool (2 × A100-like + 4 × V100-like servers,
mixed prompt and output lengths), each against the ideal makespan of that pool.

    python -m fedpool.benchmarks.policies --requests 3000 --speedup 2

The ideal is total work ÷ aggregate saturated throughput: every server kept saturated for the whole run
with nothing left over (a fluid bound no schedule beats), with the engine model's costs (prefill is
serial and compute-bound, decode steps are shared by the batch). Profiles here are illustrative, set
from the A100/V100 memory-bandwidth ratio (~2×, decode is bandwidth-bound) and their usual batch sizes;
the calibrated emulator profiles belong to the engines issue.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import fedpool.benchmarks.baselines  # noqa: F401 (registers the baseline policies it routes by)
from fedpool.benchmarks.assignment import saturated_cost
from fedpool.benchmarks.report import markdown_table, write_report
from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile
from fedpool.federation import DispatchConfig, Dispatcher, Endpoint, InferenceRequest, make_policy, new_session
from fedpool.federation.gateway.transport import HttpTransport
from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus, prior_weight

POLICIES = ("capacity_weighted", "least_inflight", "power_of_two", "round_robin", "random", "prefix_affinity")


@dataclass(frozen=True)
class Kind:
    accelerator: str
    profile: EmulatorProfile
    count: int


POOL = (
    Kind("A100", EmulatorProfile("a100-illustrative", max_running=32, prefill_s_per_token=0.0002,
                                 decode_s_per_token=0.012, batch_slowdown=0.02, default_output_tokens=4096), 2),
    Kind("V100", EmulatorProfile("v100-illustrative", max_running=16, prefill_s_per_token=0.0005,
                                 decode_s_per_token=0.024, batch_slowdown=0.03, default_output_tokens=4096), 4),
)


def workload(n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt words, output tokens): short and long prompts, short and longer answers."""
    rng = random.Random(seed)
    return [(rng.choice((50, 200, 800)), rng.choice((16, 64))) for _ in range(n)]


def pool_rate(jobs: list[tuple[int, int]]) -> float:
    """Requests per engine second the whole pool completes when every engine is saturated: each request
    costs its (compute-bound, serial) prefill plus its share of full decode steps (deploy.batching's model,
    the same cost the speedup benchmark's ideal uses)."""
    return sum(kind.count / statistics.mean(saturated_cost(kind.profile, p, o) for p, o in jobs) for kind in POOL)


def ideal_makespan(jobs: list[tuple[int, int]], speedup: float) -> float:
    return len(jobs) / pool_rate(jobs) / speedup


async def run_policy(name: str, jobs: list[tuple[int, int]], args: argparse.Namespace) -> dict[str, object]:
    servers, entries = [], []
    for kind in POOL:
        for i in range(kind.count):
            server = EmulatedServer(model="bench-model", profile=kind.profile, speedup=args.speedup)
            await server.start()
            servers.append(server)
            record = ServerRecord(id=f"{kind.accelerator.lower()}-{i}", url=server.url, engine=Engine.VLLM,
                                  model="bench-model", accelerator=kind.accelerator, gpu_count=1,
                                  capacity=kind.profile.max_running)
            entries.append(ServerEntry(record, ServerStatus.HEALTHY, record.capacity or 1, prior_weight(record)))
    snap = PoolSnapshot(1, 0.0, tuple(entries))
    queue = list(enumerate(jobs))
    try:
        async with new_session() as session:
            config = DispatchConfig(no_server_timeout_s=5.0)
            dispatcher = Dispatcher(HttpTransport(session, config.timeouts), lambda: snap,
                                    make_policy(name, random.Random(args.seed)), config=config)

            async def worker(client: str) -> None:
                while True:
                    if not queue:
                        dispatcher.client_done_sending(client)  # the rest in flight is this eval's tail
                        return
                    i, (prompt, out) = queue.pop()
                    body = {"prompt": " ".join(["w"] * prompt), "max_tokens": out, "temperature": 0}
                    await dispatcher.submit(InferenceRequest.from_body(
                        body, request_id=f"r{i}", model="bench-model", endpoint=Endpoint.COMPLETIONS, client_id=client))

            started = time.perf_counter()
            await asyncio.gather(*(worker(f"eval-{c % args.clients}") for c in range(args.clients * args.per_client)))
            makespan = time.perf_counter() - started
            stats = dispatcher.stats()
    finally:
        for server in servers:
            await server.stop()
    share = Counter({s.server_id: s.answered for s in stats.servers})
    a100 = sum(v for k, v in share.items() if k.startswith("a100"))
    return {"makespan": makespan, "a100_share": a100 / max(1, sum(share.values())), "hedges": stats.hedges}


def run_scenario(jobs: list[tuple[int, int]], args: argparse.Namespace, per_client: int) -> dict[str, dict]:
    scenario = argparse.Namespace(**{**vars(args), "per_client": per_client})
    results = {}
    for name in POLICIES:
        results[name] = asyncio.run(run_policy(name, jobs, scenario))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--speedup", type=float, default=2.0, help="emulators run this many times real time")
    parser.add_argument("--clients", type=int, default=4, help="concurrent evals")
    parser.add_argument("--per-client", type=int, default=64, help="requests each eval keeps outstanding")
    parser.add_argument("--underloaded-per-client", type=int, default=16,
                        help="outstanding per eval in the second scenario (fewer than the pool's slots)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    jobs = workload(args.requests, args.seed)
    ideal = ideal_makespan(jobs, args.speedup)
    slots = sum(k.count * k.profile.max_running for k in POOL)
    a100_capacity_share = sum(
        k.count / statistics.mean(saturated_cost(k.profile, p, o) for p, o in jobs)
        for k in POOL if k.accelerator == "A100"
    ) / pool_rate(jobs)
    scenarios = [("saturated", args.per_client), ("under-loaded", args.underloaded_per_client)]
    tables, all_results = [], {}
    for label, per_client in scenarios:
        results = run_scenario(jobs, args, per_client)
        all_results[label] = results
        best = min(r["makespan"] for r in results.values())
        for name, r in results.items():
            print(f"{label:<13} {name:<18} makespan {r['makespan']:.2f} s ({r['makespan'] / ideal:.2f} × ideal "
                  f"{ideal:.2f} s)  A100 share {r['a100_share']:.0%}  hedges {r['hedges']}")
        rows = [
            (name, f"{r['makespan']:.2f}", f"{r['makespan'] / ideal:.2f}", f"{r['makespan'] / best:.2f}",
             f"{r['a100_share']:.0%}", r["hedges"])
            for name, r in results.items()
        ]
        outstanding = args.clients * per_client
        tables.append(
            f"### {label}: {args.clients} evals × {per_client} outstanding = {outstanding} requests, "
            f"{slots} slots\n\n"
            + markdown_table(("policy", "makespan (s)", "÷ ideal", "÷ best policy", "A100 share of requests",
                              "hedges"), rows)
        )
    body = (
        f"{args.requests} requests (prompts of 50/200/800 words, answers of 16/64 tokens, seed {args.seed}) from "
        f"{args.clients} concurrent evals, over "
        + ", ".join(f"{k.count} × {k.accelerator}-like (max {k.profile.max_running} running)" for k in POOL)
        + f" emulated servers at {args.speedup:g}× real time, all greedy (stragglers may be hedged at each eval's "
        f"tail). Ideal makespan (fluid bound, every server at its full batch throughout): {ideal:.2f} s, in which "
        f"the A100s do {a100_capacity_share:.0%} of the requests.\n\n"
        "Saturated, the admission windows decide: a slot frees on some server and the next request takes it, "
        "so every policy gives the fast servers their share and the policies tie. Under-loaded, the choice "
        "matters: policies blind to speed give the V100s as much as the A100s, and the run waits for them. "
        "(The under-loaded run cannot reach the fluid ideal, which assumes full batches everywhere; compare "
        "its policies with each other.)\n\n" + "\n\n".join(tables)
    )
    saturated = all_results["saturated"]
    write_report("policies", "Routing policies on a heterogeneous pool", body, {
        f"{name}_vs_ideal": f"{saturated[name]['makespan'] / ideal:.2f}"
        for name in ("capacity_weighted", "round_robin", "least_inflight", "power_of_two")
    })


if __name__ == "__main__":
    main()
