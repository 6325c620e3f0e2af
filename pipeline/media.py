"""Multimodal content parts: image, audio and video files of a sample read and encoded into what
OpenAI-compatible servers accept (image_url data URLs, input_audio), with the modality fields of the
OmniEvaluator schema (sampling rate, number of frames, sampling strategy) kept in the record.

Encoding is CPU work (reading, base64, frame sampling); `MediaPool` runs it on Ray CPU actors, a chunk of
samples per call, ahead of the requests. Videos are given as a directory of frame images (sorted by name)
or as a video file, which needs OpenCV (`pip install opencv-python-headless`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import wave
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedpool.pipeline.actors import cpu_actor_options
from fedpool.pipeline.errors import DataError
from fedpool.pipeline.loaders import Sample
from fedpool.pipeline.schema import AudioPart, ContentPart, ImagePart, VideoPart
from fedpool.pipeline.spec import BenchmarkSpec, MediaSpec

MAX_MEDIA_BYTES = 20 * 1024 * 1024  # per file (per frame for frame directories)
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
               ".webp": "image/webp"}
AUDIO_FORMATS = {".wav": "wav", ".mp3": "mp3"}
_MAGIC = {"image/png": (b"\x89PNG\r\n\x1a\n",), "image/jpeg": (b"\xff\xd8\xff",), "image/gif": (b"GIF87a", b"GIF89a"),
          "image/webp": (b"RIFF",)}


@dataclass(frozen=True, slots=True)
class EncodedMedia:
    """One sample's media: the parts for the request body, and the parts the record keeps (paths and
    modality fields, never the bytes)."""

    request_parts: tuple[dict[str, Any], ...]
    record_parts: tuple[ContentPart, ...]
    error: str | None = None  # the sample's media could not be read: its record is written as failed


def _read(path: Path, sample_id: str, what: str) -> bytes:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(str(path), None, f"sample {sample_id!r}: {what} file does not exist") from None
    if size > MAX_MEDIA_BYTES:
        raise DataError(str(path), None, f"sample {sample_id!r}: {what} is {size} bytes, over the "
                        f"{MAX_MEDIA_BYTES // (1024 * 1024)} MiB limit")
    return path.read_bytes()


def _image_url(path: Path, sample_id: str) -> dict[str, Any]:
    mime = IMAGE_TYPES.get(path.suffix.lower())
    if mime is None:
        raise DataError(str(path), None, f"sample {sample_id!r}: unsupported image type {path.suffix!r} "
                        f"(use {', '.join(sorted(IMAGE_TYPES))})")
    data = _read(path, sample_id, "image")
    if not data.startswith(_MAGIC[mime]) or (mime == "image/webp" and data[8:12] != b"WEBP"):
        raise DataError(str(path), None, f"sample {sample_id!r}: not a {mime} file (its bytes say otherwise)")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def _audio(path: Path, sample_id: str) -> tuple[dict[str, Any], int | None]:
    fmt = AUDIO_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(str(path), None, f"sample {sample_id!r}: unsupported audio type {path.suffix!r} "
                        f"(use {', '.join(sorted(AUDIO_FORMATS))})")
    data = _read(path, sample_id, "audio")
    rate = None
    if fmt == "wav":
        try:
            with wave.open(io.BytesIO(data)) as wav:
                rate = wav.getframerate()
        except (wave.Error, EOFError) as exc:
            raise DataError(str(path), None, f"sample {sample_id!r}: not a readable WAV file ({exc})") from None
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}
    return part, rate


def sample_indices(total: int, wanted: int, strategy: str) -> list[int]:
    """Which of `total` frames to keep: `uniform` spreads `wanted` over the whole clip (the middle of each
    of `wanted` equal segments), `first` takes the first ones."""
    if total <= 0:
        return []
    if wanted >= total:
        return list(range(total))
    if strategy == "first":
        return list(range(wanted))
    return [min(total - 1, int((i + 0.5) * total / wanted)) for i in range(wanted)]


def _video(path: Path, media: MediaSpec, sample_id: str) -> list[dict[str, Any]]:
    wanted = media.num_frames or 8
    if path.is_dir():
        frames = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_TYPES)
        if not frames:
            raise DataError(str(path), None, f"sample {sample_id!r}: video directory has no frame images")
        return [_image_url(frames[i], sample_id) for i in sample_indices(len(frames), wanted, media.sampling)]
    if not path.exists():
        raise DataError(str(path), None, f"sample {sample_id!r}: video does not exist")
    try:
        # OpenCV is optional (not a dependency): its module and stubs exist only where a user installed it.
        import cv2  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise DataError(str(path), None, f"sample {sample_id!r}: video files need OpenCV (pip install "
                        "opencv-python-headless), or give a directory of frame images") from None
    capture = cv2.VideoCapture(str(path))
    try:
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        parts = []
        for index in sample_indices(total, wanted, media.sampling):
            capture.set(cv2.CAP_PROP_POS_FRAMES, index)
            ok, frame = capture.read()
            if not ok:
                raise DataError(str(path), None, f"sample {sample_id!r}: cannot decode frame {index}")
            ok, png = cv2.imencode(".png", frame)
            parts.append({"type": "image_url",
                          "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.tobytes()).decode()}})
    finally:
        capture.release()
    if not parts:
        raise DataError(str(path), None, f"sample {sample_id!r}: video has no decodable frames")
    return parts


def encode_sample(media: Sequence[MediaSpec], fields: dict[str, Any], base_dir: Path, sample_id: str) -> EncodedMedia:
    """Every media field of one sample; paths are relative to the data file's directory."""
    request: list[dict[str, Any]] = []
    record: list[ContentPart] = []
    for item in media:
        raw = fields.get(item.field)
        if not isinstance(raw, str) or not raw:
            raise DataError(str(base_dir), None, f"sample {sample_id!r}: media field {item.field!r} must be a path")
        path = Path(raw) if Path(raw).is_absolute() else base_dir / raw
        if item.type == "image":
            request.append(_image_url(path, sample_id))
            record.append(ImagePart(value=raw))
        elif item.type == "audio":
            part, rate = _audio(path, sample_id)
            request.append(part)
            record.append(AudioPart(value=raw, sampling_rate=rate))
        else:
            frames = _video(path, item, sample_id)
            request.extend(frames)
            record.append(VideoPart(value=raw, num_frames=len(frames), sampling_strategy=item.sampling))
    return EncodedMedia(tuple(request), tuple(record))


