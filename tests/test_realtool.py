"""Real lm-eval processes in both arms (benchmarks/realtool_speedup.py, small): each on its own llama.cpp
server, then all through fedpool's gateway. Every answer of every eval comes back in both arms, as separate
clients (one key each), and the report is written with its result line.

Which arm is faster is measured by the benchmark (benchmarks/results/realtool_speedup.md, medians and spread
over repeats), not asserted here: on 2 shared cores the short eval's wall time moved 7.2-18.7 s between
repeats of one arm, and "not later through the gateway" compared two noisy medians of near-equal expectation
(11.3 vs 7.9 s in one fresh-clone CI run, the other way round in the previous one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpool.benchmarks import realtool_speedup

pytestmark = [pytest.mark.llamacpp, pytest.mark.lmeval]


# One repeat of 2 arms x 2 lm-eval processes on real llama.cpp (the benchmark itself repeats, for its medians)
@pytest.mark.timeout(600)
def test_two_lm_eval_processes_through_the_gateway(tmp_path: Path) -> None:
    args = realtool_speedup.parse_args([
        "--small", "--repeats", "1", "--pairs", "unequal", "--no-fedpool-arm", "--gateway-concurrency", "8",
        "--results-dir", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work")])
    results, path, line = realtool_speedup.execute(args)
    assert line["tool"] == "lm-eval" and line["processes"] == 2 and line["repeats"] == 1
    result = results["unequal"]
    # The report's agreement is the answers' own: recomputed here from every answer of both arms. Greedy
    # llama.cpp is not batch-invariant, so it is not 100 (the benchmark reports the engine's own run-to-run
    # agreement beside it); but a gateway that returned other answers, or answers keyed to other documents,
    # would agree on none.
    same = total = 0
    for run in result.runs:
        for name, answers in run["conventional"].answers.items():
            for doc, response in answers.items():
                total += 1
                same += run["gateway-nc8"].answers[name].get(doc) == response
    assert total == sum(len(w.rows) for w in result.pair.workloads) * len(result.runs)
    assert line["answers_same_pct"] == f"{100.0 * same / total:.1f}" and same > 0, line
    assert path.read_text().rstrip().endswith("result: " + " ".join(f"{k}={v}" for k, v in line.items()))
    sizes = {w.name: len(w.rows) for w in result.pair.workloads}
    assert result.gateway_arms == ["gateway-nc8", "gateway-nc8-sized"]
    for run in result.runs:  # every record of every eval came back in every arm
        for arm in ("conventional", "gateway-nc8", "gateway-nc8-sized"):
            assert {name: len(answers) for name, answers in run[arm].answers.items()} == sizes, arm
    # each arm timed in every repeat (what the report compares)
    for arm in ("conventional", "gateway-nc8", "gateway-nc8-sized"):
        walls = result.eval_walls(arm)
        assert set(walls) == set(sizes) and all(w > 0 for w in walls.values()), (arm, walls)
        assert result.median(arm) > 0, arm
        # The machine's cores during the arm: the engines computed (their own CPU time, from the kernel), and the
        # report prints the table the "why" of the balanced bound rests on.
        for run in result.runs:
            cpu = run[arm].cpu
            assert cpu is not None and cpu.engines_cpu_s > 0 and cpu.engines_wait_s >= 0 and cpu.other_cpu_s >= 0, cpu
    assert "engines waited for a core s" in path.read_text()
    for run in result.runs:  # every answered request's duration, per eval (the packing floor's input)
        for arm in ("conventional", "gateway-nc8", "gateway-nc8-sized"):
            assert {n: len(d) for n, d in run[arm].durations.items()} == sizes, arm
            assert all(d > 0 for ds in run[arm].durations.values() for d in ds), arm
    assert "Whole requests allow no better than" in path.read_text()
    # The sized arm's processes declared their runs (the gateway read them from the URL): its later evals are
    # counted against the conventional arm's as the plain arm's are.
    assert line["sized_later_evals"] == len(realtool_speedup.later_evals(result, "gateway-nc8-sized"))
    assert "gateway-nc8-sized: " in path.read_text()


def test_packing_deals_whole_requests_onto_the_slots_under_a_share() -> None:
    """8 slots; "short" 8 requests of 1 s, "long" 8 of 4 s (the larger). Share 0: short first, long after
    (done at 5); no cap: long first (short after it, done at 5); half and half: long's last four wait for
    short's two waves (done at 6: a ragged last wave)."""
    durations = {"short": [1.0] * 8, "long": [4.0] * 8}
    assert realtool_speedup.packing(durations, 8, 0) == (5.0, {"short": 1.0, "long": 5.0})
    assert realtool_speedup.packing(durations, 8, 8) == (5.0, {"long": 4.0, "short": 5.0})
    assert realtool_speedup.packing(durations, 8, 4) == (6.0, {"short": 2.0, "long": 6.0})
    assert realtool_speedup.packing({"short": [], "long": []}, 8, 4) == (0.0, {})


def test_a_later_eval_is_shown_beside_the_engines_and_the_packing() -> None:
    """Two equal evals: on their own servers both end at 50 s (each server busy 45 s); through the gateway one ends
    at 53 s, the servers busy 47.7 s each (1.06× the engines' time) and the makespan 1.11× that, as the
    conventional arm's: the report says so. A gateway arm that packed worse, or one beside a conventional arm
    that idles a server (unequal evals), says only the numbers."""
    def arm(name: str, makespan: float, busy: float, ends: dict[str, float]) -> realtool_speedup.ArmRun:
        return realtool_speedup.ArmRun(name, makespan, ends, ends, {"s0": busy, "s1": busy}, {}, {})

    pair = realtool_speedup.Pair("equal", (), "two equal evals")
    conventional = arm("conventional", 50.0, 45.0, {"a": 50.0, "b": 49.0})
    result = realtool_speedup.PairResult(pair, [{
        "conventional": conventional, "gateway-nc8": arm("gateway-nc8", 53.0, 47.7, {"a": 53.0, "b": 52.0}),
        "gateway-nc4": arm("gateway-nc4", 60.0, 45.0, {"a": 60.0, "b": 30.0})}], ["gateway-nc8", "gateway-nc4"])
    assert realtool_speedup.later_evals(result, "gateway-nc8") == [(1, "a", 53.0, 50.0), (1, "b", 52.0, 49.0)]
    text = realtool_speedup.why_later(result, "gateway-nc8", 2)
    assert "Later by 1.06×" in text and "engines took 1.06×" in text and "1.11× its own" in text, text
    assert "that is the difference" in text, text
    text = realtool_speedup.why_later(result, "gateway-nc4", 2)
    assert "at most 1.20×" in text and "that is the difference" not in text, text  # (1.33× packing against 1.11×)
    assert realtool_speedup.why_later(result, "conventional", 2) == ""
    # Unequal evals: the conventional arm idles a server (it packs at 1.8×); a gateway arm packing better, whose
    # short eval ended later, is not explained by its engines alone.
    idle = arm("conventional", 50.0, 27.8, {"short": 9.0, "long": 50.0})
    result = realtool_speedup.PairResult(pair, [{
        "conventional": idle, "gateway-nc8": arm("gateway-nc8", 38.0, 34.0, {"short": 9.5, "long": 38.0})}],
        ["gateway-nc8"])
    text = realtool_speedup.why_later(result, "gateway-nc8", 2)
    assert "Later by 1.06×" in text and "1.12× its own" in text and "1.80×" in text, text
    assert "that is the difference" not in text, text
