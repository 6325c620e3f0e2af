"""The OpenAI-compatible gateway, driven by the openai SDK, over real emulated servers and a real registry."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from fedpool.federation import DispatchConfig, PoolConnection
from fedpool.federation.gateway.handlers import ApiKey, Gateway, parse_api_keys
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import EmulatorFactory

pytestmark = pytest.mark.ray

KEYS = [ApiKey("sk-team-a-0123456789", "team-a"), ApiKey("sk-team-b-0123456789", "team-b", weight=2.0)]


@pytest.fixture
async def gateway_url(registry: RegistryClient, emulators: EmulatorFactory) -> AsyncIterator[str]:
    for i in range(2):
        server = await emulators.start(model="emu-model", max_running=4, decode_s=0.002)
        await registry.register(ServerRecord(id=f"emu-{i}", url=server.url, engine=Engine.VLLM, model="emu-model",
                                             accelerator="A100", capacity=4))
    config = DispatchConfig(no_server_timeout_s=1.0)  # a model nobody serves is answered 503 quickly
    async with PoolConnection(registry, policy="capacity_weighted", config=config) as pool:
        runner = web.AppRunner(Gateway(pool.dispatcher, lambda: pool.snapshot, api_keys=KEYS,
                                       max_body_bytes=64 * 1024).app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
        await runner.cleanup()


async def test_openai_sdk_completions_chat_and_streaming(gateway_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key=KEYS[0].secret, max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["emu-model"]
    completion = await client.completions.create(model="emu-model", prompt="Say something", max_tokens=4)
    assert completion.choices[0].text.strip() and completion.usage.completion_tokens == 4  # type: ignore[union-attr]
    chat = await client.chat.completions.create(model="emu-model", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content
    pieces = [c.choices[0].text async for c in await client.completions.create(
        model="emu-model", prompt="Say something", max_tokens=4, stream=True)]
    assert "".join(pieces) == completion.choices[0].text  # same answer, streamed token by token
    chat_stream = await client.chat.completions.create(
        model="emu-model", messages=[{"role": "user", "content": "hi"}], stream=True)
    streamed = "".join([c.choices[0].delta.content or "" async for c in chat_stream])
    assert streamed == chat.choices[0].message.content
    await client.close()


async def test_requests_spread_over_the_pool(gateway_url: str) -> None:
    headers = {"Authorization": f"Bearer {KEYS[1].secret}"}
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> str:
            body = {"model": "emu-model", "prompt": f"p{i}", "max_tokens": 4}
            async with session.post(gateway_url + "/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                return resp.headers["X-Fedpool-Server"]

        servers = Counter(await asyncio.gather(*(one(i) for i in range(40))))
    assert set(servers) == {"emu-0", "emu-1"}


BAD_REQUESTS: list[tuple[dict[str, str] | None, object, int, str]] = [
    ({}, {"model": "emu-model", "prompt": "x"}, 401, "missing bearer token"),
    ({"Authorization": "Bearer sk-wrong-0123456789"}, {"model": "emu-model", "prompt": "x"}, 401, "invalid API"),
    (None, b"{not json", 400, "not valid JSON"),
    (None, [1, 2], 400, "JSON object"),
    (None, {"prompt": "x"}, 400, "'model'"),
    (None, {"model": "emu-model"}, 400, "'prompt'"),
    (None, {"model": "no-such-model", "prompt": "x"}, 404, "`no-such-model` does not exist"),
    (None, {"model": "emu-model", "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    (None, {"model": "emu-model", "prompt": "x", "max_tokens": "8"}, 400, "'max_tokens' must be an integer"),
    (None, {"model": "emu-model", "prompt": "x" * 70_000}, 413, "larger than"),
]


async def test_bad_requests_get_openai_style_errors(gateway_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for headers, body, status, fragment in BAD_REQUESTS:
            auth = {"Authorization": f"Bearer {KEYS[0].secret}"} if headers is None else headers
            data, json_body = (body, None) if isinstance(body, bytes) else (None, body)
            async with session.post(gateway_url + "/v1/completions", headers=auth, data=data, json=json_body) as resp:
                payload = await resp.json()
            assert resp.status == status and fragment in payload["error"]["message"], (body, payload)
        ok = {"model": "emu-model", "prompt": "still fine", "max_tokens": 2}
        async with session.post(gateway_url + "/v1/completions", json=ok,
                                headers={"Authorization": f"Bearer {KEYS[0].secret}"}) as resp:
            assert resp.status == 200  # nothing else broke


async def test_every_error_is_openai_shaped_json(gateway_url: str) -> None:
    """Unknown routes and methods, auth failures with undecodable headers, a model nobody serves: JSON errors in
    OpenAI's shape with the right status; the SDK raises NotFoundError at once (404 is not retried)."""
    auth = {"Authorization": f"Bearer {KEYS[0].secret}"}
    async with aiohttp.ClientSession() as session:
        for method, path, status in [("GET", "/v1/nothing", 404), ("PUT", "/v1/completions", 405),
                                     ("DELETE", "/v1/models", 405)]:
            async with session.request(method, gateway_url + path, headers=auth) as resp:
                payload = await resp.json()
            assert resp.status == status and set(payload["error"]) == {"message", "type", "param", "code"}
            assert resp.content_type == "application/json"
        async with session.get(gateway_url + "/v1/models/emu-model", headers=auth) as resp:
            model = await resp.json()
        assert model["id"] == "emu-model" and model["object"] == "model" and isinstance(model["created"], int)
        async with session.get(gateway_url + "/v1/models/nope", headers=auth) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
    # An Authorization header that is not UTF-8: refused like any wrong key, not a 500.
    reader, writer = await asyncio.open_connection(*gateway_url.removeprefix("http://").split(":"))
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xfd\r\n"
                 b"Connection: close\r\n\r\n")
    await writer.drain()
    head = (await reader.read()).split(b"\r\n", 1)[0]
    writer.close()
    assert head.startswith(b"HTTP/1.1 401"), head
    client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key=KEYS[0].secret)  # default retries
    started = asyncio.get_running_loop().time()
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert asyncio.get_running_loop().time() - started < 1.0
    models = await client.models.list()
    assert all(m.created and m.owned_by == "fedpool" for m in models.data)
    await client.close()


