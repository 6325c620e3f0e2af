"""Scale by simulation: the dispatcher and a routing policy driving 256 emulated servers for 64 concurrent
evals, with the emulators running faster than real time so it fits a few minutes on a laptop.

    python -m fedpool.benchmarks.scale_sim [--servers 256] [--evals 64] [--speedup 2] [--policy capacity_weighted]

The pool mixes a quarter A100-vLLM, a quarter A100-SGLang and half V100-vLLM servers (the data-sheet
profiles of `deploy/emulator.py`, max running sequences capped at `--max-running` so the 64 evals keep
the pool saturated), all real aiohttp servers in one child process. Each eval is a stream of requests
shaped like one of the Table 7 modalities (text: short prompts, long answers; image: ~1k prompt tokens,
short answers; caption; video: ~7k prompt tokens), sent through one dispatcher with `--concurrency` in
flight per eval. Reported: the dispatcher's decision cost per request (CPU time it spends granting
slots, and its whole process's CPU per request), the makespan against the ideal (the larger of the LP
bound at saturated cost and the longest single request), and per-eval completion times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import resource
import statistics
import time
from dataclasses import asdict, replace
from multiprocessing.synchronize import Event
from typing import TypedDict

import psutil

from fedpool.benchmarks.assignment import Workload, ideal_makespan
from fedpool.benchmarks.report import markdown_table, write_report
from fedpool.deploy.emulator import PROFILES, EmulatorProfile

MODEL = "sim-7b"
SHAPES = {  # modality: (prompt tokens, answer tokens), as benchmarks/configs/table7_evals.yaml
    "text": (250, 384),
    "image": (1100, 24),
    "caption": (900, 96),
    "video": (7000, 32),
}
GROUPS = (("vllm-a100-80gb-7b", "A100", 0.25), ("sglang-a100-80gb-7b", "A100", 0.25),
          ("vllm-v100-32gb-7b", "V100", 0.5))


def pool_profiles(max_running: int) -> dict[str, EmulatorProfile]:
    return {name: replace(PROFILES[name], max_running=max_running, output_spread=0.0) for name, _, _ in GROUPS}


def full_step(profile: EmulatorProfile, modality: str) -> float:
    """One decode step of a full batch of this modality's requests (as `assignment.saturated_cost` prices it)."""
    prompt, answer = SHAPES[modality]
    n = profile.max_running
    if profile.kv_cache_tokens is not None:
        n = max(1, min(n, int(profile.kv_cache_tokens // (prompt + answer))))
    return (profile.decode_s_per_token * (1 + profile.batch_slowdown * (n - 1))
            + profile.attn_s_per_ctx_token * n * (prompt + answer / 2))


class DriveFigures(TypedDict):
    """What `drive` measured: wall and CPU seconds, the dispatcher's counters, each eval's completion time."""

    wall_s: float
    finished: dict[str, float]
    completed: int
    failed: int
    decisions: int
    decision_s: float
    process_cpu_s: float
    inflight_end: int
    on_server_s: float
    expected_on_server_s: float


def _farm(counts: dict[str, int], profiles_json: str, speedup: float, out: mp.Queue, stop: Event) -> None:
    from fedpool.deploy.emulator import EmulatedServer

    profiles = {k: EmulatorProfile(**v) for k, v in json.loads(profiles_json).items()}

    async def main() -> None:
        servers = []
        for name, n in counts.items():
            for i in range(n):
                servers.append((name, EmulatedServer(model=MODEL, profile=profiles[name], speedup=speedup, seed=i)))
        for _, server in servers:
            await server.start()
        out.put([(name, server.url) for name, server in servers])
        await asyncio.to_thread(stop.wait)
        for _, server in servers:
            await server.stop()

    asyncio.run(main())


async def drive(urls: list[tuple[str, str]], evals: list[tuple[str, str, int]], args: argparse.Namespace,
                ) -> DriveFigures:
    from fedpool.federation import DispatchConfig, Dispatcher, Endpoint, InferenceRequest, make_policy, new_session
    from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus
    from fedpool.registry.weights import prior_weight

    accel = {name: acc for name, acc, _ in GROUPS}
    entries = []
    for i, (name, url) in enumerate(urls):
        engine = Engine.SGLANG if "sglang" in name else Engine.VLLM
        record = ServerRecord(id=f"{name}-{i}", url=url, engine=engine, model=MODEL,
                              accelerator=accel[name], gpu_count=1, capacity=args.max_running)
        entries.append(ServerEntry(record, ServerStatus.HEALTHY, args.max_running, prior_weight(record)))
    snap = PoolSnapshot(1, 0.0, tuple(entries))
    words = [f"w{i}" for i in range(5000)]
    # Prompts are built before the clock starts (a real eval loads its data on CPU actors, overlapped): the
    # clock is the dispatcher's and the servers', not a Python loop joining 6,000-word strings.
    prompts = {name: [" ".join(random.Random(f"{name}/{k}").choices(words, k=SHAPES[modality][0]))
                      for k in range(size)] for name, modality, size in evals}
    finished: dict[str, float] = {}
    profiles = pool_profiles(args.max_running)
    expected_s = [0.0]
    in_flight_s = [0.0]  # seconds requests spent on a server (sent until answered, not waiting in the dispatcher)
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    async with new_session() as session:
        policy = make_policy("planned" if args.planned else args.policy, random.Random(0))
        dispatcher = Dispatcher(session, lambda: snap, policy,
                                config=DispatchConfig(hedging=False, adaptive_windows=not args.fixed_windows))

        async def one_eval(name: str, modality: str, size: int) -> None:
            prompt_tokens, answer = SHAPES[modality]
            queue = list(range(size))
            left = [size]
            # What an EvalRun reports: work left (for shortest_first) and requests left (for the planner).
            dispatcher.set_client_remaining(name, float(size * (prompt_tokens + answer)), size)

            async def worker() -> None:
                while queue:
                    k = queue.pop()
                    prompt = prompts[name][k]
                    result = await dispatcher.submit(InferenceRequest.from_body(
                        {"prompt": prompt, "max_tokens": answer, "ignore_eos": True},
                        request_id=f"{name}/{k}", model=MODEL, endpoint=Endpoint.COMPLETIONS, client_id=name))
                    on_server = sum(a.latency_s for a in result.attempts)
                    in_flight_s[0] += on_server
                    kind = result.server_id.rsplit("-", 1)[0]
                    # What the request would take in a full batch of this engine, by the data sheet: its
                    # prefill and its answer's decode steps at full batch (the ideal's accounting).
                    profile = profiles[kind]
                    full_batch_s = prompt_tokens * profile.prefill_s_per_token + answer * full_step(profile, modality)
                    expected_s[0] += full_batch_s / args.speedup
                    left[0] -= 1
                    dispatcher.set_client_remaining(name, float(left[0] * (prompt_tokens + answer)), left[0])

            await asyncio.gather(*(worker() for _ in range(min(args.concurrency, size))))
            finished[name] = time.perf_counter() - started

        await asyncio.gather(*(one_eval(*ev) for ev in evals))
        stats = dispatcher.stats()
    wall = time.perf_counter() - started
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    return {"wall_s": wall, "finished": finished, "completed": stats.completed, "failed": stats.failed,
            "decisions": stats.decisions, "decision_s": stats.decision_s, "process_cpu_s": cpu,
            "inflight_end": stats.inflight_total,
            "on_server_s": in_flight_s[0], "expected_on_server_s": expected_s[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=256)
    parser.add_argument("--evals", type=int, default=64)
    parser.add_argument("--min-size", type=int, default=60)
    parser.add_argument("--max-size", type=int, default=180)
    parser.add_argument("--speedup", type=float, default=2.0, help="emulated engine seconds per wall second")
    parser.add_argument("--max-running", type=int, default=16, help="max running sequences per server")
    parser.add_argument("--concurrency", type=int, default=200, help="requests in flight per eval")
    parser.add_argument("--policy", default="capacity_weighted")
    parser.add_argument("--fixed-windows", action="store_true",
                        help="admission windows fixed at each server's capacity (no learning)")
    parser.add_argument("--planned", action="store_true", help="route by the dispatcher's makespan plan")
    parser.add_argument("--name", default="scale_sim", help="report name: results/NAME.md")
    args = parser.parse_args()
    profiles = pool_profiles(args.max_running)
    counts = {name: max(1, round(args.servers * share)) for name, _, share in GROUPS}
    rng = random.Random(7)
    modalities = list(SHAPES)
    evals = [(f"eval-{i:02d}-{modalities[i % 4]}", modalities[i % 4], rng.randint(args.min_size, args.max_size))
             for i in range(args.evals)]
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    stop = ctx.Event()
    farm = ctx.Process(target=_farm, args=(counts, json.dumps({k: asdict(v) for k, v in profiles.items()}),
                                           args.speedup, out, stop), daemon=True)
    farm.start()
    urls = out.get(timeout=300)
    print(f"{len(urls)} emulated servers up; {len(evals)} evals, {sum(s for *_, s in evals)} requests", flush=True)
    farm_proc = psutil.Process(farm.pid)
    farm_cpu_before = sum(farm_proc.cpu_times()[:2])
    try:
        r = asyncio.run(drive(urls, evals, args))
        farm_cpu = sum(farm_proc.cpu_times()[:2]) - farm_cpu_before
    finally:
        stop.set()
        farm.join(30)
    sizes = {name: size for name, _, size in evals}
    work = [Workload(name, size, float(SHAPES[m][0]), float(SHAPES[m][1])) for name, m, size in evals]
    lp_engine_s, _ = ideal_makespan(work, profiles, counts)
    # No request can finish faster than alone on the fastest server: prefill, then its answer's decode steps.
    longest = max(min(p.prefill_s_per_token * pt + p.decode_s_per_token * at for p in profiles.values())
                  for pt, at in SHAPES.values())
    ideal_s = max(lp_engine_s, longest) / args.speedup
    requests = sum(sizes.values())
    per_decision_us = r["decision_s"] / max(1, r["decisions"]) * 1e6
    per_request_cpu_ms = r["process_cpu_s"] / max(1, r["completed"]) * 1e3
    stretch = r["on_server_s"] / r["expected_on_server_s"]
    client_cores = r["process_cpu_s"] / r["wall_s"]
    occupancy = r["on_server_s"] / (len(urls) * args.max_running * r["wall_s"])
    done_times = sorted(r["finished"].values())
    by_modality = {m: statistics.median(t for n, t in r["finished"].items() if n.endswith(m)) for m in SHAPES}
    rows = [
        ("servers", f"{len(urls)} ({', '.join(f'{n} × {k}' for k, n in counts.items())}), max running "
         f"{args.max_running} each, emulators at {args.speedup:g}× real time", ""),
        ("evals / requests", f"{len(evals)} / {requests} ({r['completed']} completed, {r['failed']} failed)", ""),
        ("dispatcher decision cost", f"{per_decision_us:.0f} µs per granted slot ({r['decisions']} grants)",
         "CPU time inside the grant step (queue order, policy, accounting)"),
        ("client process CPU per request", f"{per_request_cpu_ms:.2f} ms",
         "everything: HTTP, JSON, dispatcher, 64 evals' coroutines"),
        ("CPU used during the run: client process + emulator farm",
         f"{client_cores:.2f} + {farm_cpu / r['wall_s']:.2f} of {os.cpu_count()} cores",
         "the client process is one event loop: it can use one core at most"),
        ("makespan", f"{r['wall_s']:.1f} s", ""),
        ("ideal", f"{ideal_s:.1f} s (LP at saturated cost {lp_engine_s / args.speedup:.1f} s; longest single "
         f"request {longest / args.speedup:.2f} s)", ""),
        ("makespan ÷ ideal", f"{r['wall_s'] / ideal_s:.2f}", ""),
        ("request time on a server ÷ its full-batch time", f"{stretch:.2f}",
         "measured attempt seconds ÷ (prefill + answer × full-batch decode step) by the data sheet; above 1: the "
         "emulated engines ran slower than their own full-batch figure (prefills of others stalling the batch, "
         "the farm's event loop)"),
        ("slot occupancy", f"{occupancy:.0%}", "seconds requests spent on a server ÷ (slots × makespan): how full "
         "the engines' batches were kept"),
        ("eval completion: first / median / last", f"{done_times[0]:.1f} / {statistics.median(done_times):.1f} / "
         f"{done_times[-1]:.1f} s", ""),
        ("median completion by modality", ", ".join(f"{m} {t:.1f} s" for m, t in by_modality.items()), ""),
        ("in flight after the run", str(r["inflight_end"]), "must be 0"),
    ]
    body = (
        ("Planned routing (`--planned`)" if args.planned else f"Policy `{args.policy}`")
        + f", {args.concurrency} requests in flight per eval, one dispatcher in one process; "
        "the emulated servers in another process on the same 2 cores.\n\n"
        + markdown_table(("what", "figure", "note"), rows)
        + "\n\nHow to read it: the ideal is a fluid bound — every server's batch full all the time, work split "
        f"like a fluid. What ran: the engines' slots were {occupancy:.0%} occupied, and a request spent "
        f"{stretch:.1f}× its full-batch time on its server. Occupancy alone would put the makespan at "
        f"{occupancy:.0%} of what it was; the rest is the engines running below their data-sheet rate under this "
        f"load (others' prefills stalling each batch, and {len(urls)} emulated servers sharing one process's event "
        f"loop at {args.speedup:g}× real time; `--servers 32 --evals 8` runs the same shapes smaller to compare). "
        + (f"The client process, one event loop, was busy {client_cores:.0%} of the run: its own CPU — at "
           f"{per_decision_us:.0f} µs per grant, mostly the grant step — sets the pace. " if client_cores >= 0.8 else
           f"Neither process was CPU-bound (client {client_cores:.2f}, farm {farm_cpu / r['wall_s']:.2f} cores), "
           "so the gap is the harness and the schedule, not the machine's cores. ")
        + "The grant step samples candidates (a few random draws, a full scan only when "
        "those find too few; the planned policy scans a server kind's members until one has room), but under "
        "saturation most servers are full, so its cost grows with the pool: see the decision row."
        + "\n\nThe projection to 10,000 servers (what changes: snapshot deltas, sharded registries, "
        "per-route candidate sampling) is in `docs/speedup.md`."
    )
    for row in rows:
        print(f"{row[0]:<40} {row[1]}")
    write_report(args.name, f"Scale by simulation: {len(urls)} servers, {len(evals)} evals", body, {
        "servers": len(urls), "evals": len(evals), "requests": requests,
        "decision_us": f"{per_decision_us:.0f}", "cpu_ms_per_request": f"{per_request_cpu_ms:.2f}",
        "makespan_s": f"{r['wall_s']:.1f}", "vs_ideal": f"{r['wall_s'] / ideal_s:.2f}",
    })


if __name__ == "__main__":
    main()
