"""End to end on real parts: local Ray, the registry actor, real llama.cpp servers, concurrent evals."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from fedpool.clients import EvalTarget, run_evals
from fedpool.deploy import LeaseSettings, LlamaServerConfig, ServerLauncher, free_port, llama_server_process
from fedpool.federation import PoolConnection
from fedpool.pipeline import load_spec
from fedpool.pipeline.bundled import bundled_spec_paths
from fedpool.registry import Engine, RegistryClient, ServerRecord, ServerStatus
from tests.conftest import TEST_TOKEN, LlamaServers, files_containing, read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.llamacpp]


async def register_llama(registry: RegistryClient, servers: LlamaServers) -> list[str]:
    ids = []
    for i, url in enumerate(servers.urls):
        record = ServerRecord(id=f"llama-{i}", url=url, engine=Engine.LLAMACPP, model=servers.alias,
                              revision="gemma3-270m-q4_k_m", accelerator="cpu")
        entry = await registry.register(record)
        assert entry.capacity == 4  # discovered from llama-server's /props (total_slots)
        ids.append(record.id)
    return ids


async def test_three_concurrent_evals_over_two_real_servers(
    registry: RegistryClient, llama_servers: LlamaServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secretvalue_0123456789")
    ids = await register_llama(registry, llama_servers)
    specs = [load_spec(p) for p in bundled_spec_paths()]
    specs = [s.model_copy(update={"data": s.data.model_copy(update={"limit": 12})}) for s in specs]
    async with PoolConnection(registry, policy="least_inflight") as pool:
        summaries = await run_evals(specs, pool.dispatcher, tmp_path, EvalTarget(model=llama_servers.alias),
                                    concurrency=8, secrets=[TEST_TOKEN])
        stats = pool.dispatcher.stats()
    assert stats.inflight_total == 0 and stats.completed == 36
    total_score = 0.0
    evals_on: dict[str, set[str]] = {server: set() for server in ids}
    for summary in summaries:
        records = read_jsonl(summary.artifact_dir / "records.jsonl")
        assert len(records) == 12 and len({r["sample_id"] for r in records}) == 12  # each exactly once
        assert summary.summary["failed"] == 0
        for server in {r["provenance"]["server_id"] for r in records}:
            evals_on[server].add(summary.benchmark)
        for r in records:
            prov = r["provenance"]
            assert prov["engine"] == "llamacpp" and prov["accelerator"] == "cpu" and prov["attempts"] >= 1
            assert prov["model_revision"] == "gemma3-270m-q4_k_m" and prov["latency_s"] > 0
            assert r["output"]["text"]["prediction"] and r["prompt"]
        total_score += summary.summary["scores"][0]["value"]
        saved = (summary.artifact_dir / "summary.json").read_text()
        assert '"dataset_sha256"' in saved and '"prompt_template"' in saved and '"packages"' in (
            summary.artifact_dir / "config.json"
        ).read_text()
    assert total_score > 0
    # Each engine's batches mixed requests of several evals. (Not every eval on every server: an eval whose
    # requests come after the others filled the slots takes slots as they free, and one server may free them
    # all first — the share of each eval per server is the engines' timing, not routing.)
    assert all(len(evals) >= 2 for evals in evals_on.values()), evals_on
    assert files_containing(tmp_path, [TEST_TOKEN, "hf_secretvalue_0123456789"]) == []


async def test_live_llamacpp_metrics_show_load(registry: RegistryClient, llama_servers: LlamaServers) -> None:
    await register_llama(registry, llama_servers)
    snap = await registry.snapshot()
    for _ in range(49):
        if all(e.load is not None for e in snap.entries):
            break
        await asyncio.sleep(0.2)
        snap = await registry.snapshot()
    for entry in snap.entries:
        assert entry.status is ServerStatus.HEALTHY
        assert entry.load is not None and entry.load.running >= 0 and entry.load.generation_tokens_total is not None


async def test_launcher_registers_heartbeats_and_deregisters_when_the_engine_dies(
    registry: RegistryClient, llama_servers: LlamaServers, tmp_path: Path
) -> None:
    config = LlamaServerConfig(model_path=llama_servers.model_path, alias=llama_servers.alias, port=free_port(),
                               slots=2, threads=1)
    record = ServerRecord(id="launched", url=config.url, engine=Engine.LLAMACPP, model=config.alias)
    launcher = ServerLauncher(llama_server_process(config, tmp_path / "engine.log"), record, registry,
                              lease=LeaseSettings(ttl_s=5, heartbeat_s=0.5))
    try:
        await launcher.start()
        assert (tmp_path / "engine.log").stat().st_size > 0
        entry = await registry.get("launched")
        assert entry.capacity == 2
        await asyncio.sleep(1.5)
        assert (await registry.snapshot()).get("launched") is not None
        os.kill(launcher.process.pid, 9)  # type: ignore[arg-type]
        await asyncio.wait_for(launcher.exited.wait(), 10)
        for _ in range(50):
            if (await registry.snapshot()).get("launched") is None:
                break
            await asyncio.sleep(0.1)
        assert (await registry.snapshot()).get("launched") is None
    finally:
        await launcher.stop()
