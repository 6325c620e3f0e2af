"""The verifier on a Ray CPU actor with the real Gemma 270M GGUF, overlapped with an eval's inference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedpool.clients import EvalTarget, run_evals
from fedpool.deploy.models import ensure_gemma
from fedpool.federation import DispatchConfig, PoolConnection
from fedpool.pipeline import load_spec
from fedpool.pipeline.actors import cpu_actor_options
from fedpool.pipeline.bundled import bundled_spec_paths
from fedpool.pipeline.verifier import JudgeItem, VerifierConfig, VerifierPool
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import EmulatorFactory, read_jsonl

pytestmark = pytest.mark.ray


@pytest.fixture
def verifier_pool(ray_cluster: None) -> Iterator[VerifierPool]:
    pool = VerifierPool(VerifierConfig(model_path=str(ensure_gemma()), actors=1, threads=1))
    yield pool
    pool.shutdown()


@pytest.mark.llamacpp  # the judge: llama.cpp (llama-cpp-python) in CPU actors
async def test_cpu_actors_run_at_the_eval_processes_priority(verifier_pool: VerifierPool) -> None:
    """Ray starts workers at niceness 15; a judge or stage actor there gets ~3% of a core shared with a CPU
    engine at 0. Every fedpool CPU actor runs at niceness 0, like the eval's own process."""
    import os

    from fedpool.pipeline.stages import StagePool

    judge_nice = await verifier_pool._actors[0].__ray_call__.remote(lambda _self: os.nice(0))
    stages = StagePool(1, num_cpus=0.1)
    try:
        await stages.ready()
        stage_nice = await stages._actors[0].__ray_call__.remote(lambda _self: os.nice(0))
    finally:
        stages.shutdown()
    assert (judge_nice, stage_nice) == (0, 0)


def test_actor_options_keep_a_callers_environment() -> None:
    options = cpu_actor_options(0.5, {"runtime_env": {"env_vars": {"X": "1"}, "pip": ["a"]}, "name": "n"})
    assert options["runtime_env"] == {"pip": ["a"], "env_vars": {"RAY_worker_niceness": "0", "X": "1"}}
    assert (options["num_cpus"], options["name"], options["max_restarts"]) == (0.5, "n", -1)


@pytest.mark.llamacpp
async def test_real_judgments_come_back_parsed_or_counted(verifier_pool: VerifierPool) -> None:
    items = [JudgeItem("What is the capital of France?", "Paris", p) for p in ("Paris", "Berlin", "paris.")]
    judgments = await verifier_pool.judge_many(items)
    assert len(judgments) == 3 and all(j.raw for j in judgments)
    assert verifier_pool.judged == 3
    assert verifier_pool.unparsed == sum(j.rating is None for j in judgments)


@pytest.mark.llamacpp
async def test_every_record_of_a_verified_eval_is_judged_once(
    registry: RegistryClient, emulators: EmulatorFactory, verifier_pool: VerifierPool, tmp_path: Path
) -> None:
    server = await emulators.start(model="emu-model")
    await registry.register(ServerRecord(id="emu", url=server.url, engine=Engine.VLLM, model="emu-model", capacity=4))
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


@pytest.mark.llamacpp
@pytest.mark.parametrize("shared", [False, True])
async def test_judge_calls_count_as_work_left_when_judges_share_the_engines_cores(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path, shared: bool
) -> None:
    """shortest_first, one slot: 4 judged multiple-choice samples are less inference than 12 arith samples,
    so they go first, unless the judges run on the engines' cores: then each judgment costs the pool as
    much as an inference call and the arith eval has less work left. Both evals start together, so the first
    grant already follows the order."""
    server = await emulators.start(model="emu-model", max_running=1)
    await registry.register(ServerRecord(id="emu", url=server.url, engine=Engine.VLLM, model="emu-model", capacity=1))
    paths = {p.stem: p for p in bundled_spec_paths()}
    judged = load_spec(paths["capitals_mc"])
    judged = judged.model_copy(update={"verifier": True, "data": judged.data.model_copy(update={"limit": 4})})
    arith = load_spec(paths["arith"])
    arith = arith.model_copy(update={"data": arith.data.model_copy(update={"limit": 12})})
    judges = VerifierPool(VerifierConfig(model_path=str(ensure_gemma()), actors=1, threads=1,
                                         shares_engine_cores=shared))
    try:
        await judges.ready()
        async with PoolConnection(registry, config=DispatchConfig(client_order="shortest_first")) as pool:
            summaries = await run_evals([judged, arith], pool.dispatcher, tmp_path, EvalTarget(model="emu-model"),
                                        verifier=judges)
    finally:
        judges.shutdown()
    answered = {s.benchmark: sorted(r["provenance"]["completed_at"] for r in read_jsonl(
        s.artifact_dir / "records.jsonl")) for s in summaries}
    assert [len(answered["capitals_mc"]), len(answered["arith"])] == [4, 12]
    if shared:
        assert answered["arith"][-1] < answered["capitals_mc"][0], answered
    else:
        assert answered["capitals_mc"][-1] < answered["arith"][0], answered


