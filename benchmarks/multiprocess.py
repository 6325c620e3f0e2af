"""Many processes, one pool (issue 23, "The benchmark"): the same evals as N `fedpool eval run` processes against
one process, and two lm-eval processes each behind its own gateway replica against both behind one gateway, on a
real local pool.

    python -m fedpool.benchmarks.multiprocess --repeats 3

The pool is what `fedpool up` starts (deploy/localpool.py's `local_servers`): local Ray on loopback, the registry
(probing every 2 s) and N llama.cpp servers serving the bundled Gemma 3 270M. Every other process joins it as a
user's would (`--address`, `--state-dir`): each has its own dispatcher, leasing its slots from the registry's broker.
The eval processes, which start no CPU actors here, reach the registry over its HTTP API (the URL and token in the
state dir) and are no Ray drivers; the gateways join Ray.

1. **eval run**: N evals (`--processes`, default 8), half of them long-answer ones (`long_a`, `long_b`, ...: 40
   prompts x 48 tokens, no stop; the odd one out is long too) and half short ones (the bundled `arith`, `capitals`,
   `capitals_mc`, then renamed copies of them: `arith_2`, ...), as one `fedpool eval run` with N `--spec` (**one**),
   as N `fedpool eval run` processes started together, each leasing its slots (**multi**), and as the same N
   processes each sending through one `fedpool gateway` (**gateway**: `eval run --gateway`, the gateway placing
   every eval's requests, with `eval run`'s default routing), same flags otherwise; the order of the arms
   alternates between repeats. N = 4 is the issue-23 set: `long_a`, `long_b`, `arith`, `capitals`.
   Times are taken from launch (the moment the processes are started) with the wall clock the records carry
   (`provenance.completed_at`): an eval is done at its last record; its own time is its summary's `wall_time_s`
   and its start-up (launch to the eval's start: the process's imports, reaching the registry, its lease client)
   the difference.
2. **replicas**: two lm-eval processes (`local-completions`, realtool_speedup's invocation, `num_concurrent` = the
   pool's slots, one API key each) each behind its own `fedpool gateway` process (**two-replicas**) against both
   behind one (**one-gateway**); fresh gateways in every arm. realtool_speedup's start gate holds every request
   until both processes have sent one (lm-eval's start-up is outside the clock) and reads which server answered
   each request (the gateway's `X-Fedpool-Server`). `replicas_eval_vs_one`: each lm-eval run's time (start line
   to its last answer) behind two replicas ÷ behind one gateway, the median over repeats, the worse of the two runs.
   Each part's repeats follow one untimed run on the fresh pool (`--no-warmup`: none): the arm met first by the
   engines and the registry, with no cost learned yet, had read up to 1.4x the same arm's later repeats.
3. **lease traffic**: the registry's count of lease calls (`RegistryClient.leases()["calls"]`) before and after
   each arm, over the arm's wall time; the broker's holders and the slots it granted per server, sampled every
   0.5 s.

The engines' queue beyond their slots is each llama-server's own `llamacpp:requests_deferred`, sampled every 100 ms;
the machine's load (`os.getloadavg()`) is recorded at the start and end of every arm.

Cores: every process shares every core by default, as on a machine a user runs everything on. `--engine-cpus N`
(benchmarks/cores.py) keeps N cores for the engines and every other process — Ray, the registry, the eval processes,
the gateways, lm-eval, this script — on the rest, in both arms alike. On this project's 2-core machine that split
does not isolate the coordination: the clients then share one core, four processes start and refill their slots
slower on it than one, and the short evals finish later (3 repeats, engines on one core: makespan 4 processes ÷ 1
1.09×, the latest eval 1.30×, against 1.11× and 1.11× shared). The report gives, per arm, the engines' CPU seconds,
their wait for a core and everyone else's CPU, and the engines' prompt and generation counters.

Writes benchmarks/results/multiprocess.md, ending with
`result: processes=N repeats=N makespan_vs_one=X latest_eval_vs_one=X leases_makespan_vs_one=X
leases_latest_eval_vs_one=X max_engine_queue=N replicas_eval_vs_one=X replicas_busier_share=X lease_calls_per_s=X
over_capacity=N` (ratios: medians over repeats; the first two the gateway arm's, the `leases_` ones the multi arm's;
`over_capacity`: the registry's exported over-capacity counter over every arm, which must stay 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fedpool.benchmarks.cores import CoreSplit, kept_to, pin, split
from fedpool.benchmarks.realtool_speedup import (
    CpuMeter,
    CpuUse,
    StartGate,
    Workload,
    _child_env,
    _lm_eval_answers,
    _lm_eval_argv,
    _run_process,
    arith,
    stories,
)
from fedpool.benchmarks.report import RESULTS_DIR, code_version, compile_bytecode, markdown_table, write_report
from fedpool.federation.core.dispatcher import PREEMPTED
from fedpool.registry import RegistryClient

log = logging.getLogger("fedpool.multiprocess")

PROBE_INTERVAL_S = 2.0  # the registry's probe period, as `fedpool up` starts it
ENGINE_SAMPLE_S = 0.1  # the engines' /metrics, read this often
LEASE_SAMPLE_S = 0.5  # the broker's holders and grants, read this often
# What a process logs when its capacity lease lapses (federation/gateway/leases.py): renewed too late, or never granted.
LEASE_LAPSES = ("capacity lease not renewed in time", "no capacity lease from the registry")
RUN_FILE = "run.json"  # the run's arguments and start, in its work dir (what --from-work-dir re-renders)
LOST_COPY_WINDOW_S = 15.0  # a deferred request is set beside the straggler copies cancelled this long before it
STARVED_S = 5.0  # a replica without slots this long while its client sends is reported
SETTLE_S = 4.0  # between arms: every holder of the last arm has released or expired (the broker's TTL is 3 s)
PROCESS_TIMEOUT_S = 900.0
ENGINE_METRICS = ("llamacpp:requests_deferred", "llamacpp:requests_processing", "llamacpp:tokens_predicted_total",
                  # where the engines' time went: prompt tokens evaluated (those its prompt cache did not hold) and
                  # the seconds spent on them, and on generating
                  "llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total",
                  "llamacpp:tokens_predicted_seconds_total",
                  # how full its batches were: decode steps, and the mean busy slots per step since it started
                  "llamacpp:n_decode_total", "llamacpp:n_busy_slots_per_decode")
DECODE_METRICS = ("llamacpp:n_decode_total", "llamacpp:n_busy_slots_per_decode")
EVAL_ARMS = ("one", "multi", "gateway")
WARMUP_LIMIT = 8  # samples of each eval in part 1's untimed warm-up
TOOL_ARMS = ("one-gateway", "two-replicas")
TARGETS = {"processes": 8, "repeats": 3, "makespan_vs_one": 1.05, "latest_eval_vs_one": 1.10, "max_engine_queue": 1,
           "replicas_eval_vs_one": 1.10, "replicas_busier_share": 0.55, "over_capacity": 0}
PROCESSES = 8  # eval processes of the multi and gateway arms (`--processes`)
EVAL_CONCURRENCY = 64  # `eval run`'s default --concurrency (requests in flight per eval)
SHORT_EVALS = ("arith", "capitals", "capitals_mc")  # the bundled short evals, taken in this order (then copies)


# ---- the pool ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pool:
    model: str
    server_urls: dict[str, str]
    slots: int
    ray_address: str
    state_dir: Path
    registry: RegistryClient
    engine_pids: tuple[int, ...] = ()  # the llama.cpp servers' processes (CPU accounting)
    cores: CoreSplit | None = None  # engines and everything else on cores of their own (None: shared)


@contextlib.asynccontextmanager
async def local_pool(work: Path, servers: int, slots: int, threads: int,
                     cores: CoreSplit | None = None) -> AsyncIterator[Pool]:
    """`fedpool up`'s pool without its gateway: loopback Ray, the registry, the servers (deploy/localpool.py).
    With `cores`, this process (and so Ray, the registry and every client it starts) keeps to `cores.others` and
    every thread of each server to `cores.engines` once it is up (benchmarks/cores.py); this process back on its
    cores after."""
    with kept_to(cores.others) if cores is not None else contextlib.nullcontext():
        async with _local_pool(work, servers, slots, threads, cores) as pool:
            yield pool


@contextlib.asynccontextmanager
async def _local_pool(work: Path, servers: int, slots: int, threads: int,
                      cores: CoreSplit | None) -> AsyncIterator[Pool]:
    import ray

    from fedpool.deploy.localpool import LocalPoolSpec, init_loopback_ray, local_servers

    joined = ray.is_initialized()  # a caller's Ray (a test session's): used, and left running
    if not joined:
        # A fresh cluster of our own: without an address Ray joins the one `ray start` last started on this
        # machine (/tmp/ray/ray_current_cluster), and refuses `num_cpus` there.
        saved = os.environ.get("RAY_ADDRESS")
        os.environ["RAY_ADDRESS"] = "local"
        try:
            init_loopback_ray()
        finally:
            if saved is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = saved
    spec = LocalPoolSpec(count=servers, slots=slots, threads=threads)
    registry = await RegistryClient.start(work / "registry", probe_interval_s=PROBE_INTERVAL_S)
    try:
        async with local_servers(registry, spec, work / "logs") as launchers:
            pids = tuple(pid for lr in launchers if (pid := lr.process.pid) is not None)
            if cores is not None:
                for pid in pids:
                    pin(pid, cores.engines)
            yield Pool(spec.served_model(), {lr.record.id: lr.record.url for lr in launchers}, slots,
                       ray.get_runtime_context().gcs_address, work / "registry", registry, pids, cores)
    finally:
        await registry.terminate()
        if not joined:
            ray.shutdown()


def _env() -> dict[str, str]:
    """A child's environment: no FEDPOOL_ settings, and no RAY_ADDRESS (it would win over --address)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FEDPOOL_") and k != "RAY_ADDRESS"}


