"""The OpenAI Batch API over the pool: four batches of different sizes and shapes handed to the gateway together,
against the same requests sent online through the gateway and each batch on its own server.

    python -m fedpool.benchmarks.batch                      # both pools, full sizes (a quiet machine: ~30-60 min)
    python -m fedpool.benchmarks.batch --pools emulated --scale 0.05 --name batch_check   # a quick check

Per pool (the emulated Table 7 pool, benchmarks/configs/table7_pool.yaml; local llama.cpp servers,
benchmarks/configs/real_pool.yaml), each arm on servers started afresh (no prompt cache carried over from an earlier
arm) and registered in a registry of the benchmark's own, with the gateway as a process of its own (`serve`, below:
the pool app with the Batch API, shortest first, `--policy`, default planned), the arms run in turn:

The gateway runs with the product's `--online-reserve` (1 server per model, `--online-reserve` here; the
unreserved arm's excepted): while online callers are about, batches leave the N servers online requests are
answered soonest on to them, and online requests go there (clients/batchrunner.py `OnlineReserve`).

- **idle**: an online probe (one small request at a time, every `--probe-period` seconds) on the idle pool: its
  latency p99 is the reference for `online_p99_ratio`;
- **batch**: the four batches uploaded and created at once with the openai SDK (`files.create`,
  `batches.create`), polled (one list call every 1 s, every 0.25 s over the last ~5 s) until all have
  ended; makespan from the first upload to the last batch seen ended. The probe runs beside them:
  `online_p99_ratio`, and the makespan over the ideal `vs_ideal_beside_online` — what keeping online latency costs
  the batches on these engines;
- **batch without the probe**: the batch arm again with nothing beside it (warmed up by a batch of 3 requests, not
  by online ones, which would hold the reserve for 30 s): the makespan the ratios read (nothing online is about, so
  batches use every server, as the ideal, online and conventional arms do);
- **unreserved**: the batch arm with the probe again, the gateway started with `--online-reserve 0` (batches fill
  every server even beside online callers): `online_p99_ratio_unreserved`, what the reserve spares the probe;
- **restart**: the same four batches again, the gateway process killed -9 once 40% of their requests are kept and
  started again on the same directory: every custom_id must be in an output or error file exactly once
  (`lost`, `duplicated` count those that are not, over every batch of every arm);
- **online**: the same requests sent online through the gateway by four openai-SDK clients (one per batch, each
  with its own key), 8 at a time each, nothing beside them: right after the batch arm without the probe, in every
  repeat on llama.cpp and the first on the emulated pool (`--online-repeats`); `vs_online` pairs each with that
  run (one online run read 89.7 s against 92.1 s the session before on the same code: a single denominator's
  spread decided a ratio that sits near 1);
- **conventional**: each batch on its own server (the most work on the fastest), sent straight to it at twice its
  slots; on a pool with fewer servers than batches, batches share servers in turn.

The batch arms (with the probe and without) and the unreserved arm run `--repeats` times on the emulated pool
(default 3: one run there has read from 1.16 to 1.44× the ideal on the same code) and `--real-repeats` times on
llama.cpp (default 1), each on fresh servers behind a fresh gateway; their ratios are medians over the runs,
printed with the lowest and highest. The restart and conventional arms run once.
`vs_ideal` (the emulated pool only): the batch arm's makespan without the probe over the ideal makespan, the LP of
benchmarks/assignment.py over the four batches' true token counts (the emulator's own `request_shape`) at the
pool's time scale. `vs_online` and `vs_conventional` are that makespan over those arms'; the result line
carries the emulated pool's vs_ideal and the larger of the two pools' other ratios. Writes
benchmarks/results/NAME.md (default batch), ending with `result: batches=N requests=N vs_ideal=X vs_online=X
vs_conventional=X online_p99_ratio=X vs_ideal_beside_online=X online_p99_ratio_unreserved=X restarts=N lost=N
duplicated=N`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import openai

from fedpool.benchmarks.assignment import Workload, ideal_makespan
from fedpool.benchmarks.report import markdown_table, write_report
from fedpool.benchmarks.speedup_engine import LiveServer, PoolConfig, load_pool_config, started_pool
from fedpool.clients.batchrunner import ONLINE_RESERVE
from fedpool.deploy import EngineProcess, free_port
from fedpool.deploy.emulator import request_shape

CONFIGS = Path(__file__).resolve().parent / "configs"
POOLS = {"emulated": CONFIGS / "table7_pool.yaml", "llamacpp": CONFIGS / "real_pool.yaml"}
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau upsilon phi chi psi "
         "omega river stone cloud lamp orbit field quartz ember tide maple copper").split()
ONLINE_CONCURRENCY = 8
RESTART_AT = 0.4  # the share of the requests kept when the restart arm kills the gateway
POLL_S = 1.0  # the batch arm's list call, at most this far apart ...
FINE_POLL_S = 0.25  # ... and this far once the requests left would be done within FINE_AHEAD_S at the pace so far
FINE_AHEAD_S = 5.0
WARM_UP = 3  # probe requests, untimed, to a gateway just started (its first request loads the policy)
T = TypeVar("T")


@dataclass(frozen=True)
class Shape:
    """One batch: its requests, their prompt length (words) and answer budget, and its endpoint."""

    name: str
    size: int
    prompt_words: int
    max_tokens: int
    endpoint: str


SHAPES = {  # the emulated pool's: the shapes of benchmarks/configs/table7_evals.yaml's four evals
    "emulated": (Shape("reasoning", 1200, 250, 384, "/v1/chat/completions"),
                 Shape("short-answer", 1600, 1100, 24, "/v1/completions"),
                 Shape("caption", 600, 900, 96, "/v1/chat/completions"),
                 Shape("long-context", 300, 7000, 32, "/v1/completions")),
    "llamacpp": (Shape("classify", 120, 60, 8, "/v1/completions"),
                 Shape("reason", 24, 30, 96, "/v1/chat/completions"),
                 Shape("long-context", 24, 400, 16, "/v1/completions"),
                 Shape("summarize", 12, 200, 48, "/v1/chat/completions")),
}


def lines_of(shape: Shape, model: str, scale: float, seed: int) -> list[dict[str, Any]]:
    """The batch's input lines (`custom_id` NAME-i), prompts of seeded words: the same in every arm."""
    rng = random.Random(f"{seed}:{shape.name}")
    out = []
    for i in range(max(1, round(shape.size * scale))):
        text = f"{shape.name} item {i}: " + " ".join(rng.choice(WORDS) for _ in range(shape.prompt_words))
        body: dict[str, Any] = {"model": model, "max_tokens": shape.max_tokens, "temperature": 0}
        if shape.endpoint == "/v1/completions":
            body["prompt"] = text
        else:
            body["messages"] = [{"role": "user", "content": text}]
        out.append({"custom_id": f"{shape.name}-{i}", "method": "POST", "url": shape.endpoint, "body": body})
    return out


