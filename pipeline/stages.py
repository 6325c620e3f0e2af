"""CPU stages beside inference: a pool of Ray CPU actors that run per-item stage work, so data loading
(media decoding) and scoring (metrics, judging) overlap with requests in flight instead of stalling them.

`StageCosts` describes a stage's CPU time per item. The speedup benchmark uses it to give emulated
benchmarks the CPU cost real ones have (decoding images and video frames, an answer extractor or
judge); the same costs are spent serially inside the conventional baseline's process, so both sides
pay for the same work and only where it runs differs.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fedpool.pipeline.actors import cpu_actor_options
from pydantic import BaseModel, ConfigDict, Field


class StageCosts(BaseModel):
    """CPU seconds per item of each stage (engine-time seconds: divided by the run's time scale)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    load_s: float = Field(default=0.0, ge=0)  # read + decode one item before its request (images, frames)
    metric_s: float = Field(default=0.0, ge=0)  # post-process and score one answer
    verify_s: float = Field(default=0.0, ge=0)  # the verifier / judge on one answer


class StageWorker:
    """One CPU actor: runs a stage's work for one item at a time, as a worker process would.

    By default the work is a wait (the speedup benchmark compresses time 10× on a 2-core machine, where
    burning the emulated CPU time for real would measure the machine, not the schedule). `cpu_bound`
    burns the CPU for the given seconds instead (hashing), for benchmarks of the overlap itself."""

    def __init__(self, time_scale: float, cpu_bound: bool = False):
        self._scale = time_scale
        self._cpu_bound = cpu_bound

    def ready(self) -> bool:
        return True

    def node(self) -> str:
        """The Ray node this actor runs on (where a restart put it)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def work(self, seconds: float) -> float:
        """Occupies this actor for `seconds` (scaled); returns how long it took."""
        start = time.perf_counter()
        if seconds <= 0:
            return 0.0
        if not self._cpu_bound:
            time.sleep(seconds / self._scale)
            return time.perf_counter() - start
        budget = seconds / self._scale
        spent = time.thread_time()
        block = b"fedpool" * 1024
        while time.thread_time() - spent < budget:  # CPU seconds, so a busy machine makes it take longer
            for _ in range(64):
                block = hashlib.sha256(block).digest() * 224
        return time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class StageHooks:
    """What an eval run calls around its requests: `before(n)` loads the next n samples (the run prefetches
    them in chunks of `chunk`, ahead of the requests), `after()` scores one finished record."""

    before: Callable[[int], Awaitable[None]] | None = None
    after: Callable[[], Awaitable[None]] | None = None
    chunk: int = 16  # samples per load call, as a data loader's batch
    prefetch: int = 8  # load calls in flight at once


class _Batcher:
    """Gathers per-record calls for a few milliseconds (or `size` of them) into one actor call, as a
    scoring worker takes a batch: Ray's per-call overhead is paid once per batch, not once per record."""

    def __init__(self, pool: StagePool, seconds_each: float, size: int = 16, linger_s: float = 0.005):
        self._pool = pool
        self._each = seconds_each
        self._size = size
        self._linger = linger_s
        self._pending: list[asyncio.Future[None]] = []
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._pending.append(fut)
        if len(self._pending) >= self._size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self._linger, self._flush)
        await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[asyncio.Future[None]]) -> None:
        try:
            await self._pool.work(self._each * len(batch))
        except Exception as exc:
            for fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for fut in batch:
            if not fut.done():
                fut.set_result(None)


class StagePool:
    """N Ray CPU actors; each call goes to the actor with the fewest calls in flight."""

    def __init__(self, actors: int, *, time_scale: float = 1.0, num_cpus: float | None = None,
                 cpu_bound: bool = False, actor_options: dict[str, object] | None = None):
        import ray

        if actors < 1:
            raise ValueError("a stage pool needs at least one actor")
        if num_cpus is None:
            # One core each where the cluster has them, but all of them together at most half the cluster's
            # CPUs, so judges and other actors can still be placed (an actor that cannot be placed would
            # wait forever).
            total = float(ray.cluster_resources().get("CPU", 0.0))
            num_cpus = max(0.01, min(1.0, total / (2 * actors))) if total > 0 else 0.0
        self.num_cpus = num_cpus
        # A node that dies takes its actors with it: Ray starts them again elsewhere and retries the calls
        # that were in flight, so an eval loses no record to a lost CPU node.
        remote = ray.remote(StageWorker).options(**cpu_actor_options(num_cpus, actor_options))
        self._actors = [remote.remote(time_scale, cpu_bound) for _ in range(actors)]
        self._busy = [0] * actors

    @property
    def size(self) -> int:
        return len(self._actors)

    async def ready(self, timeout_s: float = 120.0) -> None:
        """Wait until every actor's process is up (a fresh actor takes a second or two to start)."""
        try:
            await asyncio.wait_for(asyncio.gather(*(actor.ready.remote() for actor in self._actors)), timeout_s)
        except TimeoutError:
            raise RuntimeError(
                f"{len(self._actors)} CPU stage actors ({self.num_cpus:g} CPU each) did not all start within "
                f"{timeout_s:g} s: the Ray cluster cannot place them (fewer actors or more CPUs)"
            ) from None

    async def work(self, seconds: float) -> None:
        if seconds <= 0:
            return
        index = min(range(len(self._actors)), key=self._busy.__getitem__)
        self._busy[index] += 1
        try:
            await self._actors[index].work.remote(seconds)
        finally:
            self._busy[index] -= 1

    def hooks(self, costs: StageCosts) -> StageHooks:
        """Loading ahead of the requests in chunks; metrics and the verifier in small batches as answers
        arrive; all on the actors."""
        async def before(n: int) -> None:
            await self.work(costs.load_s * n)

        after = _Batcher(self, costs.metric_s + costs.verify_s)
        return StageHooks(before if costs.load_s > 0 else None,
                          after if costs.metric_s + costs.verify_s > 0 else None,
                          prefetch=max(2, self.size))

    def shutdown(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors.clear()


async def spend_inline(seconds: float, time_scale: float) -> None:
    """The same work in the caller's own process (the conventional baseline): nothing else of this eval
    runs meanwhile, because the baseline's loop is sequential."""
    if seconds > 0:
        await asyncio.sleep(seconds / time_scale)