def _fedpool_argv(pool: Pool, command: str, sub: str | None, *args: str) -> list[str]:
    """`fedpool COMMAND [SUB]` joined to the pool as benchmarks/reliability.py's `_fedpool` does."""
    return [sys.executable, "-m", "fedpool.cli", command, *([sub] if sub else []), "--address", pool.ray_address,
            "--state-dir", str(pool.state_dir), *args]


# ---- what the engines and the broker said during one arm ---------------------------------------------------------
@dataclass
class ArmWatch:
    """The engines' own metrics (every ENGINE_SAMPLE_S) and the broker (every LEASE_SAMPLE_S) over one arm."""

    load_start: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_end: tuple[float, float, float] = (0.0, 0.0, 0.0)
    started: float = 0.0
    ended: float = 0.0
    max_deferred: dict[str, int] = field(default_factory=dict)
    deferred_samples: dict[str, int] = field(default_factory=dict)  # samples with any request deferred
    samples: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)  # time with a request processing
    predicted: dict[str, float] = field(default_factory=dict)  # tokens generated during the arm
    predicted_at_start: dict[str, float] = field(default_factory=dict)
    lease_calls: int = 0
    over_capacity: int = 0  # re-shares that leased a server past its slots (the registry's exported counter): 0
    lease_lapses: int = 0  # warnings of a lapsed lease in the arm's processes' logs
    holders_seen: set[str] = field(default_factory=set)
    max_holders: int = 0
    max_granted: dict[str, int] = field(default_factory=dict)  # server -> most slots leased at once, all holders
    # (seconds into the arm, what was sampled): the raw series, written beside the arm's logs
    engine_series: list[tuple[float, dict[str, dict[str, float]]]] = field(default_factory=list)
    lease_series: list[tuple[float, dict[str, dict[str, int]]]] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    @property
    def lease_calls_per_s(self) -> float:
        return self.lease_calls / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def deepest(self) -> int:
        return max(self.max_deferred.values(), default=0)

    def load(self) -> str:
        return f"{self.load_start[0]:.1f} → {self.load_end[0]:.1f}"

    def counted(self, metric: str) -> float | None:
        """How much an engine counter grew over the arm, summed over the servers (None where it was not sampled)."""
        if not self.engine_series:
            return None
        first, last = self.engine_series[0][1], self.engine_series[-1][1]
        grown = [last[sid][metric] - first[sid][metric] for sid in first
                 if sid in last and metric in first[sid] and metric in last[sid]]
        return sum(grown) if grown else None

    def busy_slots_per_decode(self) -> float | None:
        """The engines' mean busy slots per decode step over the arm, all servers (llama.cpp reports the mean since
        it started: each server's busy-slot steps are that mean × its steps, at both ends of the arm)."""
        if not self.engine_series:
            return None
        first, last = self.engine_series[0][1], self.engine_series[-1][1]
        n, mean = DECODE_METRICS
        steps = busy = 0.0
        for sid, end in last.items():
            start = first.get(sid)
            if start is None or not all(k in d for d in (start, end) for k in DECODE_METRICS):
                continue
            steps += end[n] - start[n]
            busy += end[n] * end[mean] - start[n] * start[mean]
        return busy / steps if steps > 0 else None


async def _engine_sample(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
        text = await resp.text()
    return {s.name: float(s.value) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in ENGINE_METRICS}


async def _sample_engines(urls: dict[str, str], watch: ArmWatch, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            values = await asyncio.gather(*(_engine_sample(session, u) for u in urls.values()), return_exceptions=True)
            watch.samples += 1
            watch.engine_series.append((time.monotonic() - watch.started, {
                sid: value for sid, value in zip(urls, values, strict=True) if isinstance(value, dict)}))
            for sid, value in zip(urls, values, strict=True):
                if not isinstance(value, dict):
                    continue
                deferred = int(value.get("llamacpp:requests_deferred", 0))
                watch.max_deferred[sid] = max(watch.max_deferred.get(sid, 0), deferred)
                watch.deferred_samples[sid] = watch.deferred_samples.get(sid, 0) + (deferred > 0)
                if value.get("llamacpp:requests_processing", 0) > 0:
                    watch.busy_s[sid] = watch.busy_s.get(sid, 0.0) + ENGINE_SAMPLE_S
                predicted = value.get("llamacpp:tokens_predicted_total", 0.0)
                watch.predicted_at_start.setdefault(sid, predicted)
                watch.predicted[sid] = predicted - watch.predicted_at_start[sid]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ENGINE_SAMPLE_S)


async def _sample_leases(registry: RegistryClient, watch: ArmWatch, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(Exception):  # a slow registry costs a sample, not the arm
            holders: dict[str, dict[str, int]] = (await registry.leases())["holders"]
            watch.lease_series.append((time.monotonic() - watch.started, holders))
            watch.holders_seen.update(h for h, slots in holders.items() if slots)
            watch.max_holders = max(watch.max_holders, sum(1 for slots in holders.values() if slots))
            granted: Counter[str] = Counter()
            for slots in holders.values():
                granted.update(slots)
            for sid, n in granted.items():
                watch.max_granted[sid] = max(watch.max_granted.get(sid, 0), n)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), LEASE_SAMPLE_S)


@contextlib.asynccontextmanager
async def watching(pool: Pool) -> AsyncIterator[ArmWatch]:
    watch = ArmWatch(load_start=os.getloadavg())
    calls_before = (await pool.registry.leases())["calls"]
    over_before = await exported_over_capacity(pool.registry)
    stop = asyncio.Event()
    watch.started = time.monotonic()
    samplers = [asyncio.create_task(_sample_engines(pool.server_urls, watch, stop)),
                asyncio.create_task(_sample_leases(pool.registry, watch, stop))]
    try:
        yield watch
    finally:
        watch.ended = time.monotonic()
        stop.set()
        await asyncio.gather(*samplers, return_exceptions=True)
        watch.lease_calls = (await pool.registry.leases())["calls"] - calls_before
        watch.over_capacity = await exported_over_capacity(pool.registry) - over_before
        watch.load_end = os.getloadavg()


async def exported_over_capacity(registry: RegistryClient) -> int:
    """The registry's `fedpool_lease_over_capacity_total`, as Prometheus scrapes it (registry/exporter.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(await registry.metrics_text()):
        if family.name == "fedpool_lease_over_capacity":
            return int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    raise RuntimeError("the registry does not export fedpool_lease_over_capacity_total")


async def settle(pool: Pool) -> None:
    """Between arms: the last arm's holders gone from the broker, no engine busy (at most 30 s)."""
    await asyncio.sleep(SETTLE_S)
    deadline = time.monotonic() + 30.0
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            holders = (await pool.registry.leases())["holders"]
            busy = await asyncio.gather(*(_engine_sample(session, u) for u in pool.server_urls.values()))
            if not any(holders.values()) and not any(b.get("llamacpp:requests_processing", 0) for b in busy):
                return
            await asyncio.sleep(0.5)
    log.warning("the pool did not settle between arms")


# ---- arm 1: the same evals in one process and in N -----------------------------------------------------------
@dataclass(frozen=True)
class EvalTiming:
    started_s: float  # launch -> the eval started (its process's start-up)
    own_s: float  # the eval's own wall time (its summary)
    done_s: float  # launch -> its last record
    records: int
    failed: int
    by_server: dict[str, int]
    # straggler copies that lost their race: (the server it ran on, seconds from launch to its cancellation, which
    # is when the winning copy answered)
    lost_copies: list[tuple[str, float]] = field(default_factory=list)
    # attempts that gave their slot back to a shrunk lease (federation/core/attempts.py) and the engine seconds they
    # had run
    given_back: int = 0
    given_back_s: float = 0.0


