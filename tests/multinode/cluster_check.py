"""Run by tests/test_multinode.py in its own process: a Ray cluster of three nodes on this machine
(ray.cluster_utils.Cluster), the registry pinned to one node, servers registering from the two others, and
a CPU actor scoring records on a node other than the registry's. Writes one JSON object to the file named by
its one argument (not to stdout, where Ray's own threads print their log lines and can split a line of ours)."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.cluster_utils import Cluster

if TYPE_CHECKING:
    from fedpool.deploy.emulator import EmulatedServer


class NodeLauncher:
    """Starts an emulated server on its node and registers it, as `fedpool serve` would there."""

    def __init__(self, token: str):
        self._token = token
        self._server: EmulatedServer | None = None

    @ray.method  # typed: Ray's types know `.remote()` of this method on the class's handles
    async def launch(self, server_id: str) -> dict[str, str]:
        from fedpool.deploy.emulator import EmulatedServer
        from fedpool.registry import Engine, RegistryClient, ServerRecord

        self._server = EmulatedServer(model="multi-model")
        url = await self._server.start()
        client = await RegistryClient.connect(token=self._token)
        await client.register(ServerRecord(id=server_id, url=url, engine=Engine.VLLM, model="multi-model"))
        return {"server_id": server_id, "node": ray.get_runtime_context().get_node_id()}


class ScoringActor:
    """A CPU stage: post-processing and metrics of finished predictions."""

    @ray.method
    def score(self, predictions: list[str], labels: list[str]) -> dict[str, object]:
        from fedpool.pipeline.metrics import exact_match

        return {"node": ray.get_runtime_context().get_node_id(),
                "scores": [exact_match(p, [label]) for p, label in zip(predictions, labels, strict=True)]}


async def main() -> dict[str, object]:
    from fedpool.federation import DispatchConfig, Endpoint, InferenceRequest, PoolConnection, SamplingParams
    from fedpool.registry import RegistryClient

    # Ray's actor classes made by a call, not a class decorator: mypy does not apply a class decorator's type.
    launcher_class = ray.remote(num_cpus=0)(NodeLauncher)
    scorer_class = ray.remote(num_cpus=0)(ScoringActor)
    state = Path(tempfile.mkdtemp(prefix="fedpool-multinode-"))
    registry = await RegistryClient.start(state, token="multinode-token-123", probe_interval_s=0.5,
                                    resources={"registry-node": 0.01})
    # Ray types an untyped handle's methods as Never (they are remote methods): typed loosely once.
    handle: Any = registry.handle
    registry_node = await handle.node_id.remote()
    launchers = [launcher_class.options(resources={f"server-node-{i}": 0.01}).remote("multinode-token-123")
                 for i in (1, 2)]
    launched = await asyncio.gather(*(la.launch.remote(f"srv-{i}") for i, la in enumerate(launchers, start=1)))
    snapshot = await registry.snapshot()
    async with PoolConnection(registry, config=DispatchConfig(no_server_timeout_s=10)) as pool:
        results = await asyncio.gather(*(
            pool.dispatcher.submit(InferenceRequest(f"r{i}", "multi-model", Endpoint.COMPLETIONS,
                                                    prompt=f"q{i}", params=SamplingParams(max_tokens=4)))
            for i in range(20)
        ))
    scorer = scorer_class.options(resources={"server-node-2": 0.01}).remote()
    scored = await scorer.score.remote([r.completion.text for r in results], [r.completion.text for r in results])
    await handle.shutdown_prober.remote()
    return {
        "registry_node": registry_node,
        "server_nodes": {x["server_id"]: x["node"] for x in launched},
        "registered": list(snapshot.ids()),
        "answered_by": sorted({r.server_id for r in results}),
        "scorer_node": scored["node"],
        "scores": scored["scores"],
    }


if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"registry-node": 1}})
    for i in (1, 2):
        cluster.add_node(num_cpus=1, resources={f"server-node-{i}": 1})
    ray.init(address=cluster.address, namespace="fedpool", log_to_driver=False)
    try:
        Path(sys.argv[1]).write_text(json.dumps(asyncio.run(main())))
    finally:
        ray.shutdown()
        cluster.shutdown()
    sys.exit(0)
