"""`fedpool serve`: engine command lines, and the whole launch → register → heartbeat → deregister cycle."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import psutil
import pytest
import ray

from fedpool.deploy.engines import EngineSpec, engine_argv, gpu_family
from fedpool.federation import DispatchConfig, PoolConnection
from fedpool.federation.core.types import Endpoint, InferenceRequest
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import TEST_TOKEN, EmulatorFactory

ROOT = Path(__file__).resolve().parent.parent


def test_sglang_command_line_has_metrics_and_served_name() -> None:
    argv = engine_argv(EngineSpec(engine="sglang", model="qwen-7b", model_path="/models/Qwen2.5-7B", port=30000,
                                  host="0.0.0.0", capacity=128, gpus=2, python="/opt/sglang/bin/python"))
    assert argv == ["/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/Qwen2.5-7B",
                    "--served-model-name", "qwen-7b", "--host", "0.0.0.0", "--port", "30000", "--enable-metrics",
                    "--max-running-requests", "128", "--tp-size", "2"]


def test_vllm_and_llamacpp_command_lines() -> None:
    vllm = engine_argv(EngineSpec(engine="vllm", model="m", model_path="/w", port=8000, capacity=64, gpus=4,
                                  python="/venv/bin/python", extra_args=("--dtype", "float32")))
    assert vllm == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/w",
                    "--served-model-name", "m", "--host", "127.0.0.1", "--port", "8000", "--max-num-seqs", "64",
                    "--tensor-parallel-size", "4", "--dtype", "float32"]
    llama = engine_argv(EngineSpec(engine="llamacpp", model="g", model_path="/m.gguf", port=9000, capacity=6,
                                   threads=2))
    assert {"--metrics", "-cb", "--slots"} <= set(llama)
    assert llama[llama.index("-np") + 1] == "6" and llama[llama.index("--alias") + 1] == "g"
    with pytest.raises(ValueError, match="GGUF"):
        engine_argv(EngineSpec(engine="llamacpp", model="g", port=1))
    with pytest.raises(ValueError, match="unknown engine"):
        engine_argv(EngineSpec(engine="tgi", model="g", port=1))


def test_emulated_engines_register_with_their_profiles_protocol() -> None:
    from fedpool.deploy.engines import registry_engine

    assert registry_engine("emulated", "a100-illustrative") == "vllm"
    assert registry_engine("emulated", "sglang-a100-illustrative") == "sglang"
    assert registry_engine("sglang") == "sglang"
    with pytest.raises(ValueError, match="unknown emulator profile"):
        registry_engine("emulated", "tpu-v9")


def test_gpu_names_map_to_families() -> None:
    assert gpu_family("NVIDIA A100-SXM4-80GB") == "A100"
    assert gpu_family("Tesla V100-SXM2-32GB") == "V100"
    assert gpu_family("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_family("Some New Chip") == "Some New Chip"


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float = 60.0) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await check():
            return
        await asyncio.sleep(0.2)
    raise AssertionError("condition not met in time")


@pytest.mark.ray
@pytest.mark.slow
async def test_serve_emulated_registers_heartbeats_and_deregisters(
    registry: RegistryClient, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TEST_TOKEN)
    address = ray.get_runtime_context().gcs_address

    def start(server_id: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "fedpool.cli", "serve", "--address", address, "--token-file-path",
             str(token_file), "--engine", "emulated", "--model", "emu-served", "--id", server_id, "--lease", "3",
             "--log-dir", str(tmp_path / "logs"), "--accelerator", "A100", "--gpus", "1"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    async def present(sid: str) -> bool:
        return (await registry.snapshot()).get(sid) is not None

    async def absent(sid: str) -> bool:
        return not await present(sid)

    proc = start("served-a")
    try:
        await wait_for(lambda: present("served-a"))
        entry = (await registry.snapshot()).get("served-a")
        assert entry is not None and entry.record.accelerator == "A100"
        assert entry.record.labels["engine_kind"] == "emulated"
        await asyncio.sleep(4.5)  # longer than the 3 s lease: only heartbeats keep it
        assert (await registry.snapshot()).get("served-a").status.value == "healthy"  # type: ignore[union-attr]
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 0, err
        assert "engine log:" in out and "stopped and deregistered" in out
        assert await absent("served-a")
        assert (tmp_path / "logs" / "served-a.log").exists()
    finally:
        if proc.poll() is None:
            proc.kill()

    proc = start("served-b")
    try:
        await wait_for(lambda: present("served-b"))
        engine = psutil.Process(proc.pid).children()[0]
        os.kill(engine.pid, signal.SIGKILL)  # the engine dies under fedpool serve
        out, err = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 1 and "exited" in err
        assert await absent("served-b")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.ray
@pytest.mark.slow
async def test_serve_joins_a_registry_started_afresh(
    registry: RegistryClient, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The registry is killed for good and an operator starts a new one with an empty state directory:
    `fedpool serve` finds the new actor and registers its server again (its heartbeat is refused)."""

    token_file = tmp_path / "token"
    token_file.write_text(TEST_TOKEN)
    proc = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "fedpool.cli", "serve", "--address", ray.get_runtime_context().gcs_address,
         "--token-file-path", str(token_file), "--engine", "emulated", "--model", "emu-served", "--id", "phoenix",
         "--lease", "1.5", "--log-dir", str(tmp_path / "logs"), "--accelerator", "A100", "--gpus", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    fresh: RegistryClient | None = None
    try:
        async def known_to(client: RegistryClient) -> bool:
            return (await client.snapshot()).get("phoenix") is not None

        await wait_for(lambda: known_to(registry))
        await registry.terminate()  # killed for good: the name is free when it returns
        fresh = await RegistryClient.start(tmp_path_factory.mktemp("afresh"), token=TEST_TOKEN, probe_interval_s=0.3)
        await wait_for(lambda: known_to(fresh), timeout_s=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.communicate, timeout=30)
        if fresh is not None:
            await fresh.terminate()


