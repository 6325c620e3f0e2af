"""Real tools in both arms: lm-evaluation-harness processes on their own llama.cpp servers (conventional) and
the same processes all pointed at fedpool's gateway (federated), plus fedpool's own `eval run`.

    python -m fedpool.benchmarks.realtool_speedup --repeats 3

Each process is lm-eval 0.4's own CLI with `--model local-completions` (its OpenAI-completions API client,
`lm_eval/models/openai_completions.py` over `api_models.py`'s TemplateAPI): requests built first, then sent
with `num_concurrent` in flight, refilled as each answers; `tokenized_requests=False,tokenizer_backend=None`,
so no tokenizer is needed offline. The conventional arm is what a user with N servers and N evals does today:
process i on server i, `num_concurrent` = that server's slots. The federated arm runs the same processes, each
with its own OPENAI_API_KEY (the gateway tells clients apart by it), against one gateway in front of the same
servers. Arms alternate order in every repeat. Busy time is read from each llama-server's own
`llamacpp:requests_processing` gauge (sampled every 50 ms), which gives the balanced bound: all the servers'
busy seconds in the conventional arm ÷ servers — the makespan if that work were spread perfectly.

Makespans are **inference** makespans: from the first request any server sees to the last answer, so the
same lm-eval start-up (imports, task building: a few seconds per process, in every arm alike) is not
counted; process wall times, start-up included, are in the report beside them. Answers are compared record by
record (lm-eval's `--log_samples`) between the conventional and the federated arm.

With `--work-dir`, each lm-eval arm leaves `ARM-timeline.json` beside its logs: every request as [eval, sent,
answered (seconds from the start gate's release), the server that answered (the gateway's `X-Fedpool-Server`)].

Writes benchmarks/results/realtool_speedup.md, ending with
`result: tool=lm-eval processes=N repeats=N speedup_makespan=X vs_balanced=X answers_same_pct=X later_evals=N
sized_speedup_makespan=X sized_vs_balanced=X sized_later_evals=N` (the unequal pair at the first gateway
concurrency: the processes as they are, then each declaring its run's size in its URL, `-sized`; `later_evals`:
evals that finished later than on their own server, over every repeat).

Each arm's processes run at the concurrency of what they are pointed at: on its own server, that server's
slots (more only queues inside llama-server); through the gateway, the pool's slots (the gateway admits up to
each server's slots and queues the rest itself, in its client order). The gateway at one server's slots is
reported too: there a long eval is bound by its own concurrency (its requests in flight × llama.cpp's
per-sequence latency, which falls only from 5.4 s to 4.0 s per 64 tokens going from 4 to 2 sequences on a
server here), whatever the pool does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report
from fedpool.federation.gateway import REQUESTS_QUERY

log = logging.getLogger("fedpool.realtool")

ARITH_TEMPLATE = "3 + 4 = 7\n12 + 5 = 17\n2 + 9 = 11\n14 + 8 = 22\n6 + 1 = 7\n10 + 10 = 20\n{a} + {b} ="
TOPICS = ["the sea", "a lighthouse", "winter", "a market", "an old clock", "the moon", "a train", "rain",
          "a garden", "a library", "mountains", "a river", "a violin", "bread", "a bridge", "the desert",
          "a harbour", "snow", "a forest", "a candle"]
SAMPLE_PREFIX = "samples_"


# ---- the workloads -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Workload:
    """One eval: an lm-eval task (and the same benchmark as a fedpool spec for the `eval run` arm)."""

    name: str
    rows: list[dict[str, Any]]
    template: str  # fedpool prompt template ({field}); lm-eval gets the same as Jinja
    max_tokens: int
    stop: list[str]

    def lm_eval_yaml(self, data: Path) -> str:
        jinja = self.template.replace("{", "{{").replace("}", "}}")
        return json.dumps({
            "task": self.name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "generate_until", "doc_to_text": jinja,
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": self.stop, "max_gen_toks": self.max_tokens, "do_sample": False,
                                  "temperature": 0.0},
            "metric_list": [{"metric": "exact_match"}],
        }, indent=1)  # YAML is a superset of JSON

    def fedpool_spec(self, data: Path) -> str:
        return json.dumps({
            "name": self.name, "description": f"realtool benchmark {self.name}", "data": {"path": str(data)},
            "label_field": "answer", "prompt": {"style": "completion", "template": self.template},
            "generation": {"max_tokens": self.max_tokens, "temperature": 0.0, "stop": self.stop},
            "postprocess": ["strip"], "metrics": ["exact_match"],
        }, indent=1)


def arith(n: int) -> Workload:
    """The bundled arith benchmark (six-shot addition, a number back): short prompts, short answers."""
    from fedpool.pipeline.bundled import bundled_spec_paths

    path = next(p for p in bundled_spec_paths() if p.stem == "arith").with_suffix(".jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()[:n]]
    return Workload("arith", rows, ARITH_TEMPLATE, 4, ["\n"])


def stories(name: str, n: int, tokens: int) -> Workload:
    """n prompts asking for prose, `tokens` generated each (no stop string): long answers."""
    rows = [{"id": f"{name}-{i:03d}", "topic": TOPICS[i % len(TOPICS)], "k": i, "answer": "-"} for i in range(n)]
    return Workload(name, rows, "Story {k}. Here is a long, quiet story about {topic}. Once upon a time,",
                    tokens, [])


@dataclass(frozen=True, slots=True)
class Pair:
    name: str
    workloads: tuple[Workload, ...]
    note: str


def pairs(small: bool) -> dict[str, Pair]:
    if small:  # the CI test's version
        return {"unequal": Pair("unequal", (arith(24), stories("long", 16, 32)), "A: 24 arith; B: 16 x 32 tokens"),
                "equal": Pair("equal", (stories("long", 16, 48), stories("long2", 16, 48)), "16 x 48 tokens each")}
    return {"unequal": Pair("unequal", (arith(60), stories("long", 40, 64)),
                            "A: bundled arith, 60 samples (a number back); B: 40 prompts x 64 tokens"),
            "equal": Pair("equal", (stories("long", 40, 64), stories("long2", 40, 64)),
                          "two evals of 40 prompts x 64 tokens: nothing to balance")}


# ---- busy sampling -----------------------------------------------------------------------------------
@dataclass
class BusyLog:
    """When each server had at least one request processing (its own gauge), sampled every `period_s`."""

    period_s: float = 0.05
    busy_s: dict[str, float] = field(default_factory=dict)
    running_s: dict[str, float] = field(default_factory=dict)  # ∫ requests processing dt
    first: float | None = None
    last: float | None = None

    def span(self) -> float:
        return (self.last - self.first) if self.first is not None and self.last is not None else 0.0


async def _processing(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
        text = await resp.text()
    return float(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name in ("llamacpp:requests_processing", "llamacpp:requests_deferred")))


async def sample_busy(urls: dict[str, str], busy: BusyLog, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            now = time.monotonic()
            values = await asyncio.gather(*(_processing(session, u) for u in urls.values()), return_exceptions=True)
            for sid, value in zip(urls, values, strict=True):
                if isinstance(value, float) and value > 0:
                    busy.busy_s[sid] = busy.busy_s.get(sid, 0.0) + busy.period_s
                    busy.running_s[sid] = busy.running_s.get(sid, 0.0) + busy.period_s * value
                    busy.first = now if busy.first is None else busy.first
                    busy.last = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), busy.period_s)


# ---- the start line --------------------------------------------------------------------------------------
class StartGate:
    """A pass-through in front of each arm's targets that holds every request until each of the arm's processes
    has sent its first one, then lets them all go at once: lm-eval's start-up (indexing its task registry,
    building requests: 5-15 s per process on 2 cores, varying run to run) is then outside every arm's clock,
    and the processes start sending together, as evals launched together on idle servers would. Each process
    (told apart by its API key) is forwarded to its own target; request and response bodies pass unchanged.
    Records, per process, when its last answer came back."""

    def __init__(self, session: aiohttp.ClientSession):
        self._session = session
        self._targets: dict[str, str] = {}
        self._open = asyncio.Event()
        self._seen: set[str] = set()
        self.released_at: float | None = None
        self.last_answer: dict[str, float] = {}
        # every request answered: (API key, sent, answered (monotonic s), the server that answered or "")
        self.timeline: list[tuple[str, float, float, str]] = []
        self.url = ""
        self._runner: Any = None

    def arm(self, targets: dict[str, str]) -> None:
        """The next arm: API key -> target base URL."""
        self._targets = dict(targets)
        self._open = asyncio.Event()
        self._seen = set()
        self.released_at = None
        self.last_answer = {}
        self.timeline = []

    async def start(self) -> None:
        from aiohttp import web

        from fedpool.deploy.process import free_port

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _forward(self, request: Any) -> Any:
        from aiohttp import web

        key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        target = self._targets.get(key)
        if target is None:
            return web.json_response({"error": {"message": "unknown key at the start gate"}}, status=401)
        body = await request.read()
        if request.method == "POST":  # requests, not lm-eval's model listing, count for the start line
            self._seen.add(key)
            if self._seen >= set(self._targets) and not self._open.is_set():
                self.released_at = time.monotonic()
                self._open.set()
            await self._open.wait()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        sent = time.monotonic()
        async with self._session.request(request.method, target + request.path_qs, data=body,
                                         headers=headers) as resp:
            payload = await resp.read()
            out = web.Response(body=payload, status=resp.status,
                               content_type=resp.content_type or "application/json")
            server = resp.headers.get("X-Fedpool-Server", "")
        if request.method == "POST":
            self.last_answer[key] = answered = time.monotonic()
            self.timeline.append((key, sent, answered, server))
        return out

    def durations(self) -> dict[str, float]:
        """API key -> seconds from the release to that process's last answer."""
        if self.released_at is None:
            return {}
        return {k: t - self.released_at for k, t in self.last_answer.items()}


