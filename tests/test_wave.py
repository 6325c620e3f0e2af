"""One wave (federation/routing/wave.py, federation/routing/waveplan.py): the assignment of everything a route's
clients have
left, and `earliest_finish` probing each server kind, then placing a whole wave, driving the real dispatcher in
simulated time (benchmarks/simulator.py)."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import looptime

from fedpool.benchmarks.scale_oracle import KindModel as EngineModel
from fedpool.benchmarks.scale_sim import Spec, ideal_s
from fedpool.benchmarks.simulator import (
    EvalOutcome,
    SimResult,
    SimTransport,
    World,
    build_world,
    make_dispatcher,
    run_eval,
    simulate,
)
from fedpool.federation import DispatchConfig, Dispatcher, EarliestFinish, make_policy
from fedpool.federation.core.types import Completion, Endpoint, InferenceRequest, StreamProgress, Target
from fedpool.federation.routing.waveplan import (
    LONG_ANSWER_TOKENS,
    SHORT_CHAIN_STEPS,
    Demand,
    KindModel,
    Room,
    assign,
)

FAST = KindModel(prefill_s=1e-4, step_s=0.01, batch=4)
SLOW = KindModel(prefill_s=3e-4, step_s=0.025, batch=4)


@dataclass(frozen=True)
class Server:
    id: str


def rooms(fast: int, slow: int) -> list[Room]:
    return [Room(Server(f"fast-{i}"), "fast") for i in range(fast)] + \
        [Room(Server(f"slow-{i}"), "slow") for i in range(slow)]


def test_every_request_is_assigned_once_long_answers_packed_a_batch_to_a_server_of_the_fast_kind() -> None:
    demand = [Demand("long", 10, 200, 300), Demand("short", 12, 1000, 20), Demand("mid", 6, 900, 96)]
    result = assign(demand, rooms(4, 4), {"fast": FAST, "slow": SLOW})
    assert result.unplaced == 0
    assert {c: len(s) for c, s in result.servers.items()} == {"long": 10, "short": 12, "mid": 6}
    long_on = Counter(s.id for s in result.servers["long"])
    # the long answers decode 2.5x slower on the slow kind: only the fast kind takes them, a full batch (4) to a
    # server before the next is opened
    assert all(sid.startswith("fast") for sid in long_on)
    assert sorted(long_on.values()) == [2, 4, 4]
    # a 96-token answer takes 2.4 s on the slow kind against 0.96 s on the fast one, longer than SHORT_CHAIN_STEPS
    # of the fast kind's steps: kept off the slow kind; the 20-token answers may go anywhere
    assert 96 * SLOW.step_s > max(1.1 * 96 * FAST.step_s, SHORT_CHAIN_STEPS * FAST.step_s)
    assert all(s.id.startswith("fast") for s in result.servers["mid"])
    assert any(s.id.startswith("slow") for s in result.servers["short"])
    # the modelled makespan is the latest server's completion
    assert result.predicted_s == max(t for _, _, t in result.modelled.values())
    assert LONG_ANSWER_TOKENS <= 300


def test_long_answers_beyond_a_full_batch_on_every_server_of_their_kind_may_go_to_another() -> None:
    """Two fast servers of batch 4 and 24 long answers: once both hold a full batch, the next go where they complete
    soonest — a second and third batch on the fast servers while that is sooner, then the slow kind (2.5× the steps,
    but idle) — not all 24 behind each other on the fast ones (12 a server: 900 steps, 9 s)."""
    result = assign([Demand("long", 24, 200, 300)], rooms(2, 4), {"fast": FAST, "slow": SLOW})
    on = Counter(s.id for s in result.servers["long"])
    assert all(on[f"fast-{i}"] >= 2 * FAST.batch for i in range(2))
    assert sum(n for sid, n in on.items() if sid.startswith("slow")) > 0
    assert result.predicted_s < 12 * 300 / FAST.batch * FAST.step_s


def test_a_busy_server_is_given_less() -> None:
    """What a server already runs (its prefill and decode still to come) counts: of two servers of one kind, the
    one busy for 5 s more is given nothing while the idle one can finish sooner."""
    busy, idle = Server("busy"), Server("idle")
    result = assign([Demand("c", 4, 100, 20)], [Room(busy, "fast", 1.0, 5.0), Room(idle, "fast")], {"fast": FAST})
    assert all(s is idle for s in result.servers["c"])
    assert busy not in result.modelled


def test_no_server_no_kind_nothing_placed() -> None:
    result = assign([Demand("c", 3, 100, 20)], [], {"fast": FAST})
    assert result.unplaced == 3 and result.servers == {} and result.predicted_s == 0.0


class Recording(SimTransport):
    """The simulator's transport, noting when each attempt started and where."""

    def __init__(self, servers: Any, clock: Any):
        super().__init__(servers)
        self.sent: list[tuple[float, str, str]] = []  # (when, server id, client)
        self._clock = clock

    async def complete(self, server: Target, request: InferenceRequest,
                       progress: StreamProgress | None = None) -> Completion:
        self.sent.append((self._clock(), server.id, request.client_id))
        return await super().complete(server, request)


