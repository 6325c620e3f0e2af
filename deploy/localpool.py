"""The embedded default: local Ray, a registry actor and real engines on this machine (llama.cpp's server with the
bundled Gemma, vLLM's CPU build, or the emulator), started, registered with leases, and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import ray

from fedpool.deploy import (
    GEMMA_ALIAS,
    EngineProcess,
    LeaseSettings,
    LlamaServerConfig,
    ServerLauncher,
    ensure_gemma,
    free_port,
    llama_server_process,
)
from fedpool.registry import Engine, RegistryClient, ServerRecord

if TYPE_CHECKING:
    import psutil

log = logging.getLogger("fedpool.localpool")


class _RaySettings(TypedDict):
    """What every `ray.init` here passes (typed, so `**` checks against ray.init's parameters)."""

    namespace: str
    logging_level: int
    log_to_driver: bool


# fedpool's namespace, and Ray's own logging kept quiet
_RAY_SETTINGS: _RaySettings = {"namespace": "fedpool", "logging_level": logging.WARNING, "log_to_driver": False}


def init_local_ray(num_cpus: int | None = None) -> None:
    """Start Ray on this machine, or join the cluster already running here (`ray start`), quietly."""
    if ray.is_initialized():
        return
    try:
        ray.init(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=False,
             **_RAY_SETTINGS)
    except ValueError as exc:  # Ray refuses resource settings when a cluster already runs on this node
        if "existing cluster" not in str(exc):
            raise
        log.info("joining the Ray cluster already running on this machine")
        ray.init(address="auto", **_RAY_SETTINGS)


LOOPBACK_HOSTS = ("127.", "localhost", "[::1]", "::1")


def is_loopback_address(address: str) -> bool:
    """A Ray address (HOST:PORT, maybe ray://) on this machine's loopback interface."""
    host = address.removeprefix("ray://").rpartition(":")[0]
    return host.startswith(LOOPBACK_HOSTS)


def loopback_ray_mode() -> None:
    """Ray's single-machine mode for this process and the Ray processes it starts: every Ray address stays on
    127.0.0.1. Needed to start a loopback-only cluster, and to join one: without it Ray (2.60) rewrites a
    driver's 127.0.0.1 address to the machine's outside address, where that cluster does not listen, and the
    driver waits for a GCS it can never reach."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # read when Ray picks the node's address, after import


def init_loopback_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Join the Ray cluster at `address`, or start one on this machine bound to 127.0.0.1 only; says which.

    Ray (2.60) resolves a local node's address to the machine's own outside address even when told
    127.0.0.1; a pool meant for this machine's tools must not be reachable from the network, so the local
    cluster is started with Ray's single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which keeps every
    Ray process on the loopback address), set for this process and every Ray process it starts. Without an
    address the cluster is always a new one (`address="local"`): a bare `ray.init()` joins whatever cluster
    RAY_ADDRESS or a `ray start` on this machine names, and a pool meant to be private would join a stranger's."""
    if address:
        if is_loopback_address(address):
            loopback_ray_mode()
        ray.init(address=address, **_RAY_SETTINGS)
        return f"joined the Ray cluster at {ray.get_runtime_context().gcs_address} (--address {address})"
    loopback_ray_mode()
    start_local_ray(num_cpus or max(2, os.cpu_count() or 2))
    return f"started a local Ray cluster at {ray.get_runtime_context().gcs_address} (loopback only; it stops with this)"


RAY_START_TRIES = 2  # Ray gives its new node a fixed 30 s to register; a loaded machine can miss that once
_RAY_START_TIMEOUT = "timed out during startup"  # the bare Exception Ray raises then says so (ray/_private/node.py)


def start_local_ray(num_cpus: int, init: Callable[..., object] = ray.init) -> None:
    """Start a new local Ray cluster; once more if Ray's node timed out registering with its own GCS (Ray waits
    a hard-coded 30 s, which a machine busy with other work can miss): the half-started node's processes (the
    children this start left that run Ray's programs) are stopped first, so the second start has the machine."""
    import psutil

    me = psutil.Process()
    for attempt in range(1, RAY_START_TRIES + 1):
        before = {child.pid for child in me.children(recursive=True)}
        try:
            init(address="local", num_cpus=num_cpus, include_dashboard=False, **_RAY_SETTINGS)
            return
        except Exception as exc:  # Ray raises a bare Exception for this one
            if _RAY_START_TIMEOUT not in str(exc) or attempt == RAY_START_TRIES:
                raise
            left = [child for child in me.children(recursive=True) if child.pid not in before and _runs_ray(child)]
            for child in left:
                with contextlib.suppress(psutil.Error):
                    child.kill()
            psutil.wait_procs(left, timeout=10)
            log.warning("Ray's local node did not register within Ray's 30 s (is the machine busy?); stopped its %d "
                        "processes, starting it once more", len(left))


def _runs_ray(process: psutil.Process) -> bool:
    """Whether a process runs one of Ray's own programs (its command line names Ray's install directory)."""
    import psutil

    ray_dir = os.path.dirname(ray.__file__)
    try:
        return any(ray_dir in part for part in process.cmdline())
    except psutil.Error:
        return False


@dataclass(frozen=True, slots=True)
class LocalServerSpec:
    count: int = 2
    slots: int = 4
    threads: int = 1
    ctx_per_slot: int = 1024
    model_path: Path | None = None
    alias: str = GEMMA_ALIAS


@contextlib.asynccontextmanager
async def local_llama_servers(
    registry: RegistryClient, spec: LocalServerSpec, log_dir: Path, *, id_prefix: str = "llamacpp"
) -> AsyncIterator[list[ServerLauncher]]:
    """Start `spec.count` real llama-server processes, registered with leases; stopped on exit."""
    model = await asyncio.to_thread(ensure_gemma, spec.model_path)
    launchers = []
    for i in range(spec.count):
        port = free_port()
        config = LlamaServerConfig(
            model_path=model, alias=spec.alias, port=port, slots=spec.slots, threads=spec.threads,
            ctx_per_slot=spec.ctx_per_slot,
        )
        record = ServerRecord(
            id=f"{id_prefix}-{i}", url=config.url, engine=Engine.LLAMACPP, model=spec.alias,
            revision="gemma3-270m-q4_k_m", accelerator="cpu", gpu_count=0,
            labels={"host": "localhost", "launched_by": "fedpool"},
        )
        process = llama_server_process(config, log_dir / f"{record.id}.log", name=record.id)
        launchers.append(ServerLauncher(process, record, registry, lease=LeaseSettings(ttl_s=30, heartbeat_s=5)))
    try:
        await asyncio.gather(*(launcher.start() for launcher in launchers))
        yield launchers
    finally:
        await asyncio.gather(*(launcher.stop() for launcher in launchers), return_exceptions=True)


LOCAL_ENGINES = ("llamacpp", "vllm", "emulated")


@dataclass(frozen=True, slots=True)
class LocalPoolSpec:
    """N local servers of one engine: llama.cpp (the bundled Gemma 3 270M, or a GGUF given), vLLM's CPU build
    (the tiny model of deploy/tiny_hf_model.py), or the emulator with a profile."""

    engine: str = "llamacpp"
    count: int = 2
    slots: int = 4
    threads: int = 1
    model_path: Path | None = None
    profile: str = "tiny"  # emulated
    model: str | None = None  # served model name (default: the engine's bundled model)
    ctx_per_slot: int = 1024  # llama.cpp: context tokens per slot (prompt and answer)

    def served_model(self) -> str:
        if self.model:
            return self.model
        from fedpool.deploy.vllm_cpu import TINY_MODEL_NAME

        return {"llamacpp": GEMMA_ALIAS, "vllm": TINY_MODEL_NAME, "emulated": "emu-model"}[self.engine]


@contextlib.asynccontextmanager
async def local_servers(registry: RegistryClient, spec: LocalPoolSpec, log_dir: Path,
                        on_progress: Callable[[str], None] = lambda line: None) -> AsyncIterator[list[ServerLauncher]]:
    """Start the servers (in parallel), each registered with a lease; all stopped (and deregistered) on exit.
    Their processes die with this one however it ends (PR_SET_PDEATHSIG)."""
    if spec.engine not in LOCAL_ENGINES:
        raise ValueError(f"unknown local engine {spec.engine!r}; use {', '.join(LOCAL_ENGINES)}")
    if spec.engine == "llamacpp":
        async with local_llama_servers(registry, LocalServerSpec(
                count=spec.count, slots=spec.slots, threads=spec.threads, model_path=spec.model_path,
                alias=spec.served_model(), ctx_per_slot=spec.ctx_per_slot), log_dir) as launchers:
            yield launchers
        return
    launchers = [await _launcher(registry, spec, i, log_dir, on_progress) for i in range(spec.count)]
    try:
        await asyncio.gather(*(launcher.start() for launcher in launchers))
        yield launchers
    finally:
        await asyncio.gather(*(launcher.stop() for launcher in launchers), return_exceptions=True)


async def _launcher(registry: RegistryClient, spec: LocalPoolSpec, index: int, log_dir: Path,
                    on_progress: Callable[[str], None]) -> ServerLauncher:
    from fedpool.deploy.engines import EngineSpec, engine_argv, registry_engine

    port = free_port()
    model = spec.served_model()
    env: dict[str, str] = {}
    if spec.engine == "vllm":
        from fedpool.deploy.vllm_cpu import ensure_tiny_model, ensure_vllm_python, vllm_cpu_args, vllm_cpu_env

        on_progress("vLLM's CPU build: checking its venv (installed on first use, ~5 min)")
        python = await asyncio.to_thread(ensure_vllm_python)
        weights = spec.model_path or await asyncio.to_thread(ensure_tiny_model, python)
        argv = engine_argv(EngineSpec(engine="vllm", model=model, port=port, model_path=str(weights),
                                      capacity=spec.slots, python=str(python), extra_args=vllm_cpu_args()))
        env = vllm_cpu_env()
        engine = Engine.VLLM
        capacity = spec.slots
    else:
        from fedpool.deploy.emulator import PROFILES

        argv = engine_argv(EngineSpec(engine="emulated", model=model, port=port, profile=spec.profile))
        engine = registry_engine("emulated", spec.profile)
        capacity = PROFILES[spec.profile].max_running
    record = ServerRecord(id=f"{spec.engine}-{index}", url=f"http://127.0.0.1:{port}", engine=engine, model=model,
                          revision=f"local-{spec.engine}", accelerator="cpu", gpu_count=0,
                          capacity=capacity,
                          labels={"host": "localhost", "launched_by": "fedpool-up"})
    process = EngineProcess(record.id, argv, log_dir / f"{record.id}.log", env=env)
    return ServerLauncher(process, record, registry, lease=LeaseSettings(ttl_s=30, heartbeat_s=5),
                          start_deadline_s=900 if spec.engine == "vllm" else 120)