# ---- CPU accounting ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CpuUse:
    """What this machine's cores did during an arm: the engines' own CPU seconds, the seconds their threads spent
    runnable but waiting for a core (the kernel's run-queue delay, /proc/<pid>/task/*/schedstat), and every other
    process's CPU seconds (the machine's busy time, /proc/stat via psutil, less the engines'). Everything runs on
    one 2-core machine: what the rest uses, the engines wait for."""

    engines_cpu_s: float
    engines_wait_s: float
    other_cpu_s: float


def _cpu_counters(pids: Sequence[int]) -> tuple[float, float, float]:
    """(machine busy CPU s, engines' CPU s, engines' run-queue wait s) since boot."""
    import psutil

    times = psutil.cpu_times()
    busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
    cpu = wait = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
                    cpu += int(run_ns) / 1e9
                    wait += int(wait_ns) / 1e9
    return busy, cpu, wait


class CpuMeter:
    """`CpuUse` between `start` and `stop` (None where /proc is not Linux's)."""

    def __init__(self, pids: Sequence[int]):
        self._pids = list(pids)
        self._begin: tuple[float, float, float] | None = None

    async def start(self) -> None:
        self._begin = await asyncio.to_thread(self._read)

    async def stop(self) -> CpuUse | None:
        end = await asyncio.to_thread(self._read)
        if self._begin is None or end is None:
            return None
        busy, cpu, wait = (b - a for a, b in zip(self._begin, end, strict=True))
        return CpuUse(cpu, wait, max(0.0, busy - cpu))

    def _read(self) -> tuple[float, float, float] | None:
        if not self._pids or not Path("/proc/self/schedstat").exists():
            return None
        return _cpu_counters(self._pids)


