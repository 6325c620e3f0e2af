"""The scale simulator (benchmarks/scale_sim.py): a small world end to end in simulated time, its report and the
per-kind account of where the time went, for fedpool and the least-outstanding-work baseline."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from fedpool.benchmarks.scale_sim import Spec, by_kind, main, run_baseline, run_virtual
from fedpool.benchmarks.simulator import kind_counts


def test_a_small_world_answers_everything_and_accounts_for_every_request_by_kind() -> None:
    spec = Spec(servers=8, evals=4, seed=5)
    requests = sum(e.size for e in spec.eval_list())
    counts = kind_counts(spec.kind_table, spec.servers)
    for result in (run_virtual(spec), run_baseline(spec)):
        assert result.completed == requests and result.failed == 0 and result.inflight_end == 0
        kinds = by_kind(result, spec)
        assert {k: row["servers"] for k, row in kinds.items()} == counts
        assert sum(n for row in kinds.values() for n in row["requests"].values()) == requests
        for row in kinds.values():
            assert 0 <= row["last_median_s"] <= row["last_max_s"] <= result.makespan_s
            assert 0 <= row["busy_share"] <= 1.5  # saturated-cost work ÷ makespan: near 1 when a kind is kept busy
        assert max(row["last_max_s"] for row in kinds.values()) == result.makespan_s  # the last answer ends the run


def test_the_report_ends_with_its_result_line_and_shows_where_the_time_goes(tmp_path: Path) -> None:
    main(["--servers", "8", "--evals", "4", "--seeds", "5", "--name", "small", "--results-dir", str(tmp_path)])
    text = (tmp_path / "small.md").read_text()
    assert "Where the time goes, per server kind" in text
    assert "| 5 | vllm-v100-32gb-7b | 4 |" in text
    last = text.rstrip().splitlines()[-1]
    assert last.startswith("result: mode=virtual servers=8 evals=4 vs_ideal=") and "worlds=1" in last


def test_leasing_processes_make_the_same_schedule_whatever_the_hash_seed() -> None:
    """Simulated time measures the schedule, not the machine: the same world of leasing processes gives the same
    makespan under two hash seeds (the broker once woke holders in a set's hash order: 1.37-1.46x the ideal on one
    world from run to run)."""
    script = ("from fedpool.benchmarks.scale_sim import Spec, run_virtual; "
              "print(run_virtual(Spec(servers=16, evals=8, processes=8, leases=True, seed=3)).makespan_s)")
    makespans = set()
    for hash_seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True,
                              env={**os.environ, "PYTHONHASHSEED": hash_seed})
        makespans.add(float(done.stdout.strip().splitlines()[-1]))
    assert len(makespans) == 1


def test_processes_that_delegate_to_one_gateway_are_placed_as_one_process_places_its_evals() -> None:
    """Four eval processes sending through one gateway (`eval run --gateway`: the real gateway app in process, each
    process's evals through a `DelegatingDispatcher`): the gateway's one dispatcher sees all eight evals, declared
    with their sizes, and places them as one process does — within 2% of one process's makespan (the hops to the
    gateway, 1 ms a request, are the difference), every request answered once. Its report shows the design beside
    the same processes leasing slots."""
    one = Spec(servers=32, evals=8, seed=1, policy="earliest_finish", client_order="longest_answers_first",
               engine_times=True)
    four = replace(one, processes=4, delegate=True)
    alone, delegated = run_virtual(one), run_virtual(four)
    requests = sum(e.size for e in one.eval_list())
    assert delegated.completed == requests and delegated.failed == 0 and delegated.inflight_end == 0
    assert all(o.answered == e.size for e, o in zip(four.eval_list(), delegated.outcomes.values(), strict=True))
    assert abs(delegated.makespan_s / alone.makespan_s - 1) < 0.02


def test_the_delegating_report_shows_the_leasing_design_beside_it(tmp_path: Path) -> None:
    main(["--servers", "8", "--evals", "4", "--processes", "2", "--delegate", "--also-leases", "--seeds", "5",
          "--name", "both", "--results-dir", str(tmp_path)])
    text = (tmp_path / "both.md").read_text()
    assert "the same processes leasing slots (÷ ideal)" in text and "handing its placement to one gateway" in text
    last = text.rstrip().splitlines()[-1]
    assert "processes=2" in last and "design=gateway" in last and "leases_vs_ideal=" in last
    assert "below_least_work_worlds=" in last
