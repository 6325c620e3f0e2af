"""The cluster files under deploy/ are checked, not just written: shell scripts by shellcheck and (Ray) by
running them, Kubernetes objects against the Kubernetes schemas, every `fedpool` command line they hold
by fedpool's own argument parser, and every Grafana expression against the metrics fedpool exports."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kubernetes_validate
import psutil
import pytest
import yaml
from prometheus_client import generate_latest

from fedpool.cli import build_parser
from fedpool.deploy.process import free_port
from fedpool.federation.gateway.handlers import _Metrics as GatewayMetrics
from fedpool.options import RegistryStartOptions, ServeOptions
from fedpool.registry import (
    ClientDemand,
    DemandReport,
    Engine,
    LeaseBroker,
    LeaseServer,
    LeaseService,
    ModelDemand,
    PoolSnapshot,
    ServerEntry,
    ServerRecord,
    ServerStatus,
)
from fedpool.registry.exporter import pool_metrics_text
from fedpool.registry.snapshot import LoadSample

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SCRIPTS = [*sorted((DEPLOY / "ray").glob("*.sh")), DEPLOY / "slurm" / "fedpool-vllm.sbatch",
           *sorted((ROOT / "scripts").glob("*.sh"))]
VENV_BIN = Path(sys.executable).parent


def test_shell_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck") or str(VENV_BIN / "shellcheck")
    done = subprocess.run([shellcheck, "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def k8s_documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_kubernetes_objects_validate_against_the_schemas() -> None:
    core = [(p, d) for p, d in k8s_documents() if "ray.io" not in d["apiVersion"]]
    assert {d["kind"] for _, d in core} >= {"Deployment", "PersistentVolumeClaim"}
    for path, doc in core:
        kubernetes_validate.validate(doc, "1.37", strict=True)  # raises ValidationError naming the field
        assert path.read_text().count("Checked with:") == 1


def fedpool_args(command: str) -> list[str]:
    """The arguments after `fedpool` in a shell command line, with $(VAR) / ${VAR} placeholders filled."""
    words = shlex.split(re.sub(r"\$\(?\{?([A-Z_]+)\)?\}?", r"X\1", command))
    return words[words.index("fedpool") + 1:]


def test_raycluster_has_what_kuberay_and_fedpool_need() -> None:
    (_, cluster), = [(p, d) for p, d in k8s_documents() if d["kind"] == "RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    head = cluster["spec"]["headGroupSpec"]
    # KubeRay passes rayStartParams to `ray start` verbatim: every value must be a string.
    for group in [head, *cluster["spec"]["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    assert json.loads(json.loads(head["rayStartParams"]["resources"])) == {"fedpool-head": 1}
    container = head["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in container["ports"]} >= {6379, 9108}
    start = container["lifecycle"]["postStart"]["exec"]["command"][-1].split("; ")[-1]
    args = build_parser().parse_args(fedpool_args(start))
    assert isinstance(args, RegistryStartOptions)
    assert (args.pin_resource, args.metrics_port) == ("fedpool-head", 9108)
    for group in cluster["spec"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_gpu_deployment_runs_a_valid_fedpool_serve() -> None:
    (_, deployment), = [(p, d) for p, d in k8s_documents() if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(fedpool_args(container["args"][0]))
    assert isinstance(args, ServeOptions)
    assert args.engine == "vllm" and args.host == "0.0.0.0" and args.address == "fedpool-head-svc:6379"
    assert args.token_path == Path("/etc/fedpool/registry.token")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_slurm_script_builds_the_serve_command(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nprintf 'NVIDIA A100-SXM4-80GB\\nNVIDIA A100-SXM4-80GB\\n'\n")
    (bin_dir / "fedpool").write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "FEDPOOL_RAY_ADDRESS": "10.0.0.1:6379", "FEDPOOL_TOKEN_FILE": "/home/u/registry.token"}
    done = subprocess.run(["bash", str(DEPLOY / "slurm" / "fedpool-vllm.sbatch")], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    args = build_parser().parse_args(json.loads(record.read_text()))
    assert isinstance(args, ServeOptions)
    assert (args.engine, args.gpus, args.id, args.address) == ("vllm", 2, "slurm-4242", "10.0.0.1:6379")
    assert args.label == ["slurm_job=4242"] and (args.advertise_url or "").endswith(":8000")
    # Without the required settings it stops with a message naming them.
    env.pop("FEDPOOL_RAY_ADDRESS")
    done = subprocess.run(["bash", str(DEPLOY / "slurm" / "fedpool-vllm.sbatch")], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode != 0 and "FEDPOOL_RAY_ADDRESS" in done.stderr


def exported_metric_names() -> set[str]:
    record = ServerRecord(id="a100-0", url="http://10.0.0.5:8000", engine=Engine.VLLM, model="m", accelerator="A100",
                          gpu_count=1, capacity=64)
    entry = ServerEntry(record=record, status=ServerStatus.HEALTHY, capacity=64, weight=2.0,
                        load=LoadSample(running=3, waiting=1, observed_at=1.0, kv_cache_usage=0.2, tokens_per_s=90.0),
                        probe_latency_s=0.01)
    broker = LeaseBroker(lambda: 0.0, restarted=False)  # the lease figures, one holder with one client
    broker.set_servers([LeaseServer("a100-0", "m", 64)])
    broker.report(DemandReport(holder="h", models=(ModelDemand(model="m", clients=(
        ClientDemand(client="c", wanted=1, requests_left=9),)),)))
    text = pool_metrics_text(PoolSnapshot(1, 1.0, (entry,)), {"last_probe_cycle_s": 0.4, "probe_cycles": 3},
                             LeaseService(broker).figures()).decode()
    gateway = GatewayMetrics()  # the gateway's own exposition, one series of each family filled in
    gateway.requests.labels("chat", "200").inc()
    gateway.latency.labels("chat").observe(0.1)
    gateway.inflight.labels("a100-0").set(2)
    gateway.window.labels("a100-0").set(8)
    text += generate_latest(gateway.registry).decode()
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_grafana_dashboard_queries_only_metrics_fedpool_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "fedpool-dashboard.json").read_text())
    names = exported_metric_names()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        used = set(re.findall(r"\bfedpool_[a-z_]+\b", expr))
        assert used and used <= names, (expr, used - names)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.ray
@pytest.mark.slow
def test_ray_head_and_worker_scripts_start_a_cluster_with_the_registry() -> None:
    temp = Path(tempfile.mkdtemp(prefix="fpray", dir="/tmp"))  # short: Ray's socket paths have a length limit
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "RAY_PORT": str(port),
           "FEDPOOL_STATE_DIR": str(temp / "state"), "FEDPOOL_METRICS_PORT": str(metrics_port),
           "FEDPOOL_METRICS_HOST": "127.0.0.1", "RAY_NUM_CPUS": "1", "RAY_TEMP_DIR": str(temp / "ray")}
    try:
        head = subprocess.run(["bash", str(DEPLOY / "ray" / "head.sh")], env=env, capture_output=True, text=True,
                              timeout=180)
        assert head.returncode == 0, head.stdout[-2000:] + head.stderr[-2000:]
        assert "head ready" in head.stdout
        worker = subprocess.run(["bash", str(DEPLOY / "ray" / "worker.sh"), f"127.0.0.1:{port}"], env=env,
                                capture_output=True, text=True, timeout=180)
        assert worker.returncode == 0, worker.stderr[-2000:]
        status = subprocess.run([str(VENV_BIN / "fedpool"), "registry", "status", "--address", f"127.0.0.1:{port}",
                                 "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr[-2000:]
        info = json.loads(status.stdout)
        assert Path(info["state_dir"]) == temp / "state"
        deadline = time.monotonic() + 60
        nodes = 0
        while time.monotonic() < deadline and nodes < 2:
            probe = subprocess.run([str(VENV_BIN / "python"), "-c", (
                f"import ray; ray.init(address='127.0.0.1:{port}', logging_level='ERROR'); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))")], env={**env, "RAY_AUTH_MODE": "token"},
                capture_output=True, text=True, timeout=120)
            nodes = int(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else 0
        assert nodes == 2  # head and the worker that joined
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            assert b"fedpool_registry_snapshot_version" in resp.read()
    finally:
        for proc in psutil.process_iter(["cmdline"]):
            if any(str(temp) in part for part in proc.info["cmdline"] or ()):
                proc.kill()
        shutil.rmtree(temp, ignore_errors=True)
