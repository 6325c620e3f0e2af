"""The routing planner: its linear programs, and the dispatcher following a plan against real emulators."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from fedpool.federation import DispatchConfig, Dispatcher, Endpoint, InferenceRequest, make_policy, new_session
from fedpool.federation.planner import Planner, server_cost, solve_phased_plan, solve_plan
from fedpool.registry import PoolSnapshot, ServerEntry, ServerRecord, ServerStatus, prior_weight

from tests.conftest import EmulatorFactory


def entry(sid: str, accelerator: str, url: str = "http://127.0.0.1:9", capacity: int = 256,
          model: str = "emu-model") -> ServerEntry:
    record = ServerRecord(id=sid, url=url, engine="vllm", model=model, accelerator=accelerator, gpu_count=1)
    return ServerEntry(record=record, status=ServerStatus.HEALTHY, capacity=capacity, weight=prior_weight(record))


def test_roofline_costs_price_prefill_and_decode_by_the_data_sheet() -> None:
    a100, v100 = server_cost(entry("a", "A100")), server_cost(entry("v", "V100"))
    # Prefill is compute-bound: 312 vs 125 TFLOPS; decode bandwidth-bound: 2.039 vs 0.9 TB/s.
    assert a100.prefill_s_per_token * 312 == pytest.approx(v100.prefill_s_per_token * 125)
    assert a100.decode_s_per_token * 2.039 == pytest.approx(v100.decode_s_per_token * 0.9)
    # So a prompt-heavy request gains more from the A100 than an answer-heavy one.
    assert v100.of(7000, 20) / a100.of(7000, 20) > v100.of(250, 400) / a100.of(250, 400)
    # An accelerator with no data-sheet entry is priced from its speed prior, never refused.
    assert server_cost(entry("x", "MI300X")).prefill_s_per_token > 0


def test_makespan_plan_balances_servers_and_places_every_request() -> None:
    cost = {("video", "fast"): 3.0, ("video", "slow"): 9.0, ("text", "fast"): 1.0, ("text", "slow"): 2.0}
    makespan, plan = solve_plan(["video", "text"], ["fast", "slow"], {"video": 10, "text": 30}, cost)
    for client, n in (("video", 10), ("text", 30)):
        assert sum(plan[client].values()) == pytest.approx(n)
    loads = {s: sum(plan[c].get(s, 0.0) * cost[c, s] for c in plan) for s in ("fast", "slow")}
    assert max(loads.values()) == pytest.approx(makespan)
    # Comparative advantage: video (3× slower on `slow`) stays on `fast`; text (2×) takes `slow`.
    assert plan["video"].get("slow", 0.0) == pytest.approx(0.0, abs=1e-6)
    assert plan["text"]["slow"] > 0
    # Work already held by a server counts against it.
    held_makespan, held_plan = solve_plan(["text"], ["fast", "slow"], {"text": 30}, cost, {"fast": 40.0})
    assert held_plan["text"].get("fast", 0.0) < plan["text"].get("fast", 0.0) + 30
    assert held_makespan >= 40.0


def test_phased_plan_lets_the_first_client_finish_early_within_the_makespan_slack() -> None:
    servers = ["a", "b"]
    cost = {(c, s): 1.0 for c in ("small", "big") for s in servers}
    counts = {"small": 10, "big": 90}
    makespan, _ = solve_plan(["small", "big"], servers, counts, cost)
    plan = solve_phased_plan(["small", "big"], servers, counts, cost, {}, makespan * 1.02)
    assert plan is not None
    assert sum(plan["small"].values()) == pytest.approx(10)
    # The small client spread over both servers, so it finishes in ~5 units rather than at the makespan.
    assert all(plan["small"].get(s, 0.0) == pytest.approx(5.0) for s in servers)
    # An impossible limit is reported as such (the caller keeps the makespan plan).
    assert solve_phased_plan(["small", "big"], servers, counts, cost, {}, makespan * 0.5) is None


def test_planner_waits_for_every_announced_client_then_follows_quotas() -> None:
    now = [0.0]
    planner = Planner(lambda: now[0], period_s=1.0, warmup_s=0.5)
    fast, slow = entry("fast", "A100"), entry("slow", "V100")
    route = [fast, slow]
    planner.set_remaining("video", 10)
    planner.set_remaining("text", 40)
    planner.note_request("video", prompt_chars=28000, max_tokens=32)
    # "text" said how much it has but has not sent yet: the first plan waits for it (a plan for video alone
    # would hand it every server)...
    assert planner.warming_up()
    assert planner.pick("video", route, {"video": 10}, lambda s: True) is None
    # ...but not for ever.
    now[0] = 0.6
    assert not planner.warming_up()
    now[0] = 0.0
    planner.note_request("text", prompt_chars=1000, max_tokens=512)
    assert not planner.warming_up()
    picks = Counter()
    for _ in range(10):
        server = planner.pick("video", route, {"video": 10, "text": 40}, lambda s: True)
        assert server is not None
        planner.on_sent("video", server.id)
        picks[server.id] += 1
    plan = planner.plan()
    assert plan is not None and plan.quotas["video"]
    for sid, quota in plan.quotas["video"].items():
        assert abs(picks[sid] - quota) <= 1.0
    # A client whose planned servers are all full is held rather than sent elsewhere. (The plan is an LP
    # vertex: with two clients and two servers at most three placements are non-zero, so one client has one
    # server.)
    single = next(c for c in ("video", "text") if len(plan.quotas[c]) == 1)
    (home,) = plan.quotas[single]
    assert planner.pick(single, route, {"video": 10, "text": 40}, lambda s: s.id != home) is None
    assert planner.pick(single, route, {"video": 10, "text": 40}, lambda s: True).id == home
    # Answers replace the prior shape; completions free what the servers hold.
    planner.note_answer("video", fast, 7000, 20)
    for sid, n in picks.items():
        for _ in range(n):
            planner.on_done("video", sid)
    assert planner._inflight.get("video", 0) == 0


async def test_dispatcher_routes_by_the_plan_on_real_servers(emulators: EmulatorFactory) -> None:
    """Two emulated servers, one twice as fast at prompts: long-prompt requests go where prefill is cheap,
    every request completes once, and the plan is what the dispatcher reports."""
    fast = await emulators.start(max_running=8, decode_s=0.0005, prefill_s=0.00002)
    slow = await emulators.start(max_running=8, decode_s=0.001, prefill_s=0.0002)
    entries = (entry("a100", "A100", fast.url, capacity=8), entry("v100", "V100", slow.url, capacity=8))
    snap = PoolSnapshot(version=1, taken_at=0.0, entries=entries)
    async with new_session() as session:
        dispatcher = Dispatcher(session, lambda: snap, make_policy("capacity_weighted"),
                                config=DispatchConfig(planned=True, plan_period_s=0.05, client_order="shortest_first"))
        dispatcher.set_client_remaining("video", 1.0, 12)
        dispatcher.set_client_remaining("text", 1.0, 24)

        def req(client: str, i: int, words: int, max_tokens: int) -> InferenceRequest:
            prompt = " ".join(f"{client}{i}w{j}" for j in range(words))
            return InferenceRequest(request_id=f"{client}-{i}", model=fast.model, endpoint=Endpoint.COMPLETIONS,
                                    body={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                                    client_id=client)

        results = await asyncio.gather(
            *(dispatcher.submit(req("video", i, 600, 4)) for i in range(12)),
            *(dispatcher.submit(req("text", i, 8, 64)) for i in range(24)),
        )
    assert len({r.request_id for r in results}) == 36
    planner = dispatcher.planner
    assert planner is not None and planner.plans_made >= 1
    by_client = Counter((r.request_id.split("-")[0], r.server_id) for r in results)
    # The prompt-heavy client lands mostly on the server that prefills fast.
    assert by_client["video", "a100"] > by_client["video", "v100"]
    stats = dispatcher.stats()
    assert stats.completed == 36 and stats.inflight_total == 0 and stats.waiting == 0


async def test_longest_answers_first_serves_the_longest_answers_first(emulators: EmulatorFactory) -> None:
    server = await emulators.start(max_running=1, decode_s=0.005)
    entries = (entry("s0", "V100", server.url, capacity=1),)
    snap = PoolSnapshot(version=1, taken_at=0.0, entries=entries)
    async with new_session() as session:
        dispatcher = Dispatcher(session, lambda: snap, make_policy("round_robin"),
                                config=DispatchConfig(client_order="longest_answers_first"))
        done: list[str] = []

        async def one(client: str, i: int, max_tokens: int) -> None:
            await dispatcher.submit(InferenceRequest(
                request_id=f"{client}{i}", model=server.model, endpoint=Endpoint.COMPLETIONS,
                body={"prompt": f"q {client} {i}", "max_tokens": max_tokens}, client_id=client))
            done.append(client)

        blocker = asyncio.create_task(one("short", 99, 20))  # holds the slot (~0.1 s) while the others queue
        await asyncio.sleep(0.005)
        others = [asyncio.create_task(one(c, i, n)) for i in range(3) for c, n in (("short", 2), ("long", 16))]
        await asyncio.gather(blocker, *others)
    assert done[1:] == ["long"] * 3 + ["short"] * 3


def test_long_prompts_wait_while_long_answers_run_on_a_server() -> None:
    now = [0.0]
    planner = Planner(lambda: now[0], period_s=1.0, warmup_s=0.0)
    a, b = entry("a", "A100"), entry("b", "A100")
    for client, chars, answer in (("video", 28000, 32), ("text", 1000, 512)):
        planner.set_remaining(client, 50)
        planner.note_request(client, prompt_chars=chars, max_tokens=answer)
    planner.on_sent("text", "a")  # a long answer decodes on `a`
    assert planner._interferes("video", "a") and not planner._interferes("video", "b")
    assert not planner._interferes("text", "a")  # short prompts may join it
    picks = {getattr(planner.pick("video", [a, b], {"video": 50, "text": 50}, lambda s: True), "id", None)
             for _ in range(3)}
    assert picks == {"b"}  # never `a` while the long answer runs there
    planner.on_done("text", "a")
    assert not planner._interferes("video", "a")
    planner.long_answer_tokens = None  # the rule can be switched off
    planner.on_sent("text", "a")
    assert not planner._interferes("video", "a")


def test_a_client_that_announced_its_shape_is_planned_before_it_sends() -> None:
    now = [0.0]
    planner = Planner(lambda: now[0], period_s=1.0, warmup_s=0.5)
    fast, slow = entry("fast", "A100"), entry("slow", "V100")
    for client in ("video", "text"):
        planner.set_remaining(client, 10)
    planner.note_request("video", prompt_chars=28000, max_tokens=32)
    assert planner.warming_up()  # text has not sent, nor said what it will send
    planner.note_prior("text", prompt_tokens=250, max_tokens=512)
    assert not planner.warming_up()
    assert planner.pick("video", [fast, slow], {"video": 10, "text": 10}, lambda s: True) is not None
    plan = planner.plan()
    assert plan is not None and set(plan.quotas) == {"video", "text"}
    # A later request's characters do not overwrite what the client announced.
    planner.note_request("text", prompt_chars=40, max_tokens=512)
    assert planner._shapes["text"].prompt == 250