@dataclass
class ArmWatch:
    """What an arm's engines and cores did while it ran (`cpu` set when the arm ends)."""

    busy: BusyLog = field(default_factory=BusyLog)
    cpu: CpuUse | None = None


@contextlib.asynccontextmanager
async def watching(server_urls: dict[str, str], engine_pids: Sequence[int]) -> AsyncIterator[ArmWatch]:
    """For the arm's life: the engines' busy gauges sampled, the machine's cores metered."""
    watch, stop, meter = ArmWatch(), asyncio.Event(), CpuMeter(engine_pids)
    await meter.start()
    sampler = asyncio.create_task(sample_busy(server_urls, watch.busy, stop))
    try:
        yield watch
    finally:
        stop.set()
        await sampler
    watch.cpu = await meter.stop()


# ---- one arm -------------------------------------------------------------------------------------------
@dataclass
class ArmRun:
    arm: str
    inference_makespan_s: float
    process_wall_s: dict[str, float]  # eval -> its process's wall time (start-up included)
    eval_s: dict[str, float]  # eval -> seconds from the start line to its last answer
    busy_s: dict[str, float]
    running_s: dict[str, float]  # server -> ∫ requests processing dt (÷ busy_s: its mean batch when busy)
    answers: dict[str, dict[int, Any]]  # eval -> doc_id -> lm-eval's resps (or fedpool's prediction)
    cpu: CpuUse | None = None  # what the machine's cores did meanwhile
    # eval -> each answered request's seconds from sent to answered, in the order sent (lm-eval arms)
    durations: dict[str, list[float]] = field(default_factory=dict)

    @property
    def process_makespan_s(self) -> float:
        return max(self.process_wall_s.values())


def _lm_eval_argv(model: str, base_url: str, task: str, task_dir: Path, out: Path, concurrent: int,
                  declare: int | None = None) -> list[str]:
    """lm-eval's command line; `declare`: the run's size in the URL's query, which the gateway reads
    (`fedpool_requests`, federation/gateway/handlers.py)."""
    query = f"?{REQUESTS_QUERY}={declare}" if declare is not None else ""
    return [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model={model},base_url={base_url}/v1/completions{query},num_concurrent={concurrent},max_retries=3,"
            "tokenized_requests=False,tokenizer_backend=None",
            "--tasks", task, "--include_path", str(task_dir), "--output_path", str(out), "--log_samples"]


async def _run_process(argv: list[str], env: dict[str, str], log_path: Path) -> float:
    await asyncio.to_thread(log_path.parent.mkdir, parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("wb") as logf:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=logf, stderr=asyncio.subprocess.STDOUT, env=env)
        code = await proc.wait()
    if code != 0:
        tail = (await asyncio.to_thread(log_path.read_text, encoding="utf-8", errors="replace"))[-2500:]
        raise RuntimeError(f"{argv[2]} exited {code} (log {log_path}):\n{tail}")
    return time.monotonic() - started


def _lm_eval_answers(out: Path, task: str) -> dict[int, Any]:
    path = next(out.rglob(f"{SAMPLE_PREFIX}{task}_*.jsonl"))
    return {row["doc_id"]: row["resps"] for row in map(json.loads, path.read_text().splitlines())}


def _child_env(api_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDPOOL_")}
    env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": api_key,
                "TOKENIZERS_PARALLELISM": "false"})
    return env


