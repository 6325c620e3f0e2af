"""The gateway as a separate `fedpool gateway` process in front of two real llama.cpp servers: a server killed
under 16 concurrent streams does not break them (each is continued on the other server and ends well
formed), the migrations are counted, the gateway logs no traceback; an over-long prompt is refused with
llama-server's own reason; a client that drops its stream costs nothing but a count."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from fedpool.deploy import LlamaServerConfig, free_port, llama_server_process
from fedpool.deploy.models import GEMMA_ALIAS, ensure_gemma
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import TEST_TOKEN, wait_http_up

pytestmark = [pytest.mark.ray, pytest.mark.llamacpp]
ROOT = Path(__file__).resolve().parent.parent


async def test_streams_survive_a_server_killed_mid_stream(registry: RegistryClient, tmp_path: Path) -> None:
    model = await asyncio.to_thread(ensure_gemma)
    servers = []
    for i in range(2):
        config = LlamaServerConfig(model_path=model, alias=GEMMA_ALIAS, port=free_port(), slots=8, threads=1)
        proc = llama_server_process(config, tmp_path / f"llama-{i}.log", name=f"llama-{i}")
        await proc.start()
        await proc.wait_healthy(config.url + "/health", deadline_s=120)
        servers.append(proc)
        # Replicas: same engine, model and an explicit revision (what a continuation may run on).
        await registry.register(ServerRecord(id=f"llama-{i}", url=config.url, engine=Engine.LLAMACPP,
                                             model=GEMMA_ALIAS, revision="gemma3-270m-q4km", accelerator="cpu"))
    (tmp_path / "registry.token").write_text(TEST_TOKEN)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "gateway.log"
    argv = [sys.executable, "-m", "fedpool.cli", "gateway", "--address", ray.get_runtime_context().gcs_address,
            "--token-file-path", str(tmp_path / "registry.token"), "--port", str(port), "--policy", "capacity_weighted"]
    gateway = await asyncio.to_thread(subprocess.Popen, argv, cwd=ROOT, stdout=log_path.open("w"),
                                      stderr=subprocess.STDOUT, text=True)
    try:
        await asyncio.to_thread(wait_http_up, url, gateway, "gateway")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-stream-test-0123456789", max_retries=0)

        # An over-long prompt: llama-server's own reason, with its status, attributed to the server.
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=GEMMA_ALIAS, prompt="word " * 3000, max_tokens=4)
        assert "exceeds the available context size" in str(refused.value)

        chunks_seen = [0]

        async def one(i: int) -> tuple[str, str]:
            kind = "chat" if i % 2 else "completion"
            if kind == "chat":
                chat_stream = await client.chat.completions.create(
                    model=GEMMA_ALIAS, messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
                    max_tokens=96, temperature=0, stream=True)
                parts = []
                async for c in chat_stream:
                    if c.choices and c.choices[0].delta.content:
                        parts.append(c.choices[0].delta.content)
                        chunks_seen[0] += 1
                return kind, "".join(parts)
            stream = await client.completions.create(model=GEMMA_ALIAS, prompt=f"The story of the number {i} is",
                                                     max_tokens=96, temperature=0, stream=True)
            parts = []
            async for piece in stream:
                if piece.choices and piece.choices[0].text:
                    parts.append(piece.choices[0].text)
                    chunks_seen[0] += 1
            return kind, "".join(parts)

        tasks = [asyncio.create_task(one(i)) for i in range(16)]
        for _ in range(1200):  # until streams are under way on both servers
            if chunks_seen[0] >= 40:
                break
            await asyncio.sleep(0.05)
        assert servers[0].pid is not None
        os.kill(servers[0].pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors  # every stream ended well formed (none needed the error event here)
        assert all(text.strip() for _, text in results)  # type: ignore[misc]

        # A client that drops its stream half-way: counted, nothing else.
        async with aiohttp.ClientSession() as session:
            body = {"model": GEMMA_ALIAS, "prompt": "Count to fifty:", "max_tokens": 64, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.content.readline()
        await asyncio.sleep(1.0)
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
            metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in text_string_to_metric_families(await resp.text()) for s in f.samples}
        assert metrics[("fedpool_gateway_stream_migrations_total", ())] >= 1
        streamed = {labels: v for (name, labels), v in metrics.items() if name == "fedpool_gateway_requests_total"}
        assert sum(streamed.values()) >= 18
        await client.close()
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(30)
        except subprocess.TimeoutExpired:
            gateway.kill()
        for proc in servers:
            await proc.stop()
    text = log_path.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert text.count("continuing on another replica") >= 1  # one line per migration