async def prompt_tokens(url: str) -> float:
    """What the engine has been asked to prefill in all: it grows with every request it is sent."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prompt_tokens_total"))


@pytest.mark.ray
@pytest.mark.slow
async def test_drain_and_remove_stick_for_a_server_fedpool_serve_runs(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    """Drained, a server `fedpool serve` runs stays draining while its launcher heartbeats (it was removed once idle
    and its launcher registered it again, healthy, within seconds) and gets no new request; removed, its `fedpool
    serve` stops its engine and exits 0, and the server does not come back."""
    token_file = tmp_path / "token"
    token_file.write_text(TEST_TOKEN)
    proc = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "fedpool.cli", "serve", "--address", ray.get_runtime_context().gcs_address,
         "--token-file-path", str(token_file), "--engine", "emulated", "--model", "emu-model", "--id", "served-d",
         "--lease", "1.5", "--log-dir", str(tmp_path / "logs"), "--accelerator", "A100", "--gpus", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        async def status() -> str | None:
            entry = (await registry.snapshot()).get("served-d")
            return None if entry is None else entry.status.value

        await wait_for(lambda: _is(status, "healthy"))
        url = (await registry.get("served-d")).url
        other = await emulators.start(model="emu-model")
        await registry.register(ServerRecord(id="emu-other", url=other.url, engine=Engine.VLLM, model="emu-model",
                                             accelerator="A100", capacity=4))
        await registry.drain("served-d")
        asked = await prompt_tokens(url)
        # Heartbeats every 0.5 s and probes every 0.3 s of an idle engine: drained at once, and 12 heartbeats on
        # (the registry's drain timeout is simulated past in test_registry_units), still draining.
        for _ in range(24):
            await asyncio.sleep(0.25)
            assert await status() == "draining"
        async with PoolConnection(registry, config=DispatchConfig(no_server_timeout_s=10.0)) as pool:
            await pool.refresh()
            for i in range(8):
                await pool.dispatcher.submit(InferenceRequest.from_body(
                    {"prompt": f"q{i}", "max_tokens": 2}, request_id=f"r{i}", model="emu-model",
                    endpoint=Endpoint.COMPLETIONS, client_id="after-drain"))
        assert await prompt_tokens(url) == asked  # every request went to the other server
        assert await status() == "draining"
        await registry.deregister("served-d")  # `fedpool server remove`
        out, err = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 0, err
        assert "served-d is draining" in err and "was removed from the pool" in out, (out, err)
        for _ in range(8):  # its lease was 1.5 s: a launcher still running would have registered it again by now
            await asyncio.sleep(0.25)
            assert await status() is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


async def _is(check: Callable[[], Awaitable[str | None]], value: str) -> bool:
    return await check() == value
