"""`fedpool bench speedup`: the same evals on the same servers, conventionally and through fedpool.

Given a pool (emulated engine profiles, a live pool's server URLs, or local llama.cpp servers) and a set of
evals (synthetic workloads with a modality's shape, or real benchmark specs), each repeat runs every arm:

- the **conventional baselines** (`benchmarks/conventional.py`): each eval on the servers a careful user
  would give it (`benchmarks/assignment.py`: prefill-aware, exact for small pools), with the client of a real
  tool — `static` batches, a `sliding` window at the server's capacity, or the `whole` eval handed over at
  once — and its CPU work where that tool does it;
- **federated-inline**: every eval at once through the registry and dispatcher, its CPU work left in its own
  process as the conventional arms do it (what federation alone gains);
- **federated**: the same with the CPU work on Ray CPU actors (what fedpool gains).

The arms alternate (their order reversed on every other repeat) on pools started afresh; each server's own
metrics are sampled for busy time; for emulated pools the ideal makespan (an LP) and the oracle static split
(the best equal-shard assignment with the true token counts) bound what any arm could do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import aiohttp
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from fedpool.benchmarks.assignment import Workload, best_static_split, careful_split, ideal_makespan, split_makespan
from fedpool.benchmarks.conventional import (
    CLIENT_MODES,
    BaselineResult,
    BaselineServer,
    ClientMode,
    ConventionalEval,
)
from fedpool.benchmarks.costs import StageCosts, actor_hooks, inline_hooks
from fedpool.clients import EvalTarget, run_evals
from fedpool.deploy import EngineProcess, free_port
from fedpool.deploy.emulator import PROFILES, EmulatorProfile
from fedpool.deploy.localpool import LocalServerSpec, init_local_ray, local_llama_servers
from fedpool.federation import DispatchConfig, PoolConnection, new_session, prepare_policy
from fedpool.pipeline import BenchmarkSpec, load_spec, read_records
from fedpool.pipeline.bundled import bundled_spec_paths
from fedpool.pipeline.stages import StagePool
from fedpool.pipeline.verifier import VerifierConfig, VerifierPool, VerifierWorker
from fedpool.pipeline.yamlfile import field_problems, read_yaml
from fedpool.registry import (
    Engine,
    LoadSample,
    RegistryClient,
    ServerEntry,
    ServerRecord,
    ServerStatus,
    UnknownServerError,
    adapter_for,
)

log = logging.getLogger("fedpool.bench")

WORDS = tuple(f"w{i:03d}" for i in range(512))  # synthetic prompt vocabulary (one token each in the emulator)


class BenchConfigError(Exception):
    """A pool or evals file is wrong; the message names the file and field."""


# ---- configuration -------------------------------------------------------------------------------------
class EmulatedServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    profile: str
    accelerator: str = "unknown"
    overrides: dict[str, Any] = Field(default_factory=dict)  # any EmulatorProfile field

    @model_validator(mode="after")
    def _known_profile(self) -> EmulatedServerConfig:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown emulator profile {self.profile!r}; known: {', '.join(sorted(PROFILES))}")
        unknown = set(self.overrides) - set(EmulatorProfile.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown profile fields in overrides: {sorted(unknown)}")
        return self

    def resolved(self, output_spread: float | None, perturb_seed: int | None = None) -> EmulatorProfile:
        """The profile this server runs. With `perturb_seed`, its prefill and decode costs are scaled by
        independent factors in [0.7, 1.3] (seeded per server): a world routing has never seen."""
        raw = {**asdict(PROFILES[self.profile]), **self.overrides}
        if output_spread is not None and "output_spread" not in self.overrides:
            raw["output_spread"] = output_spread
        if perturb_seed is not None:
            prefill, decode = perturbation(perturb_seed, self.id)
            raw["prefill_s_per_token"] *= prefill
            raw["decode_s_per_token"] *= decode
            raw["attn_s_per_ctx_token"] *= decode
            raw["source"] = f"{raw['source']}; perturbed: prefill ×{prefill:.3f}, decode ×{decode:.3f}"
        return EmulatorProfile(**raw)


def perturbation(seed: int, server_id: str) -> tuple[float, float]:
    """(prefill factor, decode factor) of one server under a perturbation seed: independent, in [0.7, 1.3]."""
    rng = random.Random(f"perturb:{seed}:{server_id}")
    return rng.uniform(0.7, 1.3), rng.uniform(0.7, 1.3)


class RealServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    url: str
    engine: Engine
    accelerator: str = "unknown"
    capacity: int | None = Field(default=None, ge=1)


class LocalLlamaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int = Field(default=2, ge=1, le=16)
    slots: int = Field(default=4, ge=1, le=64)
    threads: int = Field(default=1, ge=1, le=64)
    ctx_per_slot: int = Field(default=1024, ge=128)


class PoolConfig(BaseModel):
    """Which servers: emulated profiles, running servers by URL, or llama.cpp servers started here."""

    model_config = ConfigDict(extra="forbid")

    model: str = "omni-7b"
    time_scale: float = Field(default=1.0, gt=0, description="emulated engine seconds per wall second")
    output_spread: float | None = Field(default=None, ge=0, lt=1)
    perturb_seed: int | None = Field(default=None, description="emulated: scale each server's prefill and decode "
                                     "costs by seeded factors in [0.7, 1.3] that routing never sees")
    per_request_metrics: bool = Field(default=False, description="emulated: vLLM servers answer with their own "
                                      "per-request times, as with vLLM's --enable-per-request-metrics")
    emulated: list[EmulatedServerConfig] = Field(default_factory=list)
    servers: list[RealServerConfig] = Field(default_factory=list)
    local_llamacpp: LocalLlamaConfig | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> PoolConfig:
        kinds = sum(bool(x) for x in (self.emulated, self.servers, self.local_llamacpp))
        if kinds != 1:
            raise ValueError("give exactly one of: emulated, servers, local_llamacpp")
        ids = [s.id for s in self.emulated] + [s.id for s in self.servers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"server ids must be unique: {dup}")
        if self.local_llamacpp is None and self.time_scale != 1.0 and self.servers:
            raise ValueError("time_scale only applies to emulated servers")
        return self

    @property
    def is_emulated(self) -> bool:
        return bool(self.emulated)

    def profiles(self) -> dict[str, EmulatorProfile]:
        return {s.id: s.resolved(self.output_spread, self.perturb_seed) for s in self.emulated}


class SyntheticEval(BaseModel):
    """A workload with a modality's shape: prompt length (text, or image/video tokens), answer length."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["synthetic"] = "synthetic"
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    modality: str = "text"
    size: int = Field(ge=1, le=1_000_000)
    prompt_tokens: int = Field(ge=1)
    prompt_jitter: float = Field(default=0.25, ge=0, lt=1)  # prompt lengths vary ± this fraction
    max_tokens: int = Field(ge=1)
    shared_prefix_tokens: int = Field(default=32, ge=0)  # the benchmark's instruction, the same in every prompt
    costs: StageCosts = Field(default_factory=StageCosts)


