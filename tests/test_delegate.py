"""Evals that hand their placement to a gateway (`fedpool eval run --gateway URL`, clients/delegate.py): two eval
processes through one real gateway over real emulated servers and a real registry; and the client's side of
every refusal, against a small aiohttp server that answers as the gateway does."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fedpool.clients.delegate import DelegatingDispatcher, GatewayHttp
from fedpool.federation import DispatchConfig, Endpoint, InferenceRequest, PoolConnection
from fedpool.federation.core.errors import FailureKind, NoServerError, RequestFailed
from fedpool.federation.gateway.handlers import ApiKey, Gateway
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import EmulatorFactory

ROOT = Path(__file__).resolve().parent.parent
FEDPOOL = [sys.executable, "-m", "fedpool.cli"]
KEY = ApiKey("sk-evals-0123456789", "evals")


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def fedpool(*args: str, key: str | None = KEY.secret) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDPOOL_")}
    env.update({"FEDPOOL_API_KEY": key} if key else {})
    return subprocess.run([*FEDPOOL, *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


@pytest.fixture
async def gateway(registry: RegistryClient, emulators: EmulatorFactory) -> AsyncIterator[tuple[str, Gateway]]:
    for i in range(2):
        server = await emulators.start(model="emu-model", max_running=4, decode_s=0.002)
        await registry.register(ServerRecord(id=f"emu-{i}", url=server.url, engine=Engine.VLLM, model="emu-model",
                                             accelerator="A100", capacity=4, revision="r1"))
    async with PoolConnection(registry, policy="capacity_weighted", config=DispatchConfig()) as pool:
        gw = Gateway(pool.dispatcher, lambda: pool.snapshot, api_keys=[KEY])
        runner, url = await serve(gw.app())
        yield url, gw
        await runner.cleanup()


@pytest.mark.ray
async def test_two_eval_processes_send_through_one_gateway_which_places_every_request(
        gateway: tuple[str, Gateway], tmp_path: Path) -> None:
    """Two `eval run --gateway` processes, started together, one eval each: every record lands once, its
    provenance the server, engine, accelerator and revision the gateway's answer named; the gateway served each
    eval as a client of its own under the key (`evals/arith`, `evals/arith-b`), each declaring its run's 60
    requests and its mean prompt."""
    url, gw = gateway
    spec = ROOT / "pipeline" / "bundled" / "arith.yaml"
    other = tmp_path / "arith-b.yaml"
    other.write_text(spec.read_text().replace("name: arith", "name: arith-b")
                     .replace("{path: arith.jsonl}", f"{{path: {spec.parent}/arith.jsonl}}"))
    runs = [asyncio.to_thread(fedpool, "eval", "run", "--gateway", url + "/v1", "--spec", str(s), "--model",
                              "emu-model", "--out", str(tmp_path / name), "--concurrency", "4", "--json", "-q")
            for s, name in ((spec, "a"), (other, "b"))]
    for result in await asyncio.gather(*runs):
        assert result.returncode == 0, result.stderr
    for name, bench in (("a", "arith"), ("b", "arith-b")):
        rows = [json.loads(line) for line in (tmp_path / name / bench / "records.jsonl").read_text().splitlines()]
        assert len(rows) == 60 and len({r["sample_id"] for r in rows}) == 60
        for row in rows:
            prov = row["provenance"]
            assert prov["server_id"] in {"emu-0", "emu-1"} and prov["engine"] == "vllm"
            assert prov["accelerator"] == "A100" and prov["model_revision"] == "r1" and prov["attempts"] >= 1
        config = json.loads((tmp_path / name / bench / "config.json").read_text())
        assert config["gateway"] == url + "/v1"
    kept = gw.runs._runs  # each request said its eval's run size (each run kept until its client id expires)
    assert set(kept) == {"evals/arith", "evals/arith-b"}
    assert all(r.declared == r.arrived == r.finished == 60 for r in kept.values())
    for client in kept:  # and its mean prompt, announced as the eval's shape with its answer budget
        shape = gw._dispatcher._clients.shape(client)
        assert shape is not None and shape.announced and shape.prompt_tokens > 3 and shape.max_tokens == 4


def test_a_gateway_flag_that_cannot_be_used_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    spec = str(ROOT / "pipeline" / "bundled" / "arith.yaml")
    out = tmp_path / "run"
    common = ["eval", "run", "--spec", spec, "--model", "emu-model", "--out", str(out)]
    with_user = fedpool(*common, "--gateway", "http://me:secret@127.0.0.1:9/v1")
    assert with_user.returncode == 2 and "no credentials" in with_user.stderr and "secret" not in with_user.stderr
    nobody = fedpool(*common, "--gateway", "http://127.0.0.1:9")  # (the discard port: nothing listens)
    assert nobody.returncode == 3 and "cannot reach http://127.0.0.1:9" in nobody.stderr
    assert not out.exists()


async def test_a_gateway_that_refuses_the_key_or_the_model_is_named(tmp_path: Path) -> None:
    async def models(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {KEY.secret}":
            return web.json_response({"error": {"message": "invalid API key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "other-model", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner, url = await serve(app)
    try:
        spec = str(ROOT / "pipeline" / "bundled" / "arith.yaml")
        common = ["eval", "run", "--spec", spec, "--model", "emu-model", "--out", str(tmp_path / "run"),
                  "--gateway", url]
        wrong = await asyncio.to_thread(fedpool, *common, key="sk-wrong-key-000000")
        assert wrong.returncode == 2 and "answered 401" in wrong.stderr and "invalid API key" in wrong.stderr
        assert "sk-wrong" not in wrong.stderr
        unknown = await asyncio.to_thread(fedpool, *common)
        assert unknown.returncode == 3 and "emu-model" in unknown.stderr and "other-model" in unknown.stderr
        assert not (tmp_path / "run").exists()
    finally:
        await runner.cleanup()


class Script:
    """A gateway's answers in order, each (status, body, headers), and what it was sent."""

    def __init__(self, *answers: tuple[int, dict[str, Any], dict[str, str]]):
        self.answers = list(answers)
        self.sent: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.sent.append((request.path, dict(request.headers), await request.json()))
        status, body, headers = self.answers.pop(0)
        return web.json_response(body, status=status, headers=headers)


