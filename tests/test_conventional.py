"""The conventional baseline behaves as documented (docs/speedup.md): split servers, static batches that
wait for their slowest member, loading before each batch, scoring after inference. A weak baseline would
inflate the speedup, so each of these is checked against real emulated servers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
from fedpool.benchmarks.conventional import BaselineServer, ConventionalEval, shards
from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile
from fedpool.pipeline import BenchmarkSpec, read_records
from fedpool.pipeline.stages import StageCosts

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
    await server.start()
    return server


class RunningPeak:
    def __init__(self, servers: list[EmulatedServer]):
        self.servers, self.peak = servers, [0] * len(servers)

    async def watch(self) -> None:
        while True:
            for i, s in enumerate(self.servers):
                self.peak[i] = max(self.peak[i], s.stats.running + s.stats.waiting)
            await asyncio.sleep(0)


async def test_static_batches_wait_for_their_slowest_request(tmp_path: Path) -> None:
    server = await start()
    spec = make_spec(tmp_path, 20)
    run = ConventionalEval(spec, [BaselineServer("a", server.url)], model="m", out_dir=tmp_path / "out",
                           batch_size=8, time_scale=SCALE)
    peak = RunningPeak([server])
    watcher = asyncio.create_task(peak.watch())
    try:
        async with aiohttp.ClientSession() as session:
            result = await run.run(session)
    finally:
        watcher.cancel()
        await server.stop()
    assert [b.size for b in result.batches] == [8, 8, 4]
    for before, after in zip(result.batches, result.batches[1:], strict=False):
        assert after.sent >= before.done  # the next batch leaves only when the whole batch is back
    assert peak.peak[0] <= 8  # never more than one batch at the engine, though it could run 64
    assert result.records == 20 and result.failed == 0
    records = read_records(tmp_path / "out" / "conv" / "records.jsonl")
    assert sorted(r.sample_id for r in records) == [f"s{i:03d}" for i in range(20)]
    # Answers of varying length (output_spread): a batch lasts as long as its longest answer.
    lengths = [r.provenance.completion_tokens for r in records]
    assert min(lengths) < max(lengths)


async def test_loading_before_each_batch_and_scoring_after_inference(tmp_path: Path) -> None:
    server = await start()
    spec = make_spec(tmp_path, 16)
    costs = StageCosts(load_s=0.2, metric_s=0.05, verify_s=0.05)  # engine seconds per item
    run = ConventionalEval(spec, [BaselineServer("a", server.url)], model="m", out_dir=tmp_path / "out",
                           batch_size=8, costs=costs, time_scale=SCALE)
    try:
        async with aiohttp.ClientSession() as session:
            result = await run.run(session)
    finally:
        await server.stop()
    for batch in result.batches:  # 8 items loaded one after another before the batch is sent
        assert batch.sent - batch.load_start >= 8 * 0.2 / SCALE * 0.95
    assert result.scoring_s >= 16 * 0.1 / SCALE * 0.95  # serial, after the last answer
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
