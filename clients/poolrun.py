"""Evals run through the pool by a process of their own (`fedpool eval run | resume | replay`): one pool
connection, the Ray CPU actor pools its specs need (media encoding and the verifier made ready before the first
request; each benchmark's summary's at first use, by a large eval) shut down after the last, and a progress view, around
`run_evals`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedpool.clients.delegate import DelegatingDispatcher, GatewayHttp
from fedpool.clients.eval_client import EvalSummary, EvalTarget
from fedpool.clients.progress import ProgressView
from fedpool.clients.runner import run_evals
from fedpool.federation import DispatchConfig, PoolConnection, prepare_policy
from fedpool.pipeline import BenchmarkSpec
from fedpool.pipeline.media import MediaPool
from fedpool.pipeline.stages import StagePool
from fedpool.pipeline.verifier import VerifierPool


async def run_evals_through_pool(
    registry: Any, specs: Sequence[BenchmarkSpec], out_dir: Path, target: EvalTarget, *, policy: str,
    dispatch: DispatchConfig, concurrency: int, verifier: Callable[[], VerifierPool], media_actors: int,
    metric_actors: int, progress: str = "auto", retry_failed: bool = False, run_info: dict[str, Any] | None = None,
    join_ray: Callable[[], object] | None = None, holder: str | None = None, gateway: GatewayHttp | None = None,
) -> list[EvalSummary]:
    """`run_evals` over a new connection to `registry`'s pool with `policy`; `verifier` is called only when a spec
    asks for judgments; `metric_actors=0` scores on a thread of this process; `progress` is ProgressView's mode.
    `join_ray` joins the Ray cluster (blocking) before the first CPU actor is made, for a process that reached the
    registry without Ray (its HTTP API): called only when a spec needs actors, or a large eval its scoring actors.
    `holder`: this process's name at the lease broker, where it announced its evals before (`loading_report`).
    `gateway`: every request goes through that gateway, which places them (clients/delegate.py); `registry`,
    `policy`, `dispatch` and `holder` are then the gateway's business, not this process's."""
    if gateway is None:
        prepare_policy(policy)  # (its solver, if it plans, loads while Ray and the actors start)
    needs_actors_now = any(s.verifier or s.prompt.media for s in specs)
    if join_ray is not None and needs_actors_now:
        await asyncio.to_thread(join_ray)
    judge = verifier() if any(s.verifier for s in specs) else None
    # Images, audio and video frames are read and encoded on Ray CPU actors, ahead of the requests.
    media = MediaPool(media_actors, num_cpus=0.5) if any(s.prompt.media for s in specs) else None
    # Each benchmark's summary (corpus metrics, bootstrap intervals) is computed on CPU actors as well, once it
    # has enough records to be worth an actor (eval_client.SUMMARY_ON_ACTORS_FROM): the pool starts them then.
    scoring = StagePool(metric_actors, num_cpus=0.25, before_start=join_ray) if metric_actors > 0 else None
    try:
        # The judges and the media encoders are needed from the first records on: up before the first request.
        # The scoring actors only at an eval's end, and only for a large eval: eval processes started together,
        # each booting its actors, take that CPU from the engines on the same cores.
        await asyncio.gather(*(x.ready() for x in (judge, media) if x is not None))
        if gateway is not None:
            view = ProgressView(None, mode=progress)
            async with view:
                return await run_evals(specs, DelegatingDispatcher(gateway, where=f"the gateway at {gateway.url}"),
                                       out_dir, target, concurrency=concurrency, verifier=judge, media=media,
                                       scoring=scoring, on_progress=view.update, retry_failed=retry_failed,
                                       run_info=run_info)
        expect = [(s.name, target.model, s.at_once(concurrency)) for s in specs]
        async with PoolConnection(registry, policy=policy, config=dispatch, expect=expect,
                                  holder=holder, holder_kind="eval run") as pool:
            view = ProgressView(pool.dispatcher, mode=progress)
            async with view:
                return await run_evals(specs, pool.dispatcher, out_dir, target, concurrency=concurrency,
                                       verifier=judge, media=media, scoring=scoring, on_progress=view.update,
                                       retry_failed=retry_failed, run_info=run_info)
    finally:
        if gateway is not None:
            await gateway.aclose()
        for actors in (judge, media, scoring):
            if actors is not None:
                actors.shutdown()
