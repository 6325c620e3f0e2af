"""Faults on a real local pool (Ray, the registry actor, emulated servers in their own processes, a real
llama.cpp server): every record exactly once, the run completes, the pool's status right afterwards.
The same scenarios write benchmarks/results/reliability.md (`python -m fedpool.benchmarks.reliability`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpool.benchmarks.reliability import SCENARIOS, run_scenario

pytestmark = [pytest.mark.ray, pytest.mark.llamacpp]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_scenario_loses_and_doubles_nothing(ray_cluster: None, tmp_path: Path, name: str) -> None:
    # No clean run first: the penalty against one is the benchmark's figure; here, what is lost and doubled.
    figure = await run_scenario(name, tmp_path, baseline=False)
    print(" | ".join(map(str, figure.row())))  # the figure, in the test log
    # 135 records of the bundled benchmarks, or 16 streams for the streaming scenario
    assert figure.expected == (16 if name == "streams-killed" else 135)
    assert figure.lost == 0 and figure.duplicated == 0, figure
    assert figure.written == figure.expected
    assert figure.pool_ok, figure.pool_note
