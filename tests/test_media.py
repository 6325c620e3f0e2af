"""Multimodal content parts: files read and encoded (on Ray CPU actors) into OpenAI content parts, the
modality fields kept in the record, bad files failing their own record with the culprit named."""

from __future__ import annotations

import base64
import json
import struct
import wave
import zlib
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fedpool.clients import EvalTarget, run_evals
from fedpool.federation import PoolConnection
from fedpool.pipeline import SpecError, load_samples, load_spec, request_body
from fedpool.pipeline.errors import DataError
from fedpool.pipeline.media import MediaPool, encode_in_thread, encode_sample, sample_indices
from fedpool.pipeline.spec import MediaSpec
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import read_jsonl


def png(width: int = 2, height: int = 2) -> bytes:
    """A valid RGB PNG, written by hand (no imaging library needed)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def write_wav(path: Path, rate: int = 16000) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\x00\x00" * (rate // 10))


SPEC = """\
name: mm
data: {path: data.jsonl}
prompt:
  style: chat
  template: "{question}"
  media:
    - {field: image, type: image}
    - {field: clip, type: audio}
    - {field: video, type: video, num_frames: 4}
generation: {max_tokens: 4}
metrics: [exact_match]
"""


def make_dataset(tmp_path: Path, rows: int = 6) -> Path:
    (tmp_path / "img.png").write_bytes(png())
    write_wav(tmp_path / "clip.wav")
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(10):
        (frames / f"{i:03d}.png").write_bytes(png(1 + i, 1))
    lines = [{"id": i, "question": f"what is shown {i}?", "answer": "red", "image": "img.png", "clip": "clip.wav",
              "video": "frames"} for i in range(rows)]
    lines[-1]["image"] = "missing.png"  # one bad row: its record fails, naming the file; the others go on
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "spec.yaml").write_text(SPEC)
    return tmp_path / "spec.yaml"


def test_frame_sampling() -> None:
    assert sample_indices(10, 4, "uniform") == [1, 3, 6, 8]
    assert sample_indices(10, 4, "first") == [0, 1, 2, 3]
    assert sample_indices(3, 8, "uniform") == [0, 1, 2]


def test_encoding_each_modality(tmp_path: Path) -> None:
    spec = load_spec(make_dataset(tmp_path))
    sample = load_samples(spec)[0]
    encoded = encode_sample(spec.prompt.media, sample.fields, tmp_path, sample.sample_id)
    image, audio, *frames = encoded.request_parts
    assert image["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(png()).decode()
    assert audio["input_audio"]["format"] == "wav"
    assert base64.b64decode(audio["input_audio"]["data"]) == (tmp_path / "clip.wav").read_bytes()
    assert len(frames) == 4 and frames[0]["image_url"]["url"].endswith(base64.b64encode(png(2, 1)).decode())
    kinds = [(p.type, p.value) for p in encoded.record_parts]
    assert kinds == [("image", "img.png"), ("audio", "clip.wav"), ("video", "frames")]
    assert encoded.record_parts[1].sampling_rate == 16000  # type: ignore[union-attr]
    assert encoded.record_parts[2].num_frames == 4 and encoded.record_parts[2].sampling_strategy == "uniform"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [("gone.png", None, "does not exist"), ("fake.png", b"GIF89a....", "not a image/png file"),
     ("pic.bmp", b"BM", "unsupported image type")],
)
def test_bad_image_files_are_named(tmp_path: Path, name: str, content: bytes | None, fragment: str) -> None:
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError) as err:
        encode_sample([MediaSpec(field="image", type="image")], {"image": name}, tmp_path, "s1")
    assert name in str(err.value) and "'s1'" in str(err.value) and fragment in str(err.value)


def test_media_spec_errors(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text('{"id": 1, "question": "q", "answer": "a", "image": "x.png"}\n')
    bad = [
        (SPEC.replace("style: chat", "style: completion"), "need style: chat"),
        (SPEC.replace("{field: image, type: image}", "{field: image, type: image, num_frames: 2}"),
         "num_frames applies to video only"),
        (SPEC.replace("{field: image, type: image}", "{field: answer, type: image}"), "sends the label field"),
    ]
    for text, fragment in bad:
        (tmp_path / "spec.yaml").write_text(text)
        with pytest.raises(SpecError, match=fragment):
            load_spec(tmp_path / "spec.yaml")


async def test_request_body_carries_the_encoded_parts(tmp_path: Path) -> None:
    spec = load_spec(make_dataset(tmp_path))
    (sample,) = await encode_in_thread(spec, load_samples(spec)[:1])
    body = request_body(spec, sample)
    content = body["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "what is shown 0?"}
    assert [p["type"] for p in content[1:]] == ["image_url", "input_audio"] + ["image_url"] * 4
    with pytest.raises(ValueError, match="media not encoded"):
        request_body(spec, load_samples(spec)[0])


class CaptureServer:
    """A minimal OpenAI-compatible server on 127.0.0.1 that keeps every chat body it receives."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "mm-model", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        return web.json_response({"id": "x", "object": "chat.completion", "model": "mm-model", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "red"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}})


@pytest.mark.ray
async def test_media_encoded_on_actors_reaches_the_server_and_the_record(
    registry: RegistryClient, tmp_path: Path
) -> None:
    (tmp_path / "data").mkdir()
    spec = load_spec(make_dataset(tmp_path / "data"))
    server = CaptureServer()
    await server.start()
    media = MediaPool(1, num_cpus=0.25)
    try:
        await registry.register(ServerRecord(id="cap", url=server.url, engine=Engine.OPENAI, model="mm-model"))
        await media.ready()
        async with PoolConnection(registry, policy="least_inflight") as pool:
            (summary,) = await run_evals([spec], pool.dispatcher, tmp_path / "out", EvalTarget(model="mm-model"),
                                         concurrency=4, media=media)
    finally:
        media.shutdown()
        await server.stop()
    records = read_jsonl(summary.artifact_dir / "records.jsonl")
    assert len(records) == 6 and len({r["sample_id"] for r in records}) == 6
    failed = [r for r in records if r["provenance"]["error"]]
    assert len(failed) == 1 and "missing.png" in failed[0]["provenance"]["error"]
    assert failed[0]["provenance"]["error_kind"] == "data"
    assert len(server.bodies) == 5  # the bad sample never went out
    for body in server.bodies:
        parts = body["messages"][-1]["content"]
        assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
        assert parts[2]["input_audio"]["format"] == "wav" and len(parts) == 7
    good = next(r for r in records if not r["provenance"]["error"])
    user = good["messages"][-1]["content"]
    assert [p["type"] for p in user] == ["text", "image", "audio", "video"]
    assert user[3]["num_frames"] == 4 and user[2]["sampling_rate"] == 16000
    assert "base64" not in json.dumps(good)  # the record keeps paths, never the encoded bytes
    assert summary.summary["failed"] == 1 and summary.summary["scores"][0]["value"] == pytest.approx(500 / 6)
