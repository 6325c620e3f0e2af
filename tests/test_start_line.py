"""Evals started together in one process send their first requests together, whatever the client order: the
first to load its samples does not fill every slot while the others are still loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedpool.clients import EvalTarget, run_evals
from fedpool.federation import DispatchConfig, PoolConnection
from fedpool.pipeline import load_spec
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import EmulatorFactory, read_jsonl

pytestmark = pytest.mark.ray


def _spec(tmp: Path, name: str, samples: int, max_tokens: int, pad: int = 0) -> Path:
    data = tmp / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"id": f"{name}-{i}", "q": f"{i} + 1", "answer": str(i + 1), "pad": "x" * pad})
                            + "\n" for i in range(samples)), encoding="utf-8")
    spec = tmp / f"{name}.yaml"
    spec.write_text(json.dumps({
        "name": name, "version": "1", "data": {"path": data.name}, "label_field": "answer",
        "prompt": {"style": "completion", "template": "{q} ="},
        "generation": {"max_tokens": max_tokens, "temperature": 0.0}, "metrics": ["exact_match"]}), encoding="utf-8")
    return spec


async def test_under_fair_the_eval_that_loads_first_does_not_fill_every_slot(
        registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path) -> None:
    """`long` (8 samples, 32-token answers) loads at once; `big` (12 of 20,000 samples of 4 KB, 2-token answers:
    its 80 MB are hashed for the artifact) a moment later. Under `fair` each eval used to start as soon as it had
    loaded: `long` filled the 4 slots and `big`'s first request waited for one of its answers (in
    benchmarks/results/multiprocess.md's one-process arm a long eval that loaded first held all 8 slots 4 s and
    the short evals ended up to 1.4x later). At the start line both send together: `big`'s first request starts
    before `long`'s first answer."""
    server = await emulators.start(model="emu-model", max_running=4, decode_s=0.1)
    await registry.register(ServerRecord(id="emu", url=server.url, engine=Engine.VLLM, model="emu-model", capacity=4))
    specs = [load_spec(_spec(tmp_path, "long", 8, 32)), load_spec(_spec(tmp_path, "big", 20_000, 2, pad=4000))]
    specs[1] = specs[1].model_copy(update={"data": specs[1].data.model_copy(update={"limit": 12})})
    async with PoolConnection(registry, config=DispatchConfig(client_order="fair")) as pool:
        await run_evals(specs, pool.dispatcher, tmp_path / "out", EvalTarget("emu-model"), concurrency=8)
    records = {name: read_jsonl(tmp_path / "out" / name / "records.jsonl") for name in ("long", "big")}
    assert [len(records["long"]), len(records["big"])] == [8, 12]
    long_first_answer = min(r["provenance"]["completed_at"] for r in records["long"])
    big_first_start = min(r["provenance"]["completed_at"] - r["provenance"]["latency_s"] for r in records["big"])
    assert big_first_start < long_first_answer
