"""Real lm-eval processes in both arms (benchmarks/realtool_speedup.py, small): each on its own llama.cpp
server, then all through fedpool's gateway. Every answer of every eval comes back in both arms, as separate
clients (one key each), and the report is written with its result line.

Which arm is faster is measured by the benchmark (benchmarks/results/realtool_speedup.md, medians and spread
over repeats), not asserted here: on 2 shared cores the short eval's wall time moved 7.2-18.7 s between
repeats of one arm, and "not later through the gateway" compared two noisy medians of near-equal expectation
(11.3 vs 7.9 s in one fresh-clone CI run, the other way round in the previous one)."""

from __future__ import annotations

from pathlib import Path

from fedpool.benchmarks import realtool_speedup


def test_two_lm_eval_processes_through_the_gateway(tmp_path: Path) -> None:
    args = realtool_speedup.parse_args([
        "--small", "--repeats", "3", "--pairs", "unequal", "--no-fedpool-arm", "--gateway-concurrency", "8",
        "--results-dir", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work")])
    results, path, line = realtool_speedup.execute(args)
    assert line["tool"] == "lm-eval" and line["processes"] == 2 and line["repeats"] == 3
    assert 0.0 <= float(str(line["answers_same_pct"])) <= 100.0
    assert path.read_text().rstrip().endswith("result: " + " ".join(f"{k}={v}" for k, v in line.items()))
    result = results["unequal"]
    sizes = {w.name: len(w.rows) for w in result.pair.workloads}
    for run in result.runs:  # every record of every eval came back in both arms
        for arm in ("conventional", "gateway-nc8"):
            assert {name: len(answers) for name, answers in run[arm].answers.items()} == sizes, arm
    for arm in ("conventional", "gateway-nc8"):  # each arm timed in every repeat (what the report compares)
        walls = result.eval_walls(arm)
        assert set(walls) == set(sizes) and all(w > 0 for w in walls.values()), (arm, walls)
        assert result.median(arm) > 0, arm
