"""The earliest-finish policy (federation/routing/finish.py) and the engine times it learns from: each answer's own
prefill
and decode times read from llama.cpp's `timings` and vLLM's per-request `metrics`, served by the emulator and by a
real llama-server; the policy driving the real dispatcher in simulated time (benchmarks/simulator.py)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from fedpool.benchmarks.scale_oracle import KindModel
from fedpool.benchmarks.scale_sim import Spec, ideal_s
from fedpool.benchmarks.simulator import MODEL, SimTransport, World, build_world, make_dispatcher, simulate
from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile
from fedpool.federation import DispatchConfig, Dispatcher, EarliestFinish, make_policy
from fedpool.federation.core.types import Endpoint, EngineTimes, InferenceRequest
from fedpool.federation.gateway.answers import engine_times
from fedpool.federation.gateway.transport import HttpTransport, new_session
from fedpool.federation.gateway.unpooled import UrlTarget
from fedpool.federation.routing.finish import REFIT_EVERY
from fedpool.registry import Engine, ServerEntry, ServerRecord, ServerStatus, prior_weight
from tests.conftest import LlamaServers


def test_engine_times_are_read_from_llamacpp_timings_and_vllm_metrics() -> None:
    assert engine_times({"prompt_n": 120, "prompt_ms": 30.0, "predicted_n": 9, "predicted_ms": 80}) == \
        EngineTimes(0.03, 0.08, 120)
    assert engine_times(None, {"time_to_first_token_ms": 85.2, "generation_time_ms": 1240.5,
                               "queue_time_ms": 12.3}) == EngineTimes(0.0852, 1.2405, None)
    for malformed in ({"prompt_ms": "30", "predicted_ms": 80}, {"prompt_ms": -1.0, "predicted_ms": 80},
                      {"prompt_ms": float("nan"), "predicted_ms": 80}, {"prompt_ms": 3.0}, [1, 2]):
        assert engine_times(malformed) is None
    assert engine_times(None, None) is None
    assert engine_times(None, {"time_to_first_token_ms": True, "generation_time_ms": 1.0}) is None  # (a bool)


@pytest.mark.parametrize("enabled", [True, False])
async def test_the_emulator_serves_vllms_per_request_metrics_when_asked(enabled: bool) -> None:
    """As `vllm serve --enable-per-request-metrics`: the answer carries its time to first token (its prompt's
    prefill, from its scheduling) and its generation time; without the flag, none."""
    server = EmulatedServer(model="m", profile=EmulatorProfile(prefill_s_per_token=0.001, decode_s_per_token=0.002,
                                                               default_output_tokens=64), per_request_metrics=enabled)
    await server.start()
    try:
        async with new_session() as session:
            completion = await HttpTransport(session).complete(UrlTarget("s", server.url), InferenceRequest.from_body(
                {"prompt": "word " * 100, "max_tokens": 20}, request_id="r", model="m", endpoint=Endpoint.COMPLETIONS))
    finally:
        await server.stop()
    if not enabled:
        assert completion.engine_times is None
        return
    times = completion.engine_times
    assert times is not None and times.prefill_tokens is None
    assert times.prefill_s > 0 and times.decode_s > 0  # (20 tokens: 19 steps after the first)


@pytest.mark.llamacpp
async def test_a_real_llama_server_reports_each_answers_own_times(llama_servers: LlamaServers) -> None:
    """llama-server's answers carry `timings` (asked for a stream, as fedpool asks it, and not): prompt and predicted
    milliseconds and the prompt tokens it prefilled."""
    async with new_session() as session:
        transport = HttpTransport(session)
        for stream in (False, True):
            completion = await transport.complete(
                UrlTarget("llama", llama_servers.urls[0], streamed=stream), InferenceRequest.from_body(
                    {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0},
                    request_id=f"r-{stream}", model=llama_servers.alias, endpoint=Endpoint.COMPLETIONS))
            times = completion.engine_times
            assert times is not None, f"no timings (stream={stream})"
            assert times.prefill_s >= 0 and times.decode_s > 0
            assert times.prefill_tokens is not None and times.prefill_tokens <= (completion.prompt_tokens or 0)


def run(spec: Spec, *, engine_times: bool = True, policy_name: str = "earliest_finish",
        **options: Any) -> tuple[Any, Any]:
    policies: list[Any] = []

    def dispatchers(transport: SimTransport, world: World, clock: Any) -> list[Dispatcher]:
        transport.engine_times = engine_times
        policy = make_policy(policy_name, random.Random(0), **options)
        policies.append(policy)
        return [make_dispatcher(transport, world, policy, DispatchConfig(client_order=spec.client_order), clock,
                                seed=0)]

    result = simulate(lambda clock: build_world(spec.kind_table, spec.profiles(), spec.servers, clock),
                      spec.eval_list(), dispatchers)
    return result, policies[0]


def texts_by_accelerator(result: Any) -> Counter[str]:
    """The long answers (text evals) each accelerator answered."""
    texts: Counter[str] = Counter()
    for server in result.servers:
        for client, n in server.answered_by.items():
            if client.endswith("text"):
                texts["V100" if "v100" in server.kind else "A100"] += n
    return texts


def test_earliest_finish_answers_everything_keeps_long_answers_off_the_slow_kind_and_learns_engine_costs() -> None:
    """A small mixed pool (A100s and V100s) in simulated time: every request answered once, nothing in flight at
    the end, no copies (the policy places the tail itself); the long answers (text, 384 tokens: 2.4× longer to
    decode on a V100) go to the A100s; each kind's costs come from its answers' engine times, within a factor of
    the engine model's own (which routing never sees); and the run ends within 1.5× the ideal."""
    spec = Spec(servers=24, evals=8, seed=3, client_order="longest_answers_first")
    result, policy = run(spec)
    assert isinstance(policy, EarliestFinish)
    requests = sum(e.size for e in spec.eval_list())
    assert result.completed == requests and result.failed == 0 and result.inflight_end == 0
    assert result.attempts == requests  # no copies, no retries
    texts = texts_by_accelerator(result)
    assert texts["V100"] <= 0.1 * sum(texts.values())
    costs = policy.costs()
    assert {c.source for c in costs.values()} == {"engine"}
    a100 = KindModel.of(spec.profiles()["vllm-a100-80gb-7b"])
    learned = costs[(MODEL, "A100x1/16")]
    assert a100.prefill_s / 3 < learned.prefill_s < a100.prefill_s * 3
    assert a100.step_s / 3 < learned.step_s < a100.step_s * 3
    ideal = ideal_s(spec)[0]
    assert ideal <= result.makespan_s <= 1.5 * ideal


