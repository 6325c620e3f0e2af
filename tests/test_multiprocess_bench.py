"""benchmarks/multiprocess.py, small: five `fedpool eval run` processes and one, two lm-eval processes behind two
gateway replicas and behind one, on a real local pool. Every record and answer comes back in every arm, the
requests are counted per server, lease traffic is measured, and the report ends with its result line.

How the arms compare is measured by the benchmark (benchmarks/results/multiprocess.md), not asserted here: on 2
shared cores start-up alone moves by seconds between runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedpool.benchmarks import multiprocess

pytestmark = [pytest.mark.llamacpp, pytest.mark.lmeval]

LIMIT = 4
LONG_PROMPTS = 4
TOOL_ARITH = 8
PROCESSES = 5  # not the default: three long-answer evals and two short ones


@pytest.mark.timeout(600)
def test_multiprocess_benchmark_small(tmp_path: Path) -> None:
    args = multiprocess.parse_args([
        "--repeats", "1", "--processes", str(PROCESSES), "--limit", str(LIMIT), "--long-prompts", str(LONG_PROMPTS),
        "--long-tokens", "8", "--tool-arith", str(TOOL_ARITH), "--results-dir", str(tmp_path / "results"),
        "--work-dir", str(tmp_path / "work"), "--engine-cpus", "1"])
    cores_before = os.sched_getaffinity(0)
    results, path, line = multiprocess.execute(args)
    assert os.sched_getaffinity(0) == cores_before  # the engines' core given back to this process
    assert line["processes"] == PROCESSES and line["repeats"] == 1, line
    assert float(str(line["replicas_eval_vs_one"])) > 0, line
    assert line["over_capacity"] == 0, line  # the registry's exported counter, through every arm
    assert "Bytecode: fedpool's modules compiled once before the arms" in path.read_text()  # and the report says so
    assert path.read_text().rstrip().endswith("result: " + " ".join(f"{k}={v}" for k, v in line.items()))
    (evals,) = results.evals  # the untimed warm-up runs ran first, and are not among the repeats
    assert all((tmp_path / "work" / part / "arm.json").is_file() for part in ("evals-warmup", "tools-warmup"))
    for arm in multiprocess.EVAL_ARMS:
        run = evals[arm]
        assert sorted(run.evals) == ["arith", "capitals", "long_a", "long_b", "long_c"], arm
        for name, timing in run.evals.items():  # every record, from launch, after its process started
            assert timing.records == LIMIT and timing.failed == 0, (arm, name, timing)
            assert 0 < timing.started_s < timing.done_s, (arm, name, timing)
            assert sum(timing.by_server.values()) == LIMIT, (arm, name, timing)
        assert run.watch.lease_calls > 0 and run.watch.samples > 0, arm
        assert run.cpu is not None and run.cpu.engines_cpu_s > 0, (arm, run.cpu)  # the engines' cores, measured
    assert len(evals["multi"].process_s) == PROCESSES and len(evals["one"].process_s) == 1
    (tools,) = results.tools
    for arm in multiprocess.TOOL_ARMS:
        tool = tools[arm]
        assert tool.answers == {"arith": TOOL_ARITH, "long": LONG_PROMPTS}, arm
        # every request was answered by a server of the pool, and counted once
        assert sum(tool.by_server.values()) == TOOL_ARITH + LONG_PROMPTS, (arm, tool.answered)
        assert set(tool.by_server) <= set(multiprocess_servers(tmp_path)), tool.by_server
        assert all(s > 0 for s in tool.eval_s.values()), (arm, tool.eval_s)
    assert len(tools["two-replicas"].pids) == 2 and len(tools["one-gateway"].pids) == 1
    # the report written again from what the run kept: the same figures
    again = multiprocess.parse_args(["--from-work-dir", str(tmp_path / "work"), "--results-dir",
                                     str(tmp_path / "again")])
    _, path_again, line_again = multiprocess.execute(again)
    assert line_again == line
    assert path_again.read_text().split("## 1.")[1] == path.read_text().split("## 1.")[1]


def multiprocess_servers(tmp_path: Path) -> list[str]:
    """The server ids the pool registered (their logs are named after them)."""
    return [p.stem for p in (tmp_path / "work" / "logs").glob("*.log")]