async def run_lm_eval_arm(arm: str, pair: Pair, targets: Sequence[str], model: str, work: Path,
                          task_dir: Path, concurrent: int, server_urls: dict[str, str], gate: StartGate,
                          engine_pids: Sequence[int], repeat: int = 1, sized: bool = False) -> ArmRun:
    """Every eval of the pair as its own lm-eval process, eval i against targets[i] (through the start gate),
    all at once. Each process has a key of its own in each pair, arm and repeat, as separate runs would: the
    gateway ranks a caller by the service it has had (shortest_first), so a key used again — by the same eval
    in the pair before or the repeat before, within the gateway's 10 minutes of memory — came ranked behind a
    fresh one (the equal pair's `long`, the unequal pair's key before, waited 26 s for its first slot). `sized`:
    each process declares its run's size (its requests: one a document) in its URL."""
    keys = {w.name: f"sk-realtool-{pair.name}-r{repeat}-{arm}-{w.name}-0123456789" for w in pair.workloads}
    gate.arm({keys[w.name]: target for w, target in zip(pair.workloads, targets, strict=True)})
    outs = {w.name: work / arm / w.name for w in pair.workloads}
    for out in outs.values():  # a run before in the same --work-dir: its samples must not be read as this one's
        await asyncio.to_thread(shutil.rmtree, out, ignore_errors=True)
    async with watching(server_urls, engine_pids) as watch:
        walls = await asyncio.gather(*(
            _run_process(_lm_eval_argv(model, gate.url, w.name, task_dir, outs[w.name], concurrent,
                                       len(w.rows) if sized else None),
                         _child_env(keys[w.name]), work / f"{arm}-{w.name}.log")
            for w in pair.workloads))
    answers = {w.name: _lm_eval_answers(outs[w.name], w.name) for w in pair.workloads}
    by_key = gate.durations()
    evals = {w.name: by_key.get(keys[w.name], 0.0) for w in pair.workloads}
    if gate.released_at is not None:  # every request's times from the release, beside the arm's logs
        names, zero = {keys[w.name]: w.name for w in pair.workloads}, gate.released_at
        await asyncio.to_thread((work / f"{arm}-timeline.json").write_text, json.dumps(
            [[names.get(k, k), round(a - zero, 4), round(b - zero, 4), server] for k, a, b, server in gate.timeline]),
            encoding="utf-8")
    names = {keys[w.name]: w.name for w in pair.workloads}
    durations: dict[str, list[float]] = {w.name: [] for w in pair.workloads}
    for key, sent, answered, _ in sorted(gate.timeline, key=lambda t: t[1]):
        if key in names:
            durations[names[key]].append(answered - sent)
    return ArmRun(arm, max(evals.values()), dict(zip(outs, walls, strict=True)), evals, watch.busy.busy_s,
                  watch.busy.running_s, answers, watch.cpu, durations)


async def run_fedpool_arm(pair: Pair, model: str, work: Path, data: dict[str, Path], ray_address: str,
                          state_dir: Path, server_urls: dict[str, str], engine_pids: Sequence[int]) -> ArmRun:
    """fedpool's own `eval run` with both benchmarks (one process, one dispatcher)."""
    specs = []
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    for w in pair.workloads:
        spec = work / f"{w.name}.fedpool.yaml"
        await asyncio.to_thread(spec.write_text, w.fedpool_spec(data[w.name]), encoding="utf-8")
        specs += ["--spec", str(spec)]
    out = work / "fedpool-run"
    await asyncio.to_thread(shutil.rmtree, out, ignore_errors=True)  # (`eval run` refuses a directory holding a run)
    async with watching(server_urls, engine_pids) as watch:
        wall = await _run_process(
            [sys.executable, "-m", "fedpool.cli", "eval", "run", "--address", ray_address, "--state-dir",
             str(state_dir), "--quiet", "--model", model, "--out", str(out), *specs, "--metric-actors", "0"],
            {k: v for k, v in os.environ.items() if not k.startswith("FEDPOOL_")}, work / "fedpool-run.log")
    answers: dict[str, dict[int, Any]] = {}
    for w in pair.workloads:
        rows = [json.loads(line) for line in (out / w.name / "records.jsonl").read_text().splitlines()]
        index = {r["id"]: i for i, r in enumerate(w.rows)}
        answers[w.name] = {index[r["sample_id"]]: [r["output"]["text"]["prediction"]] for r in rows}  # lm-eval's shape
    summaries = {w.name: json.loads((out / w.name / "summary.json").read_text()) for w in pair.workloads}
    evals = {name: float(summary["wall_time_s"]) for name, summary in summaries.items()}
    # One process, its evals started together: the makespan is its longest eval's (start-up not counted).
    return ArmRun("fedpool-eval-run", max(evals.values()), {"(both)": wall}, evals, watch.busy.busy_s,
                  watch.busy.running_s, answers, watch.cpu)


# ---- the pool --------------------------------------------------------------------------------------------
@dataclass
class Pool:
    model: str
    server_urls: dict[str, str]
    gateway_url: str
    ray_address: str
    state_dir: Path
    slots: int
    engine_pids: tuple[int, ...] = ()  # the llama.cpp servers' processes (CPU accounting)


@contextlib.asynccontextmanager
async def local_pool(work: Path, servers: int, slots: int, threads: int) -> AsyncIterator[Pool]:
    import ray

    from fedpool.deploy.localpool import LocalServerSpec, init_loopback_ray, local_llama_servers
    from fedpool.federation import DispatchConfig, PoolConnection
    from fedpool.federation.gateway.handlers import Gateway, serving
    from fedpool.registry import RegistryClient


    joined = ray.is_initialized()  # a caller's Ray (the test session's): used, and left running
    if not joined:
        init_loopback_ray()
    registry = await RegistryClient.start(work / "registry", probe_interval_s=2.0)
    try:
        async with local_llama_servers(registry, LocalServerSpec(count=servers, slots=slots, threads=threads),
                                       work / "logs") as launchers:
            config = DispatchConfig(client_order="shortest_first")
            async with PoolConnection(registry, config=config) as conn:
                await conn.refresh()
                async with serving(Gateway(conn.dispatcher, lambda: conn.snapshot).app()) as url:
                    pids = tuple(pid for lr in launchers if (pid := lr.process.pid) is not None)
                    yield Pool(launchers[0].record.model, {lr.record.id: lr.record.url for lr in launchers},
                               url, ray.get_runtime_context().gcs_address, work / "registry", slots, pids)
    finally:
        await registry.terminate()
        if not joined:
            ray.shutdown()


