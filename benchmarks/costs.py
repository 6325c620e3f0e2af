"""The CPU cost of real benchmarks, emulated for the speedup benchmark: decoding images and video frames before
a request, post-processing and metrics after it, an answer extractor or judge. Spent on the same actor-stage
API real evals use (`pipeline.stages`: the federated arm), or in the eval's own process the way the
framework a conventional arm renders spends it (inline, serially, one item after another).

By default a cost is a wait: the benchmark compresses engine time (time scale 5–10) on a 2-core machine,
where burning the emulated CPU time for real would measure the machine, not the schedule. `cpu_bound` burns
the CPU for the given seconds instead (hashing), for benchmarks of the overlap itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from pydantic import BaseModel, ConfigDict, Field

from fedpool.pipeline.stages import Batcher, StageHooks, StagePool


class StageCosts(BaseModel):
    """CPU seconds per item of each stage (engine-time seconds: divided by the run's time scale)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    load_s: float = Field(default=0.0, ge=0)  # read + decode one item before its request (images, frames)
    metric_s: float = Field(default=0.0, ge=0)  # post-process and score one answer
    verify_s: float = Field(default=0.0, ge=0)  # the verifier / judge on one answer

    @property
    def any(self) -> bool:
        return self.load_s + self.metric_s + self.verify_s > 0


def spend(seconds: float, time_scale: float = 1.0, cpu_bound: bool = False) -> float:
    """Occupy the caller (an actor, or a thread) for `seconds` of engine time; returns the wall time taken."""
    start = time.perf_counter()
    if seconds <= 0:
        return 0.0
    budget = seconds / time_scale
    if not cpu_bound:
        time.sleep(budget)
        return time.perf_counter() - start
    spent = time.thread_time()
    block = b"fedpool" * 1024
    while time.thread_time() - spent < budget:  # CPU seconds, so a busy machine makes it take longer
        for _ in range(64):
            block = hashlib.sha256(block).digest() * 224
    return time.perf_counter() - start


def spend_batch(items: list[tuple[float, float, bool]]) -> list[float]:
    """Several items' costs on one actor, one after another (a scoring worker's batch)."""
    return [spend(*item) for item in items]


def actor_hooks(pool: StagePool, costs: StageCosts, time_scale: float, cpu_bound: bool = False) -> StageHooks:
    """The federated arm: loading ahead of the requests in chunks, metrics and the verifier in small batches
    as answers arrive, all on the pool's actors."""
    after = Batcher(pool, spend_batch)

    async def before(n: int) -> None:
        await pool.run(spend, costs.load_s * n, time_scale, cpu_bound)

    async def score() -> None:
        await after((costs.metric_s + costs.verify_s, time_scale, cpu_bound))

    return StageHooks(before if costs.load_s > 0 else None, score if costs.metric_s + costs.verify_s > 0 else None,
                      prefetch=max(2, pool.size))


def inline_hooks(costs: StageCosts, time_scale: float) -> StageHooks:
    """The same costs in the eval's own process, one item at a time (a serial sleeper per eval): the federated
    arm with its CPU work left on the critical path, to tell that gain apart from federation's."""
    lock = asyncio.Lock()

    async def before(n: int) -> None:
        async with lock:
            await spend_inline(costs.load_s * n, time_scale)

    async def score() -> None:
        async with lock:
            await spend_inline(costs.metric_s + costs.verify_s, time_scale)

    return StageHooks(before if costs.load_s > 0 else None, score if costs.metric_s + costs.verify_s > 0 else None,
                      prefetch=1)


async def spend_inline(seconds: float, time_scale: float) -> None:
    """A cost in the caller's own process: nothing else of this eval runs meanwhile (its loop is sequential)."""
    if seconds > 0:
        await asyncio.sleep(seconds / time_scale)