def test_without_engine_times_the_costs_come_from_latencies() -> None:
    """SGLang's answers (and vLLM's without its flag) carry no times: each kind's priors are scaled by a low quantile
    of its answers' latency against their priced time, and the run still answers everything."""
    spec = Spec(servers=24, evals=8, seed=3, client_order="longest_answers_first")
    result, policy = run(spec, engine_times=False)
    assert result.completed == sum(e.size for e in spec.eval_list()) and result.failed == 0
    assert {c.source for c in policy.costs().values()} == {"latency"}


def test_what_it_keeps_is_forgotten_with_its_clients_and_servers() -> None:
    spec = Spec(servers=16, evals=4, seed=5, client_order="longest_answers_first")
    _, policy = run(spec)
    clients, servers = policy.known()
    assert clients == 4 and servers > 0
    for e in spec.eval_list():
        policy.forget_client(e.name)
    for i in range(spec.servers):
        for kind in spec.kind_table:
            policy.forget_server(f"{kind}-{i}")
    assert policy.known() == (0, 0)


def test_each_model_on_a_kind_learns_its_own_costs() -> None:
    """A 7 B and a 70 B model on the same A100s are not one cost: each (model, kind) learns from its own answers."""
    policy = EarliestFinish()

    def entry(model: str, i: int) -> ServerEntry:
        record = ServerRecord(id=f"{model}-{i}", url=f"http://127.0.0.1:{9000 + i}", engine=Engine.VLLM, model=model,
                              accelerator="A100", gpu_count=1, capacity=16)
        return ServerEntry(record, ServerStatus.HEALTHY, 16, prior_weight(record))

    for model, prefill_ms, decode_ms in (("small", 10.0, 100.0), ("large", 100.0, 1000.0)):
        for i in range(REFIT_EVERY):
            # (the time to first token includes the step that samples it: one of the answer's 100 steps)
            first_token_s = (prefill_ms + decode_ms / 100) / 1000
            policy.observe_answer("c", entry(model, i), 1000, 101, 1.0, EngineTimes(first_token_s, decode_ms / 1000,
                                                                                   1000))
    costs = policy.costs()
    assert set(costs) == {("small", "A100x1/16"), ("large", "A100x1/16")}
    assert costs[("small", "A100x1/16")].prefill_s == pytest.approx(1e-5)
    assert costs[("large", "A100x1/16")].step_s == pytest.approx(0.01)
    assert {c.source for c in costs.values()} == {"engine"}