class SpecEval(BaseModel):
    """A real benchmark spec (a YAML path, or `bundled:NAME`), optionally cut to `limit` samples."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["spec"] = "spec"
    spec: str
    modality: str = "text"
    limit: int | None = Field(default=None, ge=1)
    verifier: bool = False  # judge every answer with the real CPU verifier (Gemma on llama.cpp)
    costs: StageCosts = Field(default_factory=StageCosts)


def _eval_kind(raw: Any) -> str:
    if isinstance(raw, dict):
        return str(raw.get("kind") or ("spec" if "spec" in raw else "synthetic"))
    return str(getattr(raw, "kind", "synthetic"))


EvalConfig = Annotated[
    Annotated[SyntheticEval, Tag("synthetic")] | Annotated[SpecEval, Tag("spec")], Discriminator(_eval_kind)
]


class VerifierSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    actors: int = Field(default=1, ge=1, le=64, description="federated arm: judge actors shared by all evals")
    threads: int = Field(default=1, ge=1, le=64)
    model_path: str | None = None  # default: the Gemma 270M GGUF from the model package


ARMS = (*CLIENT_MODES, "federated-inline", "federated")


class EvalsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    baselines: list[Literal["static", "sliding", "whole"]] = Field(
        default_factory=lambda: list(CLIENT_MODES), min_length=1, description="the conventional arms to run")
    inline_arm: bool = Field(default=True, description="also run the federated arm with CPU work inline")
    batch_size: int = Field(default=8, ge=1, le=4096, description="the static arm's batch")
    window: int | None = Field(default=None, ge=1, description="the sliding arm's window (default: capacity)")
    stage_actors: int = Field(default=4, ge=1, le=256, description="CPU actors for the federated arm's stages")
    concurrency: int = Field(default=1024, ge=1, description="requests each federated eval keeps in flight")
    policy: str = "capacity_weighted"
    client_order: Literal["fair", "shortest_first", "longest_answers_first"] = "fair"
    planned: bool = Field(default=False, description="federated arm: route by the dispatcher's makespan plan")
    planned_pick: Literal["quota", "finish"] = Field(
        default="quota", description="planned: within a client's planned kinds, the server with the most quota left "
                                     "(quota) or where the engine model answers it soonest (finish)")
    window_factor: float = Field(default=1.0, gt=0, le=64,
                                 description="federated arm: admission window ceiling = engine capacity × this")
    adaptive_windows: bool = Field(default=True, description="federated arm: windows follow the engine queue")
    verifier: VerifierSettings = Field(default_factory=VerifierSettings)
    repeats: int = Field(default=3, ge=1, le=20,
                         description="run every arm this many times; wall times and makespans are the medians")
    seed: int = 0
    evals: list[EvalConfig] = Field(min_length=1)


M = TypeVar("M", bound=BaseModel)


def _load_yaml_model(path: Path, model: type[M]) -> M:
    raw = read_yaml(path, BenchConfigError)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise BenchConfigError(f"{path}: {field_problems(exc)}") from None


def load_pool_config(path: Path) -> PoolConfig:
    return _load_yaml_model(path, PoolConfig)


def load_evals_config(path: Path) -> EvalsConfig:
    return _load_yaml_model(path, EvalsConfig)


# ---- evals → specs ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PreparedEval:
    spec: BenchmarkSpec
    modality: str
    costs: StageCosts
    size: int
    mean_prompt_tokens: float  # words of the rendered prompts (the emulator's token count)

    def known_workload(self) -> Workload:
        """What a user knows beforehand: the size, the prompts' length, max_tokens (answers stop at most there)."""
        return Workload(self.spec.name, self.size, self.mean_prompt_tokens, float(self.spec.generation.max_tokens))


