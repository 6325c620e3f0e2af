"""The `fedpool` command as a user runs it: real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_jsonl

FEDPOOL = [sys.executable, "-m", "fedpool.cli"]
ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FEDPOOL, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "args",
    [[], ["demo"], ["registry", "start"], ["registry", "status"], ["server", "add"], ["server", "list"],
     ["server", "show"], ["server", "drain"], ["server", "remove"]],
)
def test_every_command_has_help(args: list[str]) -> None:
    result = run(*args, "--help")
    assert result.returncode == 0 and "usage: fedpool" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["demo", "--servers", "0"], "expected a number >= 1"),
        (["demo", "--policy", "fastest"], "invalid choice: 'fastest'"),
        (["server", "add", "--id", "x"], "the following arguments are required"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], fragment: str) -> None:
    result = run(*args)
    assert result.returncode == 2 and fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_server_add_validates_fields_before_connecting() -> None:
    result = run("server", "add", "--id", "bad id", "--url", "ftp://x", "--engine", "vllm", "--model", "m")
    assert result.returncode == 2
    assert "id:" in result.stderr and "url:" in result.stderr and "Traceback" not in result.stderr


def test_bad_spec_is_named_before_anything_starts(tmp_path: Path) -> None:
    spec = tmp_path / "broken.yaml"
    spec.write_text("name: broken\ndata: {path: nowhere.jsonl}\nprompt: {template: 'Q: {q}'}\nmetrics: [vibes]\n")
    result = run("demo", "--spec", str(spec), "--out", str(tmp_path / "runs"))
    assert result.returncode == 2 and str(spec) in result.stderr and "vibes" in result.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_registry_commands_without_a_cluster_say_what_to_do(tmp_path: Path) -> None:
    result = run("server", "list", "--address", "127.0.0.1:1", timeout=120, env={"RAY_ADDRESS": ""})
    assert result.returncode == 3 and "ray start --head" in result.stderr


@pytest.mark.ray
@pytest.mark.llamacpp
def test_demo_runs_the_main_job_end_to_end(tmp_path: Path) -> None:
    """README command one, small: 2 real llama.cpp servers, 3 concurrent evals, JSON report."""
    result = run("demo", "--limit", "10", "--json", "--out", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert set(report["benchmarks"]) == {"arith", "capitals", "capitals_mc"}
    assert set(report["answered"]) == {"llamacpp-0", "llamacpp-1"}
    for server, per_bench in report["answered"].items():
        assert set(per_bench) == {"arith", "capitals", "capitals_mc"}, server
    for name, bench in report["benchmarks"].items():
        records = read_jsonl(Path(bench["artifact_dir"]) / "records.jsonl")
        assert len(records) == 10 and bench["failed"] == 0, name
    assert "running 3 evaluations concurrently" in result.stderr
    run_dir = Path(report["run_dir"])
    assert (run_dir / "run.json").exists() and (run_dir / "logs" / "llamacpp-0.log").exists()
    assert not list(run_dir.rglob("*.token"))  # the registry token stays out of the artifacts