def entry_on(accelerator: str, i: int, model: str = "m") -> ServerEntry:
    record = ServerRecord(id=f"{accelerator}-{i}", url=f"http://127.0.0.1:{9100 + i}", engine=Engine.VLLM, model=model,
                          accelerator=accelerator, gpu_count=1, capacity=16)
    return ServerEntry(record, ServerStatus.HEALTHY, 16, prior_weight(record))


def test_a_kind_not_heard_from_is_priced_on_the_learned_scale() -> None:
    """The data-sheet priors are for 1 B parameters: once a 7 B model's A100 costs are learned (~7× their prior), a
    V100 none of whose answers has come back is priced on that scale (its prior × the A100's learned ÷ prior), not at
    its bare prior, which made it look ~7× faster than it is and drew every request until its own answers came."""
    policy = EarliestFinish()
    a100, v100 = entry_on("A100", 0), entry_on("V100", 1)
    bare, prior_a100 = policy.kind_costs("m", v100), policy.kind_costs("m", a100)
    assert bare.source == prior_a100.source == "prior"
    for _ in range(REFIT_EVERY):
        policy.observe_answer("c", a100, 1000, 101, 1.0,  # (its first token's time: the prefill and one step)
                              EngineTimes(7 * (prior_a100.prefill_s * 1000 + prior_a100.step_s),
                                          7 * prior_a100.step_s * 100, 1000))
    learned = policy.kind_costs("m", a100)
    assert learned.source == "engine" and learned.prefill_s == pytest.approx(7 * prior_a100.prefill_s)
    scaled = policy.kind_costs("m", v100)
    assert scaled.source == "scaled"
    assert scaled.prefill_s == pytest.approx(7 * bare.prefill_s) and scaled.step_s == pytest.approx(7 * bare.step_s)
    assert policy.kind_costs("other", v100).source == "prior"  # (another model's scale is its own)
    assert set(policy.costs()) == {("m", "A100x1/16")}  # (what was learned, not what was scaled)


def test_planned_routing_picking_by_finish_keeps_to_the_plan_and_answers_everything() -> None:
    """`planned_finish` (`planned` with `pick="finish"`): the plan chooses each client's kinds, the engine model
    the server among them. Every request is answered once with nothing left in flight; the long answers stay off the
    V100s (the plan keeps them on the A100s, where they decode 2.4× faster); the picker learns each kind's costs from
    the engine times; the run ends within 1.5× the ideal."""
    spec = Spec(servers=24, evals=8, seed=3, client_order="longest_answers_first")
    result, policy = run(spec, policy_name="planned_finish", period_s=1.0)
    requests = sum(e.size for e in spec.eval_list())
    assert result.completed == requests and result.failed == 0 and result.inflight_end == 0
    assert result.attempts == requests
    texts = texts_by_accelerator(result)
    assert texts["V100"] <= 0.1 * sum(texts.values())
    assert policy.plans_made > 1
    assert {c["source"] for c in policy.describe()["finish"].values()} == {"engine"}
    ideal = ideal_s(spec)[0]
    assert ideal <= result.makespan_s <= 1.5 * ideal


def test_planned_rejects_an_unknown_pick() -> None:
    with pytest.raises(ValueError, match="pick"):
        make_policy("planned", pick="closest")
