"""The embedded default: local Ray, a registry actor and real llama.cpp servers on this machine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import ray
from fedpool.deploy import (
    GEMMA_ALIAS,
    LeaseSettings,
    LlamaServerConfig,
    ServerLauncher,
    ensure_gemma,
    free_port,
    llama_server_process,
)
from fedpool.registry import Engine, RegistryClient, ServerRecord

log = logging.getLogger("fedpool.localpool")


def init_local_ray(num_cpus: int | None = None) -> None:
    """Start Ray on this machine, or join the cluster already running here (`ray start`), quietly."""
    if ray.is_initialized():
        return
    common: dict[str, object] = {"namespace": "fedpool", "logging_level": logging.WARNING, "log_to_driver": False}
    try:
        ray.init(num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=False, **common)
    except ValueError as exc:  # Ray refuses resource settings when a cluster already runs on this node
        if "existing cluster" not in str(exc):
            raise
        log.info("joining the Ray cluster already running on this machine")
        ray.init(address="auto", **common)


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
