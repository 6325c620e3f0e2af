"""`fedpool demo`: the main job on the embedded default — a real local pool and concurrent evals."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import ray

from fedpool.cli_eval import verifier_pool
from fedpool.clients import EvalTarget
from fedpool.clients.poolrun import run_evals_through_pool
from fedpool.clients.report import DemoReport, answered_by_server
from fedpool.deploy.localpool import LocalServerSpec, init_local_ray, local_llama_servers
from fedpool.federation import DispatchConfig
from fedpool.options import DemoOptions
from fedpool.pipeline import BenchmarkSpec, load_specs, package_versions
from fedpool.pipeline.artifact import write_json_atomic
from fedpool.pipeline.bundled import bundled_spec_paths
from fedpool.registry import RegistryClient


def run_demo(options: DemoOptions, out: TextIO = sys.stdout) -> DemoReport:
    specs = load_specs(options.spec or bundled_spec_paths(), options.limit)  # bad specs fail before anything starts
    run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-demo"
    run_dir = (options.out / run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    print("[fedpool] starting local Ray (namespace fedpool)", file=out, flush=True)
    init_local_ray()
    # The registry's state (and its token) live outside the run directory: artifacts carry no secrets.
    try:
        with tempfile.TemporaryDirectory(prefix="fedpool-demo-registry-") as state_dir:
            return asyncio.run(_run_pool(options, specs, run_dir, out, Path(state_dir)))
    finally:
        ray.shutdown()


async def _run_pool(options: DemoOptions, specs: list[BenchmarkSpec], run_dir: Path, out: TextIO,
                    state_dir: Path) -> DemoReport:
    registry = await RegistryClient.start(state_dir, probe_interval_s=2.0)
    await registry.ping()
    servers = LocalServerSpec(count=options.servers, slots=options.slots, threads=options.threads,
                              model_path=options.model_path, ctx_per_slot=options.ctx_per_slot)
    print(f"[fedpool] registry actor up; starting {servers.count} llama.cpp servers ({servers.slots} slots of "
          f"{servers.ctx_per_slot} tokens, {servers.threads} thread(s) each)", file=out, flush=True)
    async with local_llama_servers(registry, servers, run_dir / "logs") as launchers:
        for launcher in launchers:
            print(f"[fedpool]   {launcher.record.id}: {launcher.record.url}  log {launcher.process.log_path}",
                  file=out, flush=True)
        pool_servers = tuple(e.describe() for e in (await registry.snapshot()).entries)
        run_info = {"run_id": run_dir.name, "policy": options.policy, "pool": list(pool_servers),
                    "concurrent_evals": [s.name for s in specs]}
        write_json_atomic(run_dir / "run.json", {**run_info, "command": " ".join(sys.argv), "packages":
                                                 package_versions(), "started_at": datetime.now(UTC).isoformat()})
        print(f"[fedpool] running {len(specs)} evaluations concurrently through the pool "
              f"(policy {options.policy}): {', '.join(s.name for s in specs)}", file=out, flush=True)
        if options.verifier:
            specs = [s.model_copy(update={"verifier": True}) for s in specs]
            print("[fedpool] verifier: Ray CPU actors judging every prediction as it completes", file=out)
        started = time.monotonic()
        summaries = await run_evals_through_pool(  # (the judges run beside the llama.cpp servers, on their cores)
            registry, specs, run_dir, EvalTarget(model=launchers[0].record.model), policy=options.policy,
            dispatch=DispatchConfig(), concurrency=options.concurrency,
            verifier=lambda: verifier_pool(options, options.model_path, shares_engine_cores=True),
            media_actors=options.media_actors, metric_actors=options.metric_actors, progress="plain",
            run_info=run_info)
        wall = time.monotonic() - started
    report = DemoReport(run_dir, wall, tuple(summaries), answered_by_server(summaries), pool_servers)
    write_json_atomic(run_dir / "report.json", report.as_json())
    print("\n" + report.text(), file=out, flush=True)
    return report
