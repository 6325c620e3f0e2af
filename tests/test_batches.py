"""The Batch API (`/v1/files`, `/v1/batches`), driven by the openai SDK over real emulated servers and a real
registry: answers as online, a vLLM `run-batch` input file as it is, every bad input refused whole and naming its
line, keys scoping files and batches, cancel, expiry, a failed line beside good ones, shortest first between
batches, and a gateway process killed -9 mid-batch and started again (each custom_id exactly once)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types import Batch

from fedpool.clients.batchrunner import ONLINE_RESERVE, BatchRunner, OnlineReserve
from fedpool.clients.poolapp import batch_service, build_app
from fedpool.deploy.emulator import Faults
from fedpool.deploy.process import free_port
from fedpool.federation import DispatchConfig, Endpoint, InferenceRequest, PoolConnection
from fedpool.federation.gateway.handlers import ApiKey, Gateway, serving
from fedpool.options import GatewayOptions
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import TEST_TOKEN, EmulatorFactory, wait_http_up

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parent.parent
KEYS = [ApiKey("sk-team-a-0123456789", "team-a"), ApiKey("sk-team-b-0123456789", "team-b")]
MAX_FILE_BYTES = 64 * 1024
VLLM_FILE = Path(__file__).parent / "data" / "vllm_run_batch.jsonl"  # vLLM's examples/offline_inference/openai_batch
FINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class Served:
    url: str
    pool: PoolConnection
    runner: BatchRunner
    batches_dir: Path
    gateway: Gateway

    def client(self, key: ApiKey = KEYS[0]) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key.secret, max_retries=0)


@contextlib.asynccontextmanager
async def served(registry: RegistryClient, emulators: EmulatorFactory, where: Path, *, servers: int = 2,
                 decode_s: float = 0.002, model: str = "emu-model", faults: Faults | None = None,
                 online_reserve: int = 0) -> AsyncIterator[Served]:
    """`servers` emulated servers of 4 slots, and the pool app with the Batch API over them (shortest first)."""
    for i in range(servers):
        server = await emulators.start(model=model, max_running=4, decode_s=decode_s, faults=faults)
        await registry.register(ServerRecord(id=f"emu-{i}", url=server.url, engine=Engine.VLLM, model=model,
                                             accelerator="A100", capacity=4))
    config = DispatchConfig(no_server_timeout_s=1.0, client_order="shortest_first")
    async with PoolConnection(registry, config=config) as pool:
        await pool.refresh()
        gateway = Gateway(pool.dispatcher, lambda: pool.snapshot, api_keys=KEYS, max_body_bytes=64 * 1024)
        runner, api = await batch_service(gateway, pool, where / "batches", max_file_bytes=MAX_FILE_BYTES,
                                          max_lines=1000, online_reserve=online_reserve)
        try:
            async with serving(build_app(gateway, pool, "<html></html>", batches=api)) as url:
                yield Served(url, pool, runner, where / "batches", gateway)
        finally:
            await runner.stop()


def request_line(i: int, *, endpoint: str = "/v1/completions", model: str = "emu-model", max_tokens: int = 6,
                 **body: Any) -> dict[str, Any]:
    asked: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, **body}
    if endpoint == "/v1/completions":
        asked.setdefault("prompt", f"question number {i} of the batch")
    else:
        asked.setdefault("messages", [{"role": "user", "content": f"question number {i} of the batch"}])
    return {"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": asked}


def jsonl(lines: Sequence[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def until_final(client: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 120.0,
                      statuses: Sequence[str] = FINAL) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}: {batch.request_counts}"
        await asyncio.sleep(0.05)


async def until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.05)


async def file_lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def submit(client: openai.AsyncOpenAI, lines: Sequence[dict[str, Any]], endpoint: str = "/v1/completions",
                 window: str = "24h") -> Batch:
    uploaded = await client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return await client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                       completion_window=window)  # type: ignore[arg-type]


async def test_openai_sdk_batch_end_to_end_answers_as_online(registry: RegistryClient, emulators: EmulatorFactory,
                                                             tmp_path: Path) -> None:
    async with served(registry, emulators, tmp_path) as pool:
        client = pool.client()
        lines = [request_line(i, max_tokens=4 + i % 5) for i in range(12)]
        data = jsonl(lines)
        uploaded = await client.files.create(file=("questions.jsonl", data), purpose="batch")
        assert uploaded.id.startswith("file-") and uploaded.bytes == len(data) and uploaded.purpose == "batch"
        assert (await client.files.retrieve(uploaded.id)).filename == "questions.jsonl"
        assert [f.id async for f in client.files.list()] == [uploaded.id]
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                            completion_window="24h", metadata={"eval": "arith"})
        assert batch.status == "validating" and batch.request_counts is not None
        assert batch.request_counts.total == 12 and batch.metadata == {"eval": "arith"} and batch.model == "emu-model"
        done = await until_final(client, batch.id)
        assert done.status == "completed", done
        counts = done.request_counts
        assert counts is not None and (counts.completed, counts.failed) == (12, 0)
        assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
        assert done.usage is not None and done.usage.output_tokens == sum(4 + i % 5 for i in range(12))
        outputs = await file_lines(client, done.output_file_id)
        assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(12)]  # line for line, input order
        for line, out in zip(lines, outputs, strict=True):
            assert out["error"] is None and out["response"]["status_code"] == 200 and out["id"].startswith("batch_req_")
            online = await client.completions.create(**line["body"])
            assert out["response"]["body"]["choices"][0]["text"] == online.choices[0].text
            assert out["response"]["body"]["model"] == "emu-model"
        output_file = await client.files.retrieve(done.output_file_id or "")
        assert output_file.purpose == "batch_output" and output_file.bytes > 0
        second = await submit(client, lines[:2])
        await until_final(client, second.id)
        assert [b.id async for b in client.batches.list(limit=1)] == [second.id, batch.id]  # newest first, paged
        page = await client.batches.list(limit=1)
        assert page.has_more and [b.id for b in page.data] == [second.id]
        deleted = await client.files.delete(uploaded.id)
        assert deleted.deleted and deleted.id == uploaded.id
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(uploaded.id)
        await client.close()


async def test_a_vllm_run_batch_file_as_it_is(registry: RegistryClient, emulators: EmulatorFactory,
                                              tmp_path: Path) -> None:
    """vLLM's own example input (chat, `max_completion_tokens`, its model's name) runs unchanged."""
    async with served(registry, emulators, tmp_path, model="meta-llama/Meta-Llama-3-8B-Instruct") as pool:
        client = pool.client()
        uploaded = await client.files.create(file=VLLM_FILE.open("rb"), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        done = await until_final(client, batch.id)
        assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 2
        outputs = await file_lines(client, done.output_file_id)
        assert [o["custom_id"] for o in outputs] == ["request-1", "request-2"]
        for out in outputs:
            body = out["response"]["body"]
            assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
            assert body["model"] == "meta-llama/Meta-Llama-3-8B-Instruct"
        await client.close()


GOOD = request_line(0)
BAD_FILES: list[tuple[str, bytes, int, str, int | None]] = [
    ("malformed line", jsonl([GOOD]) + b"{not json\n", 400, "invalid_json_line", 2),
    ("not an object", jsonl([GOOD]) + b"[1, 2]\n", 400, "invalid_json_line", 2),
    ("duplicate custom_id", jsonl([GOOD, request_line(1), GOOD]), 400, "duplicate_custom_id", 3),
    ("no custom_id", jsonl([GOOD, {**request_line(1), "custom_id": ""}]), 400, "invalid_custom_id", 2),
    ("not POST", jsonl([{**GOOD, "method": "GET"}]), 400, "invalid_method", 1),
    ("url not served", jsonl([GOOD, {**request_line(1), "url": "/v1/embeddings"}]), 400, "invalid_url", 2),
    ("two models", jsonl([GOOD, request_line(1, model="other")]), 400, "mismatched_model", 2),
    ("no prompt", jsonl([{**GOOD, "body": {"model": "emu-model"}}]), 400, "invalid_body", 1),
    ("a stream", jsonl([request_line(0, stream=True)]), 400, "invalid_body", 1),
    ("a mistyped field", jsonl([request_line(0, max_tokens="8")]), 400, "invalid_body", 1),  # type: ignore[arg-type]
    ("empty file", b"", 400, "empty_file", None),
    ("blank lines only", b"\n  \n", 400, "empty_file", None),
]
TOO_BIG = jsonl([request_line(i, prompt="x" * 1000) for i in range(100)])
BAD_FILES.append(("over the size limit", TOO_BIG, 413, "file_too_large", TOO_BIG[:MAX_FILE_BYTES].count(b"\n") + 1))


async def test_every_bad_input_is_refused_whole_naming_its_line(registry: RegistryClient,
                                                                emulators: EmulatorFactory, tmp_path: Path) -> None:
    async with served(registry, emulators, tmp_path) as pool:
        client = pool.client()
        for what, data, status, code, line in BAD_FILES:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.files.create(file=("bad.jsonl", data), purpose="batch")
            error = refused.value.body
            assert isinstance(error, dict) and refused.value.status_code == status, (what, error)
            assert error["code"] == code and error.get("line") == line, (what, error)
            assert set(error) >= {"message", "type", "param", "code"}
            if line is not None:
                assert f"line {line}:" in error["message"], (what, error)
        assert [f async for f in client.files.list()] == []  # nothing kept ...
        assert list((pool.batches_dir / "uploads").iterdir()) == []  # ... not even a partial upload
        with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
            await client.files.create(file=("x.jsonl", jsonl([GOOD])), purpose="fine-tune")

        for what, asked, (status, code, line, fragment) in await _bad_batches(client):
            with pytest.raises(openai.APIStatusError) as refused:
                await client.batches.create(**{"endpoint": "/v1/completions", "completion_window": "24h", **asked})
            error = refused.value.body
            assert isinstance(error, dict), what
            assert (refused.value.status_code, error["code"], error.get("line")) == (status, code, line), (what, error)
            assert fragment in error["message"], (what, error)
        assert [b async for b in client.batches.list()] == []  # no batch was created
        finished = await submit(client, [GOOD])
        await until_final(client, finished.id)
        with pytest.raises(openai.ConflictError, match="its status is 'completed'"):
            await client.batches.cancel(finished.id)
        for call in (client.batches.retrieve, client.batches.cancel):
            with pytest.raises(openai.NotFoundError, match="No such Batch object"):
                await call("batch_nosuchbatch")
        for file_call in (client.files.retrieve, client.files.content, client.files.delete):
            with pytest.raises(openai.NotFoundError, match="No such File object"):
                await file_call("file-nosuchfile")
        await client.close()


async def _bad_batches(client: openai.AsyncOpenAI) -> list[tuple[str, dict[str, Any], tuple[int, str, int | None,
                                                                                           str]]]:
    """Each bad batch: what it is, what creating it asks (its input uploaded), and what it is refused with: (status,
    code, line, a fragment of the message)."""
    cases: list[tuple[str, list[dict[str, Any]], dict[str, Any], tuple[int, str, int | None, str]]] = [
        ("endpoint not the lines' url", [request_line(0, endpoint="/v1/chat/completions")], {},
         (400, "mismatched_endpoint", 1, "is not the batch's endpoint /v1/completions")),
        ("one line's url not the endpoint", [GOOD, request_line(1), request_line(2, endpoint="/v1/chat/completions")],
         {}, (400, "mismatched_endpoint", 3, "url /v1/chat/completions")),
        ("model not served", [request_line(0, model="no-such-model")], {},
         (404, "model_not_found", 1, "`no-such-model` does not exist")),
        ("unknown file", [], {"input_file_id": "file-nosuchfile"}, (404, "file_not_found", None, "No such File")),
        ("endpoint not served", [GOOD], {"endpoint": "/v1/embeddings"},
         (400, "invalid_endpoint", None, "endpoint must be one of")),
        ("bad window", [GOOD], {"completion_window": "2 weeks"}, (400, "invalid_window", None, "completion_window")),
        ("bad metadata", [GOOD], {"metadata": {"k": 1}}, (400, "invalid_metadata", None, "metadata must be")),
    ]
    out = []
    for what, lines, asked, expected in cases:
        if lines:
            uploaded = await client.files.create(file=(f"{what}.jsonl", jsonl(lines)), purpose="batch")
            asked = {"input_file_id": uploaded.id, **asked}
        out.append((what, asked, expected))
    return out


async def test_keys_scope_files_and_batches(registry: RegistryClient, emulators: EmulatorFactory,
                                            tmp_path: Path) -> None:
    async with served(registry, emulators, tmp_path) as pool:
        a, b = pool.client(KEYS[0]), pool.client(KEYS[1])
        batch = await submit(a, [GOOD, request_line(1)])
        done = await until_final(a, batch.id)
        assert [f async for f in b.files.list()] == [] and [x async for x in b.batches.list()] == []
        theirs = [batch.input_file_id, done.output_file_id or ""]
        for file_id in theirs:
            for file_call in (b.files.retrieve, b.files.content, b.files.delete):
                with pytest.raises(openai.NotFoundError):
                    await file_call(file_id)
        for call in (b.batches.retrieve, b.batches.cancel):
            with pytest.raises(openai.NotFoundError):
                await call(batch.id)
        with pytest.raises(openai.NotFoundError):
            await b.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/completions",
                                   completion_window="24h")
        assert {f.id async for f in a.files.list()} == set(theirs)  # the owner still sees them all
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer sk-not-a-key-0123456"}):
                async with session.get(pool.url + "/v1/batches", headers=headers) as resp:
                    assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
        await a.close()
        await b.close()


async def test_cancel_stops_new_requests_and_keeps_finished_ones(registry: RegistryClient,
                                                                 emulators: EmulatorFactory, tmp_path: Path) -> None:
    async with served(registry, emulators, tmp_path, decode_s=0.05) as pool:  # a request: 8 tokens, ~0.4 s
        client = pool.client()
        batch = await submit(client, [request_line(i, max_tokens=8) for i in range(80)])

        async def some_done() -> bool:
            counts = (await client.batches.retrieve(batch.id)).request_counts
            return counts is not None and counts.completed >= 8

        await until(some_done, 60, "8 lines answered")
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
        ended = await until_final(client, batch.id)
        assert ended.status == "cancelled" and ended.cancelled_at and ended.request_counts is not None
        outputs = await file_lines(client, ended.output_file_id)
        errors = await file_lines(client, ended.error_file_id)
        assert len(outputs) == ended.request_counts.completed and 8 <= len(outputs) < 80
        assert all(e["response"] is None and e["error"]["code"] == "batch_cancelled" for e in errors)
        ids = Counter(line["custom_id"] for line in outputs + errors)
        assert ids == Counter(f"req-{i}" for i in range(80))  # every line once: answered, or not executed
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(batch.id)
        await client.close()


async def test_a_failed_line_goes_to_the_error_file_and_retries_are_the_gateways(
        registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path) -> None:
    """Servers that fail 30% of requests (retried elsewhere, as online) and one line the engine refuses (400, kept
    with the engine's message as the gateway would answer it): the batch completes with that one line failed."""
    async with served(registry, emulators, tmp_path, faults=Faults(error_rate=0.3)) as pool:
        client = pool.client()
        lines = [request_line(i) for i in range(20)]
        lines[7] = request_line(7, max_tokens=0)
        done = await until_final(client, (await submit(client, lines)).id)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (19, 1)
        errors = await file_lines(client, done.error_file_id)
        assert [e["custom_id"] for e in errors] == ["req-7"] and errors[0]["error"] is None
        refused = errors[0]["response"]
        assert refused["status_code"] == 400 and refused["body"]["error"]["code"] == "upstream_refused"
        assert "max_tokens must be at least 1" in refused["body"]["error"]["message"]
        assert len(await file_lines(client, done.output_file_id)) == 19
        assert pool.pool.dispatcher.stats().retries > 0
        await client.close()


async def test_the_window_is_estimated_at_submit_and_expiry_ends_the_rest(
        registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path) -> None:
    async with served(registry, emulators, tmp_path, decode_s=0.05) as pool:
        client = pool.client()
        first = await submit(client, [request_line(i, max_tokens=8) for i in range(8)])
        assert (first.model_extra or {})["fedpool"]["estimate"]["seconds"] is None  # nothing answered yet
        await until_final(client, first.id)
        lines = [request_line(i, max_tokens=8) for i in range(200)]
        roomy = await submit(client, lines, window="24h")
        assert roomy.model_extra is not None and roomy.model_extra["fedpool"]["estimate"]["meets_window"] is True
        await client.batches.cancel(roomy.id)
        tight = await submit(client, lines, window="2s")
        estimate = (tight.model_extra or {})["fedpool"]["estimate"]
        assert estimate["meets_window"] is False and estimate["seconds"] > 2
        assert "longer than its completion_window" in estimate["note"]
        ended = await until_final(client, tight.id)
        assert ended.status == "expired" and ended.expired_at and ended.request_counts is not None
        errors = await file_lines(client, ended.error_file_id)
        outputs = await file_lines(client, ended.output_file_id)
        assert {e["error"]["code"] for e in errors} == {"batch_expired"} and len(outputs) < 200
        assert sorted(line["custom_id"] for line in outputs + errors) == sorted(f"req-{i}" for i in range(200))
        await client.close()


async def test_a_short_batch_goes_before_a_long_one(registry: RegistryClient, emulators: EmulatorFactory,
                                                    tmp_path: Path) -> None:
    """A 24-line batch submitted while a 300-line one runs (8 slots, ~0.4 s a request): shortest first, its lines
    take the slots as they free (the long batch's youngest even give theirs back), so few of the long batch's end
    while it runs; in a fair share a third of the answers in that time would be the long batch's."""
    async with served(registry, emulators, tmp_path, decode_s=0.05) as pool:
        client = pool.client()
        long = await submit(client, [request_line(i, max_tokens=8) for i in range(300)])
        await until_final(client, long.id, statuses=("in_progress",))
        short = await submit(client, [request_line(1000 + i, max_tokens=8) for i in range(24)])
        long_at_short_start = (await client.batches.retrieve(long.id)).request_counts
        done = await until_final(client, short.id)
        long_at_short_end = (await client.batches.retrieve(long.id)).request_counts
        assert done.status == "completed" and long_at_short_start is not None and long_at_short_end is not None
        assert long_at_short_end.completed - long_at_short_start.completed < 16
        await client.batches.cancel(long.id)
        await until_final(client, long.id)
        await client.close()


async def test_an_online_reserve_leaves_a_server_to_online_callers_while_they_are_about(
        registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path) -> None:
    """`--online-reserve 1` on two like servers (emu-0 is held: ties go by id): while an online caller is about, a
    batch sends nothing to emu-0, so every request emu-0 answered is an online one; once online traffic has been
    gone longer than the reserve looks back, the next batch uses emu-0 too."""
    async with served(registry, emulators, tmp_path, decode_s=0.01, online_reserve=1) as pool:
        held, other = emulators.servers
        client = pool.client()

        async def online() -> str:
            raw = await client.completions.with_raw_response.create(model="emu-model", prompt="online", max_tokens=4)
            return raw.headers["X-Fedpool-Server"]

        assert GatewayOptions.model_fields["online_reserve"].default == ONLINE_RESERVE  # (the CLI's, the app's)
        reserve = pool.runner.reserve
        asked = InferenceRequest("asked", "emu-model", Endpoint.COMPLETIONS, prompt="online")
        assert reserve is not None and pool.gateway.steer == reserve.online
        answered = [await online()]
        assert reserve.online(asked) is None  # (no batch about: online requests go anywhere)
        batch = await submit(client, [request_line(i, max_tokens=8) for i in range(40)])
        steered = []
        while (await client.batches.retrieve(batch.id)).status not in FINAL:
            steered.append(reserve.online(asked))
            answered.append(await online())
        done = await until_final(client, batch.id)
        assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 40
        assert held.stats.completed == answered.count("emu-0") and other.stats.completed >= 40
        assert reserve.pins("emu-model") == ("emu-1",) and ("emu-0",) in steered  # online steered to the held one
        assert reserve.online(asked) is None  # (the batch is over)

        pool.runner.reserve = OnlineReserve(1, pool.pool.dispatcher, lambda: pool.pool.snapshot, about_s=0.2)
        await asyncio.sleep(0.5)  # (online traffic gone longer than the reserve's 0.2 s)
        assert pool.runner.reserve.pins("emu-model") is None
        before = held.stats.completed
        again = await until_final(client, (await submit(client, [request_line(100 + i) for i in range(40)])).id)
        assert again.status == "completed" and held.stats.completed > before
        await client.close()


async def test_a_batch_that_has_ended_is_no_online_caller_for_the_reserve(
        registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path) -> None:
    """With the reserve on and nobody online, batches use every server, and a batch that has ended (in the
    dispatcher's foreground again: it says nothing any more) does not make the next one leave a server free as if an
    online caller were about."""
    async with served(registry, emulators, tmp_path, decode_s=0.01, online_reserve=1) as pool:
        held, other = emulators.servers
        client = pool.client()
        first = await until_final(client, (await submit(client, [request_line(i, max_tokens=8) for i in range(40)])).id)
        assert first.status == "completed" and held.stats.completed > 0 and other.stats.completed > 0
        assert pool.runner.reserve is not None and pool.runner.reserve.pins("emu-model") is None
        assert not pool.pool.dispatcher.online_within(60.0)
        before = held.stats.completed
        second = await until_final(client, (await submit(client, [request_line(50 + i) for i in range(40)])).id)
        assert second.status == "completed" and held.stats.completed > before
        await client.close()


async def test_online_requests_past_the_held_servers_slots_spread_as_without_a_reserve(
        registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path) -> None:
    """While a batch runs, online requests go to the held server (emu-0) until it has as many of them in flight as
    it has slots (4); past that, the reserve names no server and online requests spread as they would without it."""
    async with served(registry, emulators, tmp_path, decode_s=0.02, online_reserve=1) as pool:
        client, reserve, ledger = pool.client(), pool.runner.reserve, pool.pool.dispatcher.ledger
        assert reserve is not None
        asked = InferenceRequest("asked", "emu-model", Endpoint.COMPLETIONS, prompt="online")
        await client.completions.create(model="emu-model", prompt="first", max_tokens=2)  # (online callers about)
        batch = await submit(client, [request_line(i, max_tokens=30) for i in range(60)])

        async def batch_about() -> bool:
            return reserve.online(asked) == ("emu-0",)

        await until(batch_about, 30, "the batch under way")
        async def ask(i: int) -> str:
            raw = await client.completions.with_raw_response.create(model="emu-model", prompt=f"online {i}",
                                                                    max_tokens=60)
            return raw.headers["X-Fedpool-Server"]

        online = [asyncio.create_task(ask(i)) for i in range(4)]

        async def held_full() -> bool:
            return ledger.on_server("emu-0") >= 4

        await until(held_full, 30, "four online requests in flight on the held server")
        assert reserve.online(asked) is None  # (past its slots: anywhere)
        assert {await task for task in online} == {"emu-0"}
        assert (await until_final(client, batch.id)).status == "completed"
        await client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_an_online_request_steered_to_a_failing_server_is_answered_by_another(
        registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path, stream: bool) -> None:
    """The online reserve steers online requests to the servers held for them (federation/gateway/state.py
    `Steer`); where the held server fails them (every answer a 500 here), the request goes once more to any server
    and is answered: a preference never costs an online caller an answer the pool could give."""
    async with served(registry, emulators, tmp_path) as pool:
        failing, other = emulators.servers
        failing.faults = Faults(error_rate=1.0)
        pool.gateway.steer = lambda request: ("emu-0",)
        client = pool.client()
        if stream:
            parts = [c.choices[0].text async for c in await client.completions.create(
                model="emu-model", prompt="online", max_tokens=5, stream=True) if c.choices]
            assert "".join(parts).strip()
        else:
            raw = await client.completions.with_raw_response.create(model="emu-model", prompt="online", max_tokens=5)
            assert raw.headers["X-Fedpool-Server"] == "emu-1" and raw.parse().choices[0].text.strip()
        assert failing.stats.requests_by_status.get("500", 0) >= 1 and failing.stats.completed == 0  # (tried there)
        assert other.stats.completed == 1
        await client.close()


@pytest.mark.slow
async def test_a_gateway_killed_mid_batch_resumes_with_each_custom_id_once(
        ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, emulators: EmulatorFactory,
        tmp_path: Path) -> None:
    state = tmp_path_factory.mktemp("batch-registry")
    registry = await RegistryClient.start(state, token=TEST_TOKEN, probe_interval_s=0.3, probe_timeout_s=1.0,
                                          check_timeout_s=3.0)
    try:
        for i in range(2):
            server = await emulators.start(max_running=4, decode_s=0.05, seed=i)
            await registry.register(ServerRecord(id=f"emu-{i}", url=server.url, engine=Engine.VLLM,
                                                 model="emu-model", accelerator="A100", capacity=4))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "tests.batch_gateway", "--state-dir", str(state), "--port", str(port),
                "--batches", str(tmp_path / "batches")]
        proc = await asyncio.to_thread(start, argv)
        try:
            await asyncio.to_thread(wait_http_up, url, proc, "batch gateway")
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            batch = await submit(client, [request_line(i, max_tokens=8) for i in range(60)])

            async def some_kept() -> bool:
                counts = (await client.batches.retrieve(batch.id)).request_counts
                return counts is not None and counts.completed >= 10

            await until(some_kept, 60, "10 lines kept")
            proc.kill()  # SIGKILL: nothing of the gateway's runs after this
            await asyncio.to_thread(proc.wait, 10)
            before = (await asyncio.to_thread(_counts_on_disk, tmp_path / "batches", batch.id))
            assert 10 <= before[0] < 60
            proc = await asyncio.to_thread(start, argv)
            await asyncio.to_thread(wait_http_up, url, proc, "batch gateway, restarted")
            done = await until_final(client, batch.id)
            assert done.status == "completed" and done.request_counts is not None
            assert (done.request_counts.total, done.request_counts.completed) == (60, 60)
            outputs = await file_lines(client, done.output_file_id)
            assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(60)]  # each once, none lost
            assert done.error_file_id is None
            await client.close()
        finally:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
    finally:
        await registry.terminate()


