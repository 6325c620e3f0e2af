"""The conventional baselines: each eval drives its own server(s) from its own process, as the evaluation
frameworks do it. Three client modes, each rendering a real tool's code path (docs/speedup.md quotes them):

- **static** — lmms-eval 0.5's OpenAI-compatible client (`models/chat/openai_compatible.py`,
  `generate_until`): batches of `batch_size`; each batch's payloads are built one after another in the eval's
  process (media decoded then), sent at once, and the next batch starts only when the slowest answer of
  this one is in.
- **sliding** — lm-evaluation-harness's API client (`models/api_models.py`, `TemplateAPI` with
  `num_concurrent=C`): every request is built first (`build_all_requests`; media encoded up front), then one
  task per request with a semaphore of C: C in flight, refilled as each answers (also lmms-eval's async
  client and inspect_ai's `max_connections`). C defaults to the server's capacity.
- **whole** — lm-evaluation-harness's vLLM backend (`models/vllm_causallms.py`, `batch_size=auto`): every
  request built first and all handed to the engine at once (one `generate` call).

In every mode the eval only talks to the servers it was given; with several, its samples are split into
contiguous shards, one per server (data-parallel evaluation), each run independently. Post-processing,
metrics and the judge run once every answer is in, serially, in the eval's own process (lm-eval's
`process_results` after all requests). The judge is loaded before the clock starts (warm), as in the
federated arm. Requests are byte-for-byte the ones fedpool's eval client sends, so the arms' artifacts can be
compared record by record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import aiohttp

from fedpool.benchmarks.costs import StageCosts, spend_inline
from fedpool.federation import AttemptError, Endpoint, InferenceRequest, Timeouts, post_completion
from fedpool.pipeline import (
    ArtifactWriter,
    BenchmarkSpec,
    ErrorKind,
    Provenance,
    Record,
    Sample,
    finish_record,
    load_samples,
    read_records,
    request_body,
    summarize_records,
)
from fedpool.pipeline.verifier import VerifierWorker, judge_item, with_judgment

ClientMode = Literal["static", "sliding", "whole"]
CLIENT_MODES: tuple[ClientMode, ...] = ("static", "sliding", "whole")


@dataclass(frozen=True, slots=True)
class BaselineServer:
    id: str
    url: str
    engine: str = "unknown"
    accelerator: str | None = None
    capacity: int = 8  # the engine's concurrent sequences: the sliding window's default


@dataclass(frozen=True, slots=True)
class BatchTrace:
    """One static batch: when loading began, when it was sent, when its slowest answer came back."""

    server_id: str
    size: int
    load_start: float
    sent: float
    done: float


@dataclass
class BaselineResult:
    benchmark: str
    wall_time_s: float
    inference_s: float  # first request sent → last answer in
    scoring_s: float  # metrics and verifier after inference
    records: int
    failed: int
    summary: dict[str, object]
    batches: list[BatchTrace] = field(default_factory=list)
    artifact_dir: Path | None = None


ItemT = TypeVar("ItemT")


def shards(samples: Sequence[ItemT], parts: int) -> list[list[ItemT]]:
    """Contiguous, nearly equal shards, as data-parallel evaluation splits its documents."""
    size, extra = divmod(len(samples), parts)
    out: list[list[ItemT]] = []
    start = 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(list(samples[start:end]))
        start = end
    return out


class ConventionalEval:
    """`result = await ConventionalEval(spec, servers, model=..., out_dir=...).run(session)`."""

    def __init__(
        self,
        spec: BenchmarkSpec,
        servers: Sequence[BaselineServer],
        *,
        model: str,
        out_dir: Path,
        mode: ClientMode = "static",
        batch_size: int = 8,
        window: int | None = None,
        costs: StageCosts | None = None,
        time_scale: float = 1.0,
        timeouts: Timeouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        samples: Sequence[Sample] | None = None,
        judge: VerifierWorker | None = None,
    ):
        if not servers:
            raise ValueError(f"conventional eval {spec.name!r} needs at least one server")
        if mode not in CLIENT_MODES:
            raise ValueError(f"client mode must be one of {', '.join(CLIENT_MODES)}, not {mode!r}")
        if batch_size < 1 or (window is not None and window < 1):
            raise ValueError("batch_size and window must be at least 1")
        if spec.verifier and judge is None:
            raise ValueError(f"benchmark {spec.name!r} asks for the verifier; pass its (loaded) judge")
        self.spec = spec
        self.servers = tuple(servers)
        self.model = model
        self.out_dir = out_dir / spec.name
        self.mode = mode
        self.batch_size = batch_size
        self.window = window
        self.costs = costs or StageCosts()
        self.time_scale = time_scale
        self.timeouts = timeouts or Timeouts()
        self._clock = clock
        self._samples = list(samples) if samples is not None else None
        self.batches: list[BatchTrace] = []
        self._judge = judge if spec.verifier else None

    async def run(self, session: aiohttp.ClientSession) -> BaselineResult:
        started = self._clock()
        samples = self._samples if self._samples is not None else await asyncio.to_thread(load_samples, self.spec)
        if self.mode != "static":  # every request built before the first is sent (build_all_requests)
            for _ in samples:
                await spend_inline(self.costs.load_s, self.time_scale)
        parts = shards(samples, len(self.servers))
        answers: dict[str, tuple[Sample, str | None, Provenance]] = {}
        first_sent: list[float] = []
        results = await asyncio.gather(*(
            self._run_shard(session, server, part, first_sent) for server, part in zip(self.servers, parts, strict=True)
        ))
        for shard_answers in results:
            answers.update(shard_answers)
        inference_end = self._clock()
        # Scoring after inference, serially, in this process.
        writer = await asyncio.to_thread(
            ArtifactWriter, self.out_dir, {"benchmark": self.spec.model_dump(mode="json"), "model": self.model,
                                           "mode": f"conventional-{self.mode}", "batch_size": self.batch_size,
                                           "window": self.window}
        )
        # This process's own judge (loaded before the clock), on one answer after another (a thread, so the other
        # evals' processes, rendered as tasks here, are not held up).
        judge = self._judge
        failed = 0
        for sample in samples:
            sample_, text, prov = answers[sample.sample_id]
            await spend_inline(self.costs.metric_s + self.costs.verify_s, self.time_scale)
            record: Record = finish_record(self.spec, sample_, text, prov)
            if judge is not None and not record.failed:
                try:
                    (judgment,) = await asyncio.to_thread(judge.judge, [judge_item(record)])
                except Exception:  # a broken judge must not lose the record: it is written unjudged
                    judgment = None
                record = with_judgment(record, judgment)
            failed += record.failed
            writer.write(record)
        await asyncio.to_thread(writer.close)
        records = await asyncio.to_thread(read_records, writer.path)
        summary = summarize_records(self.spec, records)
        end = self._clock()
        return BaselineResult(
            self.spec.name, end - started, inference_end - (min(first_sent) if first_sent else started),
            end - inference_end, len(records), failed, summary, list(self.batches), self.out_dir,
        )

    async def _run_shard(
        self, session: aiohttp.ClientSession, server: BaselineServer, part: list[Sample], first_sent: list[float]
    ) -> dict[str, tuple[Sample, str | None, Provenance]]:
        if self.mode == "static":
            return await self._static(session, server, part, first_sent)
        # sliding: C in flight, refilled as each answers; whole: everything at once
        limit = asyncio.Semaphore(self.window or server.capacity) if self.mode == "sliding" else None
        first_sent.append(self._clock())

        async def one(sample: Sample) -> tuple[Sample, str | None, Provenance]:
            if limit is None:
                return (sample, *await self._send(session, server, sample))
            async with limit:
                return (sample, *await self._send(session, server, sample))

        answered = await asyncio.gather(*(one(s) for s in part))
        self.batches.append(BatchTrace(server.id, len(part), first_sent[-1], first_sent[-1], self._clock()))
        return {sample.sample_id: (sample, text, prov) for sample, text, prov in answered}

    async def _static(
        self, session: aiohttp.ClientSession, server: BaselineServer, part: list[Sample], first_sent: list[float]
    ) -> dict[str, tuple[Sample, str | None, Provenance]]:
        out: dict[str, tuple[Sample, str | None, Provenance]] = {}
        for start in range(0, len(part), self.batch_size):
            batch = part[start:start + self.batch_size]
            load_start = self._clock()
            for _ in batch:  # read and decode each item of the batch, one after another
                await spend_inline(self.costs.load_s, self.time_scale)
            sent = self._clock()
            first_sent.append(sent)
            answered = await asyncio.gather(*(self._send(session, server, s) for s in batch))
            self.batches.append(BatchTrace(server.id, len(batch), load_start, sent, self._clock()))
            for sample, (text, prov) in zip(batch, answered, strict=True):
                out[sample.sample_id] = (sample, text, prov)
        return out

    async def _send(
        self, session: aiohttp.ClientSession, server: BaselineServer, sample: Sample
    ) -> tuple[str | None, Provenance]:
        request = InferenceRequest.from_body(
            request_body(self.spec, sample),
            request_id=f"{self.spec.name}/{sample.sample_id}",
            model=self.model,
            endpoint=Endpoint.COMPLETIONS if self.spec.prompt.style == "completion" else Endpoint.CHAT,
            client_id=self.spec.name,
        )
        start = self._clock()
        try:
            completion = await post_completion(session, server.url, request, self.timeouts)
        except AttemptError as exc:  # no retries elsewhere: this eval has no other server
            return None, Provenance(server_id=server.id, model=self.model, attempts=1, error=str(exc),
                                    error_kind=ErrorKind(exc.kind.value), completed_at=time.time())
        return completion.text, Provenance(
            server_id=server.id, engine=server.engine, accelerator=server.accelerator, model=self.model, attempts=1,
            latency_s=self._clock() - start, prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens, finish_reason=completion.finish_reason,
            completed_at=time.time(),
        )
