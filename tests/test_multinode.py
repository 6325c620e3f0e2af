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


def run_script(name: str, out: Path) -> dict[str, Any]:
    """Runs tests/multinode/<name> in its own process (a test session can be connected to one Ray cluster
    only) and reads the JSON figure it writes to `out`."""
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "multinode" / name), str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.ray
@pytest.mark.slow
def test_registry_servers_and_cpu_actors_on_different_nodes(tmp_path: Path) -> None:
    report = run_script("cluster_check.py", tmp_path / "report.json")
    nodes = report["server_nodes"]
    assert len({report["registry_node"], nodes["srv-1"], nodes["srv-2"]}) == 3  # three different nodes
    assert sorted(report["registered"]) == ["srv-1", "srv-2"]
    assert report["answered_by"] == ["srv-1", "srv-2"]  # the pool spans the nodes
    assert report["scorer_node"] == nodes["srv-2"] != report["registry_node"]
    assert report["scores"] == [1.0] * 20


@pytest.mark.ray
@pytest.mark.slow
def test_losing_the_node_of_the_cpu_actors_loses_no_record(tmp_path: Path) -> None:
    figure = run_script("node_loss.py", tmp_path / "figure.json")
    print(figure)
    assert figure["removed"] and figure["expected"] == 135
    assert figure["written"] == 135 and figure["duplicated"] == 0 and figure["failed"] == 0
    assert figure["stage_nodes_before"] == [figure["worker_node"]]  # the actors were on the lost node...
    assert figure["worker_node"] not in figure["stage_nodes_after"]  # ...and were started again elsewhere