def answer_text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


# ---- the gateway process ------------------------------------------------------------------------------------------
async def serve(args: argparse.Namespace) -> None:
    """`serve`: the pool app over the registry in --state-dir, with the Batch API over --batches, until SIGTERM."""
    from fedpool.clients.poolapp import serving_pool
    from fedpool.federation import DispatchConfig, PoolConnection, prepare_policy
    from fedpool.registry.auth import resolve_client_token
    from fedpool.registry.httpclient import find_registry_api

    prepare_policy(args.policy)
    state = Path(args.state_dir)
    api = await asyncio.to_thread(find_registry_api, url=None, state_dir=state,
                                  token=resolve_client_token(state_dir=state))
    assert api is not None, f"no registry API in {state}"
    scale = args.time_scale
    config = DispatchConfig(no_server_timeout_s=10.0, client_order=args.client_order,
                            learn_period_s=max(0.1, 2.0 / scale))
    options = {"period_s": max(0.05, 1.0 / scale)} if args.policy == "planned" else {}
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with PoolConnection(api, policy=args.policy, policy_options=options, config=config) as pool:
        await pool.refresh()
        async with serving_pool(pool, "<html></html>", "127.0.0.1", args.port, backlog=1024,
                                batches_dir=Path(args.batches), online_reserve=args.online_reserve):
            await stop.wait()


@dataclass
class Gateway:
    """The gateway process an arm talks to (restartable on the same port and directory)."""

    argv: list[str]
    url: str
    log: Path
    process: EngineProcess | None = None
    starts: int = 0

    async def start(self) -> None:
        self.process = EngineProcess(f"gateway-{self.starts}", self.argv, self.log)
        self.starts += 1
        await self.process.start()
        await self.process.wait_healthy(self.url + "/health", deadline_s=120.0, interval_s=0.1)

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop()


@contextlib.asynccontextmanager
async def gateway(state: Path, work: Path, policy: str, time_scale: float, tag: str,
                  online_reserve: int = ONLINE_RESERVE, client_order: str = "shortest_first") -> AsyncIterator[Gateway]:
    port = free_port()
    argv = [sys.executable, "-m", "fedpool.benchmarks.batch", "serve", "--state-dir", str(state), "--port", str(port),
            "--batches", str(work / f"batches-{tag}"), "--policy", policy, "--time-scale", str(time_scale),
            "--online-reserve", str(online_reserve), "--client-order", client_order]
    gw = Gateway(argv, f"http://127.0.0.1:{port}", work / f"gateway-{tag}.log")
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


