"""`fedpool bench speedup`: its configuration errors, how it splits servers, the ideal, and one small run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fedpool.benchmarks.assignment import Workload, ideal_makespan, saturated_cost
from fedpool.benchmarks.speedup_engine import (
    ArmResult,
    BenchConfigError,
    BusyTrace,
    EvalOutcome,
    EvalsConfig,
    LiveServer,
    assign_servers,
    load_evals_config,
    load_pool_config,
    median_arm,
    perturbation,
    prepare_evals,
)
from fedpool.deploy.emulator import PROFILES
from fedpool.registry import Engine, ServerRecord

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"


def test_shipped_configs_load() -> None:
    for name in ("table7", "small", "real"):
        load_pool_config(CONFIGS / f"{name}_pool.yaml")
        load_evals_config(CONFIGS / f"{name}_evals.yaml")


def test_bad_configs_name_the_file_and_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "pool.yaml"
    bad.write_text("model: m\nemulated:\n  - {id: a, profile: h100-fantasy}\n")
    with pytest.raises(BenchConfigError, match=r"pool\.yaml: field 'emulated\.0'.*h100-fantasy"):
        load_pool_config(bad)
    bad.write_text("model: m\nemulated:\n  - {id: a, profile: tiny}\n  - {id: a, profile: tiny}\n")
    with pytest.raises(BenchConfigError, match="unique"):
        load_pool_config(bad)
    bad.write_text("model: m\nemulated: [\n")
    with pytest.raises(BenchConfigError, match=r"pool\.yaml:\d+: not valid YAML"):
        load_pool_config(bad)
    evals = tmp_path / "evals.yaml"
    evals.write_text("evals:\n  - {name: t, size: 0, prompt_tokens: 5, max_tokens: 5}\n")
    with pytest.raises(BenchConfigError, match=r"evals\.yaml: field 'evals\.0\.synthetic\.size'"):
        load_evals_config(evals)
    evals.write_text("evals:\n  - {spec: 'bundled:nonesuch'}\n")
    with pytest.raises(BenchConfigError, match="no bundled benchmark 'nonesuch'"):
        prepare_evals(load_evals_config(evals), tmp_path / "data")


def live(sid: str, profile: str) -> LiveServer:
    p = PROFILES[profile]
    record = ServerRecord(id=sid, url="http://127.0.0.1:1", engine=Engine.VLLM, model="m")
    return LiveServer(record, p, 1.0 / p.decode_s_per_token)


def test_conventional_split_gives_the_heaviest_eval_the_fastest_server(tmp_path: Path) -> None:
    config = EvalsConfig.model_validate({"evals": [
        {"name": "small", "size": 10, "prompt_tokens": 50, "max_tokens": 8},
        {"name": "big", "size": 500, "prompt_tokens": 200, "max_tokens": 256},
    ]})
    evals = prepare_evals(config, tmp_path)
    a100, v100a, v100b = (live("a100", "vllm-a100-80gb-7b"), live("v100a", "vllm-v100-32gb-7b"),
                          live("v100b", "vllm-v100-32gb-7b"))
    split = assign_servers(evals, [v100a, a100, v100b])
    assert "a100" in split["big"]  # the heavy eval gets the fastest server (and spare ones shard it)
    shared = assign_servers(evals, [v100a])
    assert shared == {"big": ["v100a"], "small": ["v100a"]}  # fewer servers than evals: they share
    three = prepare_evals(EvalsConfig.model_validate({"evals": [
        *config.model_dump()["evals"], {"name": "tiny", "size": 5, "prompt_tokens": 50, "max_tokens": 8}]}),
        tmp_path / "three")
    # The two light evals share the second server; neither joins the heavy one.
    split3 = assign_servers(three, [v100a, v100b])
    assert split3["small"] == split3["tiny"] and split3["big"] != split3["small"]


def test_ideal_is_the_fluid_split_over_server_speeds() -> None:
    a100 = PROFILES["vllm-a100-80gb-7b"]
    cost = saturated_cost(a100, 1000, 10)
    assert cost == pytest.approx(1000 * a100.prefill_s_per_token, rel=0.05)  # prefill-bound
    t, plan = ideal_makespan([Workload("e", 100, 1000.0, 10.0)], {"x": a100, "y": a100})
    assert t == pytest.approx(50 * cost, rel=1e-6)
    assert plan["e"]["x"] + plan["e"]["y"] == pytest.approx(100)


@pytest.mark.ray
@pytest.mark.slow
def test_a_small_comparison_end_to_end_writes_its_report(ray_cluster: None, tmp_path: Path) -> None:
    """Every arm on freshly started emulated servers; the report carries them, the bounds and the result line."""
    from fedpool.benchmarks.speedup import main

    rc = main(["--pool", str(CONFIGS / "small_pool.yaml"), "--evals", str(CONFIGS / "small_evals.yaml"),
               "--name", "speedup_test", "--results-dir", str(tmp_path), "--work-dir", str(tmp_path / "work")])
    assert rc == 0
    report = (tmp_path / "speedup_test.md").read_text()
    last = report.strip().splitlines()[-1]
    values = dict(kv.split("=") for kv in last.removeprefix("result: ").split())
    assert set(values) == {"speedup_vs_strongest", "strongest", "speedup_vs_static", "vs_ideal",
                           "best_split_vs_ideal", "repeats"}
    assert values["strongest"] in ("static", "sliding", "whole") and values["repeats"] == "1"
    assert float(values["vs_ideal"]) >= 0.9 and float(values["best_split_vs_ideal"]) >= 0.99  # nothing beats it
    for arm in ("static", "sliding", "whole", "federated-inline", "federated"):
        assert f"| `{arm}` |" in report
    assert "Emulated engines, started afresh" in report and "other hardware" in report
    assert (tmp_path / "speedup_test_walltime.png").stat().st_size > 0
    (run,) = list((tmp_path / "work").iterdir())
    for arm in ("static", "sliding", "whole", "federated-inline", "federated"):
        for name, size in (("text", 64), ("image", 96)):
            lines = (run / "run1" / arm / name / "records.jsonl").read_text().splitlines()
            assert len(lines) == size, (arm, name)


def test_a_perturbation_is_seeded_bounded_and_invisible_to_routing() -> None:
    """Each server's speeds move by independent seeded factors in [0.7, 1.3]; the planner's priors (data-sheet
    prices) do not move with them: routing knows the accelerator, never the emulator's numbers."""
    from fedpool.federation.routing.pricing import server_cost
    from fedpool.registry import ServerEntry, ServerStatus, prior_weight

    pool = load_pool_config(CONFIGS / "table7_pool.yaml")
    plain = pool.profiles()
    factors = {s.id: perturbation(7, s.id) for s in pool.emulated}
    assert all(0.7 <= f <= 1.3 for pair in factors.values() for f in pair)
    assert len({pair for pair in factors.values()}) == len(factors)  # independent per server
    assert factors == {s.id: perturbation(7, s.id) for s in pool.emulated}  # and seeded
    moved = pool.model_copy(update={"perturb_seed": 7}).profiles()
    for sid, (prefill, decode) in factors.items():
        assert moved[sid].prefill_s_per_token == pytest.approx(plain[sid].prefill_s_per_token * prefill)
        assert moved[sid].decode_s_per_token == pytest.approx(plain[sid].decode_s_per_token * decode)

    def entry(accelerator: str) -> ServerEntry:
        record = ServerRecord(id="x", url="http://127.0.0.1:1", engine=Engine.VLLM, model="m",
                              accelerator=accelerator, gpu_count=1)
        return ServerEntry(record=record, status=ServerStatus.HEALTHY, capacity=256, weight=prior_weight(record))

    before = {a: server_cost(entry(a)) for a in ("A100", "V100")}
    import fedpool.deploy.emulator as emulator

    original = dict(emulator.PROFILES)
    try:  # the emulator's own numbers changed under routing: its prices stay the data sheet's
        for name, profile in original.items():
            emulator.PROFILES[name] = dataclasses.replace(profile, prefill_s_per_token=profile.prefill_s_per_token * 3,
                                                          decode_s_per_token=profile.decode_s_per_token * 0.3)
        assert {a: server_cost(entry(a)) for a in ("A100", "V100")} == before
    finally:
        emulator.PROFILES.clear()
        emulator.PROFILES.update(original)


def test_repeated_runs_report_medians_and_keep_the_median_runs_traces() -> None:
    """Per-eval wall times and the makespan are medians over the runs; the busy trace is the median run's."""
    def arm(makespan: float, walls: dict[str, float]) -> ArmResult:
        return ArmResult("federated", makespan, {n: EvalOutcome(n, "text", 1, w, 1, 0, None, {}) for n, w in
                                                 walls.items()}, BusyTrace(makespan), ["s0"])

    runs = [arm(10.0, {"a": 3.0, "b": 10.0}), arm(30.0, {"a": 1.0, "b": 30.0}), arm(20.0, {"a": 8.0, "b": 20.0})]
    merged = median_arm(runs)
    assert merged.makespan_s == 20.0 and {n: o.wall_s for n, o in merged.evals.items()} == {"a": 3.0, "b": 20.0}
    assert merged.busy is runs[2].busy  # the run whose makespan is the median
    assert median_arm(runs[:1]) is runs[0]
    assert median_arm(runs[:2]).makespan_s == 20.0 and median_arm(runs[:2]).busy is runs[0].busy  # lower middle
