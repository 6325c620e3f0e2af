"""Run in its own process (by tests/test_multinode.py and benchmarks/reliability.py): a two-node Ray
cluster on this machine (ray.cluster_utils.Cluster); the CPU stage actors of two evals start on the worker
node; when half the records are written the worker node is removed. Ray starts the actors again on the
head and retries the calls that were in flight; every record must still end in the artifact exactly once.
Writes one JSON object (the scenario's figure) to the file named by its one argument: not to stdout,
where Ray's own threads print their log lines and can split a line of ours."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

if TYPE_CHECKING:
    from ray._private.node import Node

MODEL = "node-loss-model"


async def main(cluster: Cluster, worker: Node, worker_id: str) -> dict[str, object]:
    from fedpool.benchmarks.costs import StageCosts, actor_hooks
    from fedpool.benchmarks.reliability import count
    from fedpool.clients import EvalProgress, EvalTarget, run_evals
    from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile
    from fedpool.federation import PoolConnection
    from fedpool.pipeline import load_spec
    from fedpool.pipeline.bundled import bundled_spec_paths
    from fedpool.pipeline.stages import StagePool
    from fedpool.registry import Engine, RegistryClient, ServerRecord

    work = Path(tempfile.mkdtemp(prefix="fedpool-node-loss-"))
    registry = await RegistryClient.start(work / "registry", token="node-loss-token-1234", probe_interval_s=0.5)
    profile = EmulatorProfile("slow", max_running=4, decode_s_per_token=0.05, batch_slowdown=0.0)
    servers = [EmulatedServer(model=MODEL, profile=profile, seed=i) for i in range(2)]
    for i, server in enumerate(servers):
        await server.start()
        await registry.register(ServerRecord(id=f"emu-{i}", url=server.url, engine=Engine.VLLM, model=MODEL,
                                             capacity=4))
    # Soft affinity: the actors start on the worker node, and may be started again elsewhere when it is gone.
    stages = StagePool(2, num_cpus=0.5, actor_options={
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=worker_id, soft=True)})
    await stages.ready()
    placed_before = sorted(set(await asyncio.gather(*(a.node.remote() for a in stages._actors))))
    specs = [load_spec(p) for p in bundled_spec_paths() if p.stem in ("arith", "capitals")]
    hooks = actor_hooks(stages, StageCosts(load_s=0.02, metric_s=0.02), 1.0)
    total = 135
    done: dict[str, int] = {}
    removed = asyncio.Event()

    def progress(p: EvalProgress) -> None:
        done[p.benchmark] = p.done
        if not removed.is_set() and sum(done.values()) >= total // 2:
            removed.set()
            cluster.remove_node(worker)  # the worker node is gone, with the actors on it

    started = time.perf_counter()
    async with PoolConnection(registry, policy="capacity_weighted") as pool:
        summaries = await run_evals(specs, pool.dispatcher, work / "run", EvalTarget(model=MODEL), concurrency=8,
                                    on_progress=progress, stages={s.name: hooks for s in specs})
    wall = time.perf_counter() - started
    placed_after = sorted(set(await asyncio.gather(*(a.node.remote() for a in stages._actors))))
    expected, written, duplicated, failed = await asyncio.to_thread(count, summaries)
    stages.shutdown()
    await registry.terminate()
    for server in servers:
        await server.stop()
    return {"expected": expected, "written": written, "duplicated": duplicated, "failed": failed,
            "wall_s": wall, "removed": removed.is_set(), "worker_node": worker_id,
            "stage_nodes_before": placed_before, "stage_nodes_after": placed_after}


if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    worker = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, namespace="fedpool", log_to_driver=False)
    try:
        worker_id = next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] and n["Alive"]
                         and n["NodeID"] != ray.get_runtime_context().get_node_id())
        figure = asyncio.run(main(cluster, worker, worker_id))
        Path(sys.argv[1]).write_text(json.dumps(figure))
    finally:
        ray.shutdown()
        cluster.shutdown()
    sys.exit(0)