# ---- the benchmark ---------------------------------------------------------------------------------------
@dataclass
class PairResult:
    pair: Pair
    runs: list[dict[str, ArmRun]]
    gateway_arms: list[str]

    def median(self, arm: str, key: str = "inference_makespan_s") -> float:
        return statistics.median(getattr(r[arm], key) for r in self.runs)

    def balanced(self, run: dict[str, ArmRun], servers: int) -> float:
        return sum(run["conventional"].busy_s.values()) / servers

    def speedups(self, arm: str) -> list[float]:
        return [r["conventional"].inference_makespan_s / max(r[arm].inference_makespan_s, 1e-9) for r in self.runs]

    def vs_balanced(self, arm: str, servers: int) -> list[float]:
        return [r[arm].inference_makespan_s / max(self.balanced(r, servers), 1e-9) for r in self.runs]

    def answers_same_pct(self, arm: str) -> float:
        same = total = 0
        for run in self.runs:
            for name, conv in run["conventional"].answers.items():
                fed = run[arm].answers.get(name, {})
                for doc, resp in conv.items():
                    total += 1
                    same += fed.get(doc) == resp
        return 100.0 * same / total if total else 0.0

    def repeat_agreement_pct(self, arm: str = "conventional") -> float | None:
        """How often the same arm gave the same answer in two repeats: the engine's own run-to-run agreement
        (llama.cpp's greedy decoding is not batch-invariant: what else shares the batch can flip a token)."""
        if len(self.runs) < 2:
            return None
        same = total = 0
        for first, second in zip(self.runs, self.runs[1:], strict=False):
            for name, answers in first[arm].answers.items():
                for doc, resp in answers.items():
                    total += 1
                    same += second[arm].answers.get(name, {}).get(doc) == resp
        return 100.0 * same / total if total else None

    def eval_walls(self, arm: str, key: str = "eval_s") -> dict[str, float]:
        names = getattr(self.runs[0][arm], key)
        return {n: statistics.median(getattr(r[arm], key)[n] for r in self.runs) for n in names}


async def run_pair(pool: Pool, pair: Pair, work: Path, repeats: int, gateway_concurrency: Sequence[int],
                   with_fedpool: bool, gate: StartGate) -> PairResult:
    task_dir = work / "tasks"
    task_dir.mkdir(parents=True, exist_ok=True)
    data = {}
    for w in pair.workloads:
        data[w.name] = task_dir / f"{w.name}.jsonl"
        data[w.name].write_text("".join(json.dumps(r) + "\n" for r in w.rows), encoding="utf-8")
        (task_dir / f"{w.name}.yaml").write_text(w.lm_eval_yaml(data[w.name]), encoding="utf-8")
    servers = list(pool.server_urls.values())
    if len(servers) < len(pair.workloads):
        raise ValueError(f"{len(pair.workloads)} evals need as many servers for the conventional arm")
    gateway_arms = [f"gateway-nc{c}" for c in gateway_concurrency]
    gateway_arms[1:1] = [f"gateway-nc{gateway_concurrency[0]}-sized"]
    order = ["conventional", *gateway_arms, *(["fedpool-eval-run"] if with_fedpool else [])]
    runs: list[dict[str, ArmRun]] = []
    for r in range(repeats):
        results: dict[str, ArmRun] = {}
        for arm in (order if r % 2 == 0 else list(reversed(order))):
            where = work / f"run{r + 1}"
            if arm == "conventional":
                targets = servers[:len(pair.workloads)]
                results[arm] = await run_lm_eval_arm(arm, pair, targets, pool.model, where, task_dir, pool.slots,
                                                     pool.server_urls, gate, pool.engine_pids, r + 1)
            elif arm == "fedpool-eval-run":
                results[arm] = await run_fedpool_arm(pair, pool.model, where, data, pool.ray_address,
                                                     pool.state_dir, pool.server_urls, pool.engine_pids)
            else:
                concurrent = int(arm.removeprefix("gateway-nc").removesuffix("-sized"))
                results[arm] = await run_lm_eval_arm(arm, pair, [pool.gateway_url] * len(pair.workloads),
                                                     pool.model, where, task_dir, concurrent, pool.server_urls, gate,
                                                     pool.engine_pids, r + 1, sized=arm.endswith("-sized"))
            print(f"[realtool] {pair.name} run {r + 1}/{repeats} {arm}: inference makespan "
                  f"{results[arm].inference_makespan_s:.1f} s ("
                  + ", ".join(f"{n} {s:.1f} s" for n, s in results[arm].eval_s.items()) + "), processes "
                  + ", ".join(f"{n} {s:.1f} s" for n, s in results[arm].process_wall_s.items()), flush=True)
        runs.append(results)
    return PairResult(pair, runs, gateway_arms)