def run(spec: Spec, *, engine_times: bool = True) -> tuple[SimResult, EarliestFinish, Recording]:
    made: list[Any] = []

    def dispatchers(transport: SimTransport, world: World, clock: Any) -> list[Dispatcher]:
        recording = Recording(world.servers, clock)
        recording.engine_times = engine_times
        policy = make_policy("earliest_finish", random.Random(0))
        made.extend((policy, recording))
        return [make_dispatcher(recording, world, policy, DispatchConfig(client_order=spec.client_order), clock,
                                seed=0)]

    result = simulate(lambda clock: build_world(spec.kind_table, spec.profiles(), spec.servers, clock),
                      spec.eval_list(), dispatchers)
    policy, recording = made
    assert isinstance(policy, EarliestFinish)
    return result, policy, recording


# 32 servers of 16 slots (8 vLLM A100s, 8 SGLang A100s, 16 V100s) against four evals of 40-60 requests each: every
# request fits the pool's room at once, several to a server
WAVE = Spec(servers=32, evals=4, min_size=40, max_size=60, seed=3, client_order="longest_answers_first")


def test_a_wave_probes_each_kind_alone_then_places_everything_on_its_assignment() -> None:
    spec = WAVE
    requests = sum(e.size for e in spec.eval_list())
    assert 2 * spec.servers <= requests <= spec.servers * spec.max_running
    result, policy, recording = run(spec)
    assert result.completed == requests and result.failed == 0 and result.inflight_end == 0
    assert len(recording.sent) == requests  # nothing taken back, retried or copied
    assert policy.waves is not None
    stats = policy.waves.stats
    assert stats.waves == 1 and stats.probes == 2  # one request alone on each kind (A100, V100)
    assert stats.dropped == 0 and stats.followed == stats.assigned
    # at the start only the long answers (text: their kinds and packing hardly depend on the costs) and one probe
    # a kind, alone on its server (and the one request placed at once as the first of its turn, before the wave
    # was seen); the rest once both probes answered
    sent = sorted(recording.sent)
    first_after = next(t for t, _, _ in sent if t > 0)
    at_start = [(sid, client) for t, sid, client in sent if t == 0]
    others = [(sid, client) for sid, client in at_start if not client.endswith("text")]
    texts_sent = sum(1 for t, _, client in sent if client.endswith("text") and t == 0)
    assert texts_sent == next(e.size for e in spec.eval_list() if e.name.endswith("text"))
    assert 2 <= len(others) <= 3
    assert any("v100" in sid for sid, _ in others) and any("a100" in sid for sid, _ in others)
    assert len({sid for sid, _ in others} & {sid for sid, c in at_start if c.endswith("text")}) == 0
    assert first_after >= 0.3  # an image's 1,100-token prompt and 24 tokens alone on an A100 take 0.35 s
    assert stats.assigned + stats.probes >= requests - 1
    # the probes measured each kind alone: within 10% of the engine model's prefill and single-sequence step
    measured = policy.waves._measured
    profiles = spec.profiles()
    for kind, profile in (("A100x1/16", profiles["vllm-a100-80gb-7b"]), ("V100x1/16", profiles["vllm-v100-32gb-7b"])):
        prefill, step = measured[("sim-7b", kind)]
        assert math.isclose(prefill, profile.prefill_s_per_token, rel_tol=0.1)
        assert math.isclose(step, profile.decode_s_per_token, rel_tol=0.1)
    # the long answers (text, 384 tokens) on the A100s only, a full batch to a server but one
    texts: Counter[str] = Counter()
    for server in result.servers:
        n = sum(v for c, v in server.answered_by.items() if c.endswith("text"))
        if n:
            assert "a100" in server.kind
            texts[server.id] = n
    assert sum(1 for n in texts.values() if n % spec.max_running) <= 1
    ideal = ideal_s(spec)[0]
    assert ideal <= result.makespan_s <= 1.5 * ideal
    # the assignment's model beside what happened: within a third
    assert result.makespan_s <= 1.35 * stats.predicted_s


