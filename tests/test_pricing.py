"""Planned routing's prices: data-sheet priors that are not the emulator's generating constants (and do not move
when the emulator's world is perturbed), and a fit that learns each server kind's speed from answers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fedpool.federation.core.ledger import InflightLedger
from fedpool.federation.routing import pricing
from fedpool.federation.routing.pricing import CostFit, server_cost, step_cost
from fedpool.registry import Engine, ServerEntry, ServerRecord, ServerStatus
from tests.sources import parse_source

ROOT = Path(__file__).resolve().parents[1]


def _entry(sid: str, accelerator: str, capacity: int = 256) -> ServerEntry:
    record = ServerRecord(id=sid, url="http://127.0.0.1:1", engine=Engine.VLLM, model="m",
                          accelerator=accelerator, gpu_count=1)
    return ServerEntry(record=record, status=ServerStatus.HEALTHY, capacity=capacity, weight=1.0)


def _emulator_efficiencies() -> dict[str, set[float]]:
    """The keyword values deploy/emulator_profiles.py derives its GPU profiles from (mfu, bw_eff, overhead)."""
    tree = parse_source((ROOT / "deploy" / "emulator_profiles.py").read_text())
    found: dict[str, set[float]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_derived":
            for kw in node.keywords:
                value = kw.value.value if isinstance(kw.value, ast.Constant) else None
                if kw.arg in {"mfu", "bw_eff", "overhead"} and isinstance(value, int | float):
                    found.setdefault(kw.arg, set()).add(float(value))
    return found


def test_priors_are_not_the_emulators_generating_constants() -> None:
    emulator = _emulator_efficiencies()
    assert emulator["mfu"] and emulator["bw_eff"], "the emulator's derivation moved: update this test's reader"
    assert pricing.PREFILL_EFFICIENCY not in emulator["mfu"]
    assert pricing.DECODE_BW_EFFICIENCY not in emulator["bw_eff"]
    # and the prior's A100:V100 prefill ratio is the data sheets' (312:125), not the emulator's (which also
    # gives the V100 a lower efficiency): the fit has to learn the difference
    a100, v100 = server_cost(_entry("a", "A100")), server_cost(_entry("v", "V100"))
    assert v100.prefill_s_per_token / a100.prefill_s_per_token == pytest.approx(312 / 125)


def test_perturbing_the_emulator_leaves_the_priors_where_they_are() -> None:
    """The Table 7 pool under three perturbation seeds: every emulated server's profile moves (prefill and
    decode scaled by factors routing never sees), and the planner's price for each server does not."""
    from fedpool.benchmarks.speedup_engine import load_pool_config

    pool = load_pool_config(ROOT / "benchmarks" / "configs" / "table7_pool.yaml")
    entries = {s.id: _entry(s.id, s.accelerator) for s in pool.emulated}
    priors = {sid: server_cost(e) for sid, e in entries.items()}
    plain = {s.id: s.resolved(pool.output_spread) for s in pool.emulated}
    for seed in (1, 2, 3):
        perturbed = {s.id: s.resolved(pool.output_spread, seed) for s in pool.emulated}
        for sid, profile in perturbed.items():
            assert profile.prefill_s_per_token != plain[sid].prefill_s_per_token
            assert profile.decode_s_per_token != plain[sid].decode_s_per_token
            assert server_cost(entries[sid]) == priors[sid], (seed, sid)
    # and the prices cannot see the emulator: nothing in routing imports it
    for module in ("routing/pricing.py", "routing/planner.py", "routing/plans.py", "routing/plan_lp.py",
                   "core/ledger.py", "routing/policies.py", "core/dispatcher.py"):
        tree = parse_source((ROOT / "federation" / module).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any("emulator" in name or "deploy" in name or "benchmarks" in name for name in imported), module


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("slowness,batch", [(3.0, 1), (0.6, 1), (2.0, 8)])
def test_cost_fit_learns_a_kinds_speed_from_busy_time(slowness: float, batch: int) -> None:
    """A server `slowness` × slower than its prior in everything, answering a mix of prompt-heavy and
    decode-heavy requests `batch` at a time: the fitted factor converges on the true one (decode steps priced at
    the batch it actually ran, not at a full batch's share), and the prior itself does not move."""
    import random

    clock = _Clock()
    ledger = InflightLedger(clock=clock, wall_clock=clock)
    fit = CostFit(ledger, clock, tau_s=1e6, window_s=1.0)
    server = _entry("s", "A100")
    prior = server_cost(server)
    before = server_cost(server)
    rng = random.Random(3)
    for _ in range(60):
        shapes = [rng.choice([(4000, 4), (100, 400), (1500, 60)])] * batch  # a batch of like requests
        steps = shapes[0][1]  # decoded together: one step per answer token
        busy = slowness * (sum(p for p, _ in shapes) * prior.prefill_s_per_token
                           + steps * step_cost(server, batch))
        for _ in shapes:
            ledger.take(ledger.slots("s"), "c")
        clock.t += busy
        for _ in shapes:
            ledger.release(ledger.slots("s"), "c")
        clock.t += 0.4  # idle between batches: not busy time
        for p, c in shapes:
            fit.observe(server, "k", p, c)
    assert fit.fitted_kinds()["k"] == pytest.approx(slowness, rel=0.15)
    assert server_cost(server) == before
    cost = fit.costs({"k": [server]})["k"]
    assert cost.prefill_s_per_token == pytest.approx(prior.prefill_s_per_token * slowness, rel=0.15)


def test_unfitted_kinds_take_the_fitted_kinds_mean_speed() -> None:
    clock = _Clock()
    ledger = InflightLedger(clock=clock, wall_clock=clock)
    fit = CostFit(ledger, clock, tau_s=1e6, window_s=1.0)
    a100, v100 = _entry("a", "A100"), _entry("v", "V100")
    prior = server_cost(a100)
    for _ in range(10):
        busy = (1000 * prior.prefill_s_per_token + 100 * step_cost(a100, 1)) * 2.0
        ledger.take(ledger.slots("a"), "c")
        clock.t += busy
        ledger.release(ledger.slots("a"), "c")
        clock.t += 1.0
        fit.observe(a100, "A", 1000, 100)
    costs = fit.costs({"A": [a100], "V": [v100]})
    assert costs["A"].of(1000, 100) == pytest.approx(2.0 * prior.of(1000, 100), rel=0.05)
    # the V100 kind has no answers: its prior, on the fitted kinds' scale
    assert costs["V"].of(1000, 100) == pytest.approx(2.0 * server_cost(v100).of(1000, 100), rel=0.05)
    disabled = CostFit(ledger, clock, tau_s=1e6, enabled=False)
    assert disabled.costs({"A": [a100]})["A"] == server_cost(a100)