def packing(durations: dict[str, list[float]], slots: int, share: int) -> tuple[float, dict[str, float]]:
    """Whole requests of the given durations dealt onto `slots` slots, each freed slot to the next request in
    the order: evals by their total seconds, least first, except that the largest holds at most `share` slots
    while another still has requests to start (0: one after the other; `slots`: no cap). (makespan, eval ->
    its last answer), all from 0: what the schedule could do with the engines as fast as they were alone."""
    import heapq

    order = sorted((n for n in durations if durations[n]), key=lambda n: (sum(durations[n]), n))
    if not order:
        return 0.0, {}
    queues = {n: list(reversed(durations[n])) for n in order}
    largest = order[-1]
    free: list[tuple[float, int, str]] = [(0.0, i, "") for i in range(slots)]  # (free at, slot, eval it ran)
    running = dict.fromkeys(order, 0)
    ends: dict[str, float] = {}
    while any(queues.values()):
        at, slot, was = heapq.heappop(free)
        if was:
            running[was] -= 1
        others = [n for n in order[:-1] if queues[n]]
        # (some eval has requests left: the loop's condition; the largest is capped only while another has)
        pick = largest if not others or (running[largest] < share and queues[largest]) else others[0]
        end = at + queues[pick].pop()
        running[pick] += 1
        ends[pick] = max(ends.get(pick, 0.0), end)
        heapq.heappush(free, (end, slot, pick))
    return max(ends.values()), ends


def _mean_batch(result: PairResult, arm: str, sid: str) -> float:
    busy = sum(r[arm].busy_s.get(sid, 0.0) for r in result.runs)
    return sum(r[arm].running_s.get(sid, 0.0) for r in result.runs) / busy if busy else 0.0


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"


def body(results: dict[str, PairResult], pool: Pool, args: argparse.Namespace) -> str:
    servers = len(pool.server_urls)
    lines = [
        f"Pool: {servers} llama.cpp servers (Gemma 3 270M Q4_K_M, {pool.slots} slots, {args.threads} thread(s) "
        f"each) on this machine, one gateway in front of them (policy capacity_weighted, client order "
        f"shortest_first). lm-eval {_lm_eval_version()} processes, `local-completions`, greedy. {args.repeats} "
        "alternating repeats per pair; ratios are medians with the (lowest–highest) over repeats.",
        "",
        "Arms: **conventional** — process i on server i at `num_concurrent` = its slots (lm-eval's API client: "
        "requests built first, that many in flight, refilled as each answers); **gateway-ncC** — the same "
        "processes, each with its own API key, all pointed at the gateway at `num_concurrent`=C; "
        "**gateway-ncC-sized** — the same again, each process declaring its run's size in its URL "
        f"(`base_url=…/v1/completions?{REQUESTS_QUERY}=N`, N its requests), which the gateway ranks by (the fewest "
        "requests left first, as SRPT; undeclared callers are ranked by the service they have had); "
        "**fedpool-eval-run** — the same benchmarks as fedpool specs in one `fedpool eval run`.",
        "",
    ]
    for result in results.values():
        arms = ["conventional", *result.gateway_arms,
                *(["fedpool-eval-run"] if "fedpool-eval-run" in result.runs[0] else [])]
        balanced = [result.balanced(r, servers) for r in result.runs]
        lines += [f"## Pair `{result.pair.name}`: {result.pair.note}", ""]
        rows = []
        for arm in arms:
            walls = result.eval_walls(arm)
            procs = result.eval_walls(arm, "process_wall_s")
            rows.append([
                arm, f"{result.median(arm):.1f}",
                ", ".join(f"{r[arm].inference_makespan_s:.1f}" for r in result.runs),
                "; ".join(f"{n} {s:.1f}" for n, s in walls.items()),
                "; ".join(f"{n} {s:.1f}" for n, s in procs.items()),
                "-" if arm == "conventional" else _spread(result.speedups(arm)),
                _spread(result.vs_balanced(arm, servers)),
                "; ".join(f"{sid} {statistics.median(r[arm].busy_s.get(sid, 0.0) for r in result.runs):.1f}"
                          f" (mean batch {_mean_batch(result, arm, sid):.1f})" for sid in pool.server_urls),
                "-" if arm == "conventional" else f"{result.answers_same_pct(arm):.1f}",
            ])
        lines += [markdown_table(
            ["arm", "makespan (s, median)", "every run", "per eval, start line to last answer (s, median)",
             "process wall incl. start-up (s, median)", "speedup vs conventional", "vs balanced bound",
             "busy s per server", "answers same as conventional (%)"], rows), ""]
        floor = result.repeat_agreement_pct()
        lines.append("Answers: greedy decoding on llama.cpp is not batch-invariant (which other sequences share a "
                     "decode batch changes the floating-point sums, and a near-tie token can flip), so the "
                     "conventional arm does not agree with itself either: "
                     + (f"{floor:.1f}% of answers were the same in consecutive repeats of the conventional arm."
                        if floor is not None else "(one repeat: no run-to-run agreement measured)."))
        cpu_rows = [[arm, *(f"{statistics.median(getattr(r[arm].cpu, f) for r in result.runs):.1f}"
                             for f in ("engines_cpu_s", "engines_wait_s", "other_cpu_s"))]
                    for arm in arms if all(r[arm].cpu is not None for r in result.runs)]
        if cpu_rows:
            lines += ["", "The machine's cores during each arm (median over repeats): the engines' CPU seconds, the "
                      "seconds their threads were runnable but waited for a core, and every other process's CPU "
                      "seconds (lm-eval, the gateway, the registry, Ray, this script):", "",
                      markdown_table(["arm", "engines CPU s", "engines waited for a core s", "everything else CPU s"],
                                     cpu_rows), ""]
        lines.append(f"Balanced bound (conventional busy server-seconds ÷ {servers}): "
                     f"{statistics.median(balanced):.1f} s (runs " + ", ".join(f"{b:.1f}" for b in balanced) + ").")
        for arm in result.gateway_arms[:2]:
            lines += why_not_balanced(result, arm, servers, pool.slots,
                                      args.target if result.pair.name == "unequal" else None)
        for arm in result.gateway_arms:  # each repeat's arms ran back to back: compared repeat by repeat
            later = later_evals(result, arm)
            lines.append(f"{arm}: " + ("no eval finished later than on its own server in any repeat" if not later
                                       else "later than on its own server: " + ", ".join(
                                           f"{n} in repeat {i} ({fed:.1f} s vs {conv:.1f} s)"
                                           for i, n, fed, conv in later)) + "." + why_later(result, arm, servers))
        lines.append("")
    return "\n".join(lines)


