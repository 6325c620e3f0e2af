"""The continuous-batching engine model behind the emulated vLLM/SGLang servers (deploy.batching)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from fedpool.deploy.batching import BLOCK, BatchEngine, PromptTooLong, prompt_blocks
from fedpool.deploy.emulator import PROFILES, EmulatedServer, EmulatorProfile, profile_from_json
from fedpool.federation.core.types import Endpoint, InferenceRequest
from fedpool.federation.gateway.transport import HttpTransport, new_session
from fedpool.federation.gateway.unpooled import UrlTarget
from fedpool.registry import adapter_for

FAST = 10.0  # engine seconds per wall second in these tests (slow enough that timing is the model)


def profile(*, max_running: int = 8, decode_s_per_token: float = 0.01, prefill_s_per_token: float = 0.0,
            max_batched_tokens: int = 4096, kv_cache_tokens: int | None = None,
            prefix_cache: bool = False) -> EmulatorProfile:
    return EmulatorProfile(max_running=max_running, decode_s_per_token=decode_s_per_token, batch_slowdown=0.0,
                           prefill_s_per_token=prefill_s_per_token, max_batched_tokens=max_batched_tokens,
                           kv_cache_tokens=kv_cache_tokens, prefix_cache=prefix_cache)


async def timed(engine: BatchEngine, n: int, prompt: int, out: int) -> float:
    start = time.monotonic()
    await asyncio.gather(*(engine.generate(prompt, out) for _ in range(n)))
    return (time.monotonic() - start) * FAST


async def test_a_batch_costs_about_what_one_sequence_costs() -> None:
    """Decode is one step per token for the whole batch: 8 sequences take ~the time of one, not 8×."""
    engine = BatchEngine(profile(), speedup=FAST)
    one = await timed(engine, 1, 10, 50)
    eight = await timed(engine, 8, 10, 50)
    await engine.close()
    assert one == pytest.approx(0.5, rel=0.3)  # 50 steps of 10 ms
    assert eight < 2 * one
    assert engine.counters.generation_tokens == 9 * 50 and engine.counters.finished == 9


@pytest.mark.looptime
@pytest.mark.parametrize("check_s", [0.0, 4.0], ids=["vllm-at-once", "sglang-every-4s"])
async def test_a_request_whose_client_went_is_dropped_at_the_engines_next_check(check_s: float) -> None:
    """vLLM drops a sequence as its client goes; SGLang looks every 4 s of waiting for a request's output
    (`abort_check_s`): until that tick a cancelled request keeps its place, queued or running."""
    engine = BatchEngine(EmulatorProfile(max_running=1, decode_s_per_token=0.01, batch_slowdown=0.0,
                                         abort_check_s=check_s), clock=asyncio.get_running_loop().time)
    running = asyncio.create_task(engine.generate(10, 1000))  # 10 s of decoding
    queued = asyncio.create_task(engine.generate(10, 10))
    await asyncio.sleep(1.0)
    assert engine.running == 1 and engine.waiting == 1
    queued.cancel()
    running.cancel()
    await asyncio.sleep(0.1)
    if check_s == 0:
        assert engine.running == 0 and engine.waiting == 0
    else:
        assert engine.running == 1 and engine.waiting == 1  # both still there at 1.1 s
        await asyncio.sleep(2.8)
        assert engine.running == 1 and engine.waiting == 1  # 3.9 s
        await asyncio.sleep(0.2)
        assert engine.running == 0 and engine.waiting == 0  # dropped at the 4 s check
    assert engine.counters.finished == 0
    await engine.close()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_an_attempt_cancelled_on_sglang_is_aborted_there_by_its_id(engine: str) -> None:
    """SGLang looks for a gone client only every 4 s (the emulator too, `abort_check_s`), so the transport names
    each attempt (`rid`) and aborts a cancelled one by that id: both requests, one running and one queued, leave
    the engine as soon as the abort calls return. On vLLM no id is sent and the closed connection is enough."""
    profile = PROFILES["sglang-a100-illustrative" if engine == "sglang" else "a100-illustrative"]
    server = EmulatedServer(model="m", profile=EmulatorProfile(
        protocol=profile.protocol, abort_check_s=profile.abort_check_s, max_running=1, decode_s_per_token=0.01,
        default_output_tokens=4096))  # speedup 1: SGLang's own check of the connection comes 4 s after
    await server.start()
    try:
        async with new_session() as session:
            transport = HttpTransport(session)
            target = UrlTarget("s", server.url, abort_path=adapter_for(engine).abort_path)
            attempts = [asyncio.create_task(transport.complete(target, InferenceRequest.from_body(
                {"prompt": f"q{i}", "max_tokens": 4096}, request_id=f"r{i}", model="m",
                endpoint=Endpoint.COMPLETIONS))) for i in range(2)]
            for _ in range(500):  # until the engine holds both, one running and one queued: both can arrive
                # before the engine's next step, when they are both still waiting
                if server.engine.running == 1 and server.engine.waiting == 1:
                    break
                await asyncio.sleep(0.01)
            assert server.engine.running == 1 and server.engine.waiting == 1
            for attempt in attempts:
                attempt.cancel()
            await asyncio.gather(*attempts, return_exceptions=True)
            await transport.settle()
            if engine == "sglang":
                assert transport.aborts.reached == 2
                assert server.engine.running == 0 and server.engine.waiting == 0
            else:
                assert transport.aborts.reached == 0
                for _ in range(500):  # the handler is cancelled once aiohttp sees the connection closed
                    if server.engine.running + server.engine.waiting == 0:
                        break
                    await asyncio.sleep(0.01)
                assert server.engine.running == 0 and server.engine.waiting == 0
            assert server.engine.counters.finished == 0
    finally:
        await server.stop()


async def test_beyond_max_running_requests_wait_in_the_engine_queue() -> None:
    engine = BatchEngine(profile(max_running=2), speedup=FAST)
    tasks = [asyncio.create_task(engine.generate(10, 40)) for _ in range(6)]  # 40 ms each
    await asyncio.sleep(0.005)
    assert engine.running == 2 and engine.waiting == 4  # the metrics' num_requests_running / waiting
    await asyncio.gather(*tasks)
    assert engine.running == 0 and engine.waiting == 0
    await engine.close()


async def test_prefill_is_chunked_by_the_token_budget_and_costs_compute() -> None:
    engine = BatchEngine(profile(prefill_s_per_token=0.001, max_batched_tokens=1000), speedup=FAST)
    cost = await timed(engine, 1, 3000, 1)  # three chunks of 1000 tokens, 1 s each, plus steps
    await engine.close()
    assert cost == pytest.approx(3.0, rel=0.25)
    assert engine.counters.prompt_tokens == 3000 and engine.counters.steps >= 3


async def test_kv_budget_forces_preemption_and_every_request_still_finishes() -> None:
    engine = BatchEngine(profile(kv_cache_tokens=400, max_running=8), speedup=FAST)
    results = await asyncio.gather(*(engine.generate(100, 60) for _ in range(6)))
    await engine.close()
    assert [r.output_tokens for r in results] == [60] * 6
    assert engine.counters.preemptions > 0  # 6 × 160 tokens do not fit 400
    assert any(r.preempted for r in results)


async def test_a_prompt_larger_than_the_cache_is_refused() -> None:
    engine = BatchEngine(profile(kv_cache_tokens=100), speedup=FAST)
    with pytest.raises(PromptTooLong):
        await engine.generate(200, 4)
    await engine.close()


async def test_prefix_cache_skips_blocks_already_computed() -> None:
    engine = BatchEngine(profile(prefix_cache=True, prefill_s_per_token=0.001), speedup=FAST)
    words = [f"w{i}" for i in range(10 * BLOCK)]
    first = await engine.generate(len(words), 2, prompt_blocks(words))
    second = await engine.generate(len(words), 2, prompt_blocks(words))
    other = await engine.generate(len(words), 2, prompt_blocks(list(reversed(words))))
    await engine.close()
    assert first.cached_tokens == 0 and other.cached_tokens == 0
    assert second.cached_tokens == 10 * BLOCK - 1  # every block but the last token, which is recomputed
    assert engine.counters.prefix_hits == second.cached_tokens


async def test_a_client_that_goes_away_frees_its_place() -> None:
    """Over HTTP: the emulator aborts a request whose client disconnected, as vLLM does."""
    server = EmulatedServer(model="m", profile=profile(max_running=1, decode_s_per_token=0.05), speedup=1.0)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": "hello", "max_tokens": 100}
            request = asyncio.create_task(session.post(server.url + "/v1/completions", json=body))
            await asyncio.sleep(0.2)
            assert server.stats.running == 1
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        for _ in range(100):
            if server.stats.running == 0:
                break
            await asyncio.sleep(0.02)
        assert server.stats.running == 0
    finally:
        await server.stop()


async def test_metrics_report_the_engine_state_in_vllm_names() -> None:
    server = EmulatedServer(model="m", profile=PROFILES["vllm-a100-80gb-7b"], speedup=50.0)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/completions",
                                    json={"model": "m", "prompt": "a b c", "max_tokens": 3}) as resp:
                body = await resp.json()
            async with session.get(server.url + "/metrics") as resp:
                text = await resp.text()
        assert body["usage"]["completion_tokens"] == 3
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                     "vllm:prefix_cache_queries_total", "fedpool_emulator_busy_seconds_total"):
            assert name in text
    finally:
        await server.stop()


def test_derived_profiles_say_where_their_figures_come_from() -> None:
    a100, v100 = PROFILES["vllm-a100-80gb-7b"], PROFILES["vllm-v100-32gb-7b"]
    assert "2039 GB/s" in a100.source and "900 GB/s" in v100.source
    assert v100.decode_s_per_token > 2 * a100.decode_s_per_token  # bandwidth-bound decode
    assert v100.kv_cache_tokens is not None and a100.kv_cache_tokens is not None
    assert v100.kv_cache_tokens < a100.kv_cache_tokens / 4
    with pytest.raises(ValueError, match="unknown profile fields"):
        profile_from_json('{"name": "x", "gpu": "A100"}')