def encode_samples(spec_json: dict[str, Any], samples: Sequence[Sample]) -> list[Sample]:
    """A chunk of samples with their media attached (what one actor call does)."""
    spec = BenchmarkSpec.model_validate(spec_json)
    base = spec.data_path().parent if not spec.data_path().is_dir() else spec.data_path()
    out = []
    for sample in samples:
        try:
            media = encode_sample(spec.prompt.media, sample.fields, base, sample.sample_id)
        except DataError as exc:  # one bad file fails its own record, not the chunk or the run
            media = EncodedMedia((), (), error=str(exc))
        out.append(replace(sample, media=media))
    return out


class MediaWorker:
    """A Ray CPU actor that encodes chunks of samples."""

    def ready(self) -> bool:
        return True

    def encode(self, spec_json: dict[str, Any], samples: list[Sample]) -> list[Sample]:
        return encode_samples(spec_json, samples)


class MediaPool:
    """N Ray CPU actors encoding media; each chunk goes to the actor with the fewest chunks in flight."""

    def __init__(self, actors: int = 1, *, num_cpus: float = 1.0):
        import ray

        remote = ray.remote(MediaWorker).options(**cpu_actor_options(num_cpus))
        # Ray's handles are not typed for .remote
        self._actors: list[Any] = [remote.remote() for _ in range(max(1, actors))]
        self._busy = [0] * len(self._actors)

    async def ready(self) -> None:
        await asyncio.gather(*(a.ready.remote() for a in self._actors))

    async def encode(self, spec: BenchmarkSpec, samples: list[Sample]) -> list[Sample]:
        index = min(range(len(self._actors)), key=self._busy.__getitem__)
        self._busy[index] += 1
        try:
            return list(await self._actors[index].encode.remote(_spec_json(spec), samples))
        finally:
            self._busy[index] -= 1

    def shutdown(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors.clear()


async def encode_in_thread(spec: BenchmarkSpec, samples: list[Sample]) -> list[Sample]:
    """Without a pool: the same encoding in a worker thread, off the event loop."""
    return await asyncio.to_thread(encode_samples, _spec_json(spec), samples)


def _spec_json(spec: BenchmarkSpec) -> dict[str, Any]:
    data = spec.model_dump(mode="json")
    data["data"]["path"] = str(spec.data_path().resolve())  # actors may run in another working directory
    return data
