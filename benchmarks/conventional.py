"""The conventional baseline: each eval drives its own server(s) from its own process, in static batches.

This is the comparison the speedup benchmark measures fedpool against, rendered as the evaluation
frameworks run (docs/speedup.md cites the code paths):

- **Split GPUs.** The eval only talks to the servers it was given. With several, the samples are split
  into contiguous shards, one per server, each run independently (lm-eval-harness's vLLM backend with
  `data_parallel_size`: one engine per shard).
- **Static batches.** Each shard is sent in batches of `batch_size` requests at once; the next batch
  starts only when the slowest request of the current one has answered (lm-eval's `generate_until`
  hands a chunk of `batch_size` requests to the engine and waits for all of them).
- **Loading before each batch.** The batch's items are read and decoded in the eval's own process just
  before the batch is sent (lmms-eval's dataset `__getitem__` / `doc_to_visual` per batch), and the
  GPU waits meanwhile.
- **Scoring after inference.** Post-processing, metrics and the verifier run once every answer is in
  (lm-eval's evaluator computes `process_results` after all requests), serially in the same process.

Requests are byte-for-byte the ones fedpool's eval client sends (same prompts, generation settings and
record format), so the two arms' artifacts can be compared record by record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from fedpool.federation import AttemptError, Endpoint, InferenceRequest, Timeouts, post_completion
from fedpool.pipeline import (
    ArtifactWriter,
    BenchmarkSpec,
    Provenance,
    Record,
    Sample,
    finish_record,
    load_samples,
    read_records,
    request_body,
    summarize_records,
)
from fedpool.pipeline.stages import StageCosts, spend_inline
from fedpool.pipeline.verifier import VerifierConfig, VerifierWorker, judge_item, with_judgment


@dataclass(frozen=True, slots=True)
class BaselineServer:
    id: str
    url: str
    engine: str = "unknown"
    accelerator: str | None = None


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


def shards(samples: Sequence[Sample], parts: int) -> list[list[Sample]]:
    """Contiguous, nearly equal shards, as data-parallel evaluation splits its documents."""
    size, extra = divmod(len(samples), parts)
    out, start = [], 0
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
        batch_size: int = 8,
        costs: StageCosts | None = None,
        time_scale: float = 1.0,
        timeouts: Timeouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        samples: Sequence[Sample] | None = None,
        verifier: VerifierConfig | None = None,
    ):
        if not servers:
            raise ValueError(f"conventional eval {spec.name!r} needs at least one server")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if spec.verifier and verifier is None:
            raise ValueError(f"benchmark {spec.name!r} asks for the verifier; pass a VerifierConfig")
        self.spec = spec
        self.servers = tuple(servers)
        self.model = model
        self.out_dir = out_dir / spec.name
        self.batch_size = batch_size
        self.costs = costs or StageCosts()
        self.time_scale = time_scale
        self.timeouts = timeouts or Timeouts()
        self._clock = clock
        self._samples = list(samples) if samples is not None else None
        self.batches: list[BatchTrace] = []
        self._verifier = verifier if spec.verifier else None

    async def run(self, session: aiohttp.ClientSession) -> BaselineResult:
        started = self._clock()
        samples = self._samples if self._samples is not None else await asyncio.to_thread(load_samples, self.spec)
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
                                           "mode": "conventional", "batch_size": self.batch_size}
        )
        # This process's own judge, loaded now and run on one answer after another (a thread, so the other
        # evals' processes, rendered as tasks here, are not held up).
        judge = await asyncio.to_thread(VerifierWorker, self._verifier.model_dump()) if self._verifier else None
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
                                    error_kind=exc.kind.value, completed_at=time.time())
        return completion.text, Provenance(
            server_id=server.id, engine=server.engine, accelerator=server.accelerator, model=self.model, attempts=1,
            latency_s=self._clock() - start, prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens, finish_reason=completion.finish_reason,
            completed_at=time.time(),
        )
