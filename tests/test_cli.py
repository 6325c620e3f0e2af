"""The `fedpool` command as a user runs it: real subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from fedpool.deploy.process import free_port
from fedpool.registry import RegistryClient
from tests.conftest import TEST_TOKEN, EmulatorFactory, files_containing, read_jsonl

FEDPOOL = [sys.executable, "-m", "fedpool.cli"]
ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FEDPOOL, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "args",
    [[], ["demo"], ["gateway"], ["serve"], ["eval", "run"], ["eval", "resume"], ["eval", "replay"],
     ["eval", "rescore"], ["registry", "start"],
     ["registry", "status"], ["server", "add"],
     ["server", "list"], ["server", "show"], ["server", "drain"], ["server", "remove"],
     ["jobs", "serve"], ["jobs", "submit"], ["jobs", "list"], ["jobs", "show"], ["jobs", "cancel"], ["jobs", "logs"],
     ["batch", "submit"], ["batch", "list"], ["batch", "show"], ["batch", "cancel"], ["batch", "download"],
     ["pool", "status"], ["bench", "speedup"]],
)
def test_every_command_has_help(args: list[str]) -> None:
    result = run(*args, "--help")
    assert result.returncode == 0 and "usage: fedpool" in result.stdout.lower()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["demo", "--servers", "0"], "expected a number >= 1"),
        (["demo", "--policy", "fastest"], "invalid choice: 'fastest'"),
        (["server", "add", "--id", "x"], "the following arguments are required"),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["eval", "resume"], "fedpool: error: Missing argument 'RUN_DIR'. (`fedpool eval resume --help`)"),
        (["gateway", "--host", "0.0.0.0"], "refusing to serve on a non-loopback address without --api-key-file"),
        (["jobs", "submit", "--model", "m"], "the following arguments are required: --spec"),
        (["batch", "submit", "f.jsonl", "--endpoint", "/v1/embeddings"], "invalid choice: '/v1/embeddings'"),
        (["eval", "run", "--spec", "x.yaml", "--model", "m", "--out", "o", "--concurrency", "0"], "expected a number"),
        (["--config", "/nonexistent.toml", "pool", "status"], "--config /nonexistent.toml: no such file"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], fragment: str) -> None:
    result = run(*args)
    assert result.returncode == 2 and fragment in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # ~20 runs of the CLI, each a new interpreter: 17 s
def test_configuration_precedence_flags_then_environment_then_file(tmp_path: Path) -> None:
    config = tmp_path / "fedpool.toml"
    config.write_text('policy = "earliest_finish"\naddress = "10.0.0.1:6379"\n[gateway]\nport = 9999\n'
                      '["eval run"]\nconcurrency = 7\n')
    shown = run("--config", str(config), "gateway", "--port", "1234", "--show-config",
                env={"FEDPOOL_PORT": "7777", "FEDPOOL_POLICY": "planned", "FEDPOOL_HOST": "::1"})
    assert shown.returncode == 0, shown.stderr
    options = json.loads(shown.stdout)["options"]
    assert options["port"] == {"value": 1234, "from": "flag"}  # over the environment's 7777 and the file's 9999
    assert options["policy"] == {"value": "planned", "from": "env FEDPOOL_POLICY"}  # over the file
    assert options["host"] == {"value": "::1", "from": "env FEDPOOL_HOST"}
    assert options["address"]["value"] == "10.0.0.1:6379" and options["address"]["from"].startswith("config file")
    run_cfg = json.loads(run("eval", "run", "--spec", "s.yaml", "--model", "m", "--out", "o", "--config", str(config),
                             "--show-config").stdout)["options"]
    assert run_cfg["concurrency"]["value"] == 7  # the ["eval run"] table
    yaml_config = tmp_path / "fedpool.yaml"
    yaml_config.write_text("jobs:\n  url: http://head:8090\n")
    assert json.loads(run("jobs", "list", "--config", str(yaml_config), "--show-config").stdout)["options"][
        "url"]["value"] == "http://head:8090"
    for text, fragment in (("porty = 1\n", "porty: no such option"), ("[gatway]\nport = 1\n", "[gatway] is not"),
                           ("policy = 'fastest'\n", "'fastest' is not one of"), ("port = [\n", "not valid TOML")):
        config.write_text(text)
        bad = run("--config", str(config), "gateway", "--show-config")
        assert bad.returncode == 2 and fragment in bad.stderr and str(config) in bad.stderr, (text, bad.stderr)
    secret = run("gateway", "--show-config", env={"FEDPOOL_API_KEY_FILE": str(tmp_path / "keys.txt")})
    assert str(tmp_path / "keys.txt") in secret.stdout  # a path is shown; token values are masked (unit test)


def test_show_config_masks_secret_values() -> None:
    from fedpool.config import mask

    assert mask("jobs_token", "s3cr3t") == "***" and mask("api_key", "abc") == "***"
    assert mask("jobs_token_file", "/x/jobs.token") == "/x/jobs.token" and mask("port", 8080) == 8080


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


# The issue asks for 2 s; the command itself takes ~1.2 s on the 2-core machine, interpreter start included, and
# the bound leaves room for a loaded machine. Failing late, as it did, took Ray, a registry and servers: 8 s and more.
BUSY_PORT_WITHIN_S = 4.0


def test_up_on_a_busy_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """`fedpool up --port P` where something listens on P: exit 2 naming --port, before Ray, the registry or any
    server starts (it used to start them all, then fail with exit 1 and a raw Ray task-failure line)."""
    state = tmp_path / "up"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        for detach in ([], ["--detach"]):
            result = run("up", "--port", str(port), "--state-dir", str(state), *detach, timeout=BUSY_PORT_WITHIN_S)
            assert result.returncode == 2, result.stderr
            assert f"--port {port}: 127.0.0.1:{port} is already in use" in result.stderr, result.stderr
            assert "Traceback" not in result.stderr and "Ray" not in result.stderr
    assert not state.exists()  # nothing started: no pid file, log or registry state


def test_registry_commands_without_a_cluster_say_what_to_do(tmp_path: Path) -> None:
    result = run("server", "list", "--address", "127.0.0.1:1", timeout=120, env={"RAY_ADDRESS": ""})
    assert result.returncode == 3 and "ray start --head" in result.stderr


def stale_up_dir(root: Path, ray_address: str, api_url: str) -> Path:
    """A `fedpool up` state dir as a pool that is gone (killed) leaves it: its ready file with the Ray address, its
    registry's token and the URL of its registry's API."""
    (root / "registry").mkdir(parents=True)
    (root / "up.json").write_text(json.dumps({"ray_address": ray_address, "state_dir": str(root)}))
    (root / "registry" / "registry.token").write_text("t" * 32)
    (root / "registry" / "registry.url").write_text(json.dumps({"url": api_url, "incarnation": "gone"}))
    return root


def run_of(root: Path, up: Path) -> Path:
    """A run directory whose `eval run` was pointed at the pool of `up` (--state-dir), as its plan records it."""
    root.mkdir(parents=True)
    plan = {"specs": [str(ROOT / "pipeline" / "bundled" / "arith.yaml")], "model": "gemma3-270m",
            "pool": {"state_dir": str(up)}}
    (root / "eval.json").write_text(json.dumps(plan))
    return root


def as_documented(command: str, up: Path, tmp_path: Path) -> list[str]:
    """The command as the docs give it, pointed at the pool of `up` where the docs point it at one (`fedpool up`
    prints --state-dir with its commands; a resume is given the run directory alone: the run recorded the pool)."""
    if command == "eval resume":
        return ["eval", "resume", str(run_of(tmp_path / "run", up))]
    if command == "jobs serve":
        return ["jobs", "serve", "--port", str(free_port()), "--jobs-dir", str(tmp_path / "jobs"), "--state-dir",
                str(up)]
    return [*command.split(), "--state-dir", str(up)]


# The bound for a command against a pool that is gone: an answer, or exit 3, within 15 s.
ANSWER_OR_EXIT_3_WITHIN_S = 15


@pytest.mark.parametrize("command", ["pool status", "server list", "server drain x", "eval resume", "jobs serve"])
def test_a_pool_that_is_gone_is_named_with_the_flags_that_reach_one(tmp_path: Path, command: str) -> None:
    """Nothing at the address a `fedpool up` recorded, nor at its registry's API: exit code 3 at once (it used to
    wait on Ray's retries for a minute, or for ever), naming both and the flags that point at a pool."""
    ray_port, api_port = free_port(), free_port()
    up = stale_up_dir(tmp_path / "up", f"127.0.0.1:{ray_port}", f"http://127.0.0.1:{api_port}")
    result = run(*as_documented(command, up, tmp_path), timeout=ANSWER_OR_EXIT_3_WITHIN_S)
    assert result.returncode == 3, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{ray_port}" in error and f"http://127.0.0.1:{api_port}" in error, error
    assert all(flag in error for flag in ("--state-dir", "--address", "--registry-url")), error


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that takes connections and never answers: a Ray cluster whose GCS does not reply."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_sigterm_or_ctrl_c_ends_a_command_waiting_for_ray(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    """Ray's connect loop lets no signal through: the command waits for it on another thread, so SIGTERM or Ctrl-C
    ends it at once. The bound is generous (a behaviour check): were the signal ignored, the command would end
    only at its join deadline, with exit code 3."""
    with silent_port() as port:
        up = stale_up_dir(tmp_path / "up", f"127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}")
        proc = subprocess.Popen([*FEDPOOL, "-v", "pool", "status", "--state-dir", str(up)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stderr is not None
            seen = []
            for line in proc.stderr:  # (debug lines: -v) until it waits for Ray
                seen.append(line)
                if f"joining the Ray cluster at 127.0.0.1:{port}" in line:
                    break
            else:
                raise AssertionError("".join(seen[-20:]))
            proc.send_signal(sig)
            _, rest = proc.communicate(timeout=10)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, rest[-2000:]
    assert sig != signal.SIGINT or "fedpool: interrupted" in rest


@pytest.mark.parametrize("command", ["pool status", "server list", "eval resume", "jobs serve"])
def test_sigterm_ends_each_command_waiting_for_ray_within_2_s(tmp_path: Path, command: str) -> None:
    """As above, for each command the issue names, as the docs give it: SIGTERM while the command waits on a
    Ray cluster that takes connections and never answers ends it within 2 s. `eval resume` is given the run
    directory alone: it waits on the pool its run recorded."""
    with silent_port() as port:
        up = stale_up_dir(tmp_path / "up", f"127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}")
        proc = subprocess.Popen([*FEDPOOL, "-v", *as_documented(command, up, tmp_path)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stderr is not None
            seen = []
            for line in proc.stderr:
                seen.append(line)
                if f"joining the Ray cluster at 127.0.0.1:{port}" in line:
                    break
            else:
                raise AssertionError("".join(seen[-20:]))
            proc.send_signal(signal.SIGTERM)
            _, rest = proc.communicate(timeout=2)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, rest[-2000:]


@pytest.mark.slow  # waits out the join deadline
def test_a_ray_cluster_that_never_answers_is_given_up_on_and_named(tmp_path: Path) -> None:
    with silent_port() as port:
        up = stale_up_dir(tmp_path / "up", f"127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}")
        result = run("server", "list", "--state-dir", str(up), timeout=60)
    assert result.returncode == 3, result.stderr
    assert f"no Ray cluster answered at '127.0.0.1:{port}'" in result.stderr and "--state-dir" in result.stderr


@pytest.mark.ray
@pytest.mark.llamacpp
def test_demo_runs_the_main_job_end_to_end(tmp_path: Path) -> None:
    """README command one, small: 2 real llama.cpp servers, 3 concurrent evals, JSON report."""
    secrets = {"HF_TOKEN": "hf_demo_secret_0123456789abcdef", "OPENAI_API_KEY": "sk-demo-secret-0123456789abcdef",
               "FEDPOOL_JOBS_TOKEN": "jobs-demo-secret-0123456789"}
    result = run("demo", "--limit", "10", "--json", "--out", str(tmp_path), timeout=600, env=secrets)
    assert result.returncode == 0, result.stderr[-3000:]
    # The secret scan after a full run: no configured secret in any log line, artifact file or output.
    assert files_containing(tmp_path, list(secrets.values())) == []
    assert not any(v in result.stdout + result.stderr for v in secrets.values())
    report = json.loads(result.stdout)
    assert set(report["benchmarks"]) == {"arith", "capitals", "capitals_mc"}
    assert set(report["answered"]) == {"llamacpp-0", "llamacpp-1"}
    # Which server answers which request depends on timing; what must hold is that both servers took a real
    # share of the work and that the per-server counts (from each record's provenance) add up to every record
    # exactly once.
    for server, per_bench in report["answered"].items():
        assert sum(per_bench.values()) >= 3, (server, per_bench)
    for name in ("arith", "capitals", "capitals_mc"):
        assert sum(per_bench.get(name, 0) for per_bench in report["answered"].values()) == 10, name
    for name, bench in report["benchmarks"].items():
        records = read_jsonl(Path(bench["artifact_dir"]) / "records.jsonl")
        assert len(records) == 10 and bench["failed"] == 0, name
    assert "running 3 evaluations concurrently" in result.stderr
    run_dir = Path(report["run_dir"])
    assert (run_dir / "run.json").exists() and (run_dir / "logs" / "llamacpp-0.log").exists()
    assert not list(run_dir.rglob("*.token"))  # the registry token stays out of the artifacts


@pytest.mark.ray
async def test_server_commands_against_a_live_registry(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    server = await emulators.start(model="served-model")
    address = ray.get_runtime_context().gcs_address
    token_file = tmp_path / "token"
    token_file.write_text(TEST_TOKEN)
    common = ["--address", address, "--token-file-path", str(token_file)]

    async def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(run, *args, timeout=120)

    added = await cli("server", "add", *common, "--id", "gpu-a", "--url", server.url, "--engine", "vllm",
                      "--model", "served-model", "--accelerator", "a100-80gb", "--gpus", "1", "--capacity", "16",
                      "--label", "rack=r1", "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["accelerator"] == "A100"
    listed = await cli("server", "list", *common)
    assert listed.returncode == 0
    header, row = listed.stdout.splitlines()[:2]
    for column in ("ID", "ENGINE", "ACCEL", "MODEL", "STATUS", "RUN", "WAIT", "KV%", "TOK/S"):
        assert column in header
    assert row.split()[:5] == ["gpu-a", "vllm", "A100", "served-model", "healthy"]
    as_json = json.loads((await cli("server", "list", *common, "--json")).stdout)
    assert [s["id"] for s in as_json["servers"]] == ["gpu-a"] and as_json["servers"][0]["labels"] == {"rack": "r1"}
    shown = await cli("server", "show", *common, "gpu-a", "--json")
    assert json.loads(shown.stdout)["capacity"] == 16
    other = await emulators.start(model="served-model")
    wrong = await cli("server", "add", *common, "--id", "gpu-b", "--url", other.url, "--engine", "vllm",
                      "--model", "other-model")
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert wrong.stderr.strip().splitlines()[-1] == (
        "fedpool: error: server 'gpu-b': check 'model' failed: server does not serve model 'other-model'; "
        "/v1/models lists ['served-model']"
    )
    assert wrong.stderr.startswith(f"fedpool: Ray cluster {address} (found by --address)")  # which cluster
    anonymous = await cli("server", "drain", "--address", address, "--state-dir", str(tmp_path), "gpu-a")
    assert anonymous.returncode == 1 and "token" in anonymous.stderr
    drained = await cli("server", "drain", *common, "gpu-a", "--json")
    assert json.loads(drained.stdout)["status"] == "draining"
    missing = await cli("server", "show", *common, "nope")
    assert missing.returncode == 1 and "nope" in missing.stderr
    for _ in range(50):  # an idle drained server is removed at the next probe
        if not json.loads((await cli("server", "list", *common, "--json")).stdout)["servers"]:
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("drained server was not removed")
    again = await cli("server", "add", *common, "--id", "gpu-a", "--url", server.url, "--engine", "vllm",
                      "--model", "served-model")
    assert again.returncode == 0, again.stderr
    pool = await cli("pool", "status", "--address", address, "--json")
    assert pool.returncode == 0, pool.stderr
    report = json.loads(pool.stdout)
    assert report["servers"] == 1 and report["models"] == {"served-model": 1}
    assert report["groups"][0]["engine"] == "vllm"
    removed = await cli("server", "remove", *common, "gpu-a")
    assert removed.returncode == 0 and "removed gpu-a" in removed.stdout
    status = await cli("registry", "status", "--address", address, "--json")
    assert json.loads(status.stdout)["servers"] == 0


def count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.ray
async def test_eval_killed_midway_then_resumed_loses_and_doubles_nothing(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    from fedpool.registry import Engine, ServerRecord

    server = await emulators.start(model="emu-model", max_running=2, decode_s=0.02)  # ~0.16 s a request
    await registry.register(ServerRecord(id="emu", url=server.url, engine=Engine.VLLM, model="emu-model", capacity=2))
    address = ray.get_runtime_context().gcs_address
    spec = ROOT / "pipeline" / "bundled" / "arith.yaml"
    out = tmp_path / "run"
    cmd = [*FEDPOOL, "eval", "run", "--address", address, "--spec", str(spec), "--model", "emu-model",
           "--out", str(out), "--concurrency", "2"]
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL)
    records = out / "arith" / "records.jsonl"
    for _ in range(600):
        if await asyncio.to_thread(count_lines, records) >= 20:
            break
        await asyncio.sleep(0.05)
    proc.kill()  # the client process dies mid-run (SIGKILL: no cleanup)
    await asyncio.wait_for(proc.wait(), 10)
    before = await asyncio.to_thread(count_lines, records)
    assert 20 <= before < 60
    again = await asyncio.to_thread(run, "eval", "resume", "--address", address, str(out), "--json", timeout=240)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)["benchmarks"]["arith"]
    rows = read_jsonl(records)
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == 60 and len(set(ids)) == 60  # every record exactly once
    assert report["resumed_records"] >= before - 1 and report["written_now"] == 60 - report["resumed_records"]
    repeat = await asyncio.to_thread(run, "eval", "run", "--address", address, "--spec", str(spec), "--model",
                                     "emu-model", "--out", str(out))
    assert repeat.returncode == 2 and "eval resume" in repeat.stderr

    # Rescore without inference: the same spec gives the same records and score.
    rescored = await asyncio.to_thread(run, "eval", "rescore", str(out), "--out", str(tmp_path / "rescored"), "--json")
    assert rescored.returncode == 0, rescored.stderr
    (again_summary,) = json.loads(rescored.stdout)["benchmarks"]
    original = json.loads((out / "arith" / "summary.json").read_text())
    assert again_summary["scores"] == original["scores"] and again_summary["records"] == 60
    old_rows = {r["sample_id"]: r for r in rows}
    for row in read_jsonl(tmp_path / "rescored" / "arith" / "records.jsonl"):
        assert row["metrics"] == old_rows[row["sample_id"]]["metrics"]
        assert row["provenance"]["server_id"] == old_rows[row["sample_id"]]["provenance"]["server_id"]
    # A changed spec may add metrics; changing what decides the answers is refused.
    text = spec.read_text()
    more = tmp_path / "arith_f1.yaml"
    more.write_text(text.replace("metrics: [exact_match]", "metrics: [exact_match, f1]")
                    .replace("{path: arith.jsonl}", f"{{path: {spec.parent}/arith.jsonl}}"))
    with_f1 = await asyncio.to_thread(run, "eval", "rescore", str(out / "arith"), "--out", str(tmp_path / "f1"),
                                      "--spec", str(more), "--json")
    assert with_f1.returncode == 0, with_f1.stderr
    metrics = [s["metric"] for s in json.loads(with_f1.stdout)["benchmarks"][0]["scores"]]
    assert metrics[-1] == "f1" and len(metrics) >= 2
    changed = tmp_path / "arith_prompt.yaml"
    changed.write_text(more.read_text().replace("{a} + {b} =", "Q: {a} + {b} ="))
    refused = await asyncio.to_thread(run, "eval", "rescore", str(out), "--out", str(tmp_path / "x"), "--spec",
                                      str(changed))
    assert refused.returncode == 2 and "prompt changed" in refused.stderr and "new run" in refused.stderr

    # Replay: the saved configuration, run again through the pool into a new directory.
    replayed = await asyncio.to_thread(run, "eval", "replay", "--address", address, str(out), "--out",
                                       str(tmp_path / "replay"), "--json", timeout=240)
    assert replayed.returncode == 0, replayed.stderr
    report = json.loads(replayed.stdout)["benchmarks"]["arith"]
    assert report["records"] == 60 and report["written_now"] == 60 and report["model"] == "emu-model"
    saved = json.loads((tmp_path / "replay" / "arith" / "config.json").read_text())
    first = json.loads((out / "arith" / "config.json").read_text())
    assert saved["dataset"] == first["dataset"]  # same file, same SHA-256
    for config in (saved, first):
        config["benchmark"]["data"].pop("path")  # absolute in the replay, as written in the spec originally
    assert saved["benchmark"] == first["benchmark"] and saved["generation"] == first["generation"]


@pytest.mark.ray
async def test_eval_run_routes_by_plan_with_a_client_order(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    """`fedpool eval run --planned --client-order shortest_first`: two benchmarks over two servers through the
    planner; every record once, and the routing settings saved for resume and in each artifact's config."""
    from fedpool.registry import Engine, ServerRecord

    for i in range(2):
        server = await emulators.start(model="emu-model", max_running=4, decode_s=0.002)
        await registry.register(ServerRecord(id=f"emu-{i}", url=server.url, engine=Engine.VLLM, model="emu-model",
                                             accelerator="A100" if i else "V100", gpu_count=1, capacity=4))
    address = ray.get_runtime_context().gcs_address
    out = tmp_path / "run"
    specs = [ROOT / "pipeline" / "bundled" / name for name in ("arith.yaml", "capitals.yaml")]
    done = await asyncio.to_thread(
        run, "eval", "run", "--address", address, *(a for s in specs for a in ("--spec", str(s))), "--model",
        "emu-model", "--out", str(out), "--planned", "--client-order", "shortest_first", "--json", timeout=240)
    assert done.returncode == 0, done.stderr
    saved = json.loads((out / "eval.json").read_text())
    assert saved["planned"] is True and saved["client_order"] == "shortest_first"
    for name in ("arith", "capitals"):
        rows = read_jsonl(out / name / "records.jsonl")
        ids = [r["sample_id"] for r in rows]
        assert ids and len(ids) == len(set(ids)) and not any(r["provenance"]["error"] for r in rows)
        config = json.loads((out / name / "config.json").read_text())
        assert config["planned"] is True and config["client_order"] == "shortest_first"