def _mean_prompt_tokens(spec: BenchmarkSpec) -> tuple[int, float]:
    from fedpool.pipeline import load_samples, request_body

    samples = load_samples(spec)
    words = [len(json.dumps(request_body(spec, s).get("prompt") or request_body(spec, s).get("messages")).split())
             for s in samples[:200]]
    return len(samples), (sum(words) / len(words) if words else 0.0)


def synthetic_rows(ev: SyntheticEval, seed: int) -> list[dict[str, str]]:
    """Deterministic prompts of the eval's shape; the label is a word the emulator may or may not say."""
    rng = random.Random(f"{seed}:{ev.name}")
    prefix = " ".join(rng.choices(WORDS, k=ev.shared_prefix_tokens))
    rows = []
    for i in range(ev.size):
        n = max(1, round(ev.prompt_tokens * (1 + ev.prompt_jitter * (2 * rng.random() - 1))) - ev.shared_prefix_tokens)
        body = " ".join(rng.choices(WORDS, k=n))
        rows.append({"id": f"{ev.name}-{i:06d}", "prompt": f"{prefix} {body}".strip(), "answer": "alpha"})
    return rows


def prepare_evals(config: EvalsConfig, data_dir: Path) -> list[PreparedEval]:
    data_dir.mkdir(parents=True, exist_ok=True)
    prepared = []
    for ev in config.evals:
        if isinstance(ev, SyntheticEval):
            path = data_dir / f"{ev.name}.jsonl"
            with path.open("w", encoding="utf-8") as f:
                for row in synthetic_rows(ev, config.seed):
                    f.write(json.dumps(row) + "\n")
            spec = BenchmarkSpec.model_validate({
                "name": ev.name, "description": f"synthetic {ev.modality} workload",
                "data": {"path": str(path)}, "prompt": {"template": "{prompt}"},
                "generation": {"max_tokens": ev.max_tokens}, "postprocess": ["strip", "first_word"],
                "metrics": ["exact_match"],
            })
            prepared.append(PreparedEval(spec, ev.modality, ev.costs, *_mean_prompt_tokens(spec)))
        else:
            spec = load_spec(_spec_path(ev.spec))
            if ev.limit is not None:
                spec = spec.model_copy(update={"data": spec.data.model_copy(update={"limit": ev.limit})})
            if ev.verifier:
                spec = spec.model_copy(update={"verifier": True})
            prepared.append(PreparedEval(spec, ev.modality, ev.costs, *_mean_prompt_tokens(spec)))
    names = [p.spec.name for p in prepared]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BenchConfigError(f"eval names must be unique: {dup}")
    return prepared