def later_evals(result: PairResult, arm: str) -> list[tuple[int, str, float, float]]:
    """(repeat, eval, its time in `arm`, on its own server) for each eval that finished later in `arm` than in the
    conventional arm of the same repeat (the arms of a repeat ran back to back)."""
    return [(i + 1, n, run[arm].eval_s[n], run["conventional"].eval_s[n]) for i, run in enumerate(result.runs)
            for n in run["conventional"].eval_s if run[arm].eval_s[n] > run["conventional"].eval_s[n]]


def why_later(result: PairResult, arm: str, servers: int) -> str:
    """Beside an arm's later evals, by how much, and the two things that decide it, from the same repeats: how much
    longer the engines took for the same requests, and how well each arm packed its own busy time (makespan ÷ busy
    server-seconds per server). Where the two arms pack alike (the conventional arm idles no server: evals of one
    size), the engines' slowdown is named as the difference; where the conventional arm idles a server (unequal
    evals) the numbers are given alone. Empty when nothing was later."""
    later = later_evals(result, arm)
    if not later:
        return ""
    med = statistics.median
    ratios = [fed / conv for _, _, fed, conv in later]
    slow = [sum(r[arm].busy_s.values()) / max(sum(r["conventional"].busy_s.values()), 1e-9) for r in result.runs]

    def packing_of(name: str) -> float:
        return med(r[name].inference_makespan_s / max(sum(r[name].busy_s.values()) / servers, 1e-9)
                   for r in result.runs)

    ours, theirs = packing_of(arm), packing_of("conventional")
    text = (f" Later by {med(ratios):.2f}× (at most {max(ratios):.2f}×, its time ÷ its time on its own server); the "
            f"engines took {med(slow):.2f}× the conventional arm's busy server-seconds for the same requests, and the "
            f"arm's makespan is {ours:.2f}× its own busy server-seconds per server against the conventional arm's "
            f"{theirs:.2f}×")
    if abs(ours / max(theirs, 1e-9) - 1.0) <= 0.02 and med(slow) > 1.0:
        # Both arms keep their servers as busy (the conventional arm leaves none idle: evals of one size), so
        # the servers' busy seconds decide, and the gateway's were longer.
        return text + (": both arms keep the servers as busy, and its engines ran slower beside the gateway on the "
                       "same cores — that is the difference.")
    return text + "."