async def test_metrics_count_requests(gateway_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key=KEYS[0].secret, max_retries=0)
    for _ in range(3):
        await client.completions.create(model="emu-model", prompt="x", max_tokens=2)
    await client.close()
    async with aiohttp.ClientSession() as session, session.get(gateway_url + "/metrics") as resp:
        text = await resp.text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("fedpool_gateway_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 3
    assert any(name == "fedpool_gateway_server_window" for name, _ in samples)
    assert KEYS[0].secret not in text


def test_api_key_file_errors_name_the_line() -> None:
    assert parse_api_keys("# team keys\nteam-a:sk-0123456789abcdef\nteam-b:sk-abcdefghijklmnop:2\n") == [
        ApiKey("sk-0123456789abcdef", "team-a"), ApiKey("sk-abcdefghijklmnop", "team-b", 2.0)]
    for text, fragment in [("team-a\n", "line 1"), ("ok:sk-0123456789abcdef\nbad:sk-too-short\n", "line 2"),
                           ("a:sk-0123456789abcdef:fast\n", "weight 'fast'"),
                           ("a:sk-0123456789abcdef:0\n", "positive"),
                           ("a:sk-0123456789abcdef\nb:sk-0123456789abcdef\n", "same secret as line 1")]:
        with pytest.raises(ValueError, match=fragment):
            parse_api_keys(text)


LM_EVAL_TASK = """\
task: fedpool_gateway_check
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


def run_lm_eval(base_url: str, task_dir: Path, out: Path, api_key: str) -> dict[int, list[object]]:
    """lm-evaluation-harness's own CLI, model local-completions, as a user would point it at a server."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": api_key}
    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"model=emu-model,base_url={base_url}/v1/completions,tokenized_requests=False,tokenizer_backend=None,"
         "num_concurrent=4", "--tasks", "fedpool_gateway_check", "--include_path", str(task_dir),
         "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    samples = next(out.rglob("samples_fedpool_gateway_check_*.jsonl"))
    return {row["doc_id"]: row["resps"] for row in map(json.loads, samples.read_text().splitlines())}


async def test_lm_evaluation_harness_through_the_gateway_matches_direct(
    gateway_url: str, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(20)))
    (tmp_path / "task.yaml").write_text(LM_EVAL_TASK.format(data=data))
    direct_server = emulators.servers[0]
    direct = await asyncio.to_thread(run_lm_eval, direct_server.url, tmp_path, tmp_path / "direct", "unused")
    via = await asyncio.to_thread(run_lm_eval, gateway_url, tmp_path, tmp_path / "gateway", KEYS[0].secret)
    assert len(direct) == 20 and via == direct  # record by record
