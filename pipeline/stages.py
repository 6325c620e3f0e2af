"""CPU stages beside inference: a pool of Ray CPU actors that run an eval's CPU work — loading and decoding
samples ahead of the requests, scoring finished records, the benchmark's summary (corpus WER/BLEU, bootstrap
intervals) — so it overlaps with requests in flight instead of stalling them.

The pool runs plain functions (`await pool.run(fn, *args)`, on the actor with the fewest calls in flight);
`StageHooks` is what an eval run calls around its requests; `Batcher` gathers per-record calls into one actor
call. The speedup benchmark's emulated CPU costs (`benchmarks/costs.py`) run on this same API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fedpool.pipeline.actors import cpu_actor_options

T = TypeVar("T")


class StageWorker:
    """One CPU actor: runs the functions it is given, one at a time, as a worker process would."""

    def ready(self) -> bool:
        return True

    def node(self) -> str:
        """The Ray node this actor runs on (where a restart put it)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


@dataclass(frozen=True, slots=True)
class StageHooks:
    """What an eval run calls around its requests: `before(n)` loads the next n samples (the run prefetches
    them in chunks of `chunk`, ahead of the requests), `after()` scores one finished record."""

    before: Callable[[int], Awaitable[None]] | None = None
    after: Callable[[], Awaitable[None]] | None = None
    chunk: int = 16  # samples per load call, as a data loader's batch
    prefetch: int = 8  # load calls in flight at once


class StagePool:
    """N Ray CPU actors; each call goes to the actor with the fewest calls in flight. A node that dies takes
    its actors with it: Ray starts them again elsewhere and retries the calls in flight, so an eval loses no
    record to a lost CPU node."""

    def __init__(self, actors: int, *, num_cpus: float | None = None, actor_options: dict[str, object] | None = None,
                 ready_timeout_s: float = 120.0, before_start: Callable[[], object] | None = None):
        if actors < 1:
            raise ValueError("a stage pool needs at least one actor")
        # Called (in a thread) before the actors are made: joins Ray for a process that has not yet (one that
        # reached the registry over HTTP, and would otherwise start a Ray cluster of its own here).
        self._before_start = before_start
        if num_cpus is None:
            import ray

            # One core each where the cluster has them, but all of them together at most half the cluster's
            # CPUs, so judges and other actors can still be placed (an actor that cannot be placed would
            # wait forever).
            total = float(ray.cluster_resources().get("CPU", 0.0))
            num_cpus = max(0.01, min(1.0, total / (2 * actors))) if total > 0 else 0.0
        self.num_cpus = num_cpus
        self._options = cpu_actor_options(num_cpus, actor_options)
        # Started at the first `ready` or `run`, not here: each actor is a Ray worker process (costly to boot),
        # and a run whose work never needs them should not pay for them.
        self._actors: list[Any] = []  # Ray's handles are not typed for .remote
        self._busy = [0] * actors
        self.calls = 0  # calls answered (for reports and tests: the work did run here)
        self._up: asyncio.Future[None] | None = None  # the readiness check, made once
        self._ready_timeout_s = ready_timeout_s

    @property
    def size(self) -> int:
        return len(self._busy)

    @property
    def started(self) -> bool:
        """Whether the actors were asked for (by `ready` or `run`)."""
        return self._up is not None

    async def ready(self) -> None:
        """Start the actors if not yet, and wait until every actor's process is up (a fresh actor takes a second
        or two to start). Checked once: later calls, and `run`, wait on the same check (a caller that gives up
        does not cancel it)."""
        if self._up is None:
            if self._before_start is not None:
                await asyncio.to_thread(self._before_start)
            if self._up is not None:  # another caller started them while this one waited
                await asyncio.shield(self._up)
                return
            import ray

            remote = ray.remote(StageWorker).options(**self._options)
            self._actors = [remote.remote() for _ in range(self.size)]
            self._up = asyncio.ensure_future(self._check(self._ready_timeout_s))
        await asyncio.shield(self._up)

    async def _check(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(actor.ready.remote() for actor in self._actors)), timeout_s)
        except TimeoutError:
            raise RuntimeError(
                f"{len(self._actors)} CPU stage actors ({self.num_cpus:g} CPU each) did not all start within "
                f"{timeout_s:g} s: the Ray cluster cannot place them (fewer actors or more CPUs)"
            ) from None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the least busy actor (fn and args must pickle: module-level functions), once the actors
        are up (an actor that cannot be placed raises here, after `ready`'s timeout, instead of waiting forever)."""
        if self._up is None or not self._up.done() or self._up.exception() is not None:
            await self.ready()
        index = min(range(len(self._actors)), key=self._busy.__getitem__)
        self._busy[index] += 1
        try:
            result = await self._actors[index].call.remote(fn, *args)
            self.calls += 1
            return result
        finally:
            self._busy[index] -= 1

    def shutdown(self) -> None:
        if self._up is None:
            return  # never started: nothing to stop (and no Ray to import for it)
        import ray

        if not self._up.done():
            self._up.cancel()  # (a readiness check still waiting on the actors killed here)
        for actor in self._actors:
            ray.kill(actor)
        self._actors.clear()


class Batcher:
    """Gathers per-item calls for a few milliseconds (or `size` of them) into one actor call `fn(items)`, as a
    scoring worker takes a batch: Ray's per-call overhead is paid once per batch, not once per record."""

    def __init__(self, pool: StagePool, fn: Callable[[list[Any]], Sequence[Any]], size: int = 16,
                 linger_s: float = 0.005):
        self._pool = pool
        self._fn = fn
        self._size = size
        self._linger = linger_s
        self._pending: list[tuple[Any, asyncio.Future[Any]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, item: Any = None) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((item, fut))
        if len(self._pending) >= self._size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self._linger, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        try:
            results = await self._pool.run(self._fn, [item for item, _ in batch])
        except Exception as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)
