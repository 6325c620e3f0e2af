"""The chaos soak: many evaluations through a real local pool for a long time while a seeded fault injector
fires a random fault from the catalogue every few seconds; then the history is checked.

    python -m fedpool.benchmarks.chaos_soak [--minutes 10] [--seed 7] [--servers 4] [--samples 300] [--parallel 4]

The pool: local Ray, the registry actor, emulated vLLM servers each in its own process (so kill -9 and
SIGSTOP are real). The clients: real `fedpool eval run` processes, `--parallel` at a time (4 by default), each on a
run directory of three synthetic benchmarks and each leasing its slots from the registry's broker; a run that is
killed, or that ends with failed records, is resumed with `fedpool eval resume` until it is complete. Faults
(seeded, one every 3-8 s; the registry is killed at least once, a third of the way in at the latest):

- a server killed -9, started again on its port 2-5 s later;
- a server frozen (SIGSTOP) for 3-8 s: it accepts connections and answers nothing, /health included;
- a server slowed for 10-20 s (frozen 80% of each 0.5 s: a fifth of its speed);
- the registry actor killed (Ray restarts it from its state file);
- a client process killed -9 (the driver resumes its run);
- a second `eval resume` started on a run that is being written (it must be refused, exit 5).

The history check, per benchmark of every run: lines in records.jsonl, unique sample ids, the dataset's
ids; lost = dataset ids with no record, duplicated = lines beyond one per id; every score of summary.json
computed over exactly the dataset's samples (n). Leaked: processes the soak started that are still alive
after it stopped everything, and tasks of the driver's event loop still pending.

The leases, throughout: the broker's leases (`RegistryClient.leases()`, through Ray) every 0.25 s, summed per server
against its slots. A registry restarted is a new broker that knows nothing of the old one's leases, which its holders
may use for one TTL and their fallback for one more: the old incarnation's last leases of holders the new one has
not heard from yet count beside the new one's for two TTLs from that sample. `over_capacity`: samples × servers
leased past their slots either way (`LeaseWatch`).

Writes benchmarks/results/chaos_soak.md (`--results-dir`), ending with `result: records=N minutes=X faults=N
processes=N registry_restarts=N lease_samples=N lost=N duplicated=N leaked=N over_capacity=N`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray

from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report
from fedpool.deploy.localpool import init_local_ray
from fedpool.deploy.process import EngineProcess, free_port
from fedpool.registry import Engine, RegistryClient, ServerRecord
from fedpool.registry.leases import LEASE_TTL_S

log = logging.getLogger("fedpool.chaos_soak")
MODEL = "soak-model"
SLOTS = 8  # each emulated server's (max_running in PROFILE, the capacity it registers)
LEASE_SAMPLE_S = 0.25  # the broker's leases are read this often
LEASE_CALL_S = 2.0  # a read of the leases that takes longer is a failed sample (the registry away)
REGISTRY_KILL_BY = 1 / 3  # share of the soak by which the registry has been killed at least once
PROFILE = json.dumps({"name": "soak", "max_running": SLOTS, "decode_s_per_token": 0.01, "batch_slowdown": 0.0,
                      "default_output_tokens": 8})
SPEC = """name: {name}
data: {{path: {data}}}
prompt: {{template: "Question {{q}} ->"}}
generation: {{max_tokens: 6}}
metrics: [exact_match]
"""


@dataclass(frozen=True, slots=True)
class OverCapacity:
    """One server leased past its slots in one sample."""

    at_s: float  # seconds into the soak
    server: str
    leased: int  # by the broker now (with `carried`: and the previous incarnation's leases still runnable)
    carried: int  # of those, the previous incarnation's


@dataclass
class LeaseWatch:
    """The broker's leases, sample by sample, against each server's slots (see the module docstring)."""

    capacity: dict[str, int]
    ttl_s: float = LEASE_TTL_S
    samples: int = 0
    failed: int = 0  # reads that failed or timed out (the registry away)
    max_holders: int = 0
    max_leased: dict[str, int] = field(default_factory=dict)  # server -> most slots leased at once (carried too)
    over: list[OverCapacity] = field(default_factory=list)
    incarnations: list[str] = field(default_factory=list)  # the brokers seen, in order
    carried_samples: int = 0  # samples in which the previous incarnation's leases were counted
    _last: dict[str, dict[str, int]] = field(default_factory=dict)  # the current incarnation's last sample
    _last_at: float = 0.0
    _previous: dict[str, dict[str, int]] = field(default_factory=dict)  # the previous incarnation's last sample
    _previous_until: float = float("-inf")

    @property
    def restarts(self) -> int:
        return max(0, len(self.incarnations) - 1)

    def observe(self, at_s: float, stats: Mapping[str, Any]) -> None:
        """One read of `RegistryClient.leases()` taken `at_s` seconds into the soak."""
        incarnation = str(stats["incarnation"])
        holders: dict[str, dict[str, int]] = {h: {s: int(n) for s, n in slots.items() if n}
                                              for h, slots in stats["holders"].items()}
        if not self.incarnations or incarnation != self.incarnations[-1]:
            if self.incarnations:  # a restarted registry: the old one's leases may be in use two TTLs more
                self._previous, self._previous_until = self._last, self._last_at + 2 * self.ttl_s
            self.incarnations.append(incarnation)
        self.samples += 1
        self.max_holders = max(self.max_holders, sum(1 for slots in holders.values() if slots))
        leased: Counter[str] = Counter()
        for slots in holders.values():
            leased.update(slots)
        carried: Counter[str] = Counter()
        if at_s < self._previous_until:
            for holder, slots in self._previous.items():
                if holder not in holders:  # (one the new broker has heard from works within its new lease)
                    carried.update(slots)
            self.carried_samples += bool(carried)
        for server in set(leased) | set(carried):
            total = leased[server] + carried[server]
            self.max_leased[server] = max(self.max_leased.get(server, 0), total)
            if total > self.capacity.get(server, 0):
                self.over.append(OverCapacity(at_s, server, total, carried[server]))
        self._last, self._last_at = holders, at_s


async def sample_leases(registry: RegistryClient, watch: LeaseWatch, t0: float, stop: asyncio.Event) -> None:
    """`watch` every LEASE_SAMPLE_S until `stop`; a read the registry does not answer in LEASE_CALL_S is a failed
    sample (it is being killed or restarted)."""
    while not stop.is_set():
        try:
            stats = await asyncio.wait_for(registry.leases(), LEASE_CALL_S)
        except Exception:  # (the actor killed, restarting, or too slow: the next sample tries again)
            watch.failed += 1
        else:
            watch.observe(time.monotonic() - t0, stats)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), LEASE_SAMPLE_S)


@dataclass
class Server:
    server_id: str
    url: str
    proc: EngineProcess
    frozen: bool = False


@dataclass
class Run:
    """One run directory and the client process working on it (None between processes)."""

    out: Path
    specs: list[Path]
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0
    killed: int = 0
    exit_codes: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class Soak:
    work: Path
    registry: RegistryClient
    servers: list[Server]
    rng: random.Random
    runs: list[Run] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    fault_log: list[tuple[float, str, str]] = field(default_factory=list)
    started_pids: set[int] = field(default_factory=set)
    refused_races: int = 0
    early_races: int = 0  # racing resumes that came before the raced run had written eval.json (nothing to resume)
    race_problems: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    pending: set[asyncio.Task[None]] = field(default_factory=set)  # faults being undone (thaw, restart)
    registry_due: float = float("inf")  # the registry is killed at the first fault from then if it was not yet
    running: int = 0  # eval processes running now (racing resumes aside) ...
    max_running: int = 0  # ... and the most at once

    # ---- clients ----------------------------------------------------------------------------------------
    async def fedpool(self, *args: str, log: Path | None = None) -> asyncio.subprocess.Process:
        """A `fedpool` client process, its output to `log` (default: a fresh file under logs/)."""
        address = ray.get_runtime_context().gcs_address
        log = log or self.work / "logs" / f"client-{time.monotonic_ns()}.log"
        with log.open("wb") as log_file:  # the child keeps its own copy of the descriptor
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fedpool.cli", *args[:2], "--address", address, "--state-dir",
                str(self.work / "registry"), "--quiet", *args[2:], stdout=log_file, stderr=asyncio.subprocess.STDOUT)
        self.started_pids.add(proc.pid)
        return proc

    async def drive(self, run: Run) -> None:
        """Run, then resume after every kill or incomplete end, until the run exits 0."""
        while not run.done:
            # A run killed before it wrote its eval.json left nothing to resume: it is started again.
            if run.starts == 0 or not (run.out / "eval.json").exists():
                args = ["eval", "run", *(a for s in run.specs for a in ("--spec", str(s))), "--model", MODEL,
                        "--out", str(run.out), "--concurrency", "16", "--no-server-timeout", "120"]
            else:
                args = ["eval", "resume", str(run.out), "--no-server-timeout", "120"]
            run.proc = await self.fedpool(*args)
            run.starts += 1
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            try:
                code = await run.proc.wait()
            finally:
                self.running -= 1
            run.proc = None
            run.exit_codes.append(code)
            if code == 0 and run.starts > 0:
                run.done = True
            elif code not in (0, 4, -signal.SIGKILL, 5):
                log.warning("%s: client exited %s; resuming", run.out.name, code)
                await asyncio.sleep(1.0)

    # ---- faults -----------------------------------------------------------------------------------------
    async def inject(self, until: float) -> None:
        while time.monotonic() < until and not all(r.done for r in self.runs):
            await asyncio.sleep(self.rng.uniform(3.0, 8.0))
            fault = self.rng.choice(("kill_server", "freeze_server", "slow_server", "kill_registry",
                                     "kill_client", "race_resume"))
            if not self.faults["kill_registry"] and time.monotonic() >= self.registry_due:
                fault = "kill_registry"  # (at least once per soak, however short)
            target = await getattr(self, fault)()
            if target is not None:
                self.faults[fault] += 1
                self.fault_log.append((time.monotonic() - self.t0, fault, target))
                log.info("%.0f s: %s %s", time.monotonic() - self.t0, fault, target)

    def _live_server(self) -> Server | None:
        candidates = [s for s in self.servers if not s.frozen and s.proc.returncode is None]
        return self.rng.choice(candidates) if len(candidates) > 1 else None  # never the last one standing

    async def kill_server(self) -> str | None:
        server = self._live_server()
        if server is None:
            return None
        server.proc.kill()
        server.frozen = True  # out of the choice until it is back

        async def restart() -> None:
            await asyncio.sleep(self.rng.uniform(2.0, 5.0))
            await server.proc.wait()
            await server.proc.start()
            assert server.proc.pid is not None
            self.started_pids.add(server.proc.pid)
            server.frozen = False

        self._background(restart())
        return server.server_id

    async def freeze_server(self) -> str | None:
        server = self._live_server()
        if server is None or server.proc.pid is None:
            return None
        server.frozen = True
        os.kill(server.proc.pid, signal.SIGSTOP)

        async def thaw(pid: int) -> None:
            await asyncio.sleep(self.rng.uniform(3.0, 8.0))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            server.frozen = False

        self._background(thaw(server.proc.pid))
        return server.server_id

    async def slow_server(self) -> str | None:
        server = self._live_server()
        if server is None or server.proc.pid is None:
            return None
        server.frozen = True
        pid = server.proc.pid

        async def throttle() -> None:
            until = time.monotonic() + self.rng.uniform(10.0, 20.0)
            try:
                while time.monotonic() < until:
                    os.kill(pid, signal.SIGSTOP)
                    await asyncio.sleep(0.4)
                    os.kill(pid, signal.SIGCONT)
                    await asyncio.sleep(0.1)
            except ProcessLookupError:
                pass
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                server.frozen = False

        self._background(throttle())
        return server.server_id

    async def kill_registry(self) -> str | None:
        await asyncio.to_thread(ray.kill, self.registry.handle, no_restart=False)
        return "registry actor"

    async def kill_client(self) -> str | None:
        running = [r for r in self.runs if r.proc is not None and r.proc.returncode is None]
        if not running:
            return None
        run = self.rng.choice(running)
        assert run.proc is not None
        with contextlib.suppress(ProcessLookupError):
            run.proc.kill()
        run.killed += 1
        return run.out.name

    async def race_resume(self) -> str | None:
        running = [r for r in self.runs if r.proc is not None and r.proc.returncode is None and r.starts > 0]
        if not running:
            return None
        run = self.rng.choice(running)
        racer_log = self.work / "logs" / f"race-{time.monotonic_ns()}.log"
        racer = await self.fedpool("eval", "resume", str(run.out), log=racer_log)

        async def judge() -> None:
            code = await racer.wait()
            if code == 5:
                self.refused_races += 1
            elif code == 2 and "nothing to resume" in await asyncio.to_thread(racer_log.read_text):
                self.early_races += 1  # it came before the run it raced had written eval.json: nothing to resume
            elif code not in (0, 4):  # 0/4: the other had just ended, this one found little or nothing to do
                self.race_problems.append(f"{run.out.name}: racing resume exited {code}")

        self._background(judge())
        return run.out.name

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)


async def _limited(limit: asyncio.Semaphore, work: Coroutine[object, object, None]) -> None:
    async with limit:
        await work


def make_datasets(work: Path, runs: int, samples: int, round_no: int) -> list[Run]:
    out = []
    for r in range(runs):
        specs = []
        for b in range(3):
            name = f"r{round_no}b{r}x{b}"
            data = work / "data" / f"{name}.jsonl"
            data.parent.mkdir(parents=True, exist_ok=True)
            data.write_text("".join(json.dumps({"id": f"{name}-{i}", "q": f"{name} {i}", "answer": "x"}) + "\n"
                                    for i in range(samples)))
            spec = work / "specs" / f"{name}.yaml"
            spec.parent.mkdir(parents=True, exist_ok=True)
            spec.write_text(SPEC.format(name=name, data=data))
            specs.append(spec)
        out.append(Run(work / "runs" / f"round{round_no}-run{r}", specs))
    return out


def check_history(runs: list[Run], samples: int) -> dict[str, int]:
    """Lost, duplicated and mis-scored records over every benchmark of every run."""
    expected = lost = duplicated = misscored = failed = lines = 0
    for run in runs:
        for spec in run.specs:
            name = spec.stem
            bench = run.out / name
            rows = [json.loads(x) for x in (bench / "records.jsonl").read_text().splitlines() if x.strip()] \
                if (bench / "records.jsonl").exists() else []
            ids = Counter(r["sample_id"] for r in rows)
            want = {f"{name}-{i}" for i in range(samples)}
            expected += samples
            lines += len(rows)
            lost += len(want - set(ids))
            duplicated += sum(n - 1 for n in ids.values()) + len(set(ids) - want)
            failed += sum(1 for r in rows if r["provenance"].get("error"))
            summary = json.loads((bench / "summary.json").read_text()) if (bench / "summary.json").exists() else {}
            if summary.get("records") != samples or any(s["n"] != samples for s in summary.get("scores", [])):
                misscored += 1
    return {"expected": expected, "lines": lines, "lost": lost, "duplicated": duplicated, "misscored": misscored,
            "failed": failed}


@dataclass
class SoakResult:
    state: Soak
    history: dict[str, int]
    leaked: int  # processes the soak started still alive, and tasks still pending, after it stopped
    minutes: float
    leases: LeaseWatch


async def start_servers(args: argparse.Namespace, work: Path, state: Soak) -> None:
    """The emulated servers, each in its own process, registered with SLOTS slots (into `state.servers`)."""
    for i in range(args.servers):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = EngineProcess(f"soak-{i}", [sys.executable, "-m", "fedpool.deploy.emulator", "--model", MODEL,
                                           "--port", str(port), "--profile-json", PROFILE,
                                           "--seed", str(args.seed + i)], work / "logs" / f"soak-{i}.log")
        await proc.start()
        assert proc.pid is not None
        state.started_pids.add(proc.pid)
        await proc.wait_healthy(url + "/health", deadline_s=60)
        await state.registry.register(ServerRecord(id=f"soak-{i}", url=url, engine=Engine.VLLM, model=MODEL,
                                                   accelerator="A100", capacity=SLOTS))
        state.servers.append(Server(f"soak-{i}", url, proc))


async def run_rounds(args: argparse.Namespace, work: Path, state: Soak) -> None:
    """Rounds of `--runs` run directories, `--parallel` client processes at once, faults firing throughout, until
    `--minutes` have passed."""
    deadline = state.t0 + args.minutes * 60
    round_no = 0
    while time.monotonic() < deadline:
        runs = make_datasets(work, args.runs, args.samples, round_no)
        state.runs += runs
        limit = asyncio.Semaphore(args.parallel)
        drivers = [asyncio.create_task(_limited(limit, state.drive(r))) for r in runs]
        injector = asyncio.create_task(state.inject(deadline + 3600))
        await asyncio.gather(*drivers)
        injector.cancel()
        await asyncio.gather(injector, return_exceptions=True)
        round_no += 1
        print(f"[soak] round {round_no} done at {(time.monotonic() - state.t0) / 60:.1f} min: "
              f"{sum(len(r.specs) for r in state.runs) * args.samples} records so far, "
              f"{sum(state.faults.values())} faults", flush=True)


async def soak(args: argparse.Namespace, work: Path) -> SoakResult:
    registry = await RegistryClient.start(work / "registry", probe_interval_s=0.5, probe_timeout_s=1.0,
                                          check_timeout_s=5.0, lease_grace_s=5.0)
    state = Soak(work, registry, [], random.Random(args.seed))
    state.registry_due = state.t0 + args.minutes * 60 * REGISTRY_KILL_BY
    watch = LeaseWatch({f"soak-{i}": SLOTS for i in range(args.servers)})
    stop = asyncio.Event()
    sampler: asyncio.Task[None] | None = None
    try:
        await start_servers(args, work, state)
        sampler = asyncio.create_task(sample_leases(registry, watch, state.t0, stop))
        await run_rounds(args, work, state)
        minutes = (time.monotonic() - state.t0) / 60
        for task in list(state.pending):  # thaw / restart whatever is still in a fault
            await task
        history = check_history(state.runs, args.samples)
    finally:
        stop.set()
        if sampler is not None:
            await asyncio.gather(sampler, return_exceptions=True)
        for server in state.servers:
            if server.proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.proc.pid, signal.SIGCONT)
            await server.proc.stop()
        await registry.terminate()
    leaked_procs = [p for p in state.started_pids if psutil.pid_exists(p)
                    and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    current = asyncio.current_task()
    leaked_tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    return SoakResult(state, history, len(leaked_procs) + len(leaked_tasks), minutes, watch)


def headline(result: SoakResult) -> dict[str, object]:
    state, history, watch = result.state, result.history, result.leases
    return {"records": history["expected"], "minutes": f"{result.minutes:.1f}", "faults": sum(state.faults.values()),
            "processes": state.max_running, "registry_restarts": watch.restarts, "lease_samples": watch.samples,
            "lost": history["lost"], "duplicated": history["duplicated"], "leaked": result.leaked,
            "over_capacity": len(watch.over)}


def leases_section(watch: LeaseWatch) -> str:
    over = watch.over
    lines = [
        "## Leases", "",
        f"The broker's leases read {watch.samples} times (every {LEASE_SAMPLE_S:g} s; {watch.failed} reads failed "
        f"or took over {LEASE_CALL_S:g} s while the registry was away); brokers seen: {len(watch.incarnations)} "
        f"({watch.restarts} restarts); most holders with slots at once: {watch.max_holders}. Samples counting a "
        f"previous broker's leases (its holders not yet heard by the new one, for {2 * watch.ttl_s:g} s): "
        f"{watch.carried_samples}.", "",
        markdown_table(("server", "slots", "most leased at once", "samples leased past its slots"),
                       [(sid, cap, watch.max_leased.get(sid, 0), sum(1 for o in over if o.server == sid))
                        for sid, cap in sorted(watch.capacity.items())]),
    ]
    if over:
        lines += ["", "Leased past its slots (first 12): " + "; ".join(
            f"{o.at_s:.1f} s {o.server} {o.leased}" + (f" ({o.carried} the previous broker's)" if o.carried else "")
            for o in over[:12])]
    return "\n".join(lines)


def report_body(args: argparse.Namespace, result: SoakResult) -> str:
    state, history = result.state, result.history
    starts = [r.starts for r in state.runs]
    return (
        f"{args.servers} emulated vLLM servers (own processes, 10 ms a token, {SLOTS} slots each) behind the "
        f"registry on local Ray; {len(state.runs)} run directories of 3 synthetic benchmarks × {args.samples} "
        f"samples, run by real `fedpool eval run` / `eval resume` processes, {args.parallel} at a time (most at "
        f"once: {state.max_running}), each leasing its slots from the registry's broker, for {result.minutes:.1f} "
        f"minutes; seed {args.seed}. A fault every 3–8 s from the catalogue (module docstring); the registry "
        "killed at least once.\n\n"
        "## Faults fired\n\n" + markdown_table(("fault", "times"), sorted(state.faults.items())) + "\n\n"
        f"Racing resumes refused (exit 5): {state.refused_races}; come before the raced run had written its "
        f"eval.json (exit 2, nothing to resume yet): {state.early_races}"
        + (f"; problems: {state.race_problems}" if state.race_problems else "") + ". "
        f"Client processes per run: {min(starts, default=0)}–{max(starts, default=0)} (a run killed or left "
        "incomplete is resumed).\n\n"
        "## History check\n\n"
        + markdown_table(("records expected", "lines written", "lost", "duplicated", "benchmarks mis-scored",
                          "failed records left", "leaked processes + tasks"),
                         [(history["expected"], history["lines"], history["lost"], history["duplicated"],
                           history["misscored"], history["failed"], result.leaked)])
        + "\n\n" + leases_section(result.leases) + "\n\n"
        "First faults: " + "; ".join(f"{t:.0f} s {f} {x}" for t, f, x in state.fault_log[:12])
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="chaos_soak", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="keep starting rounds of runs until this long")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--runs", type=int, help="run directories per round (3 benchmarks each; default: twice "
                        "--parallel)")
    parser.add_argument("--samples", type=int, default=300, help="samples per benchmark")
    parser.add_argument("--parallel", type=int, default=4, help="client processes at once (default %(default)s)")
    parser.add_argument("--name", default="chaos_soak")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, help="the runs, specs, logs and registry state here (default: a "
                        "new temporary directory, kept)")
    args = parser.parse_args(argv)
    if args.runs is None:
        args.runs = 2 * args.parallel
    return args


def execute(args: argparse.Namespace) -> tuple[SoakResult, Path, dict[str, object]]:
    """The soak on a local Ray of its own; the report written."""
    init_local_ray(num_cpus=max(2, os.cpu_count() or 2))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fedpool-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = asyncio.run(soak(args, work))
    finally:
        ray.shutdown()
    line = headline(result)
    path = write_report(args.name, "Chaos soak: every record exactly once through hours of faults (here: minutes)",
                        report_body(args, result), line, results_dir=args.results_dir)
    return result, path, line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _, path, line = execute(args)
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in line.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
