"""The routing planner: its linear programs, and the dispatcher following a plan against real emulators."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import pytest

from fedpool.federation import DispatchConfig, Dispatcher, Endpoint, InferenceRequest, make_policy, new_session
from fedpool.federation.core.clientbook import ClientBook
from fedpool.federation.core.ledger import InflightLedger, ServerSlots
from fedpool.federation.core.policy import DispatchState, Hold
from fedpool.federation.gateway.transport import HttpTransport
from fedpool.federation.routing.plan_lp import solve_phased_plan, solve_plan
from fedpool.federation.routing.planner import PlannedRouting
from fedpool.federation.routing.pricing import server_cost
from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus, prior_weight
from tests.conftest import EmulatorFactory
from tests.fakes import FakePool


def entry(sid: str, accelerator: str, url: str = "http://127.0.0.1:9", capacity: int = 256,
          model: str = "emu-model") -> ServerEntry:
    record = ServerRecord(id=sid, url=url, engine=Engine.VLLM, model=model, accelerator=accelerator, gpu_count=1)
    return ServerEntry(record=record, status=ServerStatus.HEALTHY, capacity=capacity, weight=prior_weight(record))


class Server(ServerSlots):
    """A server as the planner sees it (a ServerView with the registry's entry), its counts in the ledger."""

    def __init__(self, server_entry: ServerEntry):
        super().__init__(server_entry.id)
        self.entry = server_entry
        self.capacity = self.window = server_entry.capacity
        self.weight, self.scraped_waiting, self.scraped_running = 1.0, 0.0, 0.0

    @property
    def expected_wait(self) -> float:
        return (self.inflight + 1) / self.weight


class View:
    """A route as a dispatcher shows it to its policy (policies.RouteView), with room decided by the test."""

    key = ("emu-model", None, None, None)

    def __init__(self, servers: list[Server], usable: Callable[[Server], bool] = lambda s: True):
        self.servers, self.memo, self._usable = servers, dict[str, object](), usable

    def usable(self, server: Server, tried: set[str] | None = None) -> bool:
        return self._usable(server)

    @property
    def free(self) -> list[Server]:
        return [s for s in self.servers if self._usable(s)]

    @property
    def kinds(self) -> int:
        return len({s.entry.kind for s in self.servers})

    def free_candidates(self, limit: int | None, tried: set[str], rng: object) -> list[Server]:
        return self.free

    def group_by(self, group_of: Callable[[Server], str]) -> None:
        self._group_of = group_of

    def free_in(self, group: str) -> list[Server]:
        return [s for s in self.free_candidates(None, set(), None) if self._group_of(s) == group]

    @property
    def queues(self) -> dict[str, list[object]]:
        return {}

    @property
    def waiting(self) -> int:
        return 0

    def park(self, client: str, groups: tuple[str, ...], key: object, *, until_freed: bool = False) -> None:
        pass  # parking only spares grant passes a look at held clients: here every client is asked each time

    def unpark_all(self) -> None:
        pass


def prompt_of(client: str, chars: int, max_tokens: int | None) -> InferenceRequest:
    body: dict[str, object] = {"prompt": "x" * chars}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return InferenceRequest.from_body(body, request_id=f"{client}-req", model="emu-model",
                                      endpoint=Endpoint.COMPLETIONS, client_id=client)


class Planning:
    """A planned policy attached to a ledger and client book of its own, on an explicit clock."""

    def __init__(self, *, warmup_periods: float = 0.5, order: str = "fair"):
        self.now = 0.0
        self.ledger = InflightLedger(clock=lambda: self.now, wall_clock=lambda: self.now)
        self.clients = ClientBook(order, self.ledger)
        self.policy = PlannedRouting(period_s=1.0, warmup_periods=warmup_periods)
        self.policy.attach(DispatchState(self.ledger, self.clients, lambda: self.now))

    def server(self, sid: str, accelerator: str) -> Server:
        made = self.ledger.slots(sid, lambda _: Server(entry(sid, accelerator)))
        assert isinstance(made, Server)
        return made

    def has(self, client: str, requests: int, prompt_chars: int | None = None, max_tokens: int | None = None) -> None:
        self.clients.set_remaining(client, 1.0, requests)
        if prompt_chars is not None:
            self.clients.note_request(client, prompt_of(client, prompt_chars, max_tokens), self.now)

    def place(self, client: str, view: View) -> Server | Hold:
        placed = self.policy.place(view, prompt_of(client, 1, None), set())
        assert isinstance(placed, Server | Hold)
        return placed


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
    p = Planning(warmup_periods=0.5)
    fast, slow = p.server("fast", "A100"), p.server("slow", "V100")
    route = View([fast, slow])
    p.has("video", 10, prompt_chars=28000, max_tokens=32)
    p.has("text", 40)
    # "text" said how much it has but not what it sends: the first plan waits for it (a plan for video alone
    # would hand it every server)...
    assert p.place("video", route) is Hold.CLIENT_HELD
    assert p.policy.warming_up()
    # ...but not for ever.
    p.now = 0.6
    assert not p.policy.warming_up()
    p.now = 0.0
    p.clients.note_request("text", prompt_of("text", 1000, 512), p.now)
    assert not p.policy.warming_up()
    picks: Counter[str] = Counter()
    for _ in range(10):
        placed = p.place("video", route)
        assert isinstance(placed, Server)
        p.ledger.take(placed, "video")
        picks[placed.id] += 1
    plan = p.policy.plan()
    assert plan is not None and plan.quotas["video"]
    for sid, quota in plan.quotas["video"].items():
        assert abs(picks[sid] - quota) <= 1.0
    # A client whose planned servers are all full is held rather than sent elsewhere. (The plan is an LP
    # vertex: with two clients and two servers at most three placements are non-zero, so one client has one
    # server.)
    single = next(c for c in ("video", "text") if len(plan.quotas[c]) == 1)
    (home,) = plan.quotas[single]
    assert p.place(single, View([fast, slow], lambda s: s.id != home)) is Hold.CLIENT_HELD
    assert p.place(single, route) is p.ledger.slots(home)
    # Answers replace the prior shape; what servers hold is the ledger's.
    p.policy.observe_answer("video", fast.entry, 7000, 20)
    assert p.policy.shape("video") == (7000, 20)
    for sid, n in picks.items():
        for _ in range(n):
            p.ledger.release(p.ledger.slots(sid), "video")
    assert p.ledger.of_client("video") == 0


async def test_dispatcher_routes_by_the_plan_on_real_servers(emulators: EmulatorFactory) -> None:
    """Two emulated servers, one twice as fast at prompts: long-prompt requests go where prefill is cheap,
    every request completes once, and the plan is what the dispatcher reports."""
    fast = await emulators.start(max_running=8, decode_s=0.0005, prefill_s=0.00002)
    slow = await emulators.start(max_running=8, decode_s=0.001, prefill_s=0.0002)
    entries = (entry("a100", "A100", fast.url, capacity=8), entry("v100", "V100", slow.url, capacity=8))
    snap = PoolSnapshot(version=1, taken_at=0.0, entries=entries)
    async with new_session() as session:
        dispatcher = Dispatcher(HttpTransport(session), lambda: snap, make_policy("planned", period_s=0.05),
                                config=DispatchConfig(client_order="shortest_first"))
        dispatcher.set_client_remaining("video", 1.0, 12)
        dispatcher.set_client_remaining("text", 1.0, 24)

        def req(client: str, i: int, words: int, max_tokens: int) -> InferenceRequest:
            prompt = " ".join(f"{client}{i}w{j}" for j in range(words))
            return InferenceRequest.from_body({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                                              request_id=f"{client}-{i}", model=fast.model,
                                              endpoint=Endpoint.COMPLETIONS, client_id=client)

        results = await asyncio.gather(
            *(dispatcher.submit(req("video", i, 600, 4)) for i in range(12)),
            *(dispatcher.submit(req("text", i, 8, 64)) for i in range(24)),
        )
    assert len({r.request_id for r in results}) == 36
    planner = dispatcher.policy
    assert isinstance(planner, PlannedRouting) and planner.plans_made >= 1
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
        dispatcher = Dispatcher(HttpTransport(session), lambda: snap, make_policy("round_robin"),
                                config=DispatchConfig(client_order="longest_answers_first"))
        done: list[str] = []

        async def one(client: str, i: int, max_tokens: int) -> None:
            await dispatcher.submit(InferenceRequest.from_body(
                {"prompt": f"q {client} {i}", "max_tokens": max_tokens}, request_id=f"{client}{i}",
                model=server.model, endpoint=Endpoint.COMPLETIONS, client_id=client))
            done.append(client)

        blocker = asyncio.create_task(one("short", 99, 20))  # holds the slot (~0.1 s) while the others queue
        await asyncio.sleep(0.005)
        others = [asyncio.create_task(one(c, i, n)) for i in range(3) for c, n in (("short", 2), ("long", 16))]
        await asyncio.gather(blocker, *others)
    assert done[1:] == ["long"] * 3 + ["short"] * 3


def test_long_prompts_wait_while_long_answers_run_on_a_server() -> None:
    p = Planning(warmup_periods=0.0)
    a, b = p.server("a", "A100"), p.server("b", "A100")
    p.has("video", 50, prompt_chars=28000, max_tokens=32)
    p.has("text", 50, prompt_chars=1000, max_tokens=512)
    p.ledger.take(a, "text")  # a long answer decodes on `a`
    assert p.policy._interferes("video", "a") and not p.policy._interferes("video", "b")
    assert not p.policy._interferes("text", "a")  # short prompts may join it
    # Long prompts with long answers of their own (chain-of-thought over a long context) are not held: they are
    # the run's longest chains, and held until the other long answers drained they ran past everything else.
    p.has("reasoning", 50, prompt_chars=28000, max_tokens=512)
    assert not p.policy._interferes("reasoning", "a")
    assert p.place("reasoning", View([a])) is a
    assert {p.place("video", View([a, b])) for _ in range(3)} == {b}  # never `a` while the long answer runs
    p.ledger.release(a, "text")
    assert not p.policy._interferes("video", "a")
    p.policy.long_answer_tokens = None  # the rule can be switched off
    p.ledger.take(a, "text")
    assert not p.policy._interferes("video", "a")


def test_a_kinds_slots_go_to_the_clients_planned_there_in_proportion_to_their_quotas() -> None:
    p = Planning(warmup_periods=0.0)
    view = View([p.server("a", "A100"), p.server("b", "A100")])
    p.has("big", 300, prompt_chars=1000, max_tokens=8)
    p.has("small", 30, prompt_chars=1000, max_tokens=8)
    p.clients.waiting.update({"big": 300, "small": 30})
    placed: Counter[str] = Counter()
    for _ in range(100):
        for client in ("small", "big"):  # the small client asks first every time (as `fair` would put it)
            if isinstance(p.place(client, view), Server):
                placed[client] += 1
    plan = p.policy.plan()
    assert plan is not None and plan.kind_quotas["big"] == {"A100x1/256": 300.0}
    # Each takes the kind's slots at its plan's pace: 30 to 300, not one for one in the client order.
    assert placed["big"] == 100 and 10 <= placed["small"] <= 13
    assert p.place("small", view) is Hold.CLIENT_HELD  # ahead of its pace while `big` waits
    p.clients.waiting["big"] = 0  # a client with nothing waiting sets no pace (from the next grant pass)
    view.memo.clear()
    assert isinstance(p.place("small", view), Server)


def test_long_answers_are_never_held_for_the_pace() -> None:
    p = Planning(warmup_periods=0.0)
    view = View([p.server("a", "A100")])
    p.has("big", 300, prompt_chars=1000, max_tokens=8)
    p.has("chain", 30, prompt_chars=1000, max_tokens=512)  # long answers: each request a long chain
    p.clients.waiting.update({"big": 300, "chain": 30})
    # Held for the pace, its last requests would start last and end seconds after everything else.
    assert all(isinstance(p.place("chain", view), Server) for _ in range(30))
    assert isinstance(p.place("big", view), Server)  # nor does it hold the others back


def test_an_open_ended_caller_is_not_paced_behind_callers_with_more_waiting() -> None:
    """Gateway callers that say nothing of their size are planned over kinds but not paced: their quotas are only
    what each has waiting, so a caller sending one request at a time reached its whole quota with its first and
    waited, plan after plan, while the others had requests waiting (a probe beside four SDK clients on two
    llama.cpp servers: 78 s for a 16-token answer). The client order decides between them; a caller that said
    its size is still paced."""
    p = Planning(warmup_periods=0.0, order="shortest_first")
    view = View([p.server("a", "A100"), p.server("b", "A100")])
    for client in ("bulk0", "bulk1", "probe"):
        p.clients.note_request(client, prompt_of(client, 400, 16), p.now)
    p.clients.waiting.update({"bulk0": 8, "bulk1": 8, "probe": 1})
    assert p.clients.open_ended("probe") and p.clients.open_ended("bulk0")
    for client in ("bulk0", "bulk1", "probe"):  # each asks once: the plan covers it from its next ask
        p.place(client, view)
    plan = p.policy.plan()
    assert plan is not None and set(plan.kind_quotas) == {"bulk0", "bulk1", "probe"}
    assert isinstance(p.place("bulk0", view), Server)
    assert isinstance(p.place("probe", view), Server)  # held before: its next share 1/1 against bulk1's 1/8
    p.has("sized", 8, prompt_chars=400, max_tokens=16)  # says it has 8 left: paced with others that say so
    p.has("other", 80, prompt_chars=400, max_tokens=16)
    p.clients.waiting.update({"sized": 8, "other": 80})
    p.now += 1.0
    for client in ("sized", "other"):
        p.place(client, view)
    plan = p.policy.plan()
    assert plan is not None and plan.kind_quotas["sized"] and plan.kind_quotas["other"]
    assert p.place("sized", view) is Hold.CLIENT_HELD  # 1/8 of its quota against other's 1/80
    assert isinstance(p.place("probe", view), Server)  # the open-ended caller is not held by their pace


def test_a_client_that_announced_its_shape_is_planned_before_it_sends() -> None:
    p = Planning(warmup_periods=0.5)
    fast, slow = p.server("fast", "A100"), p.server("slow", "V100")
    p.has("video", 10, prompt_chars=28000, max_tokens=32)
    p.has("text", 10)
    assert p.place("video", View([fast, slow])) is Hold.CLIENT_HELD
    assert p.policy.warming_up()  # text has not sent, nor said what it will send
    p.clients.announce_shape("text", prompt_tokens=250, max_tokens=512)
    assert not p.policy.warming_up()
    assert not isinstance(p.place("video", View([fast, slow])), Hold)
    plan = p.policy.plan()
    assert plan is not None and set(plan.quotas) == {"video", "text"}
    # A later request's characters do not overwrite what the client announced.
    p.clients.note_request("text", prompt_of("text", 40, 512), p.now)
    assert p.policy.shape("text") == (250, 384)


@pytest.mark.looptime
async def test_two_models_under_planned_routing_make_at_most_one_plan_per_route_per_period(
        fakes: FakePool) -> None:
    """Two models behind one dispatcher (a gateway's): each route keeps its own plan, made again at most once a
    re-plan period (one plan for one route, reset whenever the other model's request came, re-solved its LP 592
    times in 200 decisions)."""
    a_servers = [fakes.start("model-a", max_running=4, decode_s=0.01) for _ in range(2)]
    b_servers = [fakes.start("model-b", max_running=4, decode_s=0.01) for _ in range(2)]
    entries = tuple(entry(f"{m}{i}", "A100", s.url, capacity=4, model=s.model)
                    for m, group in (("a", a_servers), ("b", b_servers)) for i, s in enumerate(group))
    snap = PoolSnapshot(version=1, taken_at=0.0, entries=entries)
    period = 0.5
    policy = make_policy("planned", period_s=period, warmup_periods=0.0)
    assert isinstance(policy, PlannedRouting)
    dispatcher = fakes.dispatcher(lambda: snap, policy)
    for client in ("ca", "cb"):
        dispatcher.set_client_remaining(client, 1.0, 100)
        dispatcher.set_client_shape(client, 20, 8)
    loop = asyncio.get_running_loop()
    started = loop.time()

    def req(client: str, model: str, i: int) -> InferenceRequest:
        return InferenceRequest.from_body({"prompt": f"{client} {i}", "max_tokens": 8}, request_id=f"{client}-{i}",
                                          model=model, endpoint=Endpoint.COMPLETIONS, client_id=client)

    # The two clients interleave their requests, as two tools behind one gateway would.
    results = await asyncio.gather(*(dispatcher.submit(req(c, m, i)) for i in range(100)
                                     for c, m in (("ca", "model-a"), ("cb", "model-b"))))
    elapsed = loop.time() - started  # virtual seconds
    assert len(results) == 200 and dispatcher.stats().decisions == 200
    # A plan per route at the start, then at most one per route per period (and per newcomer client).
    assert policy.plans_made <= 2 * (elapsed / period + 1) + 2, (policy.plans_made, elapsed)
    served = {r.request_id.split("-")[0]: r.server_id[0] for r in results}
    assert served == {"ca": "a", "cb": "b"}  # each model's requests on its own servers


@pytest.mark.looptime
async def test_an_online_caller_beside_background_batches_is_placed_at_once_not_paced_by_the_plan(
        fakes: FakePool) -> None:
    """A Batch API batch (background, 160 requests of 0.64 s) fills two 4-slot servers of two kinds; an online
    caller then sends one request at a time. Under `planned` each goes out at once (its client is neither planned
    nor paced: a plan paces a client to end with the others, and its one request used to go out as the batch
    ended) and takes the next slot that frees: every one ends within two requests' time, long before the batch."""
    servers = [fakes.start(max_running=4, decode_s=0.01) for _ in range(2)]
    snap = PoolSnapshot(version=1, taken_at=0.0, entries=(
        entry("a100", "A100", servers[0].url, capacity=4, model=servers[0].model),
        entry("v100", "V100", servers[1].url, capacity=4, model=servers[1].model)))
    dispatcher = fakes.dispatcher(lambda: snap, make_policy("planned", period_s=0.5, warmup_periods=0.0),
                                  config=DispatchConfig(client_order="shortest_first", adaptive_windows=False))
    loop = asyncio.get_running_loop()
    dispatcher.set_client_requests_left("batch", 160, background=True)
    dispatcher.set_client_shape("batch", 4, 64)

    def req(client: str, i: int) -> InferenceRequest:
        return InferenceRequest.from_body({"prompt": f"{client} {i}", "max_tokens": 64, "ignore_eos": True},
                                          request_id=f"{client}-{i}", model=servers[0].model,
                                          endpoint=Endpoint.COMPLETIONS, client_id=client)

    batch = asyncio.gather(*(dispatcher.submit(req("batch", i)) for i in range(160)))
    await asyncio.sleep(2.0)
    latencies = []
    for i in range(5):
        began = loop.time()
        await dispatcher.submit(req("online", i))
        latencies.append(loop.time() - began)
    assert not batch.done()
    await batch
    ended = loop.time()
    assert max(latencies) <= 2 * 0.64 + 0.1, latencies
    assert ended > 10.0  # (the batch: 160 × 0.64 s over 8 slots, and the online requests' slots)


def test_the_solver_is_imported_off_the_grant_path() -> None:
    """The first plan is made on the grant path: importing SciPy's solver there (~0.5 s) held the event loop just as
    the evals started sending. A process that will plan starts importing it in a background thread as soon as it knows
    its policy (`prepare_policy`, before joining Ray and starting actors), once; importing fedpool's federation room
    or making another policy does not import it (every eval process and gateway would pay for it)."""
    code = ("import sys, threading\n"
            "from fedpool.federation import make_policy, prepare_policy\n"
            "from fedpool.federation.routing.plan_lp import preload_solver\n"
            "make_policy('planned')\n"
            "prepare_policy('capacity_weighted')  # (plans nothing: loads nothing)\n"
            "assert 'scipy.optimize' not in sys.modules\n"
            "assert not [t for t in threading.enumerate() if t.name == 'fedpool-import-scipy']\n"
            "prepare_policy('planned')  # a process that will plan: loading from now\n"
            "[first] = [t for t in threading.enumerate() if t.name == 'fedpool-import-scipy']\n"
            "assert preload_solver() is first  # (attaching the policy later joins the same load)\n"
            "first.join(120)\n"
            "assert 'scipy.optimize' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180)