ANSWER = ({"choices": [{"text": " 4", "finish_reason": "stop"}], "usage": {"prompt_tokens": 5,
                                                                        "completion_tokens": 1}},
          {"X-Fedpool-Server": "s1", "X-Fedpool-Attempts": "2", "X-Fedpool-Engine": "sglang",
           "X-Fedpool-Accelerator": "V100", "X-Fedpool-Revision": "abc"})


def error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "x", "code": code}}


def request(i: int = 0, client: str = "arith") -> InferenceRequest:
    return InferenceRequest.from_body({"prompt": "2 + 2 =", "max_tokens": 4, "temperature": 0},
                                      request_id=f"{client}/{i}", model="m", endpoint=Endpoint.COMPLETIONS,
                                      client_id=client)


async def against(script: Script, **kwargs: Any) -> tuple[DelegatingDispatcher, GatewayHttp, web.AppRunner]:
    app = web.Application()
    app.router.add_post("/v1/completions", script.handle)
    runner, url = await serve(app)
    http = GatewayHttp(url)
    return DelegatingDispatcher(http, **kwargs), http, runner


async def test_an_answer_carries_the_gateway_s_provenance_and_each_request_its_eval_s_run_size() -> None:
    script = Script((200, *ANSWER), (200, *ANSWER), (200, *ANSWER))
    d, http, runner = await against(script)
    try:
        d.client_done_sending("arith", False)
        d.set_client_remaining("arith", 600.0, 60)
        d.set_client_remaining("arith", 590.0, 59)  # (later reports: the gateway counts down itself)
        result = await d.submit(request())
        assert result.completion.text == " 4" and result.completion.completion_tokens == 1
        assert (result.server_id, result.engine, result.accelerator, result.model_revision) == \
            ("s1", "sglang", "V100", "abc")
        assert len(result.attempts) == 2 and result.attempts[-1].server_id == "s1"
        path, headers, body = script.sent[0]
        assert path == "/v1/completions" and headers["X-Fedpool-Client"] == "arith"
        assert headers["X-Fedpool-Requests"] == "60" and body["prompt"] == "2 + 2 =" and body["model"] == "m"
        d.client_done_sending("arith", False)  # the eval runs again (resume): its next report is the new size
        d.set_client_remaining("arith", 100.0, 10)
        await d.submit(request(1))
        assert script.sent[1][1]["X-Fedpool-Requests"] == "10"
        await d.submit(request(2, client="other"))  # an eval that said nothing declares nothing
        assert "X-Fedpool-Requests" not in script.sent[2][1]
    finally:
        await http.aclose()
        await runner.cleanup()


async def test_the_gateway_s_own_load_is_waited_out_every_other_refusal_is_the_record_s() -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    script = Script((503, error("overloaded", "gateway_overloaded"), {"Retry-After": "1"}),
                    (429, error("at capacity", "gateway_overloaded"), {"Retry-After": "2"}),
                    (200, *ANSWER),
                    (400, error("prompt too long (from server s2)", "upstream_refused"), {"X-Fedpool-Server": "s2"}),
                    (503, error("no registered server serves model 'm'", "no_server"), {}),
                    (502, error("every attempt timed out", "timeout"), {}),
                    (429, error("engines rate-limited", "upstream_rate_limited"), {}))
    d, http, runner = await against(script, sleep=sleep)
    try:
        assert (await d.submit(request())).server_id == "s1"
        assert slept == [1.0, 2.0] and d.waited == 2
        with pytest.raises(RequestFailed) as refused:
            await d.submit(request(1))
        assert refused.value.last_kind is FailureKind.REQUEST_ERROR and refused.value.server_id == "s2"
        assert "prompt too long" in str(refused.value)
        with pytest.raises(NoServerError, match="no registered server"):
            await d.submit(request(2))
        with pytest.raises(RequestFailed) as timed_out:
            await d.submit(request(3))
        assert timed_out.value.last_kind is FailureKind.TIMEOUT
        with pytest.raises(RequestFailed) as limited:
            await d.submit(request(4))
        assert limited.value.last_kind is FailureKind.RATE_LIMITED
        assert not script.answers
    finally:
        await http.aclose()
        await runner.cleanup()


async def test_a_gateway_that_cannot_be_reached_is_retried_then_the_record_fails() -> None:
    now = [0.0]

    async def sleep(s: float) -> None:
        now[0] += s

    http = GatewayHttp("http://127.0.0.1:9")  # (nothing listens)
    d = DelegatingDispatcher(http, clock=lambda: now[0], sleep=sleep, unreachable_s=10.0)
    try:
        with pytest.raises(RequestFailed) as failed:
            await d.submit(request())
        assert failed.value.last_kind is FailureKind.CONNECT and 0 < now[0] <= 10.0 and d.waited >= 3
    finally:
        await http.aclose()
    with pytest.raises(RequestFailed, match="pinned"):
        pinned = InferenceRequest.from_body({"prompt": "x"}, request_id="r", model="m", endpoint=Endpoint.COMPLETIONS,
                                            client_id="c", pinned_servers=("s1",))
        await d.submit(pinned)
