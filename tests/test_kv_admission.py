"""KV admission: a server whose KV cache this dispatcher's attempts are expected to fill takes no more until some
end (federation/core/serverbook.py), the estimate learned from answers (federation/core/clientbook.py), and the KV
cache's
size as vLLM and SGLang report it (registry adapters) and the registry records it."""

from __future__ import annotations

import aiohttp
import pytest

from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile
from fedpool.federation.core.clientbook import KV_ANSWER_TOKENS, ClientBook
from fedpool.federation.core.ledger import InflightLedger
from fedpool.federation.core.serverbook import BookSettings, ServerBook, ServerState
from fedpool.registry import Engine, PoolSnapshot, RegistryClient, ServerEntry, ServerRecord, ServerStatus, adapter_for
from fedpool.registry.adapters.base import MetricSamples
from fedpool.registry.adapters.vllm import VllmAdapter


def book_with(kv: int | None, capacity: int = 8) -> tuple[ServerBook, ServerState, dict[str, float]]:
    ledger = InflightLedger(clock=lambda: 0.0, wall_clock=lambda: 0.0)
    book = ServerBook(BookSettings(1.0, False, True, 5, 30.0), ledger, clock=lambda: 0.0)
    costs: dict[str, float] = {}
    book.kv_cost = costs.__getitem__
    record = ServerRecord(id="s0", url="http://127.0.0.1:1", engine=Engine.VLLM, model="m", kv_cache_tokens=kv)
    book.sync(PoolSnapshot(version=1, taken_at=0.0, entries=(
        ServerEntry(record=record, status=ServerStatus.HEALTHY, capacity=capacity, weight=1.0),)))
    state = book.get("s0")
    assert isinstance(state, ServerState)
    return book, state, costs


def test_a_full_kv_cache_takes_no_more_until_an_attempt_ends() -> None:
    book, state, costs = book_with(1000)
    costs["video"] = 300.0
    for _ in range(3):
        book.take(state, "video", 0.0)
    assert state.kv_inflight == pytest.approx(900) and book.has_room(state)  # 3 of 8 slots, 900 of 1000 tokens
    book.take(state, "video", 0.0)
    assert not book.has_room(state) and state.inflight == 4 < state.window  # the KV cache, not the window
    book.release(state, "video")
    assert book.has_room(state) and state.kv_inflight == pytest.approx(900)
    # The estimate moves (answers came back longer): what is given back is the client's mean there, so the figure
    # returns to exactly nothing with the client's last attempt.
    costs["video"] = 700.0
    book.take(state, "video", 0.0)
    assert not book.has_room(state)
    for _ in range(4):
        book.release(state, "video")
    assert state.kv_inflight == 0 and state.kv_by_client == {} and book.has_room(state)


def test_a_lease_gives_this_process_its_share_of_the_cache_and_unknown_caches_do_not_limit() -> None:
    book, state, costs = book_with(1000, capacity=8)
    costs["a"] = 300.0
    book.apply_lease({"s0": 4})  # half the slots: half the cache
    assert state.kv_budget == pytest.approx(500)
    book.take(state, "a", 0.0)
    assert book.has_room(state)
    book.take(state, "a", 0.0)
    assert not book.has_room(state)
    unknown, plain, plain_costs = book_with(None)
    plain_costs["a"] = 10**9
    for _ in range(7):
        unknown.take(plain, "a", 0.0)
    assert plain.kv_budget is None and unknown.has_room(plain)  # only the window (8) limits it


def test_a_client_s_kv_estimate_is_its_answers_sequences_else_its_stated_shape() -> None:
    clients = ClientBook("fair", InflightLedger(clock=lambda: 0.0, wall_clock=lambda: 0.0))
    # On average over its life a request holds its prompt and half its answer (the answer grows a token a step).
    assert clients.kv_tokens("nobody") == 0.5 * KV_ANSWER_TOKENS
    clients.announce_shape("video", 40.0, 16)  # text words only: media are not counted before an answer says
    assert clients.kv_tokens("video") == 48.0
    clients.note_served("video", 30_000, 10, 1.0)  # the engine's count, frames included
    assert clients.kv_tokens("video") == 30_005.0
    clients.note_served("video", 20_000, 10, 1.0)
    assert 20_005.0 < clients.kv_tokens("video") < 30_005.0
    clients.forget("video")
    assert clients.kv_tokens("video") == 0.5 * KV_ANSWER_TOKENS


def test_vllm_and_sglang_report_their_kv_cache() -> None:
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="11553"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0\n')
    assert VllmAdapter.kv_cache_tokens(MetricSamples(text)) == (11553 + 100) * 16
    assert VllmAdapter.kv_cache_tokens(MetricSamples("vllm:num_requests_running 1\n")) is None


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_the_emulator_reports_its_kv_cache_as_the_engine_does(protocol: str) -> None:
    server = EmulatedServer(model="m", profile=EmulatorProfile(max_running=4, kv_cache_tokens=184_848,
                                                               protocol=protocol))
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            kv = await adapter_for(Engine(protocol)).discover_kv_cache_tokens(session, server.url, 5.0)
        assert kv == 184_848
    finally:
        await server.stop()


@pytest.mark.ray
async def test_the_registry_records_the_kv_cache_it_discovers(registry: RegistryClient) -> None:
    servers = [EmulatedServer(model="m", profile=EmulatorProfile(max_running=4, kv_cache_tokens=65_536), seed=i)
               for i in range(2)]
    for server in servers:
        await server.start()
    try:
        entry = await registry.register(ServerRecord(id="kv", url=servers[0].url, engine=Engine.VLLM, model="m"))
        assert entry.record.kv_cache_tokens == 65_536
        declared = await registry.register(ServerRecord(id="kv-declared", url=servers[1].url, engine=Engine.VLLM,
                                                        model="m", kv_cache_tokens=1_000))
        assert declared.record.kv_cache_tokens == 1_000  # what the operator declares wins
        assert (await registry.snapshot()).get("kv").record.kv_cache_tokens == 65_536  # type: ignore[union-attr]
    finally:
        for server in servers:
            await server.stop()