def test_a_probe_whose_server_dies_leaves_its_kind_priced_as_usual_and_loses_nothing() -> None:
    """The V100's probe dies with its server: the request is answered elsewhere, the wave waits for the other probe
    and then for `PROBE_LIMIT_S` at most, assigns the rest with the V100s priced as the policy prices them, and
    forgets the probe (a later answer from that server is no probe)."""
    spec = WAVE
    made: list[Any] = []

    async def kill_the_v100_probe(world: World) -> None:
        await asyncio.sleep(0.01)
        for sim in list(world.servers.values()):
            if "v100" in sim.kind and sim.engine.running:
                await world.kill(sim.id)

    def dispatchers(transport: SimTransport, world: World, clock: Any) -> list[Dispatcher]:
        transport.engine_times = True
        policy = make_policy("earliest_finish", random.Random(0))
        made.append(policy)
        return [make_dispatcher(transport, world, policy, DispatchConfig(client_order=spec.client_order), clock,
                                seed=0)]

    result = simulate(lambda clock: build_world(spec.kind_table, spec.profiles(), spec.servers, clock),
                      spec.eval_list(), dispatchers, events=kill_the_v100_probe)
    policy = made[0]
    assert isinstance(policy, EarliestFinish) and policy.waves is not None
    assert result.completed == sum(e.size for e in spec.eval_list()) and result.failed == 0
    assert result.inflight_end == 0
    measured = policy.waves._measured
    assert ("sim-7b", "A100x1/16") in measured and ("sim-7b", "V100x1/16") not in measured
    assert policy.waves.stats.waves == 1 and policy.waves.stats.assigned > 0
    assert not policy.waves._probes
    # (what is left of the probe client's assignment — its probe was retried elsewhere — goes with its clients, or
    # with the next request on the route that the wave did not assign)
    for e in spec.eval_list():
        policy.forget_client(e.name)
    assert policy.waves.known() == 0


def test_a_kind_the_long_answers_fill_is_not_probed_but_priced_on_the_measured_kinds_scale() -> None:
    """With H100s (a tenth of the pool, the quickest to decode) the long answers fill every one of them: no H100 is
    left idle for a probe, so none is waited for; the H100s are priced at their data-sheet prior on the scale the
    A100s' and V100s' probes measured (answers that shared their servers would price a prompt ~16× too slow)."""
    spec = Spec(servers=32, evals=8, kinds=5, min_size=50, max_size=60, seed=3, client_order="longest_answers_first")
    texts = sum(e.size for e in spec.eval_list() if e.name.endswith("text"))
    assert texts > 6 * spec.max_running  # (more long answers than the 6 H100s hold)
    result, policy, recording = run(spec)
    assert result.completed == sum(e.size for e in spec.eval_list()) and result.failed == 0
    assert policy.waves is not None and policy.waves.stats.waves == 1
    measured = policy.waves._measured
    assert ("sim-7b", "H100x1/16") not in measured and ("sim-7b", "A100x1/16") in measured
    first_after = min(t for t, _, _ in recording.sent if t > 0)
    # (the V100's probe, 0.92 s alone, then the next tick — the slot comes back before the answer is told — not the
    # 5 s limit)
    assert first_after <= 1.0 + 1e-9
    members = {"x": type("S", (), {"capacity": 16})()}
    h100 = policy.waves._model("sim-7b", "H100x1/16", members)
    engine = EngineModel.of(spec.profiles()["vllm-h100-80gb-7b"])
    assert 0.7 * engine.prefill_s < h100.prefill_s < 1.4 * engine.prefill_s
    assert 0.7 * engine.step_s < h100.step_s < 1.4 * engine.step_s


def test_without_engine_times_a_probe_is_priced_by_its_latency() -> None:
    result, policy, _ = run(WAVE, engine_times=False)
    assert result.completed == sum(e.size for e in WAVE.eval_list()) and result.failed == 0
    assert policy.waves is not None and policy.waves.stats.waves == 1
    prefill, step = policy.waves._measured[("sim-7b", "A100x1/16")]
    engine = EngineModel.of(WAVE.profiles()["vllm-a100-80gb-7b"])
    latency = 1100 * engine.prefill_s + 24 * engine.step_s  # an image alone, as the probe ran it
    assert 0.8 * latency < 1100 * prefill + 24 * step < 1.25 * latency


