"""The conventional baseline behaves as documented (docs/speedup.md): split servers, static batches that
wait for their slowest member, loading before each batch, scoring after inference. A weak baseline would
inflate the speedup, so each of these is checked against real emulated servers. The tests that measure the
baseline's own stage costs run on looptime's virtual clock (the eval's clock and the engine's are the loop's), where
a cost of 0.01 s lasts exactly 0.01 s whatever else the machine runs; the HTTP between them takes no loop time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from fedpool.benchmarks.conventional import BaselineServer, ConventionalEval, shards
from fedpool.benchmarks.costs import StageCosts
from fedpool.deploy.batching import BatchEngine, Generation
from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile
from fedpool.pipeline import BenchmarkSpec, read_records

SCALE = 20.0  # emulated engine seconds per wall second


def make_spec(tmp_path: Path, n: int) -> BenchmarkSpec:
    data = tmp_path / "data.jsonl"
    with data.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"s{i:03d}", "prompt": f"question {i} " + "word " * (i % 7), "answer": "x"})
                    + "\n")
    return BenchmarkSpec.model_validate({
        "name": "conv", "data": {"path": str(data)}, "prompt": {"template": "{prompt}"},
        "generation": {"max_tokens": 16}, "metrics": ["exact_match"],
    })


async def start(max_running: int = 64, spread: float = 0.8) -> EmulatedServer:
    server = EmulatedServer(model="m", speedup=SCALE, profile=EmulatorProfile(
        max_running=max_running, decode_s_per_token=0.02, default_output_tokens=64, output_spread=spread))
    # The engine's steps on the loop's clock (virtual where the test runs under looptime; the same as the
    # machine's otherwise).
    server.engine = CountingEngine(server.profile, speedup=SCALE, clock=loop_time)
    await server.start()
    return server


def loop_time() -> float:
    return asyncio.get_running_loop().time()


class CountingEngine(BatchEngine):
    """The emulator's engine, counting the most requests it held at once (running and queued)."""

    peak = 0

    async def generate(self, prompt_tokens: int, out_tokens: int, blocks: tuple[int, ...] = (),
                       rid: str | None = None, on_first_token: Callable[[], None] | None = None) -> Generation:
        self.peak = max(self.peak, self.running + self.waiting + 1)
        return await super().generate(prompt_tokens, out_tokens, blocks, rid, on_first_token)


def peak_of(server: EmulatedServer) -> int:
    assert isinstance(server.engine, CountingEngine)
    return server.engine.peak


async def test_static_batches_wait_for_their_slowest_request(tmp_path: Path) -> None:
    server = await start()
    spec = make_spec(tmp_path, 20)
    run = ConventionalEval(spec, [BaselineServer("a", server.url)], model="m", out_dir=tmp_path / "out",
                           batch_size=8, time_scale=SCALE)
    try:
        async with aiohttp.ClientSession() as session:
            result = await run.run(session)
    finally:
        await server.stop()
    assert [b.size for b in result.batches] == [8, 8, 4]
    for before, after in zip(result.batches, result.batches[1:], strict=False):
        assert after.sent >= before.done  # the next batch leaves only when the whole batch is back
    assert peak_of(server) <= 8  # never more than one batch at the engine, though it could run 64
    assert result.records == 20 and result.failed == 0
    records = read_records(tmp_path / "out" / "conv" / "records.jsonl")
    assert sorted(r.sample_id for r in records) == [f"s{i:03d}" for i in range(20)]
    # Answers of varying length (output_spread): a batch lasts as long as its longest answer.
    lengths = [r.provenance.completion_tokens for r in records]
    counted = [n for n in lengths if n is not None]
    assert len(counted) == len(lengths) and min(counted) < max(counted)


@pytest.mark.looptime
async def test_loading_before_each_batch_and_scoring_after_inference(tmp_path: Path) -> None:
    server = await start()
    spec = make_spec(tmp_path, 16)
    costs = StageCosts(load_s=0.2, metric_s=0.05, verify_s=0.05)  # engine seconds per item
    run = ConventionalEval(spec, [BaselineServer("a", server.url)], model="m", out_dir=tmp_path / "out",
                           batch_size=8, costs=costs, time_scale=SCALE, clock=loop_time)
    try:
        async with aiohttp.ClientSession() as session:
            result = await run.run(session)
    finally:
        await server.stop()
    for batch in result.batches:  # 8 items loaded one after another before the batch is sent
        assert batch.sent - batch.load_start == pytest.approx(8 * 0.2 / SCALE)
        assert batch.done > batch.sent  # and then the engine's time
    assert result.scoring_s == pytest.approx(16 * 0.1 / SCALE)  # serial, after the last answer
    assert result.wall_time_s >= result.inference_s + result.scoring_s


