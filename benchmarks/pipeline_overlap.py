"""Pipeline overlap: one eval whose CPU stages are heavy (a CPU-bound metric and the real verifier),
run with its stages overlapped (fedpool) and one after another (inference, then metrics, then the
verifier, as OmniEvaluator's public code and most harnesses do).

    python -m fedpool.benchmarks.pipeline_overlap [--records 40] [--metric-s 0.4] [--verifier-actors 1]

Real parts: local Ray, the registry actor, an emulated vLLM server (its timing model makes inference a
stage of known length), the real verifier (llama-cpp-python with Gemma 3 270M on Ray CPU actors), and a
metric stage on Ray CPU actors that burns `--metric-s` CPU seconds per record (standing for a model-based
metric such as an embedding score; it hashes, it does not sleep). Each stage is also timed alone on the
same records: the overlapped run should take about as long as the slowest stage, the serial run as long
as their sum.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import ray

import fedpool.benchmarks.baselines  # noqa: F401 (registers the baseline policies it routes by)
from fedpool.benchmarks.costs import StageCosts, actor_hooks
from fedpool.benchmarks.report import markdown_table, write_report
from fedpool.clients import EvalTarget, run_evals
from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile
from fedpool.deploy.models import ensure_gemma
from fedpool.federation import PoolConnection
from fedpool.pipeline import load_spec
from fedpool.pipeline.artifact import read_records
from fedpool.pipeline.bundled import bundled_spec_paths
from fedpool.pipeline.stages import StagePool
from fedpool.pipeline.verifier import VerifierConfig, VerifierPool, judge_item
from fedpool.registry import Engine, RegistryClient, ServerRecord

MODEL = "overlap-model"


async def run(args: argparse.Namespace) -> dict[str, float]:
    spec = load_spec(next(p for p in bundled_spec_paths() if p.stem == "capitals_mc"))
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"limit": args.records})})
    profile = EmulatorProfile("overlap", max_running=args.slots, decode_s_per_token=args.decode_s,
                              batch_slowdown=0.0, default_output_tokens=spec.generation.max_tokens)
    server = EmulatedServer(model=MODEL, profile=profile)
    await server.start()
    work = Path(tempfile.mkdtemp(prefix="fedpool-overlap-"))
    registry = await RegistryClient.start(work / "registry", probe_interval_s=1.0)
    await registry.register(ServerRecord(id="emu-0", url=server.url, engine=Engine.VLLM, model=MODEL,
                                         accelerator="A100", capacity=args.slots))
    model_path = await asyncio.to_thread(ensure_gemma)
    verifier = VerifierPool(VerifierConfig(model_path=str(model_path), actors=args.verifier_actors,
                                           threads=args.verifier_threads))
    metrics = StagePool(args.metric_actors, num_cpus=1.0)
    try:
        await asyncio.gather(verifier.ready(), metrics.ready())
        async with PoolConnection(registry, policy="least_inflight") as pool:
            target = EvalTarget(model=MODEL)
            # Serial: inference alone, then every record through the metric stage, then the verifier.
            t0 = time.perf_counter()
            plain = spec.model_copy(update={"verifier": False})
            (inference,) = await run_evals([plain], pool.dispatcher, work / "serial", target,
                                           concurrency=args.concurrency)
            inference_s = time.perf_counter() - t0
            records = await asyncio.to_thread(read_records, inference.artifact_dir / "records.jsonl")
            t1 = time.perf_counter()
            hooks = actor_hooks(metrics, StageCosts(metric_s=args.metric_s), 1.0, cpu_bound=True)
            assert hooks.after is not None
            await asyncio.gather(*(hooks.after() for _ in records))
            metric_s = time.perf_counter() - t1
            t2 = time.perf_counter()
            judgments = await verifier.judge_many([judge_item(r) for r in records])
            verifier_s = time.perf_counter() - t2
            serial_s = time.perf_counter() - t0
            # Overlapped: the same eval with its metric stage and the verifier running beside inference.
            t3 = time.perf_counter()
            (overlapped,) = await run_evals(
                [spec.model_copy(update={"verifier": True})], pool.dispatcher, work / "overlapped", target,
                concurrency=args.concurrency, verifier=verifier, stages={spec.name: hooks})
            overlapped_s = time.perf_counter() - t3
        done = await asyncio.to_thread(read_records, overlapped.artifact_dir / "records.jsonl")
        assert len(done) == len(records) == args.records and all(r.verifier is not None for r in done)
        return {
            "records": float(len(records)),
            "inference_s": inference_s, "metric_s": metric_s, "verifier_s": verifier_s,
            "serial_s": serial_s, "overlapped_s": overlapped_s,
            "metric_records_per_s": len(records) / metric_s,
            "judgments_per_s_per_actor": len(judgments) / verifier_s / args.verifier_actors,
            "unparsed": float(sum(1 for j in judgments if j.rating is None)),
        }
    finally:
        verifier.shutdown()
        metrics.shutdown()
        await registry.terminate()
        await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=40, help="samples of capitals_mc (at most 60)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--slots", type=int, default=4, help="the emulated server's max running sequences")
    parser.add_argument("--decode-s", type=float, default=0.2, help="emulated seconds per decode step")
    parser.add_argument("--metric-s", type=float, default=0.4, help="CPU seconds of the metric per record")
    parser.add_argument("--metric-actors", type=int, default=1)
    parser.add_argument("--verifier-actors", type=int, default=1)
    parser.add_argument("--verifier-threads", type=int, default=1)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 2), namespace="fedpool", include_dashboard=False,
             log_to_driver=False)
    try:
        r = asyncio.run(run(args))
    finally:
        ray.shutdown()
    slowest = max(r["inference_s"], r["metric_s"], r["verifier_s"])
    rows = [
        (f"inference alone (emulated vLLM, concurrency {args.concurrency}, {args.slots} slots)",
         f"{r['inference_s']:.1f} s", ""),
        (f"metric stage alone ({args.metric_actors} actor, {args.metric_s:g} CPU s per record)",
         f"{r['metric_s']:.1f} s", f"{r['metric_records_per_s']:.2f} records/s"),
        (f"verifier alone ({args.verifier_actors} actor × {args.verifier_threads} thread, Gemma 3 270M)",
         f"{r['verifier_s']:.1f} s", f"{r['judgments_per_s_per_actor']:.2f} judgments/s per actor"),
        ("serial: inference, then metrics, then verifier (baseline)", f"{r['serial_s']:.1f} s", "sum of stages"),
        ("overlapped (fedpool: stages beside inference, bounded queues)", f"{r['overlapped_s']:.1f} s",
         f"{r['overlapped_s'] / slowest:.2f} × the slowest stage"),
    ]
    body = (
        f"One eval: capitals_mc, {int(r['records'])} records, verifier on, a CPU-bound metric on Ray actors. "
        f"On this {os.cpu_count()}-core machine the verifier's llama.cpp thread, the metric actor, the "
        "emulated server and the client share the cores, so stages that overlap also compete.\n\n"
        + markdown_table(("stage / run", "wall time", "rate / note"), rows)
        + f"\n\nSpeedup of overlapping: {r['serial_s'] / r['overlapped_s']:.2f}× over serial. "
        f"Verifier answers that did not parse (scored 0, counted): {int(r['unparsed'])}."
    )
    for row in rows:
        print(f"{row[0]:<72} {row[1]:>8}  {row[2]}")
    write_report("pipeline_overlap", "Pipeline overlap: stages beside inference vs one after another", body, {
        "overlapped_s": f"{r['overlapped_s']:.1f}",
        "serial_s": f"{r['serial_s']:.1f}",
        "slowest_stage_s": f"{slowest:.1f}",
        "overlap_vs_slowest": f"{r['overlapped_s'] / slowest:.2f}",
    })


if __name__ == "__main__":
    main()
