"""One benchmark run: samples → requests through the shared dispatcher → records in the artifact."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedpool.clients.delegate import Sender
from fedpool.federation import (
    Attempt,
    Endpoint,
    FailureKind,
    InferenceRequest,
    InferenceResult,
    NoServerError,
    RequestFailed,
)
from fedpool.pipeline import (
    ArtifactWriter,
    AttemptInfo,
    BenchmarkSpec,
    ErrorKind,
    Provenance,
    Record,
    Sample,
    dataset_sha256,
    finish_record,
    load_samples,
    package_versions,
    render,
    request_body,
    summarize_records,
    unique_records,
)
from fedpool.pipeline.media import MediaPool, encode_in_thread
from fedpool.pipeline.postprocess import OPTION_LETTERS
from fedpool.pipeline.stages import StageHooks, StagePool
from fedpool.pipeline.verifier import VerifierPool, judge_item, judge_prompt_words, with_judgment

log = logging.getLogger("fedpool.client")
# Said in the record of a request the engine refused as it is (HTTP 400/413/422): it is not retried, and sent again
# it is refused again.
REFUSED_AS_IS = ("; deterministic: the same request is refused the same way, so resume will not help (change the "
                 "spec or the pool: a prompt over the servers' context, say, needs `fedpool up --ctx-per-slot`)")

# A summary of fewer records is computed on a thread of the eval's process: it costs less than starting the
# actor (a Ray worker process), and the eval processes' CPU is taken from engines that share it.
SUMMARY_ON_ACTORS_FROM = 2_000


@dataclass(frozen=True, slots=True)
class EvalTarget:
    """Which model the eval measures, and optionally where it may run (for strict reproducibility)."""

    model: str
    revision: str | None = None
    pinned_engines: tuple[str, ...] | None = None
    pinned_servers: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class EvalProgress:
    benchmark: str
    total: int
    done: int
    failed: int
    retried: int
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class EvalSummary:
    benchmark: str
    artifact_dir: Path
    summary: dict[str, Any]
    wall_time_s: float
    resumed: int = 0
    written: int = 0


class StartLine:
    """Where evals started together wait for each other before sending (see EvalRun.run)."""

    def __init__(self, evals: int):
        self._left = evals
        self._open = asyncio.Event()
        if evals <= 0:
            self._open.set()

    def arrive(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self._open.set()

    async def wait(self) -> None:
        await self._open.wait()


@dataclass
class _Counters:
    done: int = 0
    answered: int = 0  # samples whose request has its outcome (answered or failed), recorded or not yet
    failed: int = 0
    retried: int = 0
    written: int = 0
    by_server: dict[str, int] = field(default_factory=dict)


class EvalRun:
    """Sends one benchmark's requests with bounded concurrency; every sample ends in the artifact once."""

    def __init__(
        self,
        spec: BenchmarkSpec,
        dispatcher: Sender,
        out_dir: Path,
        target: EvalTarget,
        *,
        concurrency: int = 64,
        run_info: dict[str, Any] | None = None,
        secrets: Iterable[str] = (),
        on_progress: Callable[[EvalProgress], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        verifier: VerifierPool | None = None,
        stages: StageHooks | None = None,
        media: MediaPool | None = None,
        scoring: StagePool | None = None,
        summary_on_actors_from: int = SUMMARY_ON_ACTORS_FROM,
        retry_failed: bool = False,
    ):
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.spec = spec
        self._dispatcher = dispatcher
        self._dir = out_dir / spec.name
        self._target = target
        self._concurrency = concurrency
        self._run_info = run_info or {}
        self._secrets = tuple(secrets)
        self._on_progress = on_progress
        self._clock = clock
        self._counters = _Counters()
        self._stages = stages or StageHooks()
        self._media = media
        self._scoring = scoring  # CPU actors for the benchmark's summary (corpus metrics, bootstraps)
        self._summary_on_actors_from = summary_on_actors_from  # fewer records: summarized on a thread here
        self._retry_failed = retry_failed
        self._work_each = 1.0
        self._post: set[asyncio.Task[None]] = set()
        if spec.verifier and verifier is None:
            raise ValueError(f"benchmark {spec.name!r} asks for the verifier (verifier: true); pass a VerifierPool")
        self._verifier = verifier if spec.verifier else None
        self._verify_queue: asyncio.Queue[Record] | None = (
            asyncio.Queue(maxsize=2 * concurrency) if self._verifier is not None else None
        )

    def _open_writer(self, data_hash: str) -> ArtifactWriter:
        """The artifact's writer, its config recorded (blocking: package metadata and files; run in a thread)."""
        return ArtifactWriter(self._dir, self._config(data_hash), secrets=self._secrets,
                              retry_failed=self._retry_failed, purpose=f"eval of {self.spec.name}")

    def _config(self, data_hash: str) -> dict[str, Any]:
        return {
            "fingerprint": f"{self.spec.fingerprint()}-{data_hash[:16]}-{self._target.model}-{self._target.revision}",
            "benchmark": self.spec.model_dump(mode="json"),
            "prompt_template": self.spec.prompt.template,
            "generation": self.spec.generation.model_dump(mode="json"),
            "dataset": {"path": str(self.spec.data_path()), "sha256": data_hash},
            "model": self._target.model,
            "revision": self._target.revision,
            "pinned_engines": self._target.pinned_engines,
            "pinned_servers": self._target.pinned_servers,
            "packages": package_versions(),
            **self._run_info,
        }

    async def run(self, start_line: StartLine | None = None) -> EvalSummary:
        """Run the eval to its end. With a start line shared by evals started together, this one sends its
        first request only once every one of them has loaded its samples and told the dispatcher how much
        work it has: the first grants then follow the client order, not which dataset loaded first."""
        started = self._clock()
        samples, todo, data_hash, writer = await self._load(start_line)
        if start_line is not None:
            await start_line.wait()
        total = len(samples)
        if writer.resumed:
            log.info("%s: resuming, %d of %d records already in %s", self.spec.name, writer.resumed, total, writer.path)
        workers, judges, loader = self._start_tasks(todo, writer, total, started)
        await self._await_tasks(workers, judges, loader, writer)
        return await self._conclude(samples, data_hash, writer, started)

    async def _load(self, start_line: StartLine | None) -> tuple[list[Sample], list[Sample], str, ArtifactWriter]:
        """(Samples, those still to do, the dataset's hash, the artifact's writer), the dispatcher told of the work
        ahead; arrives at the start line whether or not the samples loaded."""
        # Ask for a share of the capacity now, while the samples load: evals in other processes started together
        # then start with their shares, not behind the one that loaded first (registry/leases.py, `loading`).
        # (A process that ran an eval of this name before — a jobs server — heard it had sent its last request.)
        self._dispatcher.client_done_sending(self.spec.name, False)
        self._dispatcher.expect(self.spec.name, self._target.model, self.spec.at_once(self._concurrency),
                                loading=True)
        try:
            samples = await asyncio.to_thread(load_samples, self.spec)
            data_hash = await asyncio.to_thread(dataset_sha256, self.spec.data_path())
            writer = await asyncio.to_thread(self._open_writer, data_hash)
            todo = [s for s in samples if s.sample_id not in writer.done_ids]
            total = len(samples)
            self._counters.done = self._counters.answered = total - len(todo)
            words = _mean_prompt_words(self.spec, todo)  # rendered once: work estimate and planner prior alike
            self._work_each = words + DECODE_WEIGHT * self.spec.generation.max_tokens
            if self._verifier is not None and self._verifier.config.shares_engine_cores:
                self._work_each += _judge_work_per_sample(self.spec, todo, words, self._verifier.config.max_tokens)
            # The planner's first guess at this eval's shape, before any answer reports real token counts.
            self._dispatcher.set_client_shape(self.spec.name, words, self.spec.generation.max_tokens)
            self._report_remaining(len(todo))
            # About to send: the capacity lease is asked for now, while the other evals load, not at the first
            # request (each worker's first request then finds its slots already leased).
            self._dispatcher.expect(self.spec.name, self._target.model, min(self._concurrency, len(todo)))
        except BaseException:
            self._dispatcher.expect(self.spec.name, self._target.model, 0)  # (its share goes back at once)
            raise
        finally:
            if start_line is not None:
                start_line.arrive()  # an eval that failed to load must not hold the others back
        return samples, todo, data_hash, writer

    def _start_tasks(self, todo: list[Sample], writer: ArtifactWriter, total: int, started: float
                     ) -> tuple[list[asyncio.Task[None]], list[asyncio.Task[None]], asyncio.Task[None] | None]:
        """(Workers, the verifier's judges, the prefetching loader if the samples need one), started on `todo`."""
        n_workers = min(self._concurrency, max(1, len(todo)))
        prefetching = self._stages.before is not None or bool(self.spec.prompt.media)
        # Prefetched samples wait in a bounded queue: loading runs ahead of the requests, but no further
        # than a few chunks (encoded media must not pile up in memory while inference is slower).
        queue: asyncio.Queue[Sample | None] = asyncio.Queue(
            maxsize=n_workers + max(1, self._stages.chunk) if prefetching else 0)
        loader: asyncio.Task[None] | None = None
        if not prefetching:
            for sample in todo:
                queue.put_nowait(sample)
            for _ in range(n_workers):
                queue.put_nowait(None)  # after every sample: a worker that reads it knows all were taken
        else:
            loader = asyncio.create_task(self._prefetch(todo, queue, n_workers), name=f"{self.spec.name}-loader")
        workers = [
            asyncio.create_task(self._worker(queue, writer, total, started), name=f"{self.spec.name}-worker-{i}")
            for i in range(n_workers)
        ]
        judges: list[asyncio.Task[None]] = []
        if self._verify_queue is not None and self._verifier is not None:
            judges = [
                asyncio.create_task(self._verify_stage(writer, total, started), name=f"{self.spec.name}-verify-{i}")
                for i in range(2 * self._verifier.config.actors)
            ]
        return workers, judges, loader

    async def _await_tasks(self, workers: list[asyncio.Task[None]], judges: list[asyncio.Task[None]],
                           loader: asyncio.Task[None] | None, writer: ArtifactWriter) -> None:
        """Wait for the workers, the CPU stages after them and the verifier's queue; then (or on any error) cancel
        what is left and close the artifact."""
        try:
            await asyncio.gather(*workers, *([loader] if loader is not None else []))
            while self._post:
                await asyncio.gather(*list(self._post))
            if self._verify_queue is not None:
                await self._verify_queue.join()
        finally:
            extra = [loader] if loader is not None else []
            for task in [*workers, *judges, *self._post, *extra]:
                task.cancel()
            await asyncio.gather(*workers, *judges, *self._post, *extra, return_exceptions=True)
            await asyncio.to_thread(writer.close)

    async def _conclude(self, samples: list[Sample], data_hash: str, writer: ArtifactWriter,
                        started: float) -> EvalSummary:
        """Score the artifact's records (one per sample) and write the summary."""
        total = len(samples)
        counted = await asyncio.to_thread(unique_records, writer.path, [s.sample_id for s in samples])
        for where in counted.duplicates:
            log.warning("%s: a second record of a sample, not scored (the first counts)", where)
        for where in counted.foreign:
            log.warning("%s: a record of a sample that is not in the dataset, not scored", where)
        wall = self._clock() - started
        summary = await self._summarize(list(counted.records))
        summary.update(
            {
                "model": self._target.model,
                "revision": self._target.revision,
                "dataset_sha256": data_hash,
                "prompt_template": self.spec.prompt.template,
                "generation": self.spec.generation.model_dump(mode="json"),
                "wall_time_s": wall,
                "resumed_records": writer.resumed,
                "retried_failed_records": writer.retried,
                "expected_records": total,
                "duplicate_lines": list(counted.duplicates),
                "foreign_lines": list(counted.foreign),
                **self._run_info,
            }
        )
        await asyncio.to_thread(writer.write_summary, summary)
        return EvalSummary(self.spec.name, self._dir, summary, wall, writer.resumed, self._counters.written)

    async def _summarize(self, records: list[Record]) -> dict[str, Any]:
        """The benchmark's scores (corpus WER/BLEU, bootstrap intervals over every record): on a CPU
        actor when the run has them and the eval has `summary_on_actors_from` records or more, else on a
        thread; never on the event loop, which has other evals' requests in flight. An actor that fails (its
        node gone for good) leaves the work to a thread."""
        if self._scoring is not None and len(records) >= self._summary_on_actors_from:
            try:
                return await self._scoring.run(summarize_records, self.spec, records)
            except Exception as exc:
                log.warning("%s: scoring actor failed (%s); scoring here", self.spec.name, type(exc).__name__)
        return await asyncio.to_thread(summarize_records, self.spec, records)

    async def _prefetch(self, todo: list[Sample], queue: asyncio.Queue[Sample | None], n_workers: int) -> None:
        """Loads samples on the CPU actors in chunks (stage work, media encoding), several chunks at once,
        ahead of the workers; chunks are handed on in order, so the run's order (and its tail) stays the
        dataset's. A chunk's slot is freed only once it is in the (bounded) queue: back-pressure."""
        size = max(1, self._stages.chunk)
        chunks = [todo[i:i + size] for i in range(0, len(todo), size)]
        limit = asyncio.Semaphore(max(1, self._stages.prefetch))

        async def load(chunk: list[Sample]) -> list[Sample]:
            await limit.acquire()
            if self._stages.before is not None:
                await self._stages.before(len(chunk))
            if self.spec.prompt.media:
                chunk = await (self._media.encode(self.spec, chunk) if self._media is not None
                               else encode_in_thread(self.spec, chunk))
            return chunk

        tasks = [asyncio.create_task(load(chunk)) for chunk in chunks]
        try:
            for task in tasks:
                for sample in await task:
                    await queue.put(sample)
                limit.release()
        finally:
            for task in tasks:
                task.cancel()
        for _ in range(n_workers):
            await queue.put(None)

    async def _worker(
        self, queue: asyncio.Queue[Sample | None], writer: ArtifactWriter, total: int, started: float
    ) -> None:
        while True:
            sample = await queue.get()
            if sample is None:
                # Every sample has been taken: what is still in flight is this run's tail, where the
                # dispatcher may hedge stragglers onto idle servers.
                self._dispatcher.client_done_sending(self.spec.name)
                return
            record = await self._evaluate(sample)
            # Left: what has no outcome yet, told in the step the dispatcher counted the answer (told as records
            # were written, a lease report counted some answered and left: "16 / 304" for an eval of 300).
            self._counters.answered += 1
            self._report_remaining(total - self._counters.answered)
            if self._stages.after is not None:
                # Scoring runs on the CPU actors while this worker sends its next request.
                task = asyncio.create_task(self._after_stage(record, writer, total, started))
                self._post.add(task)
                task.add_done_callback(self._post.discard)
                continue
            await self._hand_on(record, writer, total, started)

    async def _after_stage(self, record: Record, writer: ArtifactWriter, total: int, started: float) -> None:
        assert self._stages.after is not None
        try:
            await self._stages.after()
        except Exception as exc:  # a failing stage must not lose the record
            log.warning("%s/%s: CPU stage failed (%s)", record.benchmark, record.sample_id, type(exc).__name__)
        await self._hand_on(record, writer, total, started)

    async def _hand_on(self, record: Record, writer: ArtifactWriter, total: int, started: float) -> None:
        if self._verify_queue is not None and not record.failed:
            await self._verify_queue.put(record)  # bounded: a slow verifier slows inference, not memory
            return
        await self._finish(record, writer, total, started)

    async def _verify_stage(self, writer: ArtifactWriter, total: int, started: float) -> None:
        """Judges finished records on the verifier's CPU actors while inference goes on."""
        assert self._verify_queue is not None and self._verifier is not None
        while True:
            record = await self._verify_queue.get()
            try:
                judgment = await self._verifier.judge(judge_item(record))
                record = with_judgment(record, judgment)
            except Exception as exc:  # a broken judge must not lose the record: it is written unjudged
                log.warning("%s/%s: verifier failed (%s)", record.benchmark, record.sample_id, type(exc).__name__)
                record = with_judgment(record, None)
            await self._finish(record, writer, total, started)
            self._verify_queue.task_done()

    def _report_remaining(self, samples_left: int) -> None:
        self._dispatcher.set_client_remaining(self.spec.name, samples_left * self._work_each, samples_left)

    async def _finish(self, record: Record, writer: ArtifactWriter, total: int, started: float) -> None:
        if await writer.append(record):
            self._counters.written += 1
        self._counters.done += 1
        if record.failed:
            self._counters.failed += 1
        if record.provenance.attempts > 1:
            self._counters.retried += 1
        if self._on_progress is not None:
            c = self._counters
            self._on_progress(EvalProgress(self.spec.name, total, c.done, c.failed, c.retried, self._clock() - started))

    async def _evaluate(self, sample: Sample) -> Record:
        if sample.media is not None and sample.media.error is not None:
            prov = Provenance(model=self._target.model, error=sample.media.error, error_kind=ErrorKind.DATA,
                              completed_at=time.time())
            return finish_record(self.spec, sample, None, prov)
        request = InferenceRequest.from_body(
            request_body(self.spec, sample),
            request_id=f"{self.spec.name}/{sample.sample_id}",
            model=self._target.model,
            revision=self._target.revision,
            endpoint=Endpoint.COMPLETIONS if self.spec.prompt.style == "completion" else Endpoint.CHAT,
            client_id=self.spec.name,
            pinned_engines=self._target.pinned_engines,
            pinned_servers=self._target.pinned_servers,
            reproducible=self.spec.generation.bit_reproducible,
        )
        try:
            result = await self._dispatcher.submit(request)
        except RequestFailed as exc:
            prov = Provenance(
                model=self._target.model,
                attempts=len(exc.attempts),
                attempt_log=[_attempt_info(a) for a in exc.attempts],
                error=str(exc) + (REFUSED_AS_IS if exc.last_kind is FailureKind.REQUEST_ERROR else ""),
                error_kind=ErrorKind(exc.last_kind.value) if exc.last_kind else None,
                completed_at=time.time(),
            )
            return finish_record(self.spec, sample, None, prov)
        except NoServerError as exc:
            prov = Provenance(
                model=self._target.model, error=str(exc), error_kind=ErrorKind.NO_SERVER, completed_at=time.time()
            )
            return finish_record(self.spec, sample, None, prov)
        return finish_record(
            self.spec, sample, result.completion.text, _provenance(result, self._target.model),
            reasoning=result.completion.reasoning_content,
        )


DECODE_WEIGHT = 2.0  # a generated token costs about two prompt tokens of GPU time in a full batch


def _mean_prompt_words(spec: BenchmarkSpec, samples: list[Sample], probe: int = 64) -> float:
    """Mean prompt length in words over a few samples (text only: media are not encoded yet)."""
    system = len((spec.prompt.system or "").split())
    words = [system + len(render(spec, s).split()) for s in samples[:probe]]
    return sum(words) / len(words) if words else 0.0


def _judge_work_per_sample(spec: BenchmarkSpec, samples: list[Sample], question_words: float,
                           judge_max_tokens: int, probe: int = 64) -> float:
    """What judging one record costs, in the unit of the work estimate (prompt words + DECODE_WEIGHT ×
    answer tokens): the judge's prompt (its template around the question, the options and an answer as
    long as the answer budget) plus its own answer budget."""
    few = samples[:probe]
    options = sum(sum(letter in s.fields for letter in OPTION_LETTERS) for s in few) / len(few) if few else 0.0
    prompt = judge_prompt_words(question_words, spec.generation.max_tokens, options)
    return prompt + DECODE_WEIGHT * judge_max_tokens


def _attempt_info(attempt: Attempt) -> AttemptInfo:
    return AttemptInfo(
        server_id=attempt.server_id,
        latency_s=attempt.latency_s,
        failure=ErrorKind(attempt.failure.value) if attempt.failure else None,
        detail=attempt.detail,
        lost_race=attempt.lost_race,
    )


def _provenance(result: InferenceResult, model: str) -> Provenance:
    return Provenance(
        server_id=result.server_id,
        engine=result.engine,
        accelerator=result.accelerator,
        model=model,
        model_revision=result.model_revision,
        attempts=len(result.attempts),
        attempt_log=[_attempt_info(a) for a in result.attempts],
        latency_s=result.latency_s,
        hedged=result.hedged,
        prompt_tokens=result.completion.prompt_tokens,
        completion_tokens=result.completion.completion_tokens,
        finish_reason=result.completion.finish_reason,
        completed_at=time.time(),
    )