async def test_several_servers_split_the_samples_into_contiguous_shards(tmp_path: Path) -> None:
    servers = [await start(), await start()]
    spec = make_spec(tmp_path, 21)
    run = ConventionalEval(spec, [BaselineServer(f"srv{i}", s.url) for i, s in enumerate(servers)], model="m",
                           out_dir=tmp_path / "out", batch_size=4, time_scale=SCALE)
    try:
        async with aiohttp.ClientSession() as session:
            await run.run(session)
    finally:
        for s in servers:
            await s.stop()
    records = read_records(tmp_path / "out" / "conv" / "records.jsonl")
    by_server = {r.sample_id: r.provenance.server_id for r in records}
    assert [by_server[f"s{i:03d}"] for i in range(21)] == ["srv0"] * 11 + ["srv1"] * 10
    assert [len(p) for p in shards(list(range(5)), 3)] == [2, 2, 1]


@pytest.mark.looptime
async def test_a_sliding_window_keeps_c_in_flight_and_refills_as_each_answers(tmp_path: Path) -> None:
    """lm-eval's API client with num_concurrent=C: never more than C at the engine, and the next request goes
    out as soon as one answers (no batch barrier: answers of uneven length do not hold the others back)."""
    server = await start(spread=0.8)
    spec = make_spec(tmp_path, 30)
    costs = StageCosts(load_s=0.1)
    run = ConventionalEval(spec, [BaselineServer("a", server.url, capacity=6)], model="m", out_dir=tmp_path / "out",
                           mode="sliding", costs=costs, time_scale=SCALE, clock=loop_time)
    started = loop_time()
    try:
        async with aiohttp.ClientSession() as session:
            result = await run.run(session)
    finally:
        await server.stop()
    assert peak_of(server) == 6  # the window: the server's capacity, full
    assert result.records == 30 and result.failed == 0
    # Every request was built before the first went out (30 loads, serially), as build_all_requests does.
    assert result.batches[0].sent - started == pytest.approx(30 * 0.1 / SCALE)
    # Refilled: the window stays full, so the whole shard takes about 30/6 rounds of answers, not more.
    records = read_records(tmp_path / "out" / "conv" / "records.jsonl")
    mean_latency = sum(r.provenance.latency_s or 0 for r in records) / len(records)
    assert result.inference_s <= (30 / 6 + 2) * mean_latency


async def test_the_whole_eval_is_handed_over_at_once(tmp_path: Path) -> None:
    """lm-eval's vLLM backend with batch_size=auto: every request at the engine at once."""
    server = await start(max_running=64)
    spec = make_spec(tmp_path, 40)
    run = ConventionalEval(spec, [BaselineServer("a", server.url, capacity=8)], model="m", out_dir=tmp_path / "out",
                           mode="whole", time_scale=SCALE)
    try:
        async with aiohttp.ClientSession() as session:
            result = await run.run(session)
    finally:
        await server.stop()
    assert peak_of(server) == 40 and result.records == 40  # all of them, whatever the declared capacity


def test_the_careful_split_is_prefill_aware_and_exact_for_small_pools() -> None:
    """The conventional arms' assignment is the best a careful user could make from the data sheets: the
    prompt-heavy eval goes where prefill is fast even though a decode-speed ranking would not put it there,
    and for small pools no other assignment predicts a shorter makespan."""
    import itertools

    from fedpool.benchmarks.assignment import Workload, careful_split, ideal_makespan, split_makespan
    from fedpool.deploy.emulator import PROFILES

    a100, v100 = PROFILES["vllm-a100-80gb-7b"], PROFILES["vllm-v100-32gb-7b"]
    profiles = {"a100": a100, "v100-0": v100, "v100-1": v100}
    work = [Workload("video", 300, 7000, 32), Workload("text", 1200, 250, 384), Workload("image", 1600, 1100, 24)]
    split, span = careful_split(work, profiles)
    assert split["video"] == ["a100"] or "a100" in split["video"]
    subsets = [c for k in range(1, 4) for c in itertools.combinations(sorted(profiles), k)]
    every = min(split_makespan({w.name: list(c) for w, c in zip(work, choice, strict=True)}, work, profiles)
                for choice in itertools.product(subsets, repeat=3))
    assert span == every  # exact: the minimum over every assignment
    # Many evals, few servers: longest-first onto the server that finishes it soonest, each eval on one.
    many = [Workload(f"e{i}", 100 + 50 * i, 500, 64) for i in range(12)]
    big_split, big_span = careful_split(many, profiles)
    assert all(len(s) == 1 for s in big_split.values())
    ideal, _ = ideal_makespan(many, profiles)
    largest = max(split_makespan({w.name: ["a100"]}, [w], {"a100": a100}) for w in many)
    assert ideal <= big_span <= ideal + largest  # the list-scheduling bound: within one eval of the fluid optimum
