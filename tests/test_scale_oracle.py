"""The clairvoyant placement (benchmarks/scale_oracle.py): every request placed once, in its roles, in a small
simulated world, and its report."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from fedpool.benchmarks.scale_oracle import (
    TIMED_REFIT,
    FinishOracle,
    KindModel,
    assign,
    main,
    run_dispatch,
    run_oracle,
)
from fedpool.benchmarks.scale_sim import Spec, ideal_s
from fedpool.benchmarks.simulator import kind_counts
from fedpool.federation.routing.waveplan import LONG_ANSWER_TOKENS


def servers_of(spec: Spec) -> list[tuple[str, str]]:
    return [(f"{kind}-{i}", kind) for kind, n in kind_counts(spec.kind_table, spec.servers).items() for i in range(n)]


def test_every_request_is_placed_once_long_answers_packed_on_their_fastest_kind() -> None:
    spec = Spec(servers=16, evals=8, seed=3)
    servers = servers_of(spec)
    kind_of = dict(servers)
    evals = spec.eval_list()
    assignment = assign(spec, servers)
    placed = Counter((e, k) for e, k, _ in assignment.order)
    assert sorted(placed) == sorted((e, k) for e, ev in enumerate(evals) for k in range(ev.size))
    assert set(placed.values()) == {1}
    models = {kind: KindModel.of(profile) for kind, profile in spec.profiles().items()}
    fastest = min(m.step_s for m in models.values())
    long_on: Counter[str] = Counter()
    for e, _, sid in assignment.order:
        if evals[e].answer_tokens >= LONG_ANSWER_TOKENS:
            assert models[kind_of[sid]].step_s <= fastest * 1.1  # only where long answers decode fastest
            long_on[sid] += 1
    batch = spec.max_running
    assert long_on
    # packed a full batch to a server: per kind, at most one server holds a part of a batch
    partial = Counter(kind_of[sid] for sid, n in long_on.items() if n % batch)
    assert all(n <= 1 for n in partial.values())
    # a second batch on a server only once every server of those kinds has one
    fast = [sid for sid, kind in servers if models[kind].step_s <= fastest * 1.1]
    if max(long_on.values()) > batch:
        assert all(long_on[sid] >= batch for sid in fast)
    # the longest first: the order's first requests are the long answers
    firsts = [evals[e].answer_tokens for e, _, _ in assignment.order[:len(long_on)]]
    assert min(firsts) >= LONG_ANSWER_TOKENS


def test_the_simulated_run_answers_everything_and_is_no_faster_than_the_ideal() -> None:
    spec = Spec(servers=16, evals=8, seed=3)
    result, predicted = run_oracle(spec)
    assert result.completed == sum(e.size for e in spec.eval_list()) and result.failed == 0
    ideal = ideal_s(spec)[0]
    assert result.makespan_s >= ideal * 0.999  # the ideal is a bound
    assert predicted > 0


def test_the_report_ends_with_its_result_line(tmp_path: Path) -> None:
    main(["--servers", "16", "--evals", "8", "--seeds", "3", "--dispatch-orders", "fair", "--name", "oracle",
          "--results-dir", str(tmp_path)])
    text = (tmp_path / "oracle.md").read_text()
    assert "| 3 | vllm-a100-80gb-7b |" in text
    last = text.rstrip().splitlines()[-1]
    assert last.startswith("result: mode=oracle servers=16 evals=8 worlds=1 oracle_vs_ideal=")
    assert " dispatch_fair_vs_ideal=" in last and " dispatch_vs_ideal=" not in last
    assert " dispatch_timed_vs_ideal=" in last


def test_the_dispatcher_arm_answers_everything_and_waits_for_a_far_sooner_server() -> None:
    spec = Spec(servers=16, evals=8, seed=3, client_order="longest_answers_first")
    result = run_dispatch(spec)
    assert result.completed == sum(e.size for e in spec.eval_list()) and result.failed == 0
    assert result.inflight_end == 0
    assert result.makespan_s >= ideal_s(spec)[0] * 0.999
    # long answers only where they decode fastest: the V100s answered none of the text evals
    text = {e.name for e in spec.eval_list() if e.answer_tokens >= LONG_ANSWER_TOKENS}
    on_slow = sum(n for s in result.servers if "v100" in s.kind for c, n in s.answered_by.items() if c in text)
    assert on_slow == 0


def test_the_timed_arm_learns_each_kinds_costs_from_the_answers_engine_times() -> None:
    spec = Spec(servers=16, evals=8, seed=3, client_order="longest_answers_first")
    models = {kind: KindModel.of(profile) for kind, profile in spec.profiles().items()}
    kind_of = {f"{kind}-{i}": kind for kind in models for i in range(2)}
    policy = FinishOracle({k: KindModel(m.prefill_s * 3, m.step_s * 3, m.batch) for k, m in models.items()}, kind_of,
                          {})
    server, kind = next(iter(kind_of.items()))
    truth = models[kind]
    for i in range(TIMED_REFIT * 3):  # prompts alone, then answers alone; stalls (i % 3) only lengthen them
        stall = 1 + (i % 3)
        policy.timing(server, 1000, 1, 1000 * truth.prefill_s * stall, 0.0)
        policy.timing(server, 10, 64, 0.0, 63 * truth.step_s * stall)
    learned = policy.costs(kind)
    assert learned.prefill_s == pytest.approx(truth.prefill_s) and learned.step_s == pytest.approx(truth.step_s)
    assert policy.costs(next(k for k in models if k != kind)).step_s == pytest.approx(
        3 * models[next(k for k in models if k != kind)].step_s)  # a kind with no answers keeps what it had
    result = run_dispatch(spec, timed=True)
    assert result.completed == sum(e.size for e in spec.eval_list()) and result.failed == 0
    assert result.inflight_end == 0 and result.makespan_s >= ideal_s(spec)[0] * 0.999