def why_not_balanced(result: PairResult, arm: str, servers: int, slots: int, target: float | None) -> list[str]:
    """For a gateway arm: its ratio to the balanced bound split into what the schedule left idle and how much
    slower the engines ran, beside the floor whole requests allow, all from this run's own figures; with a
    `target` (the headline pair), whether it is met or within reach."""
    pool_slots = servers * slots
    ratio = statistics.median(result.vs_balanced(arm, servers))
    schedule, slowdown, floors, halves, firsts, shares = [], [], [], [], [], []
    for run in result.runs:
        busy = sum(run[arm].busy_s.values())
        conv_busy = sum(run["conventional"].busy_s.values())
        schedule.append(run[arm].inference_makespan_s / max(busy / servers, 1e-9))
        slowdown.append(busy / max(conv_busy, 1e-9))
        bound = max(conv_busy / servers, 1e-9)
        durations = run["conventional"].durations
        packed = {k: packing(durations, pool_slots, k) for k in range(pool_slots + 1)}
        best = min(packed, key=lambda k: (packed[k][0], k))
        floors.append(packed[best][0] / bound)
        halves.append(packed[pool_slots // 2][0] / bound)
        firsts.append(packed[0][0] / bound)
        shares.append(best)
    med = statistics.median
    cpu = [(a, c) for r in result.runs if (a := r[arm].cpu) is not None and (c := r["conventional"].cpu) is not None]
    cores = ""
    if len(cpu) == len(result.runs):
        cores = (f": the engines' CPU {med(a.engines_cpu_s for a, _ in cpu):.1f} s against "
                 f"{med(c.engines_cpu_s for _, c in cpu):.1f} s, and {med(a.engines_wait_s for a, _ in cpu):.1f} s "
                 f"waiting for a core against {med(c.engines_wait_s for _, c in cpu):.1f} s")
    lines = [
        "",
        f"Where {arm}'s time goes against the balanced bound ({ratio:.2f}×, medians over repeats): "
        f"{med(schedule):.2f}× is the schedule's (its makespan ÷ its own busy server-seconds per server: what it "
        f"left idle, whole requests' last wave included) and {med(slowdown):.2f}× the engines' (its busy "
        f"server-seconds ÷ the conventional arm's, for the same requests{cores}). Whole requests allow no better "
        f"than {_spread(floors)} with the engines as fast as alone: the "
        f"conventional arm's requests, each its own measured duration, dealt onto the {pool_slots} slots, the "
        f"largest eval held to its best share of them while another waits (per repeat: "
        f"{', '.join(map(str, shares))} slots); the smaller evals first {med(firsts):.2f}×, half and half "
        f"{med(halves):.2f}×.",
    ]
    if target is None:
        return [*lines, ""]
    reachable = med(floors) * med(slowdown)
    if ratio <= target:
        verdict = f"met ({ratio:.2f}×)."
    elif reachable > target:
        verdict = (f"not met, and out of reach on this machine: the floor whole requests allow times the engines' "
                   f"own slowdown is {med(floors):.2f} × {med(slowdown):.2f} = {reachable:.2f}×, above the target "
                   "before the schedule loses anything — both engines compute at once on the machine's cores beside "
                   "the lm-eval processes and the gateway, where in the conventional arm one server idles once its "
                   f"short eval is done; the schedule's own share, {med(schedule):.2f}×, is "
                   f"{med(schedule) / med(floors):.2f}× the floor's.")
    else:
        verdict = (f"not met: the floor times the engines' slowdown is {reachable:.2f}×, so the schedule lost "
                   f"{ratio / reachable:.2f}× that it could have kept.")
    return [*lines, "", f"Target vs_balanced ≤ {target:.2f} ({arm}): {verdict}", ""]


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def headline(results: dict[str, PairResult], servers: int) -> dict[str, object]:
    """The unequal pair at the first gateway concurrency: the tools as they are (`arm`), and each declaring its
    run's size (`sized_*`); `later_evals`: evals that finished later than on their own server, over the repeats."""
    unequal = results["unequal"]
    arm, sized = unequal.gateway_arms[0], unequal.gateway_arms[1]
    return {"tool": "lm-eval", "processes": len(unequal.pair.workloads), "repeats": len(unequal.runs),
            "speedup_makespan": f"{statistics.median(unequal.speedups(arm)):.2f}",
            "vs_balanced": f"{statistics.median(unequal.vs_balanced(arm, servers)):.3f}",
            "answers_same_pct": f"{unequal.answers_same_pct(arm):.1f}",
            "later_evals": len(later_evals(unequal, arm)),
            "sized_speedup_makespan": f"{statistics.median(unequal.speedups(sized)):.2f}",
            "sized_vs_balanced": f"{statistics.median(unequal.vs_balanced(sized, servers)):.3f}",
            "sized_later_evals": len(later_evals(unequal, sized))}


async def run_all(args: argparse.Namespace, work: Path) -> tuple[dict[str, PairResult], Pool]:
    chosen = pairs(args.small)
    async with local_pool(work, args.servers, args.slots, args.threads) as pool, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0)) as session:
        gate = StartGate(session)
        await gate.start()
        try:
            results = {}
            for name in args.pairs:
                results[name] = await run_pair(pool, chosen[name], work / name, args.repeats,
                                               args.gateway_concurrency,
                                               with_fedpool=not args.no_fedpool_arm and name == "unequal", gate=gate)
        finally:
            await gate.stop()
        return results, pool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="realtool_speedup", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", nargs="+", choices=("unequal", "equal"), default=["unequal", "equal"])
    parser.add_argument("--gateway-concurrency", type=int, nargs="+",
                        help="num_concurrent of each lm-eval process in the gateway arms (first: the headline; "
                             "default: the pool's slots, then one server's)")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--small", action="store_true", help="the CI test's smaller workloads")
    parser.add_argument("--no-fedpool-arm", action="store_true")
    parser.add_argument("--name", default="realtool_speedup")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--target", type=float, default=1.10,
                        help="the vs_balanced target the report checks the headline arm against")
    args = parser.parse_args(argv)
    if args.gateway_concurrency is None:
        args.gateway_concurrency = [args.servers * args.slots, args.slots]
    if "unequal" not in args.pairs:
        parser.error("--pairs must include unequal (the headline)")
    return args


def execute(args: argparse.Namespace) -> tuple[dict[str, PairResult], Path, dict[str, object]]:
    """Run every pair, write the report; (results, report path, result line)."""
    with tempfile.TemporaryDirectory(prefix="fedpool-realtool-") as tmp:
        work = args.work_dir or Path(tmp)
        results, pool = asyncio.run(run_all(args, work))
    result = headline(results, len(pool.server_urls))
    path = write_report(args.name, "Real tools in both arms: lm-eval processes, own servers vs one gateway",
                        body(results, pool, args), result, results_dir=args.results_dir)
    return results, path, result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _, path, result = execute(args)
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