@dataclass
class EvalArm:
    arm: str
    evals: dict[str, EvalTiming]
    process_s: list[float]
    watch: ArmWatch

    pids: dict[str, int] = field(default_factory=dict)  # process (its log's name) -> pid
    # CPU the arm's eval processes used (user + system, from the kernel's accounting of waited children), and
    # the share of the machine's CPU busy over the arm (/proc/stat): on a machine whose cores the engines also
    # need, what the clients burn the engines lose.
    client_cpu_s: float = 0.0
    machine_busy: float = 0.0
    cpu: CpuUse | None = None  # the engines' CPU and run-queue wait, everything else's CPU, over the arm

    @property
    def makespan_s(self) -> float:
        return max(t.done_s for t in self.evals.values())

    def first_slot_s(self) -> dict[str, float]:
        """Eval -> seconds from launch until its process first held a leased slot (the watch starts at launch)."""
        names = list(self.evals)
        process_of = {name: f"process-{i if len(self.pids) == len(names) else 0}" for i, name in enumerate(names)}
        first: dict[str, float] = {}
        for t, holders in self.watch.lease_series:
            for holder, slots in holders.items():
                if sum(slots.values()) > 0:
                    first.setdefault(holder.split(":")[1] if holder.count(":") >= 2 else holder, t)
        return {name: first[str(self.pids[process_of[name]])] for name in names
                if str(self.pids.get(process_of[name])) in first}

    @property
    def inference_s(self) -> float:
        """From the first eval's start to the last record: the makespan without the earliest start-up."""
        return self.makespan_s - min(t.started_s for t in self.evals.values())


def eval_names(count: int) -> list[str]:
    """The evals of `count` processes: the long-answer ones first (`long_a`, `long_b`, ...: half, rounded up), then
    the short ones (SHORT_EVALS, then their copies `arith_2`, ...). 4 gives issue 23's long_a, long_b, arith and
    capitals; 7 the issue-53 try of four long and three bundled short ones."""
    shorts = count // 2
    longs = [f"long_{chr(ord('a') + i)}" if i < 26 else f"long_{i + 1}" for i in range(count - shorts)]
    names = [SHORT_EVALS[i % len(SHORT_EVALS)] + (f"_{i // len(SHORT_EVALS) + 1}" if i >= len(SHORT_EVALS) else "")
             for i in range(shorts)]
    return longs + names


def write_specs(work: Path, long_prompts: int, long_tokens: int, count: int = 4) -> list[Path]:
    """The specs of `eval_names(count)`: the long-answer ones written here, the bundled short ones as shipped and
    their copies written here under a name of their own (the bundled data, by its absolute path)."""
    import yaml

    from fedpool.pipeline.bundled import bundled_spec_paths

    work.mkdir(parents=True, exist_ok=True)
    bundled = {p.stem: p for p in bundled_spec_paths()}
    specs = []
    for name in eval_names(count):
        if name in bundled:
            specs.append(bundled[name])
            continue
        spec = work / f"{name}.yaml"
        if name.startswith("long_"):
            workload = stories(name, long_prompts, long_tokens)
            data = work / f"{name}.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in workload.rows), encoding="utf-8")
            spec.write_text(workload.fedpool_spec(data), encoding="utf-8")  # JSON: YAML's subset
        else:  # a copy of a bundled short eval
            source = bundled[name.rsplit("_", 1)[0]]
            raw = yaml.safe_load(source.read_text(encoding="utf-8"))
            raw["name"] = name
            raw["data"] = {**raw["data"], "path": str((source.parent / raw["data"]["path"]).resolve())}
            spec.write_text(json.dumps(raw, indent=1), encoding="utf-8")
        specs.append(spec)
    return specs