@pytest.mark.slow
async def test_benchmark_summaries_are_computed_on_cpu_actors(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    """`fedpool eval run` hands each benchmark's summary (corpus metrics, bootstrap intervals) to CPU actors
    (here from any size; by default from `SUMMARY_ON_ACTORS_FROM` records): the scores are the same as computed
    in the process, and the actors did the work (one call per eval)."""
    from fedpool.pipeline import summarize_records
    from fedpool.pipeline.artifact import read_records
    from fedpool.pipeline.stages import StagePool

    server = await emulators.start(model="emu-model")
    await registry.register(ServerRecord(id="emu", url=server.url, engine=Engine.VLLM, model="emu-model", capacity=4))
    specs = [load_spec(p) for p in bundled_spec_paths()[:2]]
    specs = [s.model_copy(update={"data": s.data.model_copy(update={"limit": 8})}) for s in specs]
    scoring = StagePool(1, num_cpus=0.1)
    try:  # not made ready first (as `eval run` does): the actor starts while the evals run
        async with PoolConnection(registry) as pool:
            summaries = await run_evals(specs, pool.dispatcher, tmp_path, EvalTarget(model="emu-model"),
                                        scoring=scoring, summary_on_actors_from=0)
    finally:
        scoring.shutdown()
    assert scoring.calls == len(specs)
    for spec, summary in zip(specs, summaries, strict=True):
        here = summarize_records(spec, read_records(summary.artifact_dir / "records.jsonl"))
        assert summary.summary["scores"] == here["scores"] and summary.summary["records"] == 8


async def test_a_small_evals_summary_starts_no_actor(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    """Below `SUMMARY_ON_ACTORS_FROM` records the summary is computed on a thread of the eval's process, and the
    scoring pool's actors are never started (each is a Ray worker process: more CPU to boot than the summary
    costs); the scores are the ones the actors would compute."""
    from fedpool.clients.eval_client import SUMMARY_ON_ACTORS_FROM
    from fedpool.pipeline import summarize_records
    from fedpool.pipeline.artifact import read_records
    from fedpool.pipeline.stages import StagePool

    server = await emulators.start(model="emu-model")
    await registry.register(ServerRecord(id="emu", url=server.url, engine=Engine.VLLM, model="emu-model", capacity=4))
    spec = load_spec(bundled_spec_paths()[0])
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"limit": 8})})
    assert 8 < SUMMARY_ON_ACTORS_FROM
    scoring = StagePool(1, num_cpus=0.1)
    try:
        async with PoolConnection(registry) as pool:
            [summary] = await run_evals([spec], pool.dispatcher, tmp_path, EvalTarget(model="emu-model"),
                                        scoring=scoring)
        assert not scoring.started and scoring.calls == 0
    finally:
        scoring.shutdown()
    here = summarize_records(spec, read_records(summary.artifact_dir / "records.jsonl"))
    assert summary.summary["scores"] == here["scores"] and summary.summary["records"] == 8


async def test_a_stage_pool_that_cannot_be_placed_fails_its_calls_instead_of_hanging(ray_cluster: None) -> None:
    """Calls wait for the actors to be up (a pool is used without `ready` first); actors the cluster cannot
    place make every call raise after the readiness timeout, naming the cause, so the eval scores on a thread."""
    from fedpool.pipeline.stages import StagePool

    pool = StagePool(1, num_cpus=10_000, ready_timeout_s=1.0)  # far more CPUs than the test cluster has
    try:
        with pytest.raises(RuntimeError, match="did not all start within 1 s"):
            await pool.run(len, [1, 2])
        with pytest.raises(RuntimeError, match="cannot place them"):  # and again, at once: the same check
            await pool.run(len, [1, 2])
        assert pool.calls == 0
    finally:
        pool.shutdown()
    placed = StagePool(1, num_cpus=0.1)
    try:
        assert await placed.run(len, [1, 2, 3]) == 3 and placed.calls == 1
    finally:
        placed.shutdown()