# ---- the arms -----------------------------------------------------------------------------------------------------
@dataclass
class Probe:
    """One small online request at a time, every `period_s`, until stopped: the latencies seen."""

    url: str
    model: str
    period_s: float
    latencies: list[float] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)  # the server that answered each (X-Fedpool-Server)
    sent_at: list[float] = field(default_factory=list)  # when each was sent, seconds from the probe's start
    refused: int = 0  # answered with an error (the gateway overloaded): not retried, not in the latencies

    async def run(self, stop: asyncio.Event, count: int | None = None) -> None:
        """Probe until `stop` (or `count` requests: a warm-up)."""
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="probe-client-key", max_retries=0)
        prompt = "probe: " + " ".join(WORDS[:16])
        start = time.monotonic()
        try:
            while not stop.is_set() and (count is None or len(self.latencies) + self.refused < count):
                began = time.monotonic()
                try:
                    raw = await client.completions.with_raw_response.create(model=self.model, prompt=prompt,
                                                                            max_tokens=16, temperature=0)
                    self.latencies.append(time.monotonic() - began)
                    self.servers.append(raw.headers.get("X-Fedpool-Server", "?"))
                    self.sent_at.append(began - start)
                except openai.APIStatusError:
                    self.refused += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, self.period_s - (time.monotonic() - began)))
        finally:
            await client.close()

    def p99(self) -> float:
        return self.quantile(0.99)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class BatchRun:
    makespan_s: float
    ends: dict[str, float]  # batch name -> seconds from the start to its end
    answers: dict[str, str]  # custom_id -> answer text
    lost: int
    duplicated: int
    failed: int
    statuses: dict[str, str]
    starts: int = 1  # how many times the gateway process was started in the arm
    engine_busy: dict[str, float] = field(default_factory=dict)  # emulated server -> engine seconds in steps


def jsonl(lines: Sequence[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def batch_arm(gw: Gateway, batches: dict[str, list[dict[str, Any]]], *, restart_at: float | None = None,
                    poll_s: float = POLL_S, files: Mapping[str, bytes] | None = None,
                    ended: asyncio.Event | None = None) -> BatchRun:
    """Upload and create every batch at once, poll until all end (killing and restarting the gateway once
    `restart_at` of the requests are kept, if given; then `ended` is set); read their output and error files.
    Polled every `poll_s`, and every FINE_POLL_S once what is left would be done within FINE_AHEAD_S at the pace so
    far (the last batch's end, the makespan, read within 0.25 s; an earlier batch's within 1 s): four list calls a
    second throughout cost the gateway and this process ~1.5 CPU-s a run on the cores the engines compute on, where
    the online arm has no observer (measured on llama.cpp: 4.1 CPU-s against 2.5 online, both processes). `files`:
    each batch's input file, written beforehand (30 MB of JSON on the emulated pool: written here, it held this
    process's loop for ~0.14 s while the probe beside it was timing a request)."""
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="batch-client-key", max_retries=2)
    started = time.monotonic()

    async def create(name: str, lines: list[dict[str, Any]]) -> str:
        data = files[name] if files is not None else jsonl(lines)
        uploaded = await client.files.create(file=(f"{name}.jsonl", data), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint=lines[0]["url"],
                                            completion_window="24h")
        return batch.id

    ids = dict(zip(batches, await asyncio.gather(*(create(n, lines) for n, lines in batches.items())), strict=True))
    total = sum(len(lines) for lines in batches.values())
    ends: dict[str, float] = {}
    final: dict[str, Any] = {}
    while len(final) < len(ids):  # (one list call a poll: the gateway shares the machine with the engines)
        now = {b.id: b for b in (await client.batches.list(limit=len(ids))).data}
        kept = 0
        for name, batch_id in ids.items():
            batch = final.get(name) or now[batch_id]
            counts = batch.request_counts
            kept += (counts.completed + counts.failed) if counts else 0
            if name not in final and batch.status in ("completed", "failed", "expired", "cancelled"):
                final[name], ends[name] = batch, time.monotonic() - started
        if restart_at is not None and kept >= restart_at * total and gw.starts == 1:
            await gw.kill()
            await gw.start()
        await asyncio.sleep(_next_poll(kept, total, time.monotonic() - started, poll_s))
    makespan = max(ends.values())
    if ended is not None:
        ended.set()  # (the probe beside it stops before the output files are read and parsed here)
    answers, seen, failed = {}, Counter[str](), 0
    for batch in final.values():
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id is None:
                continue
            for raw in (await client.files.content(file_id)).text.splitlines():
                line = json.loads(raw)
                seen[line["custom_id"]] += 1
                response = line.get("response") or {}
                if response.get("status_code") == 200:
                    answers[line["custom_id"]] = answer_text(response["body"])
                else:
                    failed += 1
    await client.close()
    expected = {line["custom_id"] for lines in batches.values() for line in lines}
    return BatchRun(makespan, ends, answers, len(expected - set(seen)), sum(n - 1 for n in seen.values() if n > 1),
                    failed, {n: b.status for n, b in final.items()}, gw.starts)


def _next_poll(kept: int, total: int, elapsed_s: float, poll_s: float) -> float:
    """How long until the next list call: FINE_POLL_S once the requests left would be done within FINE_AHEAD_S at
    the pace so far (the batches' end, the makespan, read within it), else `poll_s`; FINE_POLL_S before any result,
    with no pace yet (a small batch may end within the first second)."""
    if kept <= 0 or elapsed_s <= 0:
        return FINE_POLL_S
    return FINE_POLL_S if (total - kept) / (kept / elapsed_s) <= FINE_AHEAD_S else poll_s


async def engine_busy(servers: Sequence[LiveServer]) -> dict[str, float]:
    """Emulated server -> the engine seconds it has spent in steps with work (`fedpool_emulator_busy_seconds_total`;
    servers are fresh each arm, so this is the arm's); other servers are left out."""
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for server in servers:
            if server.profile is None:
                continue
            async with session.get(server.record.url + "/metrics") as response:
                for line in (await response.text()).splitlines():
                    if line.startswith("fedpool_emulator_busy_seconds_total "):
                        out[server.record.id] = float(line.split()[1])
    return out


async def online_arm(url: str, batches: dict[str, list[dict[str, Any]]]) -> tuple[float, dict[str, str]]:
    """Each batch's requests sent online by a client of its own (its own key), 8 at a time: (makespan, answers)."""
    answers: dict[str, str] = {}
    started = time.monotonic()

    async def one_client(name: str, lines: list[dict[str, Any]]) -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=f"online-{name}-key", max_retries=2)
        limit = asyncio.Semaphore(ONLINE_CONCURRENCY)

        async def send(line: dict[str, Any]) -> None:
            async with limit:
                if line["url"] == "/v1/completions":
                    out = await client.completions.create(**line["body"])
                    answers[line["custom_id"]] = out.choices[0].text
                else:
                    chat = await client.chat.completions.create(**line["body"])
                    answers[line["custom_id"]] = chat.choices[0].message.content or ""

        try:
            await asyncio.gather(*(send(line) for line in lines))
        finally:
            await client.close()

    await asyncio.gather(*(one_client(n, lines) for n, lines in batches.items()))
    return time.monotonic() - started, answers


