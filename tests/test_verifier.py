"""The verifier on a Ray CPU actor with the real Gemma 270M GGUF, overlapped with an eval's inference."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients import EvalTarget, run_evals
from deploy.models import ensure_gemma
from federation import PoolConnection
from pipeline import load_spec
from pipeline.bundled import bundled_spec_paths
from pipeline.verifier import JudgeItem, VerifierConfig, VerifierPool
from registry import RegistryClient, ServerRecord
from tests.conftest import EmulatorFactory, read_jsonl

pytestmark = pytest.mark.ray


@pytest.fixture
def verifier_pool(ray_cluster: None) -> VerifierPool:
    pool = VerifierPool(VerifierConfig(model_path=str(ensure_gemma()), actors=1, threads=1))
    yield pool
    pool.shutdown()


async def test_real_judgments_come_back_parsed_or_counted(verifier_pool: VerifierPool) -> None:
    items = [JudgeItem("What is the capital of France?", "Paris", p) for p in ("Paris", "Berlin", "paris.")]
    judgments = await verifier_pool.judge_many(items)
    assert len(judgments) == 3 and all(j.raw for j in judgments)
    assert verifier_pool.judged == 3
    assert verifier_pool.unparsed == sum(j.rating is None for j in judgments)


async def test_every_record_of_a_verified_eval_is_judged_once(
    registry: RegistryClient, emulators: EmulatorFactory, verifier_pool: VerifierPool, tmp_path: Path
) -> None:
    server = await emulators.start(model="emu-model")
    await registry.register(ServerRecord(id="emu", url=server.url, engine="vllm", model="emu-model", capacity=4))
    spec = load_spec(bundled_spec_paths()[1])
    spec = spec.model_copy(update={"verifier": True, "data": spec.data.model_copy(update={"limit": 6})})
    async with PoolConnection(registry) as pool:
        (summary,) = await run_evals([spec], pool.dispatcher, tmp_path, EvalTarget(model="emu-model"),
                                     verifier=verifier_pool)
    records = read_jsonl(summary.artifact_dir / "records.jsonl")
    assert len(records) == 6 and len({r["sample_id"] for r in records}) == 6
    assert all(r["verifier"] is not None and r["metrics"]["verifier"] in (0.0, 1.0) for r in records)
    scores = {s["metric"]: s for s in summary.summary["scores"]}
    assert "verifier" in scores and 0.0 <= scores["verifier"]["value"] <= 100.0
    assert summary.summary["verifier_unparsed"] == sum(not r["verifier"]["parsed"] for r in records)
    with pytest.raises(ValueError, match="asks for the verifier"):
        await run_evals([spec], pool.dispatcher, tmp_path / "other", EvalTarget(model="emu-model"))