def start(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _counts_on_disk(root: Path, batch_id: str) -> tuple[int, int]:
    """(completed, failed) of a batch as its store kept them."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(root / "batches.sqlite")) as db:
        row = db.execute("SELECT completed, failed FROM batches WHERE id = ?", (batch_id,)).fetchone()
    return int(row[0]), int(row[1])


def test_the_store_keeps_each_lines_first_result_once_and_finalizes_again_the_same(tmp_path: Path) -> None:
    """A line run again after a restart keeps its first result and is counted once; finalizing writes the files in
    input order, lines never run in the error file as not executed, and a second finalize (a restart while
    finalizing) is refused by the status it no longer has, leaving the files as they were."""
    from fedpool.federation.gateway.batchstore import BatchStore, LineResult, scan_input

    store = BatchStore(tmp_path / "batches")
    received = store.upload_path()
    received.write_bytes(jsonl([request_line(i) for i in range(4)]))
    summary = scan_input(received, 100)
    source = store.add_file("team-a", "in.jsonl", "batch", received, summary, 1_000.0)
    batch = store.create_batch("team-a", source, "/v1/completions", ("24h", 86_400.0), None, None, 1_000.0)
    assert store.set_status(batch.id, "in_progress", 1_001.0, ("validating",))
    assert store.record(batch.id, [LineResult(3, "req-2", True, '{"first": true}', 5, 7)]) == 1
    assert store.record(batch.id, [LineResult(3, "req-2", True, '{"again": true}', 5, 7),
                                   LineResult(1, "req-0", False, '{"failed": true}')]) == 1
    kept = store.batch(batch.id, "team-a")
    assert kept is not None and (kept.completed, kept.failed, kept.left, kept.output_tokens) == (1, 1, 2, 7)
    assert store.done_lines(batch.id) == {1, 3}
    assert store.set_status(batch.id, "cancelling", 1_002.0, ("in_progress",))
    assert store.finalize(batch.id, "cancelled", 1_003.0, ("cancelling",))
    assert not store.finalize(batch.id, "cancelled", 1_004.0, ("cancelling",))
    ended = store.batch(batch.id, None)
    assert ended is not None and ended.status == "cancelled" and ended.cancelled_at == 1_003
    output = store.file_path(ended.output_file_id).read_text().splitlines()
    errors = [json.loads(line) for line in store.file_path(ended.error_file_id).read_text().splitlines()]
    assert output == ['{"first": true}']
    assert [e.get("custom_id", "req-0") for e in errors] == ["req-0", "req-1", "req-3"]
    assert [e.get("error", {}).get("code") for e in errors[1:]] == ["batch_cancelled", "batch_cancelled"]
    assert store.batch(batch.id, "team-b") is None and store.file(source.id, "team-b") is None
    assert [f.id for f in store.files("team-a", purpose="batch_output")[0]] == [ended.error_file_id,
                                                                              ended.output_file_id]
