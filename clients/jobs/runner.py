"""Running jobs: queued jobs start (up to `max_running` at once) as `run_evals` calls over one dispatcher, so
every job's requests share every engine; a job left running by a stopped server resumes from its artifact."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedpool.clients.eval_client import EvalProgress, EvalSummary, EvalTarget
from fedpool.clients.jobs.store import FINAL_STATES, JobRequest, JobStore
from fedpool.clients.rundir import duplicate_names, wait_for_model
from fedpool.clients.runner import run_evals
from fedpool.federation import Dispatcher
from fedpool.pipeline import BenchmarkSpec, load_samples, load_spec, spec_from_dict
from fedpool.pipeline.errors import PipelineError, SpecError
from fedpool.pipeline.ownership import DirectoryLock

log = logging.getLogger("fedpool.jobs")


def resolve_specs(request: JobRequest, roots: Sequence[Path] = ()) -> list[BenchmarkSpec]:
    """The job's specs, checked now (each spec and its dataset), so a bad job is refused at submission with the
    culprit named instead of failing later. Spec files and datasets are read only under `roots` (the jobs
    server's configured directories): a path outside them is refused without being opened, and errors about a
    spec file never quote its content."""
    if not request.specs and not request.spec_paths:
        raise PipelineError("a job needs `specs` (inline) or `spec_paths`")
    specs = [spec_from_dict(raw, source=f"specs[{i}]") for i, raw in enumerate(request.specs)]
    for i, given in enumerate(request.spec_paths):
        path = _under_roots(Path(given), roots, f"spec_paths[{i}]")
        if not path.is_file():
            raise PipelineError(f"spec_paths[{i}]: {given} is not a file")
        try:
            specs.append(load_spec(path))
        except SpecError:
            raise PipelineError(f"spec_paths[{i}]: {given} is not a valid benchmark spec (check it on the jobs "
                                f"server's machine with `fedpool eval run --spec {given}`)") from None
    for spec in specs:
        if not spec.data_path().is_absolute():
            raise PipelineError(f"benchmark {spec.name!r}: data.path {spec.data.path!r} must be absolute in an "
                                "inline spec (the jobs server has no spec file to resolve it against)")
        _under_roots(spec.data_path(), roots, f"benchmark {spec.name!r}: data.path")
    if request.limit is not None:
        specs = [s.model_copy(update={"data": s.data.model_copy(update={"limit": request.limit})}) for s in specs]
    if twice := duplicate_names(specs):
        raise PipelineError(f"benchmark names must be unique in a job: {', '.join(twice)}")
    for spec in specs:
        load_samples(spec)  # raises DataError naming file and line
    return specs


def _under_roots(path: Path, roots: Sequence[Path], what: str) -> Path:
    """`path` with symlinks resolved, if it lies under one of `roots`; else a PipelineError (nothing opened)."""
    resolved = path.expanduser().resolve()
    for root in roots:
        if resolved.is_relative_to(root.expanduser().resolve()):
            return resolved
    allowed = ", ".join(str(r) for r in roots) or "none configured"
    raise PipelineError(f"{what}: {path} is outside the directories this jobs server reads ({allowed}; "
                        "`fedpool jobs serve --root DIR` adds one)")


class JobRunner:
    """Runs queued jobs, up to `max_running` at once, all through one dispatcher."""

    def __init__(self, store: JobStore, dispatcher: Dispatcher, *, max_running: int = 4,
                 verifier_factory: Callable[[], Any] | None = None, clock: Callable[[], float] = time.time,
                 roots: Sequence[Path] = ()):
        self.store = store
        self.roots = tuple(roots)
        self._lock = DirectoryLock(store.root, "fedpool jobs serve")
        self._dispatcher = dispatcher
        self._max = max_running
        self._verifier_factory = verifier_factory
        self._verifier: Any = None
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.live: dict[str, dict[str, Any]] = {}  # job id -> benchmark -> progress (not yet persisted)

    async def start(self) -> None:
        """Take the jobs directory (a second jobs server on it is refused: OwnershipError naming this one),
        then queue again the jobs a stopped server left running."""
        await asyncio.to_thread(self._lock.acquire)
        resumed = await asyncio.to_thread(self.store.requeue_interrupted)
        for job_id in resumed:
            await asyncio.to_thread(self.store.log, job_id, "server restarted: queued again, resumes from its artifact")
        self._loop_task = asyncio.get_running_loop().create_task(self._schedule(), name="jobs-scheduler")

    async def stop(self) -> None:
        """Stop scheduling; running jobs are cancelled but stay `running` in the store, so the next start
        resumes them (a restart is not a cancellation)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._verifier is not None:
            self._verifier.shutdown()
        self._lock.release()

    def poke(self) -> None:
        self._wake.set()

    async def cancel(self, job_id: str) -> bool:
        job = await asyncio.to_thread(self.store.get, job_id)
        if job is None or job.state in FINAL_STATES:
            return False
        if not await asyncio.to_thread(self.store.update, job_id, only_from=("queued", "running"),
                                       state="cancelled", finished_at=self._clock()):
            return False  # it finished (or was cancelled) in the meantime
        await asyncio.to_thread(self.store.log, job_id, "cancelled by request")
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()
        return True

    async def _schedule(self) -> None:
        while True:
            for job_id in await asyncio.to_thread(self.store.queued):
                if len(self._tasks) >= self._max:
                    break
                if job_id not in self._tasks:
                    self._tasks[job_id] = asyncio.get_running_loop().create_task(self._run(job_id),
                                                                                name=f"job-{job_id}")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    async def _run(self, job_id: str) -> None:
        store = self.store
        try:
            job = await asyncio.to_thread(store.get, job_id)
            if job is None or job.state != "queued":
                return
            request = job.request
            if not await asyncio.to_thread(store.update, job_id, only_from=("queued",), state="running",
                                           started_at=job.started_at or self._clock(), attempts=job.starts + 1,
                                           error=None):
                return  # cancelled between the read and the start
            await asyncio.to_thread(store.log, job_id, f"running (start {job.starts + 1}) on model {request.model}")
            specs = await asyncio.to_thread(resolve_specs, request, self.roots)
            await self.require_servers(request)
            verifier = await self._verifier_for(specs)
            self.live[job_id] = {}
            saver = asyncio.get_running_loop().create_task(self._save_progress(job_id))
            try:
                summaries = await run_evals(
                    specs, self._dispatcher, Path(job.artifact_dir), EvalTarget(model=request.model,
                                                                            revision=request.revision),
                    concurrency=request.concurrency, run_info={"job_id": job_id},
                    on_progress=lambda p: self._progress(job_id, p), verifier=verifier,
                    retry_failed=job.starts > 0)  # a restarted job runs its failed records again
            finally:
                saver.cancel()
            await self._done(job_id, summaries)
        except asyncio.CancelledError:
            current = await asyncio.to_thread(store.get, job_id)
            if current is not None and current.state == "running":  # a server stop: resumed at next start
                await asyncio.to_thread(store.update, job_id, progress=self.live.get(job_id, {}))
            raise
        except (PipelineError, ValidationError, ValueError, OSError) as exc:
            await self._failed(job_id, exc)
        except Exception as exc:  # anything else: the job fails with the error, the server goes on
            log.exception("job %s failed", job_id)
            await self._failed(job_id, exc)
        finally:
            self._tasks.pop(job_id, None)
            self.live.pop(job_id, None)
            self.poke()

    async def _verifier_for(self, specs: Sequence[BenchmarkSpec]) -> Any:
        """The verifier pool when a spec asks for it (started on first use and kept), else None."""
        if not any(s.verifier for s in specs):
            return None
        if self._verifier is None:
            if self._verifier_factory is None:
                raise PipelineError("a spec asks for the verifier but this jobs server has none configured")
            self._verifier = self._verifier_factory()
            await self._verifier.ready()
        return self._verifier

    async def _done(self, job_id: str, summaries: Sequence[EvalSummary]) -> None:
        """Record a job that ran to its end: its scores, its last progress and a line in its log (unless it was
        cancelled meanwhile)."""
        scores = {s.benchmark: {"scores": s.summary["scores"], "records": s.summary["records"],
                                "failed": s.summary["failed"], "artifact_dir": str(s.artifact_dir)}
                  for s in summaries}
        if await asyncio.to_thread(self.store.update, job_id, only_from=("running",), state="done",
                                   finished_at=self._clock(), scores=scores, progress=self.live.get(job_id, {})):
            lines = [f"{b}: " + ", ".join(f"{x['metric']} {x['value']:.1f}" for x in v["scores"])
                     for b, v in scores.items()]
            await asyncio.to_thread(self.store.log, job_id, "done: " + "; ".join(lines))

    async def _failed(self, job_id: str, exc: Exception) -> None:
        """Record a job that failed, with the error (unless it was already final)."""
        message = f"{type(exc).__name__}: {exc}"
        await asyncio.to_thread(self.store.update, job_id, only_from=("queued", "running"), state="failed",
                                finished_at=self._clock(), error=message)
        await asyncio.to_thread(self.store.log, job_id, f"failed: {message}")

    async def require_servers(self, request: JobRequest) -> None:
        """PipelineError unless a registered server serves the job's model, after waiting up to
        `wait_for_servers_s` for one: a model nobody serves is refused, not run into a page of failures."""
        async def registered() -> dict[str, set[str]]:
            return self._dispatcher.registered_models()

        await wait_for_model(registered, request.model, request.revision, request.wait_for_servers_s,
                             "set wait_for_servers_s to wait for one")

    def _progress(self, job_id: str, p: EvalProgress) -> None:
        self.live.setdefault(job_id, {})[p.benchmark] = {
            "done": p.done, "total": p.total, "failed": p.failed, "retried": p.retried,
            "elapsed_s": round(p.elapsed_s, 2)}

    async def _save_progress(self, job_id: str) -> None:
        while True:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(self.store.update, job_id, progress=self.live.get(job_id, {}))