async def _process(argv: list[str], log_path: Path, pids: dict[str, int], ok: Sequence[int] = (0,)) -> float:
    """Run a process to its end (its pid in `pids` under its log's name); its wall time. An exit code outside `ok`
    raises with the log's tail."""
    started = time.monotonic()
    with log_path.open("wb") as logf:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=logf, stderr=asyncio.subprocess.STDOUT, env=_env())
        pids[log_path.stem] = proc.pid
        try:
            code = await asyncio.wait_for(proc.wait(), PROCESS_TIMEOUT_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    if code not in ok:
        tail = (await asyncio.to_thread(log_path.read_text, encoding="utf-8", errors="replace"))[-2500:]
        raise RuntimeError(f"{' '.join(argv[2:5])} exited {code} (log {log_path}):\n{tail}")
    return time.monotonic() - started


def _eval_timing(bench_dir: Path, launch: float) -> EvalTiming:
    rows = [json.loads(line) for line in (bench_dir / "records.jsonl").read_text(encoding="utf-8").splitlines()]
    summary = json.loads((bench_dir / "summary.json").read_text(encoding="utf-8"))
    done = max(r["provenance"]["completed_at"] for r in rows) - launch
    own = float(summary["wall_time_s"])
    servers = Counter(r["provenance"]["server_id"] for r in rows if r["provenance"].get("server_id"))
    failed = sum(1 for r in rows if r["provenance"].get("error"))
    lost = [(a["server_id"], r["provenance"]["completed_at"] - launch) for r in rows
            for a in r["provenance"]["attempt_log"] if a.get("lost_race")]
    back = [a["latency_s"] for r in rows for a in r["provenance"]["attempt_log"] if a.get("detail") == PREEMPTED]
    return EvalTiming(done - own, own, done, len(rows), failed, dict(servers), lost, len(back), sum(back))


async def run_eval_arm(arm: str, pool: Pool, specs: Sequence[Path], work: Path, limit: int | None) -> EvalArm:
    """`one`: every spec in one `fedpool eval run`; `multi`: one process per spec, all started at once, each leasing
    its slots; `gateway`: the same processes, each sending through one fresh `fedpool gateway` (`--gateway`: it
    places every eval's requests), whose routing is `eval run`'s defaults (the `one` arm's) and whose
    --max-inflight holds every eval's concurrency."""
    pids: dict[str, int] = {}
    if arm == "gateway":
        routing = ["--policy", "capacity_weighted", "--client-order", "fair", "--max-inflight",
                   str(len(specs) * EVAL_CONCURRENCY)]
        async with gateways(pool, 1, work, pids, routing) as urls:
            return await _eval_arm(arm, pool, specs, work, limit, pids, ["--gateway", urls[0]])
    return await _eval_arm(arm, pool, specs, work, limit, pids, [])


async def _eval_arm(arm: str, pool: Pool, specs: Sequence[Path], work: Path, limit: int | None,
                    pids: dict[str, int], via: Sequence[str]) -> EvalArm:
    groups = [list(specs)] if arm == "one" else [[s] for s in specs]
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    outs = [work / f"process-{i}" for i in range(len(groups))]
    extra = ["--limit", str(limit)] if limit else []
    argvs = [_fedpool_argv(pool, "eval", "run", "--quiet", "--model", pool.model, "--out", str(out), *extra, *via,
                           *(a for s in group for a in ("--spec", str(s)))) for group, out in zip(groups, outs,
                                                                                                   strict=True)]
    async with watching(pool) as watch:
        meter = CpuMeter(pool.engine_pids)
        await meter.start()
        launch = time.time()
        cpu, ticks = _children_cpu_s(), await asyncio.to_thread(_machine_ticks)
        walls = await asyncio.gather(*(_process(argv, work / f"process-{i}.log", pids, ok=(0, 4))
                                       for i, argv in enumerate(argvs)))
        client_cpu, (busy, total) = _children_cpu_s() - cpu, await asyncio.to_thread(_machine_ticks, ticks)
        use = await meter.stop()
    evals = {}
    for out in outs:
        for bench_dir in sorted(p.parent for p in out.glob("*/summary.json")):
            evals[bench_dir.name] = _eval_timing(bench_dir, launch)
    watch.lease_lapses = await asyncio.to_thread(_lease_lapses, work)
    run = EvalArm(arm, evals, list(walls), watch, pids, client_cpu, busy / total if total else 0.0, use)
    await asyncio.to_thread(_dump, work / "arm.json", run)
    return run


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's children that have ended and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _machine_ticks(since: tuple[int, int] | None = None) -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine (/proc/stat), or their change since `since`."""
    fields = [int(x) for x in Path("/proc/stat").read_text(encoding="utf-8").split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    busy = total - fields[3] - fields[4]
    if since is None:
        return busy, total
    return busy - since[0], total - since[1]


def _lease_lapses(arm_dir: Path) -> int:
    """Lapsed capacity leases the arm's fedpool processes logged (eval runs and gateways log their warnings)."""
    return sum(sum(1 for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines()
                   if any(marker in line for marker in LEASE_LAPSES)) for log_path in arm_dir.glob("*.log"))


def _dump(path: Path, run: Any) -> None:
    """The arm's raw figures and series beside its logs (for a closer look than the report's)."""
    import dataclasses

    path.write_text(json.dumps(dataclasses.asdict(run), default=sorted), encoding="utf-8")


# ---- arm 2: two lm-eval processes behind one gateway or two replicas -------------------------------------------
class ServerCountingGate(StartGate):
    """realtool_speedup's start gate, also counting which server answered each request of each process (the
    gateway's X-Fedpool-Server header)."""

    def __init__(self, session: aiohttp.ClientSession):
        super().__init__(session)
        self.answered: dict[str, Counter[str]] = {}

    def arm(self, targets: dict[str, str]) -> None:
        super().arm(targets)
        self.answered = {key: Counter() for key in targets}

    async def _forward(self, request: Any) -> Any:
        from aiohttp import web

        key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        target = self._targets.get(key)
        if target is None:
            return web.json_response({"error": {"message": "unknown key at the start gate"}}, status=401)
        body = await request.read()
        if request.method == "POST":
            self._seen.add(key)
            if self._seen >= set(self._targets) and not self._open.is_set():
                self.released_at = time.monotonic()
                self._open.set()
            await self._open.wait()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        async with self._session.request(request.method, target + request.path_qs, data=body,
                                         headers=headers) as resp:
            payload = await resp.read()
            server = resp.headers.get("X-Fedpool-Server")
            out = web.Response(body=payload, status=resp.status, content_type=resp.content_type or "application/json")
        if request.method == "POST":
            self.last_answer[key] = time.monotonic()
            if server and resp.status == 200:
                self.answered[key][server] += 1
        return out


async def _wait_gateway(url: str, model: str, proc: asyncio.subprocess.Process, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"the gateway at {url} exited {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200 and model in await resp.text():
                        return
            await asyncio.sleep(0.3)
    raise RuntimeError(f"the gateway at {url} did not serve {model} within {timeout_s:g} s")


@contextlib.asynccontextmanager
async def gateways(pool: Pool, count: int, work: Path, pids: dict[str, int], flags: Sequence[str] = ()
                   ) -> AsyncIterator[list[str]]:
    """`count` fresh `fedpool gateway` processes on the pool (defaults: capacity_weighted, shortest_first; else
    `flags`), their pids in `pids`."""
    from fedpool.deploy.process import free_port

    procs: list[asyncio.subprocess.Process] = []
    urls = []
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    try:
        for i in range(count):
            port = free_port()
            with (work / f"gateway-{i}.log").open("wb") as logf:
                procs.append(await asyncio.create_subprocess_exec(
                    *_fedpool_argv(pool, "gateway", None, "--quiet", "--port", str(port), *flags), stdout=logf,
                    stderr=asyncio.subprocess.STDOUT, env=_env()))
            pids[f"gateway-{i}"] = procs[-1].pid
            urls.append(f"http://127.0.0.1:{port}")
        await asyncio.gather(*(_wait_gateway(u, pool.model, p) for u, p in zip(urls, procs, strict=True)))
        yield urls
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@dataclass
class ToolArm:
    arm: str
    eval_s: dict[str, float]  # eval -> start line to its last answer
    process_s: dict[str, float]  # eval -> its lm-eval process's wall time, start-up included
    answered: dict[str, dict[str, int]]  # eval -> server -> requests answered (X-Fedpool-Server)
    answers: dict[str, int]  # eval -> documents answered (lm-eval's samples file)
    watch: ArmWatch
    pids: dict[str, int] = field(default_factory=dict)  # gateway -> pid
    released_s: float = 0.0  # the start line, in seconds into the arm (the watch's clock)

    def holdings(self) -> list[tuple[float, dict[str, int]]]:
        """While both processes were sending (start line to the first one's last answer): each lease sample's
        slots per gateway (holder ids are host:pid:nonce)."""
        gateway_of = {str(pid): name for name, pid in self.pids.items()}
        end = self.released_s + min(self.eval_s.values(), default=0.0)
        out = []
        for t, holders in self.watch.lease_series:
            if self.released_s <= t <= end:
                slots = {name: 0 for name in self.pids}
                for holder, held in holders.items():
                    name = gateway_of.get(holder.split(":")[1]) if holder.count(":") >= 2 else None
                    if name is not None:
                        slots[name] = sum(held.values())
                out.append((t, slots))
        return out

    def longest_without_slots_s(self) -> dict[str, float]:
        """Per gateway, the longest run of lease samples in which it held no slot while both processes sent."""
        out: dict[str, float] = {name: 0.0 for name in self.pids} if len(self.pids) > 1 else {}
        for name in out:
            run_started: float | None = None
            for t, slots in self.holdings():
                if slots[name] == 0:
                    run_started = t if run_started is None else run_started
                    out[name] = max(out.get(name, 0.0), t - run_started + LEASE_SAMPLE_S)
                else:
                    run_started = None
        return out

    @property
    def by_server(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for counts in self.answered.values():
            total.update(counts)
        return total

    @property
    def busier_share(self) -> float:
        total = self.by_server
        return max(total.values()) / sum(total.values()) if total else 0.0


async def run_tool_arm(arm: str, tag: str, pool: Pool, workloads: Sequence[Workload], task_dir: Path, work: Path,
                       gate: ServerCountingGate) -> ToolArm:
    replicas = 2 if arm == "two-replicas" else 1
    keys = {w.name: f"sk-multiprocess-{tag}-{w.name}-0123456789" for w in workloads}
    outs = {w.name: work / w.name for w in workloads}
    concurrent = pool.slots * len(pool.server_urls)
    pids: dict[str, int] = {}
    async with gateways(pool, replicas, work, pids) as urls:
        gate.arm({keys[w.name]: urls[i % replicas] for i, w in enumerate(workloads)})
        async with watching(pool) as watch:
            walls = await asyncio.gather(*(
                _run_process(_lm_eval_argv(pool.model, gate.url, w.name, task_dir, outs[w.name], concurrent),
                             _child_env(keys[w.name]), work / f"lm-eval-{w.name}.log") for w in workloads))
    durations = gate.durations()
    watch.lease_lapses = await asyncio.to_thread(_lease_lapses, work)
    run = ToolArm(arm, {w.name: durations.get(keys[w.name], 0.0) for w in workloads},
                  dict(zip(outs, walls, strict=True)), {w.name: dict(gate.answered[keys[w.name]]) for w in workloads},
                  {w.name: len(_lm_eval_answers(outs[w.name], w.name)) for w in workloads}, watch, pids,
                  (gate.released_at or watch.started) - watch.started)
    await asyncio.to_thread(_dump, work / "arm.json", run)
    return run


def tool_workloads(task_dir: Path, arith_n: int, long_prompts: int, long_tokens: int) -> list[Workload]:
    workloads = [arith(arith_n), stories("long", long_prompts, long_tokens)]
    task_dir.mkdir(parents=True, exist_ok=True)
    for w in workloads:
        data = task_dir / f"{w.name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in w.rows), encoding="utf-8")
        (task_dir / f"{w.name}.yaml").write_text(w.lm_eval_yaml(data), encoding="utf-8")
    return workloads


# ---- the benchmark ----------------------------------------------------------------------------------------------
@dataclass
class Results:
    evals: list[dict[str, EvalArm]] = field(default_factory=list)
    tools: list[dict[str, ToolArm]] = field(default_factory=list)


def _orders(arms: Sequence[str], repeats: int) -> list[list[str]]:
    return [list(arms) if r % 2 == 0 else list(reversed(arms)) for r in range(repeats)]


async def run_all(args: argparse.Namespace, work: Path) -> tuple[Results, Pool]:
    results = Results()
    async with local_pool(work, args.servers, args.slots, args.threads, split(args.engine_cpus)) as pool:
        if "evals" in args.parts:
            specs = write_specs(work / "specs", args.long_prompts, args.long_tokens, args.processes)
            if args.warmup:  # untimed: the servers' first requests and the registry's first cost figures
                warm = min(args.limit or WARMUP_LIMIT, WARMUP_LIMIT)
                await run_eval_arm("one", pool, specs, work / "evals-warmup", warm)
            for r, order in enumerate(_orders(EVAL_ARMS, args.repeats)):
                runs: dict[str, EvalArm] = {}
                for arm in order:
                    await settle(pool)
                    runs[arm] = run = await run_eval_arm(arm, pool, specs, work / f"evals-{r + 1}" / arm, args.limit)
                    print(f"[multiprocess] evals {r + 1}/{args.repeats} {arm}: makespan {run.makespan_s:.1f} s ("
                          + ", ".join(f"{n} {t.done_s:.1f}" for n, t in run.evals.items())
                          + f"), deepest queue {run.watch.deepest}, lease calls {run.watch.lease_calls_per_s:.1f}/s,"
                          f" load {run.watch.load()}", flush=True)
                results.evals.append(runs)
        if "tools" in args.parts:
            task_dir = work / "tasks"
            workloads = tool_workloads(task_dir, args.tool_arith, args.long_prompts, args.long_tokens)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                             connector=aiohttp.TCPConnector(limit=0)) as session:
                gate = ServerCountingGate(session)
                await gate.start()
                try:
                    if args.warmup:  # untimed, as above: the arm run first is otherwise the one on a cold pool
                        await settle(pool)
                        await run_tool_arm("one-gateway", "warmup", pool, workloads, task_dir, work / "tools-warmup",
                                           gate)
                    for r, order in enumerate(_orders(TOOL_ARMS, args.repeats)):
                        tool_runs: dict[str, ToolArm] = {}
                        for arm in order:
                            await settle(pool)
                            tool_runs[arm] = t = await run_tool_arm(arm, f"r{r + 1}-{arm}", pool, workloads, task_dir,
                                                                    work / f"tools-{r + 1}" / arm, gate)
                            print(f"[multiprocess] lm-eval {r + 1}/{args.repeats} {arm}: "
                                  + ", ".join(f"{n} {s:.1f} s" for n, s in t.eval_s.items())
                                  + f"; requests per server {dict(t.by_server)} (busier {t.busier_share:.2f}),"
                                  f" deepest queue {t.watch.deepest}, load {t.watch.load()}", flush=True)
                        results.tools.append(tool_runs)
                finally:
                    await gate.stop()
    return results, pool


# ---- the report -----------------------------------------------------------------------------------------------
def _spread(values: Sequence[float], unit: str = "×", digits: int = 2) -> str:
    if not values:
        return "n/a"
    return (f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}–{max(values):.{digits}f})")


def eval_ratios(results: Results, field: str = "done_s", arm: str = "multi") -> dict[str, list[float]]:
    """Per eval: its time in N processes (`arm`) ÷ in one, each repeat (`done_s`: from launch; `own_s`: from its
    start)."""
    out: dict[str, list[float]] = {}
    for run in results.evals:
        for name, multi in run[arm].evals.items():
            one = run["one"].evals.get(name)
            if one is not None and getattr(one, field) > 0:
                out.setdefault(name, []).append(getattr(multi, field) / getattr(one, field))
    return out


def makespan_ratios(results: Results, arm: str = "multi") -> list[float]:
    return [r[arm].makespan_s / r["one"].makespan_s for r in results.evals]


def replica_ratios(results: Results) -> dict[str, list[float]]:
    """Per lm-eval run: its time (start line to its last answer) behind two replicas ÷ behind one gateway, each
    repeat."""
    out: dict[str, list[float]] = {}
    for run in results.tools:
        two, one = run["two-replicas"].eval_s, run["one-gateway"].eval_s
        for name, seconds in two.items():
            if one.get(name, 0.0) > 0:
                out.setdefault(name, []).append(seconds / one[name])
    return out


def headline(results: Results) -> dict[str, object]:
    """The N processes' ratios to one process: through one gateway (`eval run --gateway`, the design for many
    processes: docs/architecture.md) as `makespan_vs_one` and `latest_eval_vs_one`; each leasing its own slots as
    `leases_makespan_vs_one` and `leases_latest_eval_vs_one`."""
    ratios = eval_ratios(results, arm="gateway")
    worst = max((statistics.median(v) for v in ratios.values()), default=None)
    leased = max((statistics.median(v) for v in eval_ratios(results).values()), default=None)
    multi_watches = [r[a].watch for r in results.evals for a in ("multi", "gateway")] + \
        [r["two-replicas"].watch for r in results.tools]
    shares = [r["two-replicas"].busier_share for r in results.tools]
    calls = [r["multi"].watch.lease_calls_per_s for r in results.evals]
    replicas = max((statistics.median(v) for v in replica_ratios(results).values()), default=None)
    return {
        "processes": max((len(r["multi"].process_s) for r in results.evals), default=0),
        "repeats": min(len(results.evals), len(results.tools)) if results.tools else len(results.evals),
        "makespan_vs_one": f"{statistics.median(makespan_ratios(results, 'gateway')):.2f}" if results.evals else "n/a",
        "latest_eval_vs_one": f"{worst:.2f}" if worst is not None else "n/a",
        "leases_makespan_vs_one": f"{statistics.median(makespan_ratios(results)):.2f}" if results.evals else "n/a",
        "leases_latest_eval_vs_one": f"{leased:.2f}" if leased is not None else "n/a",
        "max_engine_queue": max((w.deepest for w in multi_watches), default=0),
        "replicas_eval_vs_one": f"{replicas:.2f}" if replicas is not None else "n/a",
        "replicas_busier_share": f"{statistics.median(shares):.2f}" if shares else "n/a",
        "lease_calls_per_s": f"{statistics.median(calls):.1f}" if calls else "n/a",
        "over_capacity": sum(w.over_capacity for w in multi_watches)
        + sum(r["one"].watch.over_capacity for r in results.evals)
        + sum(r["one-gateway"].watch.over_capacity for r in results.tools),
    }


def _evals_section(results: Results, servers: Sequence[str]) -> list[str]:
    rows = []
    for r, run in enumerate(results.evals):
        for arm in EVAL_ARMS:
            a = run[arm]
            rows.append([
                r + 1, arm, len(a.process_s), f"{a.makespan_s:.1f}", f"{a.inference_s:.1f}",
                ", ".join(f"{s:.1f}" for s in a.process_s),
                "; ".join(f"{n} {t.started_s:.1f} + {t.own_s:.1f} = {t.done_s:.1f}" for n, t in a.evals.items()),
                sum(t.failed for t in a.evals.values()),
                f"{sum(t.given_back for t in a.evals.values())} ({sum(t.given_back_s for t in a.evals.values()):.1f})",
                "; ".join(f"{sid} {a.watch.max_deferred.get(sid, 0)} ({a.watch.deferred_samples.get(sid, 0)}"
                          f"/{a.watch.samples})" for sid in servers),
                "; ".join(f"{sid} {sum(t.by_server.get(sid, 0) for t in a.evals.values())}" for sid in servers),
                f"{a.watch.lease_calls_per_s:.1f}", a.watch.lease_lapses, a.watch.max_holders,
                "; ".join(f"{sid} {a.watch.max_granted.get(sid, 0)}" for sid in servers), a.watch.load(),
                f"{a.client_cpu_s:.1f}", f"{a.machine_busy * 100:.0f}",
            ])
    count = max((len(r["multi"].process_s) for r in results.evals), default=0)
    lines = [f"## 1. {count} evals: one `fedpool eval run` vs one process each", "", markdown_table(
        ["repeat", "arm", "processes", "makespan from launch (s)", "first eval's start to last record (s)",
         "process walls (s)",
         "per eval: start-up + own = done from launch (s)", "failed records",
         "attempts given back to a shrunk lease (engine s they had run)",
         "deepest engine queue (samples with any deferred / samples)", "records per server", "lease calls/s",
         "leases lapsed", "most holders at once", "most slots leased at once per server",
         "load 1-min (start → end)", "eval processes' CPU (s)", "machine CPU busy (%)"], rows), ""]
    ratios, owns = eval_ratios(results), eval_ratios(results, "own_s")
    per_eval = []
    for name in ratios:
        one = [r["one"].evals[name] for r in results.evals]
        multi = [r["multi"].evals[name] for r in results.evals]
        per_eval.append([
            name, _spread([t.done_s for t in one], " s", 1), _spread([t.done_s for t in multi], " s", 1),
            _spread(ratios[name]), _spread([t.started_s for t in one], " s", 1),
            _spread([t.started_s for t in multi], " s", 1), _spread(owns.get(name, []))])
    lines += [markdown_table(
        ["eval", "done from launch, one (s)", "done from launch, multi (s)", "multi ÷ one", "start-up, one (s)",
         "start-up, multi (s)", "own time multi ÷ one"], per_eval), "",
        f"Makespan from launch, multi ÷ one: {_spread(makespan_ratios(results))} over {len(results.evals)} repeats "
        "(median (lowest–highest)); from the first eval's start to the last record, multi ÷ one: "
        f"{_spread([r['multi'].inference_s / r['one'].inference_s for r in results.evals])}. "
        "`latest_eval_vs_one` is the worst eval's median of its multi ÷ one.", "",
        "Lease calls per second over each arm (median (lowest–highest)): one process "
        f"{_spread([r['one'].watch.lease_calls_per_s for r in results.evals], '/s', 1)}, {count} processes "
        f"{_spread([r['multi'].watch.lease_calls_per_s for r in results.evals], '/s', 1)}; each holder renews "
        "about twice a second (federation/gateway/leases.py RENEW_S) from its start to its exit, and a process's share "
        "changing answers its long poll at once.", ""]
    if any(r[arm].client_cpu_s > 0 for r in results.evals for arm in EVAL_ARMS):  # (older work dirs lack it)
        lines += [
            "CPU the eval processes used (user + system; start-up, Ray, leases, prompts and scoring), median (lowest–"
            f"highest): one process {_spread([r['one'].client_cpu_s for r in results.evals], ' s', 1)}, {count} "
            f"{_spread([r['multi'].client_cpu_s for r in results.evals], ' s', 1)}; the machine's CPU busy over the "
            f"arm: one {_spread([r['one'].machine_busy * 100 for r in results.evals], '%', 0)}, {count} "
            f"{_spread([r['multi'].machine_busy * 100 for r in results.evals], '%', 0)}.", ""]
    if all(r[arm].cpu is not None for r in results.evals for arm in EVAL_ARMS):
        lines += [
            "The cores during each arm (median (lowest–highest) over repeats): the engines' CPU seconds, the seconds "
            "their threads were runnable but waited for a core (the kernel's run-queue delay, "
            "/proc/<pid>/task/*/schedstat), and every other process's CPU seconds (the eval processes, the registry, "
            "Ray, this script):", "",
            markdown_table(["arm", "engines CPU s", "engines waited for a core s", "everything else CPU s"], [
                [arm, *(_spread([getattr(r[arm].cpu, key) for r in results.evals], " s", 1)
                        for key in ("engines_cpu_s", "engines_wait_s", "other_cpu_s"))] for arm in EVAL_ARMS]), ""]
    counters = [(name, f"llamacpp:{name}") for name in ("prompt_tokens_total", "prompt_seconds_total",
                                                          "tokens_predicted_total", "tokens_predicted_seconds_total")]
    if all(r[arm].watch.counted(key) is not None for r in results.evals for arm in EVAL_ARMS for _, key in counters):
        lines += [
            "The engines' own counters over each arm, all servers (median (lowest–highest) over repeats): prompt "
            "tokens evaluated (those the prompt cache did not hold) and the request-seconds spent on them, tokens "
            "generated and the request-seconds spent generating (llama.cpp sums each request's time: requests "
            "batched together each count the step); and the decode steps the engines ran (prompt batches included) "
            "with the mean slots busy in each (the batches' fullness; a server's slots at most):", "",
            markdown_table(["arm", "prompt tokens", "prompt s", "generated tokens", "generating s", "decode steps",
                            "busy slots per step"], [
                [arm, *(_spread([float(r[arm].watch.counted(key) or 0.0) for r in results.evals], "", 0 if "tokens" in
                                name else 1) for name, key in counters), *_decode_cells(results, arm)]
                for arm in EVAL_ARMS]), ""]
    return lines


def _noise_of_one_eval(results: Results) -> list[str]:
    """How far one short eval's done time moves within an arm (the same eval twice in one process), against the
    time the last short eval ends in each arm: what a single eval's ratio can tell."""
    runs = [r for r in results.evals if {"arith", "arith_2"} <= set(r["one"].evals)]
    shorts = [n for n in (results.evals[0]["one"].evals if results.evals else ()) if not n.startswith("long_")]
    if not runs or not shorts:
        return []

    def last_short(run: dict[str, EvalArm], arm: str) -> float:
        return max(run[arm].evals[n].done_s for n in shorts if n in run[arm].evals)

    twins = [r["one"].evals["arith"].done_s / r["one"].evals["arith_2"].done_s for r in runs]
    return ["", f"- One eval's ratio carries the order its requests happened to be served in: `arith` and `arith_2` "
            f"are the same eval (the same prompts) in the same process, and in the one-process arm `arith` ended "
            f"{_spread(twins)} as late as `arith_2`. The moment the last short eval ends, gateway ÷ one: "
            f"{_spread([last_short(r, 'gateway') / last_short(r, 'one') for r in results.evals])}; multi ÷ one: "
            f"{_spread([last_short(r, 'multi') / last_short(r, 'one') for r in results.evals])}. "
            f"`latest_eval_vs_one` is the largest of {len(results.evals[0]['one'].evals)} such medians, each over "
            f"{len(results.evals)} repeats, so it reads above 1 by this spread even where the arms do not differ."]


def _makespan_why(results: Results) -> list[str]:
    """The makespan's difference between the arms split into the schedule (decode steps, batch fullness) and the
    cores (the engines' and everyone else's CPU seconds), medians over repeats; nothing where not sampled."""
    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if len(known) == len(values) and known else None

    runs = results.evals
    steps = {arm: median([r[arm].watch.counted(DECODE_METRICS[0]) for r in runs]) for arm in EVAL_ARMS}
    busy = {arm: median([r[arm].watch.busy_slots_per_decode() for r in runs]) for arm in EVAL_ARMS}
    cpu = {arm: [r[arm].cpu for r in runs] for arm in EVAL_ARMS}
    engines = {arm: median([c.engines_cpu_s if c else None for c in cpu[arm]]) for arm in EVAL_ARMS}
    other = {arm: median([c.other_cpu_s if c else None for c in cpu[arm]]) for arm in EVAL_ARMS}
    span = {arm: statistics.median(r[arm].makespan_s for r in runs) for arm in EVAL_ARMS}
    if any(v is None for d in (steps, busy, engines, other) for v in d.values()):
        return []
    cores = os.cpu_count() or 1
    count = max(len(r["multi"].process_s) for r in runs)
    more = (engines["multi"] or 0.0) - (engines["one"] or 0.0) + (other["multi"] or 0.0) - (other["one"] or 0.0)
    return ["", f"- The makespan, {span['multi']:.1f} s in {EVAL_ARMS[1]} against {span['one']:.1f} s in one process "
            f"(medians): the engines ran {steps['multi']:.0f} decode steps against {steps['one']:.0f} with "
            f"{busy['multi']:.2f} slots busy per step against {busy['one']:.2f} — the leases kept the batches as "
            f"full — and spent {engines['multi']:.1f} CPU-s on them against {engines['one']:.1f}, while everything "
            f"else (the eval processes, the registry, Ray, this script) spent {other['multi']:.1f} against "
            f"{other['one']:.1f}: {more:.1f} CPU-s more on {cores} cores the engines share with the clients, "
            f"{more / cores:.1f} s of the machine against a makespan {span['multi'] - span['one']:.1f} s longer. "
            f"What the {count} processes cost is CPU taken from CPU engines on the same cores, not the schedule."]


def _decode_cells(results: Results, arm: str) -> list[str]:
    """Decode steps and busy slots per step over the arm's repeats ('-' for a run that did not sample them)."""
    steps = [v for r in results.evals if (v := r[arm].watch.counted(DECODE_METRICS[0])) is not None]
    busy = [v for r in results.evals if (v := r[arm].watch.busy_slots_per_decode()) is not None]
    return [_spread(steps, "", 0) if len(steps) == len(results.evals) else "-",
            _spread(busy, "", 2) if len(busy) == len(results.evals) else "-"]


def _cores_sentence(cores: CoreSplit | None) -> str:
    if cores is None:
        return ("Cores: shared. The engines, the eval processes, the gateways, the registry and Ray all run on every "
                f"core of this {os.cpu_count()}-core machine: what the clients use beyond one process's, the CPU "
                "engines beside them lose (`--engine-cpus N` keeps N cores for the engines).")
    return (f"Cores: {cores.describe()} (`--engine-cpus`; benchmarks/cores.py). In the deployments fedpool is for, "
            "the engines compute on accelerators of their own and the eval processes on other CPUs; on one small "
            "machine the CPU engines would otherwise lose to N client processes what one process does not use, "
            "and the arms would compare the machine's cores, not the coordination between processes. Both arms "
            "run under the same split; the clients share what is left.")


def _tools_section(results: Results, servers: Sequence[str]) -> list[str]:
    rows = []
    for r, run in enumerate(results.tools):
        for arm in TOOL_ARMS:
            t = run[arm]
            rows.append([
                r + 1, arm, "; ".join(f"{n} {s:.1f}" for n, s in t.eval_s.items()),
                "; ".join(f"{n} {s:.1f}" for n, s in t.process_s.items()),
                "; ".join(f"{n} " + "/".join(str(t.answered[n].get(sid, 0)) for sid in servers) for n in t.answered),
                "/".join(str(t.by_server.get(sid, 0)) for sid in servers), f"{t.busier_share:.2f}",
                "/".join(f"{t.watch.predicted.get(sid, 0):.0f}" for sid in servers),
                "; ".join(f"{sid} {t.watch.max_deferred.get(sid, 0)}" for sid in servers),
                f"{t.watch.lease_calls_per_s:.1f}", t.watch.lease_lapses, t.watch.max_holders,
                "; ".join(f"{g} {s:.1f}" for g, s in t.longest_without_slots_s().items()) or "-", t.watch.load()])
    lines = ["## 2. Two lm-eval processes: each behind its own gateway replica vs both behind one", "",
             "In two-replicas, `arith` is behind gateway-0 and `long` behind gateway-1.", "",
             markdown_table(["repeat", "arm", "start line to last answer (s)", "process wall incl. start-up (s)",
                             "requests per server, each eval (" + "/".join(servers) + ")", "all requests per server",
                             "busier server's share", "tokens generated per server", "deepest engine queue",
                             "lease calls/s", "leases lapsed", "most holders at once",
                             "longest a gateway held no slot while both sent (s)", "load 1-min (start → end)"], rows),
             ""]
    if results.tools:
        names = list(results.tools[0]["one-gateway"].eval_s)
        summary = []
        for arm in TOOL_ARMS:
            summary.append([arm, _spread([r[arm].busier_share for r in results.tools], "", 2)] + [
                _spread([r[arm].eval_s[n] for r in results.tools], " s", 1) for n in names])
        summary.append(["two-replicas ÷ one-gateway", "-"] + [
            _spread([r["two-replicas"].eval_s[n] / r["one-gateway"].eval_s[n] for r in results.tools]) for n in names])
        lines += [markdown_table(["arm", "busier server's share", *(f"{n}: start line to last answer" for n in names)],
                                 summary), "",
                  "`replicas_eval_vs_one` is the worse lm-eval run's median of its two-replicas ÷ one-gateway.", ""]
    return lines


def _latest_name(results: Results, arm: str) -> str:
    """The eval whose median multi ÷ one is the largest in `arm` (the one its `..._latest_eval_vs_one` reads)."""
    ratios = eval_ratios(results, arm=arm)
    return max(ratios, key=lambda n: statistics.median(ratios[n]))


def _latest_eval(results: Results, arm: str) -> str:
    """What `arm`'s latest eval against its one-process time spent, start-up and its own run."""
    name, owns = _latest_name(results, arm), eval_ratios(results, "own_s", arm=arm)

    def median(of: str, field_name: str) -> float:
        return statistics.median(getattr(r[of].evals[name], field_name) for r in results.evals)

    where = "through one gateway" if arm == "gateway" else "leasing"
    return (f"- {where.capitalize()}, the latest eval against its one-process time is `{name}`: done "
            f"{median(arm, 'done_s'):.1f} s from launch in its own process against {median('one', 'done_s'):.1f} s in "
            f"one (medians). Of that, start-up (launch to the eval's start) was {median(arm, 'started_s'):.1f} s "
            f"against {median('one', 'started_s'):.1f} s, and its own run {median(arm, 'own_s'):.1f} s against "
            f"{median('one', 'own_s'):.1f} s (own time ÷ one: {_spread(owns[name])}).")


def _medians_of(results: Results, arm: str) -> str:
    """Every eval's median multi ÷ one in `arm`, with its spread: how far apart evals of the same arm read."""
    ratios = eval_ratios(results, arm=arm)
    return ("Every eval's done from launch, " + arm + " ÷ one: "
            + "; ".join(f"`{n}` {_spread(v)}" for n, v in ratios.items()) + ".")


def _findings(results: Results, line: dict[str, object]) -> list[str]:
    """Each target against its number; where one is missed, the numbers that say why."""
    out = ["## Targets", ""]
    for key, target in TARGETS.items():
        value = line.get(key)
        try:
            number = float(str(value))
        except ValueError:
            out.append(f"- {key} = {value}: not measured")
            continue
        met = number >= target if key in ("processes", "repeats") else number <= target
        out.append(f"- {key} = {value} (target {'≥' if key in ('processes', 'repeats') else '≤'} {target}): "
                   + ("met" if met else "**not met**"))
    if results.evals:
        name = _latest_name(results, "multi")
        out += ["", _latest_eval(results, "gateway") + " " + _medians_of(results, "gateway"),
                "", _latest_eval(results, "multi") + " Its process held a first slot "
                + _spread([r["multi"].first_slot_s().get(name, float("nan")) - r["multi"].evals[name].started_s
                           for r in results.evals], " s", 1)
                + " after the eval started (in one process: "
                + _spread([r["one"].first_slot_s().get(name, float("nan")) - r["one"].evals[name].started_s
                           for r in results.evals], " s", 1)
                + "): a process that starts later finds the slots held by the requests in flight of one that "
                "started earlier. Attempts under 1 s old give their slots back to a shrunk lease where the engine "
                "drops a request whose client has gone (federation/core/attempts.py: vLLM, and llama.cpp for the "
                "requests the transport sends it as streams, which are all of these); given back in the multi arms: "
                + ", ".join(str(sum(t.given_back for t in r["multi"].evals.values())) for r in results.evals)
                + ". Load (1-minute) at the start of the multi arms: "
                + ", ".join(f"{r['multi'].watch.load_start[0]:.1f}" for r in results.evals)
                + f" on {os.cpu_count()} cores; before its eval starts, each process imports fedpool, reads its specs, "
                "reaches the registry over its HTTP API and takes its first capacity lease (it starts no Ray CPU "
                "actor for evals of this size)."]
        out += _makespan_why(results)
        out += _noise_of_one_eval(results)
    queued = [(f"evals repeat {r + 1} {arm}", run[arm].watch,
               [c for t in run[arm].evals.values() for c in t.lost_copies])
              for r, run in enumerate(results.evals) for arm in EVAL_ARMS]
    queued += [(f"lm-eval repeat {r + 1} {arm}", run[arm].watch, []) for r, run in enumerate(results.tools)
               for arm in TOOL_ARMS]
    deferred = [f"  - {_queued(*q)}." for q in queued if q[1].deepest]
    out += ["", "- Engine queues: " + ("" if deferred else "no server ever deferred a request in any arm."),
            *deferred]
    if any(q[1].deepest and q[2] for q in queued):
        out.append("- A straggler copy that loses its race is cancelled and its slot given back at once "
                   "(federation/core/attempts.py), but this llama-server runs a non-streamed request whose client "
                   "closed its connection to its end (measured separately on this build: a 200-token request closed "
                   "after 1 s held its only slot 13.9 s more, its replacement deferred all that time): for the rest of "
                   "the loser's answer the engine holds one request more than fedpool counts.")
    if any(q[1].deepest and q[1].lease_lapses for q in queued):
        lapses = [q[1].lease_lapses for q in queued]
        out.append(f"- Leases lapsed {sum(lapses)} times over the {len(lapses)} arms (most in one arm: {max(lapses)}): "
                   "a renewal answered later than the lease's TTL (3 s; the registry actor and these processes "
                   "short of CPU) ends the lease, and the process falls back to its safe share, each server's "
                   "capacity ÷ the holders last known, on every server whatever lease it held, while the other "
                   "holders still hold theirs: a process that held all of one server and none of the other sends "
                   "its safe share to the other, which another holder fully holds (federation/gateway/leases.py "
                   "`_expired`). The broker likewise drops a holder whose reports arrive later than the TTL, and can "
                   "grant its slots to another while its requests still run.")
    for r, run in enumerate(results.tools):
        replicas, single = run["two-replicas"], run["one-gateway"]
        later = [n for n in replicas.eval_s if replicas.eval_s[n] > single.eval_s[n]]
        out.append(f"- lm-eval repeat {r + 1}: behind two replicas " + ", ".join(
            f"{n} {replicas.eval_s[n]:.1f} s (one gateway {single.eval_s[n]:.1f} s)" for n in replicas.eval_s)
            + "; while both sent, the longest a replica held no slot: "
            + ", ".join(f"{g} {s:.1f} s" for g, s in replicas.longest_without_slots_s().items())
            + (f"; later behind two replicas: {', '.join(later)}." if later else "."))
    if any(max(run["two-replicas"].longest_without_slots_s().values(), default=0.0) > STARVED_S
           for run in results.tools):
        out.append(f"- A replica that held no slot for more than {STARVED_S:g} s while its client was sending: under "
                   "`shortest_first` both callers are ranked by the service they have attained (slot-seconds, "
                   "answered and in flight, on the scale of every holder's answers) and share by levels of it "
                   "(registry/fills.py `level_fill`: each slot to the lowest level, a request counted at what one "
                   "of the caller's requests holds). A caller whose answered service is ahead by more than the "
                   "other's requests in flight are worth gets no new slot until the other has caught up (least "
                   "attained service across processes), and slots change hands only as the requests holding them "
                   "end.")
    return out


def _queued(label: str, watch: ArmWatch, lost: Sequence[tuple[str, float]] = ()) -> str:
    """Where and when an arm's engines deferred requests (and the straggler copies cancelled on that server before:
    llama-server runs a request whose client has gone to its end, in a slot fedpool has given back)."""
    parts = []
    for sid, depth in watch.max_deferred.items():
        times = [t for t, sample in watch.engine_series if sample.get(sid, {}).get("llamacpp:requests_deferred", 0)]
        if depth and times:
            before = [t for server, t in lost if server == sid and min(times) - LOST_COPY_WINDOW_S <= t <= min(times)]
            parts.append(f"{sid} {depth} deep, in {len(times)} samples between {min(times):.1f} and {max(times):.1f} s "
                         f"into the arm ({watch.wall_s:.1f} s long; straggler copies cancelled on it in the "
                         f"{LOST_COPY_WINDOW_S:g} s before: {len(before)})")
    return f"{label}: " + "; ".join(parts) + f"; leases lapsed in the arm: {watch.lease_lapses}"


def body(results: Results, servers: Sequence[str], args: argparse.Namespace, rendered_from: str = "") -> str:
    line = headline(results)
    lines = [
        *([rendered_from, ""] if rendered_from else []),
        f"Pool: {len(servers)} llama.cpp servers (Gemma 3 270M Q4_K_M, {args.slots} slots, {args.threads} "
        f"thread(s) each) started as `fedpool up` starts them (deploy/localpool.py), local Ray on loopback, the "
        f"registry probing every {PROBE_INTERVAL_S:g} s. Every eval run, gateway and lm-eval is its own process "
        f"joining the pool (`--address`, `--state-dir`); the eval processes reach the registry over its HTTP API "
        f"(no Ray driver), the gateways through Ray. {len(results.evals)} alternating repeats of part 1, "
        f"{len(results.tools)} of part 2; ratios are medians with the (lowest–highest) over repeats. "
        + (f"Before each part's repeats, one untimed run on the fresh pool (part 1: one process, the first "
           f"{WARMUP_LIMIT} samples of each eval; part 2: the one-gateway arm), so that no timed arm is the one "
           "that meets the engines' and the registry's first requests." if args.warmup else
           "No untimed warm-up run (`--no-warmup`): the first timed arm of each part met the fresh pool."),
        "",
        _cores_sentence(split(args.engine_cpus)) + (f" {args.bytecode}" if getattr(args, "bytecode", "") else ""),
        "",
        _evals_sentence(results, args)
        + f". lm-eval: `arith` ({args.tool_arith} samples) and `long` ({args.long_prompts} x {args.long_tokens}), "
        f"`num_concurrent` {args.slots * len(servers)} (the pool's slots), one API key each.",
        "",
        "Engine queue: each server's `llamacpp:requests_deferred` (requests it accepted beyond its slots), every "
        f"{ENGINE_SAMPLE_S * 1000:.0f} ms. Lease calls: the registry's `lease` calls over the arm's wall time "
        "(`RegistryClient.leases()[\"calls\"]`); holders and slots leased: the broker's view every "
        f"{LEASE_SAMPLE_S:g} s. Load: `os.getloadavg()` 1-minute, at the start and end of each arm, on "
        f"{os.cpu_count()} cores.",
        "",
    ]
    if results.evals:
        lines += _evals_section(results, servers)
    if results.tools:
        lines += _tools_section(results, servers)
    lines += _findings(results, line)
    return "\n".join(lines)


def _evals_sentence(results: Results, args: argparse.Namespace) -> str:
    """Which evals part 1 ran (those of its runs; `eval_names` of --processes where it ran none)."""
    names = list(results.evals[0]["multi"].evals) if results.evals else eval_names(args.processes)
    longs = [n for n in names if n.startswith("long_")]
    shorts = [n for n in names if not n.startswith("long_")]
    copies = [n for n in shorts if n not in SHORT_EVALS]
    return (f"Evals: {', '.join(f'`{n}`' for n in longs)} ({args.long_prompts} prompts x {args.long_tokens} tokens "
            f"each, no stop), the bundled {', '.join(f'`{n}`' for n in shorts if n in SHORT_EVALS)}"
            + (f" and copies of them under names of their own ({', '.join(f'`{n}`' for n in copies)})"
               if copies else "")
            + (f", each limited to {args.limit} samples" if args.limit else ""))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="multiprocess", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=PROCESSES, help="eval processes of part 1's multi arm "
                        "(and evals of its one arm): half long-answer evals, half short ones (default %(default)s)")
    parser.add_argument("--parts", nargs="+", choices=("evals", "tools"), default=["evals", "tools"])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--long-prompts", type=int, default=40)
    parser.add_argument("--long-tokens", type=int, default=48)
    parser.add_argument("--limit", type=int, help="only the first N samples of each eval in part 1 (development)")
    parser.add_argument("--tool-arith", type=int, default=60, help="arith samples of the lm-eval part")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed runs before "
                        f"each part's repeats (part 1: one process, the first {WARMUP_LIMIT} samples of each eval; "
                        "part 2: the one-gateway arm)")
    parser.add_argument("--engine-cpus", type=int, default=0, help="cores kept for the engines, every other "
                        "process on the rest (default 0: every process shares every core)")
    parser.add_argument("--name", default="multiprocess")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, help="keep every arm's logs, artifacts and arm.json here")
    parser.add_argument("--from-work-dir", type=Path, help="run nothing: write the report again from the arm.json "
                        "files and logs a run kept in this --work-dir")
    args = parser.parse_args(argv)
    if args.processes < 2:
        parser.error("--processes: at least 2 (the multi arm against one process)")
    return args


