"""Several Ray nodes on this machine (ray.cluster_utils.Cluster): registry, servers and a CPU stage on
different nodes, and requests still reach every server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def last_json_line(stdout: str) -> dict[str, Any]:
    """The script's report: its last JSON line (Ray's raylet may print log lines after it)."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))


@pytest.mark.ray
@pytest.mark.slow
def test_registry_servers_and_cpu_actors_on_different_nodes() -> None:
    # Its own process: a test session can be connected to one Ray cluster only.
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "multinode" / "cluster_check.py")], cwd=ROOT,
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json_line(result.stdout)
    nodes = report["server_nodes"]
    assert len({report["registry_node"], nodes["srv-1"], nodes["srv-2"]}) == 3  # three different nodes
    assert sorted(report["registered"]) == ["srv-1", "srv-2"]
    assert report["answered_by"] == ["srv-1", "srv-2"]  # the pool spans the nodes
    assert report["scorer_node"] == nodes["srv-2"] != report["registry_node"]
    assert report["scores"] == [1.0] * 20


@pytest.mark.ray
@pytest.mark.slow
def test_losing_the_node_of_the_cpu_actors_loses_no_record() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "multinode" / "node_loss.py")], cwd=ROOT,
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    figure = last_json_line(result.stdout)
    print(figure)
    assert figure["removed"] and figure["expected"] == 135
    assert figure["written"] == 135 and figure["duplicated"] == 0 and figure["failed"] == 0
    assert figure["stage_nodes_before"] == [figure["worker_node"]]  # the actors were on the lost node...
    assert figure["worker_node"] not in figure["stage_nodes_after"]  # ...and were started again elsewhere