async def conventional_arm(servers: Sequence[LiveServer], batches: dict[str, list[dict[str, Any]]],
                           work: Mapping[str, float]) -> float:
    """Each batch straight to its own server (the most work on the fastest) at twice its slots: the makespan."""
    fastest = sorted(servers, key=lambda s: -s.speed)
    order = sorted(batches, key=lambda n: -work[n])
    started = time.monotonic()

    async def on_server(server: LiveServer, lines: list[dict[str, Any]]) -> None:
        client = openai.AsyncOpenAI(base_url=server.record.url + "/v1", api_key="none", max_retries=2)
        limit = asyncio.Semaphore(2 * (server.record.capacity or 4))

        async def send(line: dict[str, Any]) -> None:
            async with limit:
                body = {**line["body"], "model": server.record.model}
                if line["url"] == "/v1/completions":
                    await client.completions.create(**body)
                else:
                    await client.chat.completions.create(**body)

        try:
            await asyncio.gather(*(send(line) for line in lines))
        finally:
            await client.close()

    await asyncio.gather(*(on_server(fastest[i % len(fastest)], batches[n]) for i, n in enumerate(order)))
    return time.monotonic() - started


# ---- one pool -----------------------------------------------------------------------------------------------------
@dataclass
class Repeats:
    """One arm run again and again, each time on fresh servers behind a fresh gateway: (the batches' run, the probe
    beside it) each time."""

    runs: list[tuple[BatchRun, Probe]]

    @property
    def median(self) -> tuple[BatchRun, Probe]:
        """The run of the median makespan (the lower middle of an even count)."""
        ordered = sorted(self.runs, key=lambda run: run[0].makespan_s)
        return ordered[(len(ordered) - 1) // 2]

    def spread(self, value: Callable[[BatchRun, Probe], float]) -> tuple[float, float, float]:
        """(median, lowest, highest) of a figure over the runs."""
        values = sorted(value(run, probe) for run, probe in self.runs)
        return statistics.median(values), values[0], values[-1]


@dataclass
class PoolResult:
    pool: str
    requests: int
    batches: Repeats  # the batch arm, the probe beside it (the reserve held while it is about)
    plain: Repeats  # the batch arm without the probe (its probes: none): the makespan ratios
    restart: BatchRun
    online: list[float]  # the online arm's makespans: run i beside the batch arm's run i (the first `online_repeats`)
    conventional_s: float
    idle: Probe  # the probe on the idle pool
    unreserved: Repeats  # the batch arm with the probe again, the gateway leaving no server to online callers
    ideal_s: float | None
    answers_same_pct: float
    sizes: dict[str, int]
    reserve: int

    @property
    def batch(self) -> BatchRun:
        return self.plain.median[0]

    def spreads(self) -> dict[str, tuple[float, float, float] | None]:
        """Each ratio over the repeats: (median, lowest, highest); None where it does not apply."""
        idle = self.idle.p99()
        ideal = self.ideal_s

        def of_makespan(arm: Repeats, over: float | None) -> tuple[float, float, float] | None:
            return arm.spread(lambda run, _: run.makespan_s / over) if over else None

        return {"vs_ideal": of_makespan(self.plain, ideal), "vs_online": self.vs_online(),
                "vs_conventional": of_makespan(self.plain, self.conventional_s),
                "online_p99_ratio": self.batches.spread(lambda _, probe: probe.p99() / idle),
                "vs_ideal_beside_online": of_makespan(self.batches, ideal),
                "online_p99_ratio_unreserved": self.unreserved.spread(lambda _, probe: probe.p99() / idle),
                "vs_ideal_unreserved": of_makespan(self.unreserved, ideal)}

    def vs_online(self) -> tuple[float, float, float]:
        """The batch arm's makespan over the online arm's, run by run where the online arm ran beside it (each pair
        on the same machine minutes apart), else over the online arm's median: (median, lowest, highest)."""
        runs = [run.makespan_s for run, _ in self.plain.runs]
        if len(self.online) > 1:
            values = sorted(b / o for b, o in zip(runs, self.online, strict=False))
        else:
            values = sorted(b / self.online[0] for b in runs)
        return statistics.median(values), values[0], values[-1]

    @property
    def ratios(self) -> dict[str, float | None]:
        """Each ratio's median over the repeats."""
        return {k: v[0] if v is not None else None for k, v in self.spreads().items()}


def ideal_wall_s(config: PoolConfig, batches: dict[str, list[dict[str, Any]]]) -> float | None:
    """The LP's ideal makespan in wall seconds over the true token counts (emulated pools only)."""
    profiles = config.profiles()
    if not profiles:
        return None
    profile = next(iter(profiles.values()))
    work = []
    for name, lines in batches.items():
        shapes = [request_shape(line["body"], line["url"] != "/v1/completions", profile, 0) for line in lines]
        work.append(Workload(name, len(lines), sum(s[2] for s in shapes) / len(shapes),
                             sum(s[3] for s in shapes) / len(shapes)))
    makespan, _ = ideal_makespan(work, profiles)
    return makespan / config.time_scale


async def run_pool(name: str, args: argparse.Namespace, work: Path) -> PoolResult:
    from fedpool.deploy.localpool import init_local_ray
    from fedpool.registry import RegistryClient

    config = load_pool_config(POOLS[name])
    init_local_ray()
    state = Path(tempfile.mkdtemp(prefix="registry-", dir=work))
    registry = await RegistryClient.start(state, probe_interval_s=max(0.2, 1.0 / config.time_scale),
                                          namespace=f"fedpool-bench-batch-{os.getpid()}-{name}")

    def fresh(arm: str) -> contextlib.AbstractAsyncContextManager[Sequence[LiveServer]]:
        """The pool's servers started afresh for one arm: an engine's prompt cache (the emulator's prefix cache,
        llama.cpp's slots and its host-memory cache) would serve a later arm the prompts an earlier one sent."""
        return started_pool(config, work / f"logs-{name}-{arm}", registry)

    try:
        return await _arms(name, args, work, config, state, fresh)
    finally:
        await registry.terminate()


async def _arms(name: str, args: argparse.Namespace, work: Path, config: PoolConfig, state: Path,
                fresh: Callable[[str], contextlib.AbstractAsyncContextManager[Sequence[LiveServer]]]) -> PoolResult:
    batch_runs: list[tuple[BatchRun, Probe]] = []
    plain_runs: list[tuple[BatchRun, Probe]] = []
    unreserved_runs: list[tuple[BatchRun, Probe]] = []
    online_runs: list[float] = []
    online: dict[str, str] = {}
    idle: Probe | None = None
    batches: dict[str, list[dict[str, Any]]] = {}
    files: dict[str, bytes] = {}
    model = ""
    for i in range(args.repeats if name == "emulated" else args.real_repeats):
        tag = "" if i == 0 else f"-{i + 1}"
        async with fresh(f"batch{tag}") as servers, gateway(state, work, args.policy, config.time_scale,
                                                            f"{name}-batch{tag}", online_reserve=args.online_reserve,
                                                            client_order=args.client_order) as gw:
            model = servers[0].record.model  # (a llama.cpp pool serves its model under its alias)
            batches = batches or {s.name: lines_of(s, model, args.scale, args.seed) for s in SHAPES[name]}
            files = files or {n: jsonl(lines) for n, lines in batches.items()}
            await Probe(gw.url, model, 0.0).run(asyncio.Event(), count=WARM_UP)
            if idle is None:
                _, idle = await probed(gw.url, model, args.probe_period, lambda ended: asyncio.sleep(args.idle_probe_s))
            batch_runs.append(await probed(gw.url, model, args.probe_period, functools.partial(
                batch_arm, gw, batches, files=files)))
            batch_runs[-1][0].engine_busy = await engine_busy(servers)
        async with fresh(f"plain{tag}") as servers, gateway(state, work, args.policy, config.time_scale,
                                                            f"{name}-plain{tag}", online_reserve=args.online_reserve,
                                                            client_order=args.client_order) as gw:
            # (as every arm, a first request loads the policy: here a batch's, so nothing online is about)
            await batch_arm(gw, {"warm-up": next(iter(batches.values()))[:WARM_UP]})
            plain = await batch_arm(gw, batches, files=files)
            plain.engine_busy = await engine_busy(servers)
            plain_runs.append((plain, Probe(gw.url, model, args.probe_period)))  # (no probe beside it)
        if i < online_repeats(name, args):
            async with fresh(f"online{tag}"), gateway(state, work, args.policy, config.time_scale,
                                                     f"{name}-online{tag}", client_order=args.client_order) as gw:
                await Probe(gw.url, model, 0.0).run(asyncio.Event(), count=WARM_UP)
                online_s, answers = await online_arm(gw.url, batches)
                online_runs.append(online_s)
                online = online or answers
        async with fresh(f"unreserved{tag}") as servers, gateway(state, work, args.policy, config.time_scale,
                                                                 f"{name}-unreserved{tag}", online_reserve=0,
                                                                 client_order=args.client_order) as gw:
            await Probe(gw.url, model, 0.0).run(asyncio.Event(), count=WARM_UP)
            unreserved_runs.append(await probed(gw.url, model, args.probe_period, functools.partial(
                batch_arm, gw, batches, files=files)))
            unreserved_runs[-1][0].engine_busy = await engine_busy(servers)
    assert idle is not None
    async with fresh("restart"), gateway(state, work, args.policy, config.time_scale, f"{name}-restart",
                                          client_order=args.client_order) as gw:
        restart = await batch_arm(gw, batches, restart_at=RESTART_AT, files=files)
    work_of = {n: sum(len(json.dumps(line["body"])) / 4 + 2 * line["body"]["max_tokens"] for line in lines)
               for n, lines in batches.items()}
    async with fresh("conventional") as servers:
        conventional_s = await conventional_arm(servers, batches, work_of)
    first = batch_runs[0][0]
    same = sum(1 for k, v in online.items() if first.answers.get(k) == v)
    return PoolResult(name, sum(len(v) for v in batches.values()), Repeats(batch_runs), Repeats(plain_runs), restart,
                      online_runs, conventional_s, idle, Repeats(unreserved_runs),
                      ideal_wall_s(config, batches), 100.0 * same / max(1, len(online)),
                      {n: len(v) for n, v in batches.items()}, args.online_reserve)


def online_repeats(name: str, args: argparse.Namespace) -> int:
    """How many of the pool's repeats run the online arm too: `--online-repeats`, else every repeat on llama.cpp (its
    vs_online sits near 1, where one online run's spread decides the ratio) and the first on the emulated pool (~130
    s a run, and its batches take a third of that)."""
    repeats = args.repeats if name == "emulated" else args.real_repeats
    chosen = args.online_repeats if args.online_repeats is not None else (1 if name == "emulated" else repeats)
    return max(1, min(repeats, chosen))


async def probed(url: str, model: str, period_s: float,
                 arm: Callable[..., Coroutine[Any, Any, T]]) -> tuple[T, Probe]:
    """Run the arm with the online probe beside it until the arm sets the event it is given as `ended` (or
    ends)."""
    probe, stop = Probe(url, model, period_s), asyncio.Event()
    probing = asyncio.create_task(probe.run(stop))
    try:
        return await arm(ended=stop), probe
    finally:
        stop.set()
        await probing


# ---- the report ---------------------------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _spread(x: tuple[float, float, float] | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x[0]:.{digits}f} ({x[1]:.{digits}f}–{x[2]:.{digits}f})"


def _ends(run: BatchRun) -> str:
    return ", ".join(f"{n} {_f(t, 1)}" for n, t in sorted(run.ends.items(), key=lambda x: x[1]))


def body(results: Sequence[PoolResult], args: argparse.Namespace) -> str:
    parts = [f"Scale {args.scale:g} of the full sizes, seed {args.seed}, gateway policy `{args.policy}`, "
             f"client order {args.client_order}, probe every {args.probe_period:g} s. The batch arm (with the probe "
             f"beside it, and without it) and the unreserved arm run {args.repeats} times on the emulated pool and "
             f"{args.real_repeats} on llama.cpp, each time on fresh servers behind a fresh gateway; ratios are the "
             f"median over those runs (lowest–highest); the online arm runs in the first "
             f"{online_repeats('emulated', args)} of them on the emulated pool and {online_repeats('llamacpp', args)} "
             "on llama.cpp, right after the run without the probe, and vs_online pairs each online run with that run "
             "(with one, every run over it); the restart and conventional arms run once. The makespan ratios "
             "(vs_ideal, vs_online, vs_conventional) are read from the runs without the probe, as the ideal, the "
             "online arm and the conventional arm run without it: beside the batches it is answered first, so it is "
             "work they do that the others do not (on llama.cpp each probe holds a slot for ~2 s there).\n"]
    for r in results:
        parts.append(f"## {r.pool} pool ({POOLS[r.pool].name})\n")
        rows = [[f"batch, nothing beside it, run {i + 1}", _f(run.makespan_s), "ends: " + _ends(run)]
                for i, (run, _) in enumerate(r.plain.runs)]
        rows += [[f"batch, the probe beside it (--online-reserve {r.reserve}), run {i + 1}", _f(run.makespan_s),
                  f"the probe: {len(probe.latencies)} answered, p50 {_f(probe.quantile(0.5), 3)} s, p99 "
                  f"{_f(probe.p99(), 3)} s; ends: {_ends(run)}"] for i, (run, probe) in enumerate(r.batches.runs)]
        rows += [[f"batch, the probe beside it, --online-reserve 0, run {i + 1}", _f(run.makespan_s),
                  f"the probe: {len(probe.latencies)} answered, p50 {_f(probe.quantile(0.5), 3)} s, p99 "
                  f"{_f(probe.p99(), 3)} s; ends: {_ends(run)}"] for i, (run, probe) in enumerate(r.unreserved.runs)]
        rows += [["restart (kill -9 at 40%)", _f(r.restart.makespan_s), f"lost {r.restart.lost}, duplicated "
                  f"{r.restart.duplicated}, gateway starts {r.restart.starts}"],
                 *[[f"online (4 SDK clients × 8), run {i + 1}", _f(online_s),
                    f"answers the same as the batch arm's first run: {r.answers_same_pct:.1f}%" if i == 0 else
                    "right after the batch arm's run without the probe of the same number"]
                   for i, online_s in enumerate(r.online)],
                 ["conventional (a server each)", _f(r.conventional_s), ""],
                 ["ideal (LP)", _f(r.ideal_s), "emulated pools only"]]
        parts.append(markdown_table(["arm", "makespan s", "notes"], rows))
        spreads = r.spreads()
        busy = r.batches.median[1]
        parts.append("\n" + markdown_table(
            ["batches", "requests", "vs_ideal", "vs_online", "vs_conventional", "online p99 idle s",
             "beside the batches s", "online_p99_ratio", "p50 idle/beside s", "probes idle/beside",
             "refused idle/beside"],
            [[len(r.sizes), r.requests, _spread(spreads["vs_ideal"]), _spread(spreads["vs_online"]),
              _spread(spreads["vs_conventional"]), _f(r.idle.p99(), 3), _f(busy.p99(), 3),
              _spread(spreads["online_p99_ratio"]), f"{_f(r.idle.quantile(0.5), 3)}/{_f(busy.quantile(0.5), 3)}",
              f"{len(r.idle.latencies)}/{len(busy.latencies)}", f"{r.idle.refused}/{busy.refused}"]]))
        parts.append(online_latency(r, spreads))
        parts.append("\nBatches: " + ", ".join(f"{n} {k}" for n, k in r.sizes.items()) + "; statuses "
                     + ", ".join(f"{n} {s}" for n, s in r.batch.statuses.items()) + "\n")
    return "\n".join(parts)


def online_latency(r: PoolResult, spreads: Mapping[str, tuple[float, float, float] | None]) -> str:
    """Where the probe was answered and how fast, beside the batches with and without the reserve (the median
    runs); each engine's busy share; on an emulated pool, what one engine step costs the probe alone and beside a
    step's full chunked-prefill budget."""
    (batch, _), (beside, busy), (_, unreserved) = r.plain.median, r.batches.median, r.unreserved.median
    rows = []
    for arm, probe in (("idle", r.idle), (f"beside the batches, --online-reserve {r.reserve}", busy),
                       ("beside the batches, --online-reserve 0", unreserved)):
        for server in sorted(set(probe.servers)):
            times = sorted(t for t, s in zip(probe.latencies, probe.servers, strict=True) if s == server)
            rows.append([arm, server, len(times), _f(times[len(times) // 2], 3), _f(times[-1], 3)])
    slowest = sorted(zip(busy.latencies, busy.sent_at, busy.servers, strict=True), reverse=True)[:3]
    out = ["\nThe probe by the server that answered it (the median runs):\n",
           markdown_table(["arm", "server", "probes", "p50 s", "max s"], rows),
           f"\nThe slowest probes beside the batches (--online-reserve {r.reserve}, the median run): "
           + "; ".join(f"{_f(t, 3)} s sent {_f(at, 1)} s into the arm, on {server}" for t, at, server in slowest)
           + ".\n",
           f"\nBeside the probe, with --online-reserve {r.reserve}: online_p99_ratio "
           f"{_spread(spreads['online_p99_ratio'])}, the batches at {_spread(spreads['vs_ideal_beside_online'])} of "
           f"the ideal; with --online-reserve 0: {_spread(spreads['online_p99_ratio_unreserved'])}, "
           f"{_spread(spreads['vs_ideal_unreserved'])}. Nothing online beside them: "
           f"{_spread(spreads['vs_ideal'])} (vs_ideal).\n"]
    config = load_pool_config(POOLS[r.pool])
    profiles = config.profiles()
    if batch.engine_busy:
        out += ["\nEach engine's busy share of the batch arm's median runs (engine seconds in steps with work ÷ "
                f"makespan × time scale {config.time_scale:g}; the LP's ideal keeps every engine busy to its end):\n",
                markdown_table(["server", "nothing beside it", f"the probe beside it, --online-reserve {r.reserve}"],
                               [[server, _f(seconds / (batch.makespan_s * config.time_scale), 3),
                                 _f(beside.engine_busy.get(server, 0.0)
                                    / (beside.makespan_s * config.time_scale), 3)]
                                for server, seconds in sorted(batch.engine_busy.items())])]
    if profiles:
        body = {"model": "m", "prompt": "probe: " + " ".join(WORDS[:16]), "max_tokens": 16, "temperature": 0}
        steps = []
        for server, p in profiles.items():
            _, _, prompt, answer = request_shape(body, False, p, 0)
            alone = prompt * p.prefill_s_per_token + answer * p.decode_s_per_token
            chunk = p.decode_s_per_token + p.max_batched_tokens * p.prefill_s_per_token
            steps.append([server, p.name, prompt, answer, _f(1e3 * p.decode_s_per_token, 1), _f(1e3 * alone, 0),
                          p.max_batched_tokens, _f(1e3 * chunk, 0), _f(answer * chunk / alone, 1)])
        out += ["\nWhy online latency rises beside batches on these engines (the emulator's step model, "
                "deploy/batching.py): every step decodes one token of each running answer and prefills up to "
                "`max_batched_tokens` of the prompts waiting, so the probe's every token waits for the step's prefill. "
                "Engine milliseconds:\n",
                markdown_table(["server", "profile", "probe prompt", "answer", "step alone", "probe alone",
                                "chunk tokens", "step with a full chunk", "probe ÷ alone, every step a full chunk"],
                               steps)]
    return "\n".join(out)


def result_of(results: Sequence[PoolResult]) -> dict[str, object]:
    ratios = [r.ratios for r in results]
    ideal = [x["vs_ideal"] for x in ratios if x["vs_ideal"] is not None]
    beside = [x["vs_ideal_beside_online"] for x in ratios if x["vs_ideal_beside_online"] is not None]

    def worst(key: str) -> str:
        values = [x[key] for x in ratios if x[key] is not None]
        return _f(max(values), 3) if values else "-"  # type: ignore[type-var]

    runs = [run for r in results for arm in (r.batches, r.plain, r.unreserved) for run, _ in arm.runs] + [
        r.restart for r in results]
    return {"batches": sum(len(r.sizes) for r in results), "requests": sum(r.requests for r in results),
            "vs_ideal": _f(ideal[0], 3) if ideal else "-", "vs_online": worst("vs_online"),
            "vs_conventional": worst("vs_conventional"), "online_p99_ratio": worst("online_p99_ratio"),
            "vs_ideal_beside_online": _f(beside[0], 3) if beside else "-",
            "online_p99_ratio_unreserved": worst("online_p99_ratio_unreserved"),
            "restarts": sum(r.restart.starts - 1 for r in results),
            "lost": sum(run.lost for run in runs), "duplicated": sum(run.duplicated for run in runs)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fedpool.benchmarks.batch",
                                     description=(__doc__ or "").split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    served = sub.add_parser("serve", help="(internal) the gateway process an arm talks to")
    served.add_argument("--state-dir", required=True)
    served.add_argument("--port", type=int, required=True)
    served.add_argument("--batches", required=True)
    served.add_argument("--policy", default="planned")
    served.add_argument("--time-scale", type=float, default=1.0)
    served.add_argument("--online-reserve", type=int, default=ONLINE_RESERVE)
    served.add_argument("--client-order", default="shortest_first")
    parser.add_argument("--pools", default="emulated,llamacpp", help="comma-separated: emulated, llamacpp")
    parser.add_argument("--scale", type=float, default=1.0, help="batch sizes × this (at least 1 request each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="planned")
    parser.add_argument("--probe-period", type=float, default=0.5)
    parser.add_argument("--client-order", default="shortest_first",
                        help="the gateway's order between clients (the issue's: shortest_first between batches)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the batch and unreserved arms, emulated pool")
    parser.add_argument("--real-repeats", type=int, default=1,
                        help="runs of the batch and unreserved arms on the llama.cpp pool (each takes minutes)")
    parser.add_argument("--online-repeats", type=int, default=None,
                        help="repeats that run the online arm too (default: all on llama.cpp, the first on emulated)")
    parser.add_argument("--online-reserve", type=int, default=ONLINE_RESERVE,
                        help="servers the gateway leaves to online callers (the product's default; unreserved arm: 0)")
    parser.add_argument("--idle-probe-s", type=float, default=20.0)
    parser.add_argument("--name", default="batch", help="the report's name under benchmarks/results/")
    parser.add_argument("--work-dir", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "serve":
        asyncio.run(serve(args))
        return 0
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedpool-batch-")))
        work.mkdir(parents=True, exist_ok=True)
        results = [asyncio.run(run_pool(name, args, work)) for name in args.pools.split(",")]
    result = result_of(results)
    path = write_report(args.name, "The Batch API over the pool: four batches against online and a server each",
                        body(results, args), result)
    print(f"wrote {path}\n" + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
