"""Real lm-eval processes in both arms (benchmarks/realtool_speedup.py, small): each on its own llama.cpp
server, then all through fedpool's gateway. Every answer comes back in both arms, and through the gateway no
eval finishes later than on its own server while the pair finishes sooner (issue 18: the short eval used to
queue behind the long one, as one anonymous client)."""

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
    alone, through = result.eval_walls("conventional"), result.eval_walls("gateway-nc8")
    short = min(alone, key=alone.__getitem__)
    assert through[short] <= alone[short], (through, alone)  # the short eval is not later through the gateway
    assert result.median("gateway-nc8") < result.median("conventional"), (through, alone)  # the pair sooner