def _spec_path(ref: str) -> Path:
    if ref.startswith("bundled:"):
        name = ref.removeprefix("bundled:")
        for path in bundled_spec_paths():
            if path.stem == name:
                return path
        known = ", ".join(p.stem for p in bundled_spec_paths())
        raise BenchConfigError(f"no bundled benchmark {name!r}; bundled: {known}")
    return Path(ref)


def verifier_config(config: EvalsConfig, evals: Sequence[PreparedEval], pool: PoolConfig) -> VerifierConfig | None:
    """The judge's settings when any eval asks for it (the model file is fetched once, here). Judges share
    the cores of llama.cpp servers started on this machine."""
    if not any(p.spec.verifier for p in evals):
        return None
    from fedpool.deploy import ensure_gemma

    path = config.verifier.model_path or str(ensure_gemma(None))
    return VerifierConfig(model_path=path, actors=config.verifier.actors, threads=config.verifier.threads,
                          shares_engine_cores=pool.local_llamacpp is not None)


# ---- the pool, started fresh for each arm ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LiveServer:
    record: ServerRecord
    profile: EmulatorProfile | None  # emulated servers only
    speed: float  # relative, for the conventional arm's assignment (bigger is faster)


@contextlib.asynccontextmanager
async def started_pool(config: PoolConfig, log_dir: Path, registry: RegistryClient | None) -> AsyncIterator[
        list[LiveServer]]:
    """Start (or reach) the pool's servers; with a registry, register them for the federated arm."""
    await asyncio.to_thread(log_dir.mkdir, parents=True, exist_ok=True)
    if config.local_llamacpp is not None:
        lc = config.local_llamacpp
        spec = LocalServerSpec(count=lc.count, slots=lc.slots, threads=lc.threads, ctx_per_slot=lc.ctx_per_slot)
        owner = registry or _NullRegistry()
        async with local_llama_servers(owner, spec, log_dir) as launchers:  # type: ignore[arg-type]
            servers = [LiveServer(x.record.model_copy(update={"capacity": lc.slots}), None, 1.0) for x in launchers]
            yield servers
        return
    if config.servers:
        servers = [
            LiveServer(ServerRecord(id=s.id, url=s.url.rstrip("/"), engine=s.engine, model=config.model,
                                    accelerator=s.accelerator, capacity=s.capacity), None, 1.0)
            for s in config.servers
        ]
        if registry is not None:
            for s in servers:
                await registry.register(s.record, replace=True)
        try:
            yield servers
        finally:
            if registry is not None:
                for s in servers:
                    with contextlib.suppress(Exception):
                        await registry.deregister(s.record.id)
        return
    processes: list[EngineProcess] = []
    servers = []
    try:
        for emulated in config.emulated:
            profile = emulated.resolved(config.output_spread, config.perturb_seed)
            port = free_port()
            argv = [sys.executable, "-m", "fedpool.deploy.emulator", "--model", config.model, "--port", str(port),
                    "--profile-json", json.dumps(asdict(profile)), "--speedup", str(config.time_scale),
                    *(["--enable-per-request-metrics"] if config.per_request_metrics else [])]
            process = EngineProcess(name=emulated.id, argv=argv, log_path=log_dir / f"{emulated.id}.log")
            await process.start()
            processes.append(process)
            record = ServerRecord(
                id=emulated.id, url=f"http://127.0.0.1:{port}", engine=Engine(profile.protocol), model=config.model,
                revision="emulated", accelerator=emulated.accelerator, gpu_count=1, capacity=profile.max_running,
                labels={"profile": profile.name},
            )
            servers.append(LiveServer(record, profile, 1.0 / max(profile.decode_s_per_token, 1e-9)))
        async with new_session() as session:
            await asyncio.gather(*(_wait_healthy(session, s.record.url, 60.0) for s in servers))
        if registry is not None:
            for s in servers:
                await registry.register(s.record, replace=True)
        yield servers
    finally:
        await asyncio.gather(*(p.stop() for p in processes), return_exceptions=True)


class _NullRegistry:
    """Stands in for the registry when the conventional arm starts local servers: nothing is shared, but it answers
    as the registry's client does (a heartbeat returns the server's entry, healthy) for the launchers that call it."""

    def __init__(self) -> None:
        self._records: dict[str, ServerRecord] = {}

    async def register(self, record: ServerRecord, *_: Any, **__: Any) -> ServerEntry:
        self._records[record.id] = record
        return self._entry(record.id)

    async def deregister(self, server_id: str, *_: Any, **__: Any) -> None:
        self._records.pop(server_id, None)

    async def heartbeat(self, server_id: str, *_: Any, **__: Any) -> ServerEntry:
        return self._entry(server_id)

    def _entry(self, server_id: str) -> ServerEntry:
        record = self._records.get(server_id)
        if record is None:
            raise UnknownServerError(server_id)
        return ServerEntry(record, ServerStatus.HEALTHY, record.capacity or 1, 1.0)


