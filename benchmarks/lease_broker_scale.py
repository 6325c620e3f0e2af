"""The lease broker at scale: the registry's capacity lease path (registry/leases.py's LeaseService and
LeaseBroker, behind the actor's `lease` call: the report parsed from what Ray delivers) with N simulated
holders over S servers, renewing at the production rate, on the wall clock.

    python -m fedpool.benchmarks.lease_broker_scale [--holders 1000] [--servers 10000] [--models 1] [--shards 1]
        [--seconds 30] [--warmup 20]

Each broker shard runs in a process of its own (one core at most, as the single-threaded registry actor): it
takes length-prefixed pickled calls on a Unix socket (Ray pickles the call's arguments: the report as a dict) and
answers each as the actor does. The holders run in this process: every holder is the product's `LeaseClient`
(federation/gateway/leases.py: its long polls, pokes and idle hold) over a modelled process — its evals' requests
waiting and in flight (`wanted`), each slot finishing a request every SERVICE_S on average, a new eval after an
eval ends (after an idle spell), their work left as their rank (shortest_first), their cost per server kind as
the data sheets price four shapes. The pool: the scale simulator's three kinds (vLLM and SGLang on A100, vLLM on
V100, 1:1:2), 16 slots a server, `--models` models over the servers round robin; `--shards` brokers, each the
models whose index is its number modulo the shards (sharded by model: a holder talks to its model's broker).

Measured over the window after the warm-up: the broker processes' CPU (process time, per shard), its share of
one core, CPU per renewal (everything but the re-shares, per call) and per re-share, re-share time (p50/p99), the
renewals per second all holders had answered, and the lease staleness holders see: from the re-share that
changed a holder's slots to its lease client applying them, and from the report that was answered with a
changed lease to that answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import pickle
import random
import statistics
import struct
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

from fedpool.benchmarks.report import markdown_table, write_report
from fedpool.federation.gateway.leases import RENEW_S, LeaseClient
from fedpool.registry import ClientDemand, DemandReport, Lease, ModelDemand, Served
from fedpool.registry.leases import RESHARE_BUDGET, LeaseBroker, LeaseServer, LeaseService

KINDS = (("A100:vllm", 0.25), ("A100:sglang", 0.25), ("V100:vllm", 0.5))  # server kind, share of the pool
SLOTS = 16  # per server (the scale simulator's --max-running)
SERVICE_S = 8.0  # a slot finishes a request this often, on average
# Shapes (prompt, answer tokens) priced per kind as the data sheets do, relative: what one request costs there.
SHAPE_COSTS = (
    {"A100:vllm": 1.0, "A100:sglang": 1.05, "V100:vllm": 2.6},  # text
    {"A100:vllm": 1.0, "A100:sglang": 1.0, "V100:vllm": 1.8},  # image
    {"A100:vllm": 1.0, "A100:sglang": 1.02, "V100:vllm": 1.9},  # caption
    {"A100:vllm": 1.0, "A100:sglang": 1.0, "V100:vllm": 3.4},  # video
)
HEADER = struct.Struct("!I")


@dataclass(frozen=True)
class Spec:
    holders: int
    servers: int
    models: int
    shards: int
    seconds: float
    warmup_s: float
    seed: int


def model_of(index: int, spec: Spec) -> str:
    return f"model-{index % spec.models}"


def servers_of(spec: Spec, shard: int) -> list[LeaseServer]:
    """The servers of the models this shard shares (model i on shard i mod shards)."""
    out = []
    bounds = [0.0]
    for _, share in KINDS:
        bounds.append(bounds[-1] + share)
    for i in range(spec.servers):
        if (i % spec.models) % spec.shards != shard:
            continue
        at = (i * 0.618034) % 1.0  # (kinds interleaved evenly over the servers)
        kind = next(k for (k, _), hi in zip(KINDS, bounds[1:], strict=True) if at < hi)
        out.append(LeaseServer(f"s{i}", model_of(i, spec), SLOTS, kind))
    return out


# ---- the broker side: one process per shard ---------------------------------------------------------------------
class TimedBroker(LeaseBroker):
    """The broker, its re-shares timed, and when each holder's slots last changed (monotonic)."""

    def __init__(self) -> None:
        super().__init__(time.monotonic, restarted=False)
        self.reshare_wall: list[float] = []
        self.reshare_cpu: list[float] = []
        self.changed_at: dict[str, float] = {}

    def reshare(self) -> set[str]:
        wall, cpu = time.perf_counter(), time.process_time()
        changed = super().reshare()
        self.reshare_cpu.append(time.process_time() - cpu)
        self.reshare_wall.append(time.perf_counter() - wall)
        now = time.monotonic()
        for holder in changed:
            self.changed_at[holder] = now
        return changed