@pytest.mark.ray
async def test_runs_are_owned_outages_heal_and_unknown_models_are_refused(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    """Two `eval resume` at once on one run: one works, the other is refused naming it, no line is written twice.
    A run whose records failed (every server answering 500) exits 4; once the servers are back, `eval resume`
    runs the failed records again (kept aside in records.retried.jsonl). A model no registered server serves
    is refused before anything is written."""
    from fedpool.deploy.emulator import Faults
    from fedpool.registry import Engine, ServerRecord

    server = await emulators.start(model="emu-model", max_running=2, decode_s=0.05)  # ~0.4 s a request
    await registry.register(ServerRecord(id="emu", url=server.url, engine=Engine.VLLM, model="emu-model", capacity=2))
    address = ray.get_runtime_context().gcs_address
    spec = ROOT / "pipeline" / "bundled" / "arith.yaml"

    nobody = await asyncio.to_thread(run, "eval", "run", "--address", address, "--spec", str(spec), "--model",
                                     "no-such-model", "--out", str(tmp_path / "nobody"))
    assert nobody.returncode == 3 and "no registered server serves model 'no-such-model'" in nobody.stderr
    assert "emu-model" in nobody.stderr and not (tmp_path / "nobody").exists()
    assert "pass --wait-for-servers SECONDS" in nobody.stderr
    waited = await asyncio.to_thread(run, "eval", "run", "--address", address, "--spec", str(spec), "--model",
                                     "no-such-model", "--out", str(tmp_path / "nobody"), "--wait-for-servers", "0.5")
    assert waited.returncode == 3 and "after waiting 0.5 s" in waited.stderr, waited.stderr
    assert "pass --wait-for-servers" not in waited.stderr and "a larger --wait-for-servers" in waited.stderr

    out = tmp_path / "run"
    proc = await asyncio.create_subprocess_exec(
        *FEDPOOL, "eval", "run", "--address", address, "--spec", str(spec), "--model", "emu-model", "--out",
        str(out), "--concurrency", "2", cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    records = out / "arith" / "records.jsonl"
    for _ in range(600):
        if await asyncio.to_thread(count_lines, records) >= 6:
            break
        await asyncio.sleep(0.05)
    proc.kill()
    await asyncio.wait_for(proc.wait(), 10)
    first, second = await asyncio.gather(*(asyncio.to_thread(run, "eval", "resume", "--address", address, str(out),
                                                             timeout=240) for _ in range(2)))
    codes = sorted((first.returncode, second.returncode))
    refused = first if first.returncode else second
    assert codes == [0, 5] and "in use by pid" in refused.stderr, (first.stderr, second.stderr)
    # the holder's whole command, as it was typed (it was cut after three words)
    assert f"`fedpool eval resume --address {address} {out}`" in refused.stderr, refused.stderr
    ids = [r["sample_id"] for r in read_jsonl(records)]
    assert len(ids) == 60 and len(set(ids)) == 60

    server.faults = Faults(error_rate=1.0)  # an outage: every request answered with HTTP 500
    broken = tmp_path / "broken"
    failed = await asyncio.to_thread(run, "eval", "run", "--address", address, "--spec", str(spec), "--model",
                                     "emu-model", "--out", str(broken), "--limit", "4", "--concurrency", "4",
                                     "--no-server-timeout", "2", timeout=240)
    assert failed.returncode == 4 and "eval resume" in failed.stderr, failed.stderr
    # Failed, each with its reason: HTTP 500s, or no routable server once the probes marked it down.
    kinds = {r["provenance"]["error_kind"] for r in read_jsonl(broken / "arith" / "records.jsonl")}
    assert kinds and kinds <= {"server_error", "no_server"}, kinds
    server.faults = Faults()  # the servers are back
    for _ in range(100):  # the probes see it answer again: routable
        if (await registry.snapshot()).entries[0].status.routable:
            break
        await asyncio.sleep(0.1)
    kept = await asyncio.to_thread(run, "eval", "resume", "--address", address, str(broken), "--keep-failed",
                                   "--json", timeout=240)
    assert kept.returncode == 4 and json.loads(kept.stdout)["benchmarks"]["arith"]["failed"] == 4
    healed = await asyncio.to_thread(run, "eval", "resume", "--address", address, str(broken), "--json",
                                     timeout=240)
    assert healed.returncode == 0, healed.stderr
    report = json.loads(healed.stdout)["benchmarks"]["arith"]
    assert report["failed"] == 0 and report["records"] == 4 and report["retried_failed_records"] == 4
    rows = read_jsonl(broken / "arith" / "records.jsonl")
    assert len(rows) == 4 and not any(r["provenance"]["error"] for r in rows)
    assert len(read_jsonl(broken / "arith" / "records.retried.jsonl")) == 4  # the failures are kept, aside


@pytest.mark.ray
async def test_eval_run_reaches_the_registry_over_its_api_without_ray(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    """With the registry's token (here: its state dir), `eval run` finds the API the registry wrote beside the token
    and never imports Ray (no CPU actors needed): 0.8-0.9 CPU-s less a process. With a token from elsewhere that is
    not this registry's it goes through Ray (reads need no token there); a URL given explicitly must take it."""
    from fedpool.registry import Engine, ServerRecord

    server = await emulators.start(model="emu-model", max_running=4, decode_s=0.002)
    await registry.register(ServerRecord(id="emu", url=server.url, engine=Engine.VLLM, model="emu-model", capacity=4))
    state = (await registry.ping())["state_dir"]
    address = ray.get_runtime_context().gcs_address
    spec = ROOT / "pipeline" / "bundled" / "arith.yaml"
    probe = ("import sys; from fedpool.cli import main; rc = main(sys.argv[1:]); "
             "print('RAY-IMPORTED' if 'ray' in sys.modules else 'NO-RAY', file=sys.stderr); sys.exit(rc)")
    argv = [sys.executable, "-c", probe, "eval", "run", "--address", address, "--state-dir", state, "--spec", str(spec),
            "--model", "emu-model", "--limit", "8"]
    done = await asyncio.to_thread(subprocess.run, [*argv, "--out", str(tmp_path / "run")], capture_output=True,
                                   text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "fedpool: registry API http://127.0.0.1:" in done.stderr and "NO-RAY" in done.stderr, done.stderr
    ids = [r["sample_id"] for r in read_jsonl(tmp_path / "run" / "arith" / "records.jsonl")]
    assert len(ids) == 8 == len(set(ids))
    wrong = {**os.environ, "FEDPOOL_REGISTRY_TOKEN": "w" * 32}
    via_ray = await asyncio.to_thread(subprocess.run, [*argv, "--out", str(tmp_path / "via-ray")], capture_output=True,
                                      text=True, timeout=120, cwd=ROOT, env=wrong)
    assert via_ray.returncode == 0 and "fedpool: Ray cluster" in via_ray.stderr, via_ray.stderr
    api_url = json.loads((Path(state) / "registry.url").read_text())["url"]
    refused = await asyncio.to_thread(subprocess.run, [*argv, "--out", str(tmp_path / "refused"), "--registry-url",
                                                       api_url], capture_output=True, text=True, timeout=120,
                                      cwd=ROOT, env=wrong)
    assert refused.returncode == 3 and "refused this process's token" in refused.stderr, refused.stderr
    assert not (tmp_path / "refused").exists()


@pytest.mark.ray
async def test_eval_run_ends_with_the_scores_table_demo_prints(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    """`eval run` ends as `demo` does: each benchmark's scores with their 95% CI, n, failed and wall time; the requests
    each server answered for each benchmark; the run's wall time (it printed one line per benchmark)."""
    from fedpool.registry import Engine, ServerRecord

    for i in range(2):
        server = await emulators.start(model="emu-model", max_running=4, decode_s=0.002)
        await registry.register(ServerRecord(id=f"emu-{i}", url=server.url, engine=Engine.VLLM, model="emu-model",
                                             capacity=4))
    bundled = ROOT / "pipeline" / "bundled"
    specs = [a for name in ("arith", "capitals") for a in ("--spec", str(bundled / f"{name}.yaml"))]
    done = await asyncio.to_thread(run, "eval", "run", "--address", ray.get_runtime_context().gcs_address,
                                   "--state-dir", (await registry.ping())["state_dir"], *specs, "--model", "emu-model",
                                   "--limit", "8", "--out", str(tmp_path / "run"), "--quiet", timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["Scores (95% bootstrap CI)", "  benchmark     metric         score  95% CI              n  "
                         "failed   wall s"], done.stdout
    for row, name in zip(lines[2:4], ("arith", "capitals"), strict=True):
        cells = row.split()
        assert cells[:2] == [name, "exact_match"] and cells[3].startswith("[") and cells[4].endswith("]"), row
        assert cells[5:7] == ["8", "0"] and float(cells[7]) > 0, row
    at = lines.index("Requests answered per server")
    assert lines[at + 1].split() == ["server", "arith", "capitals", "total"]
    rows = lines[at + 2:lines.index("", at)]
    answered = {cells[0]: [int(c) for c in cells[1:]] for cells in (line.split() for line in rows)}
    assert answered and set(answered) <= {"emu-0", "emu-1"} and all(sum(r[:2]) == r[2] for r in answered.values())
    assert [sum(row[i] for row in answered.values()) for i in range(3)] == [8, 8, 16]
    assert any(line.startswith("Wall time: ") and line.endswith("s for 2 evaluations run concurrently")
               for line in lines), done.stdout


def test_client_commands_find_the_pool_of_a_fedpool_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fedpool up --state-dir X` keeps its registry's state in X/registry and its Ray address in X/up.json: a command
    given `--state-dir X` looks there, and with no --state-dir, in the default `fedpool up`'s while that pool is up
    and no registry keeps its state in the default registry dir (without it, a command beside `fedpool up` joined
    Ray by Ray's own guess of an address, which was not the loopback address the pool listens on, and hung)."""
    from fedpool.deploy.reach import PoolAccess
    from fedpool.deploy.updir import PoolPlace, locate_pool

    def place(state_dir: Path) -> PoolPlace:
        return locate_pool(state_dir, Path("~/.fedpool/registry"), Path("~/.fedpool/up"))

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    default_registry, default_up = tmp_path / ".fedpool" / "registry", tmp_path / ".fedpool" / "up"
    assert place(Path("~/.fedpool/registry")) == PoolPlace(default_registry)  # nothing anywhere: as given
    up = tmp_path / "up"
    (up / "registry").mkdir(parents=True)
    (up / "registry" / "registry.token").write_text("t" * 32)
    assert place(up) == PoolPlace(up)  # the pool is not up (no up.json): as given
    (up / "up.json").write_text(json.dumps({"ray_address": "127.0.0.1:6390"}))
    assert place(up) == place(up / "registry") == PoolPlace(up / "registry", up, "127.0.0.1:6390")
    assert place(Path("~/.fedpool/registry")) == PoolPlace(default_registry)  # another state dir's pool
    (default_up / "registry").mkdir(parents=True)
    (default_up / "registry" / "registry.url").write_text("{}")
    (default_up / "up.json").write_text("{}")
    assert place(Path("~/.fedpool/registry")) == PoolPlace(default_up / "registry", default_up)
    default_registry.mkdir(parents=True)
    (default_registry / "registry.token").write_text("t" * 32)  # a registry of its own there: that one
    assert place(Path("~/.fedpool/registry")) == PoolPlace(default_registry)
    assert place(tmp_path / "elsewhere") == PoolPlace(tmp_path / "elsewhere")
    # Ray: --address when given; else the address the pool's `fedpool up` recorded; else Ray's own search.
    recorded = PoolAccess("auto", place(up))
    assert recorded.ray_address() == ("127.0.0.1:6390", f"the address `fedpool up` recorded in {up / 'up.json'}")
    assert "--state-dir" in recorded.advice() and str(up) in recorded.advice()
    assert PoolAccess("10.0.0.9:6379", place(up)).ray_address() == ("10.0.0.9:6379", "--address")
    assert PoolAccess("auto", place(tmp_path / "elsewhere")).ray_address()[0] == "auto"


def test_ray_driver_messages_go_to_stderr_and_the_commands_output_to_stdout(
        ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    """What Ray's driver thread prints about the cluster ("(raylet) Task ... failed") goes to stderr while a command
    runs, so `--json` piped to a parser reads only JSON; the thread is the one this Ray's drivers start."""
    import threading

    from fedpool.deploy.raycluster import RAY_MESSAGE_THREADS, command_stdout

    # this Ray's drivers run the thread by that name (a Ray that renamed it would print to stdout again)
    assert ray.is_initialized()
    assert RAY_MESSAGE_THREADS & {t.name for t in threading.enumerate()}
    (name,) = RAY_MESSAGE_THREADS
    before = sys.stdout
    with command_stdout():
        print(json.dumps({"figure": 1}), end="")  # the command's output, its text and newline in two writes
        raylet = threading.Thread(target=print, args=("(raylet) Task failed",), name=name)
        raylet.start()
        raylet.join()
        other = threading.Thread(target=print, args=("from a thread of ours",))
        other.start()
        other.join()
        print()
        assert sys.stdout.isatty() == before.isatty() and sys.stdout.encoding == before.encoding
    assert sys.stdout is before
    out, err = capsys.readouterr()
    assert out == '{"figure": 1}from a thread of ours\n\n'  # only Ray's thread is sent elsewhere
    assert err.endswith("(raylet) Task failed\n")
