"""Run several evaluations at once over one pool connection, so their requests share every engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from fedpool.clients.delegate import Sender
from fedpool.clients.eval_client import (
    SUMMARY_ON_ACTORS_FROM,
    EvalProgress,
    EvalRun,
    EvalSummary,
    EvalTarget,
    StartLine,
)
from fedpool.clients.rundir import duplicate_names
from fedpool.pipeline import BenchmarkSpec
from fedpool.pipeline.media import MediaPool
from fedpool.pipeline.stages import StageHooks, StagePool
from fedpool.pipeline.verifier import VerifierPool


async def run_evals(
    specs: Sequence[BenchmarkSpec],
    dispatcher: Sender,
    out_dir: Path,
    target: EvalTarget,
    *,
    concurrency: int = 64,
    run_info: dict[str, Any] | None = None,
    secrets: Iterable[str] = (),
    on_progress: Callable[[EvalProgress], None] | None = None,
    verifier: VerifierPool | None = None,
    stages: dict[str, StageHooks] | None = None,
    media: MediaPool | None = None,
    scoring: StagePool | None = None,
    summary_on_actors_from: int = SUMMARY_ON_ACTORS_FROM,
    retry_failed: bool = False,
) -> list[EvalSummary]:
    """All evals concurrently; each writes its own artifact directory under `out_dir`."""
    if twice := duplicate_names(specs):
        raise ValueError(f"benchmark names must be unique in one run: {twice}")
    runs = [
        EvalRun(
            spec, dispatcher, out_dir, target, concurrency=concurrency, run_info=run_info,
            secrets=secrets, on_progress=on_progress, verifier=verifier,
            stages=(stages or {}).get(spec.name), media=media, scoring=scoring,
            summary_on_actors_from=summary_on_actors_from, retry_failed=retry_failed,
        )
        for spec in specs
    ]
    # The first grants must already follow the client order: every eval waits at the start line until all have
    # loaded their samples and reported their work. Under fair too: an eval that started as soon as it had loaded
    # filled every slot while the others loaded, and held them a whole answer.
    start_line = StartLine(len(runs))
    tasks = [asyncio.ensure_future(run.run(start_line)) for run in runs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        # One eval failed (a full disk, say) or the run was cancelled: the others stop here, while the pool
        # connection is still open, and their outcomes are collected. Left running, they were cancelled by
        # asyncio.run's shutdown after the connection had closed: warnings for every request they had in
        # flight, and a traceback for an eval that failed the same way meanwhile.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