async def _read(reader: asyncio.StreamReader) -> Any:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def _frame(payload: object) -> bytes:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


async def _serve(path: str, spec: Spec, shard: int, ready: MpEvent) -> None:
    broker = TimedBroker()
    service = LeaseService(broker, budget=RESHARE_BUDGET)  # (as the registry actor runs it)
    service.set_servers(servers_of(spec, shard))
    done = asyncio.Event()

    async def call(writer: asyncio.StreamWriter, cid: int, args: tuple[Any, ...]) -> None:
        report, known_version, wait_s = args
        parsed = DemandReport.model_validate(report)  # (as the registry actor does with what Ray delivers)
        lease = await service.lease(parsed, known_version, wait_s)
        writer.write(_frame((cid, lease, broker.changed_at.get(parsed.holder))))

    def stats() -> dict[str, Any]:
        return {"cpu_s": time.process_time(), "calls": service.calls, "reshare_wall": list(broker.reshare_wall),
                "reshare_cpu": list(broker.reshare_cpu), "holders": len(broker.holders())}

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: set[asyncio.Task[None]] = set()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                cid, op, args = await _read(reader)
                if op == "lease":
                    task = asyncio.ensure_future(call(writer, cid, args))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif op == "release":
                    task = asyncio.ensure_future(service.release(args[0]))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif op == "stats":
                    writer.write(_frame((cid, stats(), None)))
                elif op == "stop":
                    done.set()
                    return

    server = await asyncio.start_unix_server(connection, path)
    ready.set()
    async with server:
        await done.wait()


def _shard_main(path: str, spec: Spec, shard: int, ready: MpEvent) -> None:  # runs in a child process
    asyncio.run(_serve(path, spec, shard, ready))