async def _wait_healthy(session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            raise BenchConfigError(f"server at {url} did not become healthy within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


# ---- busy sampling ---------------------------------------------------------------------------------------
@dataclass
class BusyTrace:
    """Each server's running-request count, read from its own metrics every `period_s`."""

    period_s: float
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # id -> (t since start, running)

    def busy_share(self, server_id: str, until: float) -> float:
        rows = [r for t, r in self.samples.get(server_id, []) if t <= until]
        return sum(1 for r in rows if r > 0) / len(rows) if rows else 0.0

    def mean_running(self, server_id: str, until: float) -> float:
        rows = [r for t, r in self.samples.get(server_id, []) if t <= until]
        return sum(rows) / len(rows) if rows else 0.0


async def sample_busy(servers: Sequence[LiveServer], trace: BusyTrace, started: float) -> None:
    async with new_session() as session:
        while True:
            tick = time.monotonic()
            results = await asyncio.gather(*(_load(session, s.record) for s in servers))
            for s, load in zip(servers, results, strict=True):
                if load is not None:
                    trace.samples.setdefault(s.record.id, []).append((tick - started, load.running))
            await asyncio.sleep(max(0.0, trace.period_s - (time.monotonic() - tick)))


async def _load(session: aiohttp.ClientSession, record: ServerRecord) -> LoadSample | None:
    adapter = adapter_for(record.engine)
    if adapter.metrics_path is None:
        return None
    try:
        async with session.get(record.url + adapter.metrics_path, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            text = await resp.text()
        return adapter.parse_metrics(text, time.time())
    except Exception:  # a missed sample is a gap in the timeline, not a failed benchmark
        return None


# ---- the two arms -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EvalOutcome:
    name: str
    modality: str
    size: int
    wall_s: float
    records: int
    failed: int
    score: float | None
    servers: dict[str, int]  # server id -> records it answered


async def emulator_busy_seconds(servers: Sequence[LiveServer]) -> dict[str, float]:
    """Engine-seconds each emulated server spent computing (its own counter), read at the end of an arm."""
    out: dict[str, float] = {}
    async with new_session() as session:
        for s in servers:
            if s.profile is None:
                continue
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(s.record.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    for line in (await resp.text()).splitlines():
                        if line.startswith("fedpool_emulator_busy_seconds_total "):
                            out[s.record.id] = float(line.split()[1])
    return out


@dataclass
class ArmResult:
    mode: str
    makespan_s: float
    evals: dict[str, EvalOutcome]
    busy: BusyTrace
    server_ids: list[str]
    assignment: dict[str, list[str]] = field(default_factory=dict)
    tokens: dict[str, tuple[float, float]] = field(default_factory=dict)  # eval -> (mean prompt, mean completion)
    engine_busy_s: dict[str, float] = field(default_factory=dict)  # emulated server -> engine seconds computing


def assign_servers(evals: Sequence[PreparedEval], servers: Sequence[LiveServer]) -> dict[str, list[str]]:
    """The conventional arms' split: the careful user's (`assignment.careful_split`), from what is known before
    the run (sizes, prompt lengths, max_tokens, each emulated server's prefill and decode speed)."""
    profiles = {s.record.id: s.profile for s in servers}
    split, _ = careful_split([p.known_workload() for p in evals], profiles)
    return split


def _score(summary: dict[str, Any]) -> float | None:
    for score in summary.get("scores", []):
        if isinstance(score, dict) and "value" in score:
            return float(score["value"])
    return None


def _servers_of(records: Sequence[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        sid = r.provenance.server_id or "none"
        out[sid] = out.get(sid, 0) + 1
    return out


def _token_means(records: Sequence[Any]) -> tuple[float, float]:
    ok = [r for r in records if r.provenance.prompt_tokens is not None and r.provenance.completion_tokens is not None]
    if not ok:
        return 0.0, 0.0
    return (sum(r.provenance.prompt_tokens for r in ok) / len(ok),
            sum(r.provenance.completion_tokens for r in ok) / len(ok))


async def run_conventional(
    pool: PoolConfig, evals: Sequence[PreparedEval], config: EvalsConfig, out_dir: Path, period_s: float,
    mode: ClientMode = "static",
) -> ArmResult:
    judge = await asyncio.to_thread(verifier_config, config, evals, pool)
    # Each judged eval's process has its own judge, loaded before the clock starts (warm), as the federated
    # arm's judge actors are.
    judges = {p.spec.name: await asyncio.to_thread(VerifierWorker, judge.model_dump())
              for p in evals if judge is not None and p.spec.verifier}
    async with started_pool(pool, out_dir / "logs", None) as servers:
        by_id = {s.record.id: s for s in servers}
        assignment = assign_servers(evals, servers)
        runs = [
            ConventionalEval(
                p.spec,
                [BaselineServer(sid, by_id[sid].record.url, by_id[sid].record.engine.value,
                                by_id[sid].record.accelerator, by_id[sid].record.capacity or 8)
                 for sid in assignment[p.spec.name]],
                model=servers[0].record.model, out_dir=out_dir, mode=mode,
                batch_size=config.batch_size, window=config.window, costs=p.costs, time_scale=pool.time_scale,
                judge=judges.get(p.spec.name),
            )
            for p in evals
        ]
        trace = BusyTrace(period_s)
        started = time.monotonic()
        sampler = asyncio.create_task(sample_busy(servers, trace, started))
        try:
            async with new_session() as session:
                async def timed(run: ConventionalEval) -> tuple[BaselineResult, float]:
                    result = await run.run(session)
                    return result, time.monotonic() - started

                results = await asyncio.gather(*(timed(r) for r in runs))
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        makespan = time.monotonic() - started
        engine_busy = await emulator_busy_seconds(servers)
    outcomes = {}
    tokens = {}
    for p, (result, finished) in zip(evals, results, strict=True):
        records = await asyncio.to_thread(read_records, out_dir / p.spec.name / "records.jsonl")
        outcomes[p.spec.name] = EvalOutcome(p.spec.name, p.modality, p.size, finished, result.records, result.failed,
                                            _score(result.summary), _servers_of(records))
        tokens[p.spec.name] = _token_means(records)
    return ArmResult(mode, makespan, outcomes, trace, [s.record.id for s in servers], assignment,
                     tokens, engine_busy)


async def run_federated(
    pool: PoolConfig, evals: Sequence[PreparedEval], config: EvalsConfig, out_dir: Path, period_s: float,
    inline_cpu: bool = False,
) -> ArmResult:
    dispatch_log: list[dict[str, Any]] = []
    policy = "planned" if config.planned else config.policy
    prepare_policy(policy)  # (as `fedpool eval run` does)
    with tempfile.TemporaryDirectory(prefix="fedpool-bench-registry-") as state_dir:
        # The control loops run on engine time: an emulated pool at time scale k makes decisions k× as often.
        # A registry of its own (own namespace): joined to an operator's running cluster, the bench must
        # neither use their registry nor end it when it is done.
        registry = await RegistryClient.start(Path(state_dir), probe_interval_s=max(0.2, 1.0 / pool.time_scale),
                                        namespace=f"fedpool-bench-{os.getpid()}")
        await registry.ping()
        try:
            async with started_pool(pool, out_dir / "logs", registry) as servers:
                judge = await asyncio.to_thread(verifier_config, config, evals, pool)
                if judge is not None:  # as many judge threads as the conventional arms' judged evals have
                    judge = judge.model_copy(update={"actors": sum(1 for p in evals if p.spec.verifier)})
                verifier = VerifierPool(judge) if judge is not None else None
                needs_stages = not inline_cpu and any(p.costs.any for p in evals)
                stages = StagePool(config.stage_actors) if needs_stages else None
                if stages is not None:
                    await stages.ready()
                if verifier is not None:
                    await verifier.ready()
                try:
                    dispatch = DispatchConfig(learn_period_s=max(0.1, 2.0 / pool.time_scale),
                                              client_order=config.client_order,
                                              window_factor=config.window_factor,
                                              adaptive_windows=config.adaptive_windows)
                    options = ({"period_s": max(0.05, 1.0 / pool.time_scale), "pick": config.planned_pick}
                               if config.planned else {})
                    async with PoolConnection(registry, policy=policy, policy_options=options, config=dispatch,
                                              seed=config.seed) as conn:
                        await conn.refresh()
                        trace = BusyTrace(period_s)
                        started = time.monotonic()
                        sampler = asyncio.create_task(sample_busy(servers, trace, started))
                        watcher = asyncio.create_task(_watch_dispatcher(conn, dispatch_log, started))
                        finished: dict[str, float] = {}

                        def on_progress(progress: Any) -> None:
                            if progress.done >= progress.total:
                                finished[progress.benchmark] = time.monotonic() - started

                        try:
                            summaries = await run_evals(
                                [p.spec for p in evals], conn.dispatcher, out_dir,
                                EvalTarget(model=servers[0].record.model),
                                concurrency=config.concurrency, on_progress=on_progress,
                                stages=({p.spec.name: inline_hooks(p.costs, pool.time_scale) for p in evals}
                                        if inline_cpu else
                                        {p.spec.name: actor_hooks(stages, p.costs, pool.time_scale) for p in evals}
                                        if stages else None),
                                verifier=verifier,
                            )
                        finally:
                            sampler.cancel()
                            watcher.cancel()
                            await asyncio.gather(sampler, watcher, return_exceptions=True)
                        makespan = time.monotonic() - started
                        engine_busy = await emulator_busy_seconds(servers)
                finally:
                    if stages is not None:
                        stages.shutdown()
                    if verifier is not None:
                        verifier.shutdown()
                server_ids = [s.record.id for s in servers]
        finally:
            await registry.terminate()
    outcomes = {}
    tokens = {}
    for p, summary in zip(evals, summaries, strict=True):
        records = await asyncio.to_thread(read_records, summary.artifact_dir / "records.jsonl")
        outcomes[p.spec.name] = EvalOutcome(
            p.spec.name, p.modality, p.size, finished.get(p.spec.name, summary.wall_time_s), len(records),
            sum(r.failed for r in records), _score(summary.summary), _servers_of(records),
        )
        tokens[p.spec.name] = _token_means(records)
    await asyncio.to_thread(_write_json, out_dir / "dispatch_log.json", dispatch_log)
    return ArmResult("federated-inline" if inline_cpu else "federated", makespan, outcomes, trace, server_ids,
                     tokens=tokens, engine_busy_s=engine_busy)


async def _watch_dispatcher(conn: PoolConnection, out: list[dict[str, Any]], started: float,
                            period_s: float = 0.5) -> None:
    """What the dispatcher thought of each server over time (windows, in flight, status): kept beside
    the artifacts so a slow run can be explained."""
    while True:
        stats = conn.dispatcher.stats()
        snapshot = conn.snapshot
        status = {e.id: e.status.value for e in snapshot.entries} if snapshot else {}
        loads = {e.id: e.load for e in snapshot.entries} if snapshot else {}
        out.append({
            "t": round(time.monotonic() - started, 2), "inflight": stats.inflight_total, "hedges": stats.hedges,
            "retries": stats.retries,
            "plan": _plan_of(conn.dispatcher),
            "servers": {s.server_id: {"inflight": s.inflight, "window": s.window, "answered": s.answered,
                                      "reason": s.window_reason, "status": status.get(s.server_id),
                                      "failures": s.failures,
                                      "engine_running": _load_figure(loads.get(s.server_id), "running"),
                                      "engine_waiting": _load_figure(loads.get(s.server_id), "waiting"),
                                      } for s in stats.servers},
        })
        await asyncio.sleep(period_s)


def _plan_of(dispatcher: Any) -> dict[str, Any] | None:
    """The dispatcher's current routing plan (client -> server -> requests) and the cost factors it has fitted
    per server kind, when its policy plans."""
    state = dispatcher.policy.describe()
    return None if state is None else {"quotas": state.get("quotas"), "fitted": state.get("fitted")}


def _load_figure(load: Any, name: str) -> float | None:
    """A figure of the registry's last scrape of a server (None before the first)."""
    return None if load is None else float(getattr(load, name))


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1), encoding="utf-8")


# ---- the whole comparison --------------------------------------------------------------------------------
@dataclass
class SpeedupReport:
    pool: PoolConfig
    evals_config: EvalsConfig
    evals: list[PreparedEval]
    arms: dict[str, ArmResult]  # each arm's medians over the repeats
    runs: list[dict[str, ArmResult]]  # every repeat's arms
    profiles: dict[str, EmulatorProfile]
    ideal_s: float | None = None  # wall seconds (engine seconds ÷ time_scale)
    ideal_plan: dict[str, dict[str, float]] | None = None
    best_split: dict[str, list[str]] | None = None
    best_split_s: float | None = None  # the oracle static split's predicted makespan, wall seconds
    careful_split_s: float | None = None  # the conventional arms' split, predicted the same way

    @property
    def federated(self) -> ArmResult:
        return self.arms["federated"]

    @property
    def baselines(self) -> list[str]:
        return [a for a in CLIENT_MODES if a in self.arms]

    @property
    def strongest(self) -> str:
        """The conventional arm with the shortest makespan (median over the repeats)."""
        return min(self.baselines, key=lambda a: self.arms[a].makespan_s)

    def makespan_ratio(self, arm: str, over: str = "federated") -> float:
        return self.arms[arm].makespan_s / max(self.arms[over].makespan_s, 1e-9)

    def ratio_spread(self, arm: str, over: str = "federated") -> tuple[float, float]:
        """The same ratio in every repeat: (lowest, highest)."""
        values = [run[arm].makespan_s / max(run[over].makespan_s, 1e-9) for run in self.runs]
        return min(values), max(values)

    def speedup(self, name: str, arm: str | None = None) -> float:
        """One eval's wall time in `arm` (default: the strongest baseline) over the federated arm's."""
        base = self.arms[arm or self.strongest]
        return base.evals[name].wall_s / max(self.federated.evals[name].wall_s, 1e-9)

    def mean_speedup(self, arm: str | None = None) -> float:
        values = [self.speedup(p.spec.name, arm) for p in self.evals]
        return sum(values) / len(values)

    @property
    def vs_ideal(self) -> float | None:
        return self.federated.makespan_s / self.ideal_s if self.ideal_s else None

    @property
    def best_split_vs_ideal(self) -> float | None:
        return self.best_split_s / self.ideal_s if self.ideal_s and self.best_split_s else None


async def run_speedup(pool: PoolConfig, config: EvalsConfig, out_dir: Path, *, period_s: float = 0.1,
                      arms: Sequence[str] | None = None) -> SpeedupReport:
    # Ray's CPU count is only used to place actors; stage actors and judges must fit beside each other even
    # on a 2-core machine (the engines run outside Ray either way).
    init_local_ray(num_cpus=max(4, os.cpu_count() or 1))
    evals = await asyncio.to_thread(prepare_evals, config, out_dir / "data")
    order = list(arms) if arms is not None else [*config.baselines, *(["federated-inline"] if config.inline_arm
                                                                       else []), "federated"]
    runs: list[dict[str, ArmResult]] = []
    for r in range(config.repeats):  # alternating order, so a slow drift of the machine hits every arm alike
        results: dict[str, ArmResult] = {}
        for arm in (order if r % 2 == 0 else list(reversed(order))):
            log.info("speedup: %s arm, run %d of %d", arm, r + 1, config.repeats)
            where = out_dir / f"run{r + 1}" / arm
            if arm in CLIENT_MODES:
                results[arm] = await run_conventional(pool, evals, config, where, period_s, arm)
            else:
                results[arm] = await run_federated(pool, evals, config, where, period_s,
                                                   inline_cpu=arm == "federated-inline")
            print(f"[bench] run {r + 1}/{config.repeats} {arm}: makespan {results[arm].makespan_s:.1f} s", flush=True)
        runs.append(results)
    medians = {arm: median_arm([run[arm] for run in runs]) for arm in order}
    report = SpeedupReport(pool, config, evals, medians, runs, pool.profiles())
    if pool.is_emulated:
        fed = medians["federated"]
        true = [Workload(p.spec.name, p.size, *fed.tokens[p.spec.name]) for p in evals]
        engine_s, report.ideal_plan = ideal_makespan(true, report.profiles)
        report.ideal_s = engine_s / pool.time_scale
        report.best_split, best_s = best_static_split(true, report.profiles)
        report.best_split_s = best_s / pool.time_scale
        if report.baselines:
            careful = medians[report.baselines[0]].assignment
            report.careful_split_s = split_makespan(careful, true, report.profiles) / pool.time_scale
    return report


def median_arm(arms: Sequence[ArmResult]) -> ArmResult:
    """One arm over several runs: each eval's wall time and the makespan are the medians over the runs;
    busy traces, token counts and assignments are those of the run whose makespan is the median (the lower
    middle one for an even count), so the busy shares stay consistent with a makespan."""
    if len(arms) == 1:
        return arms[0]
    middle = sorted(arms, key=lambda a: a.makespan_s)[(len(arms) - 1) // 2]
    evals = {name: dataclasses.replace(outcome, wall_s=statistics.median(a.evals[name].wall_s for a in arms))
             for name, outcome in middle.evals.items()}
    return dataclasses.replace(middle, evals=evals, makespan_s=statistics.median(a.makespan_s for a in arms))