def test_more_requests_than_room_is_no_wave() -> None:
    spec = Spec(servers=16, evals=4, seed=5, client_order="longest_answers_first")
    assert sum(e.size for e in spec.eval_list()) > spec.servers * spec.max_running
    result, policy, _ = run(spec)
    assert result.completed == sum(e.size for e in spec.eval_list())
    assert policy.waves is not None and policy.waves.stats.waves == 0 and policy.waves.known() == 0


def test_a_client_that_has_not_said_what_it_has_left_is_no_wave() -> None:
    """A gateway's caller says nothing of what is to come: a burst of its requests is placed as it comes."""
    spec = WAVE
    policy = make_policy("earliest_finish", random.Random(0))
    assert isinstance(policy, EarliestFinish) and policy.waves is not None

    async def go(clock: Any) -> int:
        world = build_world(spec.kind_table, spec.profiles(), spec.servers, clock)
        dispatcher = make_dispatcher(SimTransport(world.servers), world, policy, DispatchConfig(), clock, seed=0)
        body = {"prompt": "word " * 900, "max_tokens": 24}
        requests = [InferenceRequest.from_body(body, request_id=f"r{i}", model="sim-7b", client_id="tool",
                                               endpoint=Endpoint.COMPLETIONS) for i in range(100)]
        answers = await asyncio.gather(*(dispatcher.submit(r) for r in requests))
        await world.close()
        return len(answers)

    loop = looptime.new_event_loop(start=0.0)
    try:
        assert loop.run_until_complete(go(loop.time)) == 100
    finally:
        loop.close()
    assert policy.waves.stats.waves == 0


def test_what_a_wave_keeps_is_forgotten() -> None:
    _, policy, _ = run(WAVE)
    assert policy.waves is not None
    assert policy.waves.known() == 0  # every assigned request placed: the wave is over
    assert not policy.waves._probes
    policy.forget_client("eval-0000-text")
    assert policy.waves.known() == 0


def test_a_server_whose_lease_went_to_another_process_is_dropped_from_the_wave_not_waited_for() -> None:
    """The wave holds requests for servers still prefilling what it sent them (videos: 7,000-token prompts) when this
    process's lease on those servers goes to 0 (another process's now): the held requests go elsewhere — a window
    of 0 frees no slot for this process, ever — and every request is answered, none on those servers after the
    lease moved. (It waited for ever before: the process parked, its other slots idle.)"""
    spec = WAVE
    policy = make_policy("earliest_finish", random.Random(0))
    assert isinstance(policy, EarliestFinish) and policy.waves is not None
    waves = policy.waves
    sent: list[tuple[float, str]] = []
    moved: list[tuple[float, set[str]]] = []

    async def go(clock: Any) -> dict[str, EvalOutcome]:
        world = build_world(spec.kind_table, spec.profiles(), spec.servers, clock)
        recording = Recording(world.servers, clock)
        recording.engine_times = True
        dispatcher = make_dispatcher(recording, world, policy, DispatchConfig(client_order=spec.client_order), clock,
                                     seed=0)
        everything = {s.id: spec.max_running for s in world.servers.values()}
        dispatcher.apply_lease(everything)

        async def take_the_held_servers() -> None:
            held: set[str] = set()
            while not held:
                await asyncio.sleep(0.005)
                held = {s.id for w in waves._waves.values() for on in w.assigned.values() for s in on}
            moved.append((clock(), held))
            dispatcher.apply_lease({sid: 0 if sid in held else n for sid, n in everything.items()})

        outcomes = {e.name: EvalOutcome() for e in spec.eval_list()}
        mover = asyncio.create_task(take_the_held_servers())
        await asyncio.wait_for(asyncio.gather(*(run_eval(dispatcher, e, clock, outcomes[e.name])
                                                for e in spec.eval_list())), timeout=600)
        await mover
        sent.extend((t, sid) for t, sid, _ in recording.sent)
        await world.close()
        return outcomes

    loop = looptime.new_event_loop(start=0.0)
    try:
        outcomes = loop.run_until_complete(go(loop.time))
    finally:
        loop.close()
    assert sum(o.answered for o in outcomes.values()) == sum(e.size for e in spec.eval_list())
    assert all(o.failed == 0 for o in outcomes.values())
    when, held = moved[0]
    assert held and waves.stats.dropped > 0
    assert not [sid for t, sid in sent if t > when and sid in held]