# ---- the holder side: this process ------------------------------------------------------------------------------
class Wire:
    """One connection to a broker shard, shared by the holders of its models: the `LeaseRegistry` their lease
    clients call. Notes, per holder, when the broker changed the slots it answers with."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._pending: dict[int, asyncio.Future[tuple[Any, Any]]] = {}
        self._ids = 0
        self._task = asyncio.ensure_future(self._answers())

    async def _answers(self) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                cid, answer, changed_at = await _read(self._reader)
                future = self._pending.pop(cid, None)
                if future is not None and not future.done():
                    future.set_result((answer, changed_at))

    def send(self, op: str, *args: object) -> None:
        """A call that is not answered."""
        self._ids += 1
        self._writer.write(_frame((self._ids, op, args)))

    async def request(self, op: str, *args: object) -> tuple[Any, Any]:
        self._ids += 1
        cid = self._ids
        future: asyncio.Future[tuple[Any, Any]] = asyncio.get_running_loop().create_future()
        self._pending[cid] = future
        self._writer.write(_frame((cid, op, args)))
        try:
            return await future
        finally:
            self._pending.pop(cid, None)


@dataclass
class Seen:
    """What the holders saw in the measured window."""

    started_at: float = 0.0
    measuring: bool = False
    answers: int = 0
    staleness: list[float] = field(default_factory=list)  # s: broker changed the slots -> the holder applied them
    report_age: list[float] = field(default_factory=list)  # s: report sent -> its changed lease back


class Holder:
    """A process's dispatcher as the lease client sees it (`LeaseHolder`): its evals' requests, finishing at the
    rate its slots allow, and the registry as its lease client calls it (`LeaseRegistry`, through `Wire`)."""

    def __init__(self, name: str, model: str, wire: Wire, seen: Seen, rng: random.Random):
        self.name, self.model, self._wire, self._seen, self._rng = name, model, wire, seen, rng
        self.on_demand: Callable[[bool], None] | None = None
        self.on_over_lease_release: Callable[[], None] | None = None
        self._evals: list[list[Any]] = []  # [client, wanted (float), cost per kind]
        self._lease: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self._at = time.monotonic()
        self._done = 0.0
        self._version = -1
        self._count = 0
        self._start_eval()
        if rng.random() < 0.5:
            self._start_eval()

    def _start_eval(self) -> None:
        self._count += 1
        self._evals.append([f"{self.name}/e{self._count}", float(self._rng.randint(100, 600)),
                            self._rng.choice(SHAPE_COSTS)])

    def _progress(self) -> None:
        now = time.monotonic()
        self._done += sum(self._inflight.values()) * (now - self._at) / SERVICE_S
        self._at = now
        while self._evals and self._done >= 1.0:
            take = min(self._evals[0][1], float(int(self._done)))
            self._evals[0][1] -= take
            self._done -= take
            if self._evals[0][1] < 1.0:
                self._evals.pop(0)
                if not self._evals:
                    self._done = 0.0
                    asyncio.get_running_loop().call_later(self._rng.expovariate(1 / 3.0), self._next)
        self._spread()

    def _next(self) -> None:
        idle = not self._evals
        self._start_eval()
        if idle and self.on_demand is not None:
            self.on_demand(True)

    def _spread(self) -> None:
        """In flight: its lease, filled as far as its requests go."""
        left = int(sum(e[1] for e in self._evals))
        inflight = {}
        for sid, n in self._lease.items():
            if left <= 0:
                break
            inflight[sid] = min(n, left)
            left -= inflight[sid]
        self._inflight = inflight

    # ---- LeaseHolder ----
    def demand(self) -> tuple[ModelDemand, ...]:
        self._progress()
        if not self._evals:
            return ()
        (costs, *_) = [e[2] for e in self._evals]
        clients = tuple(ClientDemand(client=c, wanted=int(w) + 1, rank=w * min(k.values()),
                                     work_left=w * min(k.values())) for c, w, k in self._evals)
        return (ModelDemand(model=self.model, clients=clients, kind_costs=costs),)

    def inflight(self) -> dict[str, int]:
        return dict(self._inflight)

    def held(self) -> dict[str, int]:
        return dict(self._lease)

    def apply_lease(self, slots: Mapping[str, int] | None) -> None:
        self._progress()
        self._lease = dict(slots or {})
        self._spread()

    def done_sending(self, client_id: str) -> bool:
        return False

    def served_totals(self) -> Served:
        return Served()

    def price_by_pool(self, served: Served) -> None:
        pass

    # ---- LeaseRegistry ----
    async def lease(self, report: DemandReport, known_version: int = -1, wait_s: float = 0.0) -> Lease:
        sent = time.monotonic()
        lease, changed_at = await self._wire.request("lease", report.model_dump(), known_version, wait_s)
        assert isinstance(lease, Lease)
        now = time.monotonic()
        seen = self._seen
        if seen.measuring:
            seen.answers += 1
            if lease.version != self._version and changed_at is not None and changed_at >= seen.started_at:
                seen.staleness.append(now - changed_at)
                seen.report_age.append(now - sent)
        self._version = lease.version
        return lease

    async def release_lease(self, holder: str) -> None:
        self._wire.send("release", holder)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _drive(spec: Spec, paths: list[str]) -> tuple[Seen, list[dict[str, Any]], list[dict[str, Any]]]:
    wires = []
    for path in paths:
        reader, writer = await asyncio.open_unix_connection(path, limit=2**26)
        wires.append(Wire(reader, writer))
    seen = Seen()
    rng = random.Random(spec.seed)
    holders, clients = [], []
    for i in range(spec.holders):
        model = i % spec.models
        holder = Holder(f"h{i}", f"model-{model}", wires[model % spec.shards], seen, random.Random(rng.random()))
        client = LeaseClient(holder, holder, holder=holder.name, renew_s=RENEW_S)
        holders.append(holder)
        clients.append(client)
    for client in clients:
        await client.start()
        client.poke()
    await asyncio.sleep(spec.warmup_s)
    before = [(await w.request("stats"))[0] for w in wires]
    seen.started_at, seen.measuring = time.monotonic(), True
    await asyncio.sleep(spec.seconds)
    seen.measuring = False
    after = [(await w.request("stats"))[0] for w in wires]
    await asyncio.gather(*(c.stop() for c in clients))
    return seen, before, after


def run(spec: Spec) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"shard-{i}.sock") for i in range(spec.shards)]
        procs = []
        for i, path in enumerate(paths):
            ready = ctx.Event()
            proc = ctx.Process(target=_shard_main, args=(path, spec, i, ready), daemon=True)
            proc.start()
            if not ready.wait(120):
                raise RuntimeError("a broker shard did not start")
            procs.append(proc)
        cpu0 = time.process_time()
        try:
            seen, before, after = asyncio.run(_drive(spec, paths))
        finally:
            for path in paths:
                with contextlib.suppress(OSError):
                    asyncio.run(_stop(path))
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        holder_cpu = time.process_time() - cpu0
    return summarize(spec, seen, before, after, holder_cpu)


async def _stop(path: str) -> None:
    _, writer = await asyncio.open_unix_connection(path)
    writer.write(_frame((0, "stop", ())))
    await writer.drain()
    writer.close()


def summarize(spec: Spec, seen: Seen, before: list[dict[str, Any]], after: list[dict[str, Any]],
              holder_cpu: float) -> dict[str, Any]:
    shards = []
    for b, a in zip(before, after, strict=True):
        n0 = len(b["reshare_wall"])
        walls, cpus = a["reshare_wall"][n0:], a["reshare_cpu"][n0:]
        cpu, calls = a["cpu_s"] - b["cpu_s"], a["calls"] - b["calls"]
        shards.append({
            "cores": cpu / spec.seconds, "calls": calls, "reshares": len(walls),
            "renewal_us": 1e6 * (cpu - sum(cpus)) / max(1, calls),
            "reshare_ms_mean": 1e3 * statistics.fmean(cpus) if cpus else float("nan"),
            "reshare_ms_p50": 1e3 * pct(walls, 0.5), "reshare_ms_p99": 1e3 * pct(walls, 0.99),
            "holders": a["holders"]})
    return {"shards": shards, "renewals_per_s": seen.answers / spec.seconds,
            "staleness_ms": (1e3 * pct(seen.staleness, 0.5), 1e3 * pct(seen.staleness, 0.99)),
            "report_age_ms": (1e3 * pct(seen.report_age, 0.5), 1e3 * pct(seen.report_age, 0.99)),
            "changes": len(seen.staleness), "holder_process_cpu_s": holder_cpu}


def report(spec: Spec, out: dict[str, Any], name: str) -> None:
    shards = out["shards"]
    rows = [[i, s["holders"], s["calls"], f"{s['calls'] / spec.seconds:.0f}", f"{s['cores']:.2f}",
             f"{s['renewal_us']:.0f} µs", s["reshares"], f"{s['reshare_ms_mean']:.1f} ms",
             f"{s['reshare_ms_p50']:.1f} / {s['reshare_ms_p99']:.1f} ms"] for i, s in enumerate(shards)]
    table = markdown_table(["shard", "holders", "calls", "calls/s", "broker cores", "CPU per renewal",
                            "re-shares", "CPU per re-share", "re-share time p50 / p99"], rows)
    stale, age = out["staleness_ms"], out["report_age_ms"]
    body = (
        f"World: {spec.holders} holders over {spec.servers} servers ({', '.join(f'{k} {s:.0%}' for k, s in KINDS)}"
        f", {SLOTS} slots each), {spec.models} model(s), {spec.shards} broker shard(s) (by model); each holder "
        f"the product's LeaseClient (renewing every {RENEW_S} s, long polls) over 1–2 evals of 100–600 requests, "
        f"each slot finishing a request every {SERVICE_S:g} s on average, a new eval after each ends. Measured "
        f"over {spec.seconds:g} s after {spec.warmup_s:g} s of warm-up, on the wall clock; each broker shard a "
        f"process of its own (the registry actor's lease path: the report parsed from a pickled dict, the "
        f"LeaseService, the LeaseBroker), the holders all in another.\n\n{table}\n\n"
        f"Renewals answered: {out['renewals_per_s']:.0f}/s. Lease staleness holders saw ({out['changes']} changed "
        f"leases): from the re-share that changed a holder's slots to its lease client applying them "
        f"{stale[0]:.0f} / {stale[1]:.0f} ms (p50 / p99); from the report answered with a changed lease to that "
        f"answer {age[0]:.0f} / {age[1]:.0f} ms. The holders' own process used "
        f"{out['holder_process_cpu_s']:.0f} CPU-s (not the broker's).")
    write_report(name, f"The lease broker at scale: {spec.holders} holders, {spec.servers} servers", body, {
        "holders": spec.holders, "servers": spec.servers, "renewals_per_s": f"{out['renewals_per_s']:.0f}",
        "broker_cores": f"{max(s['cores'] for s in shards):.2f}",
        "reshare_ms_p99": f"{max(s['reshare_ms_p99'] for s in shards):.1f}"})


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--holders", type=int, default=1000)
    parser.add_argument("--servers", type=int, default=10000)
    parser.add_argument("--models", type=int, default=1)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--name", default="lease_broker_scale")
    parser.add_argument("--no-report", action="store_true")
    args = parser.parse_args()
    spec = Spec(args.holders, args.servers, args.models, min(args.shards, args.models), args.seconds, args.warmup,
                args.seed)
    out = run(spec)
    print(out)
    if not args.no_report:
        report(spec, out, args.name)


if __name__ == "__main__":
    main()