TITLE = "Many processes, one pool: N eval processes and gateway replicas sharing the servers' slots"
RUN_SETTINGS = ("repeats", "processes", "servers", "slots", "threads", "long_prompts", "long_tokens", "limit",
                "tool_arith", "engine_cpus", "warmup")


def execute(args: argparse.Namespace) -> tuple[Results, Path, dict[str, object]]:
    if args.from_work_dir:
        return rerender(args)
    with tempfile.TemporaryDirectory(prefix="fedpool-multiprocess-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        args.bytecode = compile_bytecode()
        (work / RUN_FILE).write_text(json.dumps({
            "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "code": code_version(), "bytecode": args.bytecode,
            "settings": {k: getattr(args, k) for k in RUN_SETTINGS}}), encoding="utf-8")
        results, pool = asyncio.run(run_all(args, work))
    line = headline(results)
    path = write_report(args.name, TITLE, body(results, list(pool.server_urls), args), line,
                        results_dir=args.results_dir)
    return results, path, line


def rerender(args: argparse.Namespace) -> tuple[Results, Path, dict[str, object]]:
    """The report again from what a run kept in its work dir (a report's text changed, not the numbers)."""
    work = args.from_work_dir
    run = json.loads((work / RUN_FILE).read_text(encoding="utf-8"))
    args.warmup = False  # (a run from before the warm-up existed had none)
    args.bytecode = run.get("bytecode", "")  # (nor did one from before the bytecode was compiled first say so)
    for key, value in run["settings"].items():
        setattr(args, key, value)
    results = load_results(work)
    servers = sorted({sid for runs in results.evals for a in runs.values() for sid in a.watch.max_deferred}
                     | {sid for runs in results.tools for t in runs.values() for sid in t.watch.max_deferred})
    note = (f"Figures of the run started {run['started']} (`python -m fedpool.benchmarks.multiprocess "
            f"{' '.join(run['argv'])}`, code {run.get('code', 'unknown')}), written again from what it kept in "
            f"{work}.")
    line = headline(results)
    path = write_report(args.name, TITLE, body(results, servers, args, note), line, results_dir=args.results_dir)
    return results, path, line


def _load_watch(raw: dict[str, Any], arm_dir: Path) -> ArmWatch:
    raw = {**raw, "load_start": tuple(raw["load_start"]), "load_end": tuple(raw["load_end"]),
           "holders_seen": set(raw["holders_seen"]),
           "engine_series": [(t, sample) for t, sample in raw["engine_series"]],
           "lease_series": [(t, holders) for t, holders in raw["lease_series"]]}
    watch = ArmWatch(**raw)
    watch.lease_lapses = _lease_lapses(arm_dir)  # from the logs: a run kept them
    return watch


def load_results(work: Path) -> Results:
    results = Results()
    r = 1
    while (work / f"evals-{r}").is_dir():
        runs: dict[str, EvalArm] = {}
        for arm in EVAL_ARMS:
            raw = json.loads((work / f"evals-{r}" / arm / "arm.json").read_text(encoding="utf-8"))
            evals = {n: EvalTiming(**{**t, "lost_copies": [tuple(c) for c in t["lost_copies"]]})
                     for n, t in raw["evals"].items()}
            runs[arm] = EvalArm(arm, evals, raw["process_s"], _load_watch(raw["watch"], work / f"evals-{r}" / arm),
                                raw["pids"], raw.get("client_cpu_s", 0.0), raw.get("machine_busy", 0.0),
                                CpuUse(**raw["cpu"]) if raw.get("cpu") else None)
        results.evals.append(runs)
        r += 1
    r = 1
    while (work / f"tools-{r}").is_dir():
        tools: dict[str, ToolArm] = {}
        for arm in TOOL_ARMS:
            raw = json.loads((work / f"tools-{r}" / arm / "arm.json").read_text(encoding="utf-8"))
            tools[arm] = ToolArm(**{**raw, "watch": _load_watch(raw["watch"], work / f"tools-{r}" / arm)})
        results.tools.append(tools)
        r += 1
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _, path, line = execute(args)
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in line.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
