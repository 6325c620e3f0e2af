"""The pure parts of two benchmarks' harnesses: which evals benchmarks/multiprocess.py runs for N processes and its
`replicas_eval_vs_one`; and the chaos soak's lease sampler (benchmarks/chaos_soak.py `LeaseWatch`), which must see
a server leased past its slots, by one broker or across a registry restart."""

from __future__ import annotations

from pathlib import Path

from fedpool.benchmarks import multiprocess
from fedpool.benchmarks.chaos_soak import LeaseWatch
from fedpool.pipeline.spec import load_specs


def test_eval_names_keep_issue_23s_four_and_grow_by_halves() -> None:
    assert multiprocess.eval_names(4) == ["long_a", "long_b", "arith", "capitals"]
    assert multiprocess.eval_names(7) == ["long_a", "long_b", "long_c", "long_d", "arith", "capitals", "capitals_mc"]
    eight = multiprocess.eval_names(8)
    assert eight == ["long_a", "long_b", "long_c", "long_d", "arith", "capitals", "capitals_mc", "arith_2"]
    many = multiprocess.eval_names(64)
    assert len(set(many)) == 64 and sum(n.startswith("long_") for n in many) == 32


def test_write_specs_gives_every_process_a_spec_of_its_own(tmp_path: Path) -> None:
    paths = multiprocess.write_specs(tmp_path, long_prompts=3, long_tokens=8, count=8)
    specs = load_specs(paths, limit=2)
    assert [s.name for s in specs] == multiprocess.eval_names(8)
    by_name = {s.name: s for s in specs}
    # the copy runs the bundled data under its own name
    assert by_name["arith_2"].prompt.template == by_name["arith"].prompt.template


def _tool_arm(arm: str, eval_s: dict[str, float]) -> multiprocess.ToolArm:
    return multiprocess.ToolArm(arm, eval_s, dict(eval_s), {n: {} for n in eval_s}, {n: 1 for n in eval_s},
                                multiprocess.ArmWatch())


def test_replicas_eval_vs_one_is_the_worse_runs_median() -> None:
    results = multiprocess.Results()
    for arith, long in ((1.2, 1.05), (1.0, 1.07), (1.1, 1.02)):  # two replicas ÷ one gateway, per repeat
        results.tools.append({"one-gateway": _tool_arm("one-gateway", {"arith": 10.0, "long": 30.0}),
                              "two-replicas": _tool_arm("two-replicas", {"arith": 10.0 * arith, "long": 30.0 * long})})
    line = multiprocess.headline(results)
    assert line["replicas_eval_vs_one"] == "1.10"  # arith's median; long's is 1.05
    assert multiprocess.TARGETS["replicas_eval_vs_one"] == 1.10
    assert list(line).index("replicas_eval_vs_one") < list(line).index("replicas_busier_share")


def _stats(incarnation: str, holders: dict[str, dict[str, int]]) -> dict[str, object]:
    return {"incarnation": incarnation, "holders": holders, "calls": 0, "reshares": 0}


def test_lease_watch_sees_one_broker_lease_a_server_past_its_slots() -> None:
    watch = LeaseWatch({"s0": 8, "s1": 8}, ttl_s=3.0)
    watch.observe(0.0, _stats("a", {"h1": {"s0": 4, "s1": 8}, "h2": {"s0": 4}, "h3": {}}))
    assert not watch.over and watch.max_holders == 2 and watch.max_leased == {"s0": 8, "s1": 8}
    watch.observe(0.25, _stats("a", {"h1": {"s0": 5}, "h2": {"s0": 4}}))
    (over,) = watch.over
    assert (over.server, over.leased, over.carried) == ("s0", 9, 0)
    assert watch.samples == 2 and watch.restarts == 0


def test_lease_watch_counts_the_old_brokers_leases_across_a_restart() -> None:
    watch = LeaseWatch({"s0": 8}, ttl_s=3.0)
    watch.observe(10.0, _stats("a", {"h1": {"s0": 6}, "h2": {"s0": 2}}))
    # The registry restarts: h1 has reported to the new broker (its new lease replaces the old one), h2 not yet;
    # h2's old lease still counts: the new broker leasing h1 7 would put s0 past its slots.
    watch.observe(11.0, _stats("b", {"h1": {"s0": 6}}))
    assert not watch.over and watch.carried_samples == 1 and watch.restarts == 1
    watch.observe(12.0, _stats("b", {"h1": {"s0": 7}}))
    (over,) = watch.over
    assert (over.leased, over.carried) == (9, 2)
    # two TTLs after the old broker's last sample its leases and their fallbacks have run out
    watch.observe(16.5, _stats("b", {"h1": {"s0": 8}}))
    assert len(watch.over) == 1 and watch.max_leased["s0"] == 9
    assert watch.incarnations == ["a", "b"]
