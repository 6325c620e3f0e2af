"""The jobs API on a real local pool: submit several jobs, kill the jobs server mid-run and start it
again, every job finishes with a complete artifact (each record exactly once); no token, no access."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import ray

from fedpool.clients.jobs.client import AsyncJobsClient, JobsApiError, JobsClient
from fedpool.deploy.process import free_port
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import TEST_TOKEN, EmulatorFactory, read_jsonl, wait_http_up

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "pipeline" / "bundled"
JOBS_TOKEN = "jobs-test-token-0123456789abcdef"


def server_argv(tmp_path: Path, port: int) -> list[str]:
    (tmp_path / "registry.token").write_text(TEST_TOKEN)
    (tmp_path / "jobs.token.given").write_text(JOBS_TOKEN)
    return [sys.executable, "-m", "fedpool.cli", "jobs", "serve", "--address", ray.get_runtime_context().gcs_address,
            "--token-file-path", str(tmp_path / "registry.token"), "--port", str(port), "--jobs-dir",
            str(tmp_path / "jobs"), "--jobs-token-file", str(tmp_path / "jobs.token.given"), "--policy",
            "capacity_weighted", "--root", str(BUNDLED)]


def start_server(tmp_path: Path, port: int) -> subprocess.Popen[str]:
    log = (tmp_path / f"server-{time.monotonic_ns()}.log").open("w")
    return subprocess.Popen(server_argv(tmp_path, port), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def fedpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedpool.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def status_of(url: str, path: str, method: str = "GET", token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, method=method, headers=headers), timeout=10):
            return 200
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow
async def test_jobs_survive_a_server_crash_and_finish_complete(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    server = await emulators.start(model="emu-model", max_running=2, decode_s=0.03)  # ~0.15 s a request
    await registry.register(ServerRecord(id="emu", url=server.url, engine=Engine.VLLM, model="emu-model", capacity=2))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(tmp_path, port)
    try:
        await asyncio.to_thread(wait_http_up, url, proc, "jobs server")
        # No token, wrong token: refused, for reads and writes alike.
        for method, path in (("GET", "/jobs"), ("POST", "/jobs"), ("GET", "/jobs/x"), ("DELETE", "/jobs/x")):
            assert await asyncio.to_thread(status_of, url, path, method) == 401
            assert await asyncio.to_thread(status_of, url, path, method, "wrong") == 401
        openapi = json.loads(await asyncio.to_thread(get_text, url + "/jobs/openapi.json"))
        assert set(openapi["paths"]) == {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/logs"}

        jobs = JobsClient(url, JOBS_TOKEN)
        with pytest.raises(JobsApiError) as bad:
            await asyncio.to_thread(jobs.submit, "emu-model", specs=[{"name": "x", "data": {"path": "/nope.jsonl"},
                                                                       "prompt": {"template": "{q}"}}])
        assert bad.value.status == 400 and "/nope.jsonl" in bad.value.message
        # A token holder cannot make the server read files outside its roots, nor learn their content.
        with pytest.raises(JobsApiError) as outside:
            await asyncio.to_thread(jobs.submit, "emu-model", spec_paths=["/etc/shadow"])
        assert outside.value.status == 400 and "outside the directories" in outside.value.message
        assert "root:" not in outside.value.message
        # A model no registered server serves is refused at once, not run into a page of failures.
        with pytest.raises(JobsApiError) as unknown:
            await asyncio.to_thread(jobs.submit, "no-such-model", spec_paths=[BUNDLED / "arith.yaml"])
        assert unknown.value.status == 400 and "no-such-model" in unknown.value.message
        # A second jobs server on the same directory is refused, naming the one that holds it.
        second = await asyncio.to_thread(subprocess.run, server_argv(tmp_path, free_port()), cwd=ROOT,
                                         capture_output=True, text=True, timeout=120)
        assert second.returncode == 5 and "in use by pid" in second.stderr, second.stderr
        with pytest.raises(JobsApiError) as bad_field:
            await asyncio.to_thread(jobs.submit, "emu-model", spec_paths=[BUNDLED / "arith.yaml"], concurrency=0)
        assert bad_field.value.status == 400 and "concurrency" in bad_field.value.message

        submitted = [
            await asyncio.to_thread(jobs.submit, "emu-model", spec_paths=[BUNDLED / "arith.yaml"], concurrency=2,
                                    name="arith-job"),
            await asyncio.to_thread(jobs.submit, "emu-model", spec_paths=[BUNDLED / "capitals.yaml"], concurrency=2),
        ]
        async with AsyncJobsClient(url, JOBS_TOKEN) as ajobs:
            submitted.append(await ajobs.submit("emu-model", spec_paths=[BUNDLED / "capitals_mc.yaml"], concurrency=2))
            assert {j["id"] for j in await ajobs.list()} >= {j["id"] for j in submitted}
        cli = await asyncio.to_thread(
            fedpool, "jobs", "submit", "--url", url, "--jobs-token-file", str(tmp_path / "jobs.token.given"),
            "--spec", str(BUNDLED / "arith.yaml"), "--model", "emu-model", "--limit", "10", "--name", "from-cli",
            "--json")
        assert cli.returncode == 0, cli.stderr
        submitted.append(json.loads(cli.stdout))
        ids = [j["id"] for j in submitted]

        # Kill the server (SIGKILL: no cleanup) once records are being written, then start it again.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            progress = [(await asyncio.to_thread(jobs.get, i))["progress"] for i in ids[:3]]
            if sum(p.get("done", 0) for job in progress for p in job.values()) >= 10:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("jobs made no progress")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        states_down = {i: None for i in ids}
        proc = start_server(tmp_path, port)
        await asyncio.to_thread(wait_http_up, url, proc, "jobs server")
        for job_id in ids:
            states_down[job_id] = (await asyncio.to_thread(jobs.wait, job_id, timeout_s=240, poll_s=0.5))["state"]
        assert set(states_down.values()) == {"done"}, states_down
        expected = {"arith": 60, "capitals": 75, "capitals_mc": 60}
        restarted = 0
        for job_id in ids:
            job = await asyncio.to_thread(jobs.get, job_id)
            for bench, result in job["scores"].items():
                rows = read_jsonl(Path(result["artifact_dir"]) / "records.jsonl")
                want = 10 if job["name"] == "from-cli" else expected[bench]
                assert len(rows) == want and len({r["sample_id"] for r in rows}) == want  # exactly once
                assert result["records"] == want
            restarted += job["starts"] > 1
            log = await asyncio.to_thread(jobs.logs, job_id)
            assert "queued" in log and "done:" in log
        assert restarted >= 1  # at least one job was running when the server died, and resumed
        # Cancel: a queued or running job stops; a finished one cannot be cancelled.
        long_job = await asyncio.to_thread(jobs.submit, "emu-model", spec_paths=[BUNDLED / "capitals.yaml"],
                                           concurrency=1)
        cancelled = await asyncio.to_thread(jobs.cancel, long_job["id"])
        assert cancelled["state"] == "cancelled"
        with pytest.raises(JobsApiError) as again:
            await asyncio.to_thread(jobs.cancel, long_job["id"])
        assert again.value.status == 409
        listing = await asyncio.to_thread(fedpool, "jobs", "list", "--url", url, "--jobs-token-file",
                                          str(tmp_path / "jobs.token.given"))
        assert listing.returncode == 0 and "cancelled" in listing.stdout and "from-cli" in listing.stdout
        assert listing.stdout.splitlines()[0].split() == ["ID", "STATE", "DONE/TOTAL", "MODEL", "NAME"]
        no_job = await asyncio.to_thread(fedpool, "jobs", "show", "no-such-job", "--url", url, "--jobs-token-file",
                                         str(tmp_path / "jobs.token.given"))
        assert no_job.returncode == 1 and no_job.stderr.startswith("fedpool: error: jobs server: "), no_job.stderr
        waited = await asyncio.to_thread(
            fedpool, "jobs", "submit", "--url", url, "--jobs-token-file", str(tmp_path / "jobs.token.given"),
            "--spec", str(BUNDLED / "arith.yaml"), "--model", "emu-model", "--limit", "4", "--wait")
        assert waited.returncode == 0, waited.stderr
        progress = [line for line in waited.stderr.splitlines() if line.startswith("fedpool: ")]
        assert progress and " done " in progress[-1] and progress[-1].split()[3] == "4/4", waited.stderr
        # The pool page and its data are served by the same process.
        page = await asyncio.to_thread(get_text, url + "/")
        assert "<title>fedpool" in page
        state = json.loads(await asyncio.to_thread(get_text, url + "/pool.json"))
        assert [s["id"] for s in state["servers"]] == ["emu"]
        assert JOBS_TOKEN not in json.dumps(state) and TEST_TOKEN not in json.dumps(state)
        assert all(j["error"] is None for j in state["jobs"])  # errors (paths) only for a caller with a key
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    logs = await asyncio.to_thread(lambda: "".join(p.read_text() for p in tmp_path.glob("server-*.log")))
    assert JOBS_TOKEN not in logs and TEST_TOKEN not in logs
    assert os.stat(tmp_path / "jobs" / "jobs.sqlite").st_size > 0
    # Private: the database, job logs and artifacts 0600 in 0700 directories.
    jobs_dir = tmp_path / "jobs"
    assert stat.S_IMODE(os.stat(jobs_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(jobs_dir / "jobs.sqlite").st_mode) == 0o600
    for job_id in ids:
        assert stat.S_IMODE(os.stat(jobs_dir / job_id).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(jobs_dir / job_id / "job.log").st_mode) == 0o600
        for records in (jobs_dir / job_id).rglob("records.jsonl"):
            assert stat.S_IMODE(os.stat(records).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(records.parent).st_mode) == 0o700


def test_a_cancel_and_a_start_racing_cannot_overwrite_each_other(tmp_path: Path) -> None:
    """The jobs store's state changes are compare-and-set: a job cancelled between the runner's read and its
    start stays cancelled (it used to be set back to running, then could be cancelled again), and a job that
    finished cannot be cancelled afterwards."""
    from fedpool.clients.jobs import JobRequest, JobStore

    store = JobStore(tmp_path / "jobs")
    job = store.create(JobRequest(model="m", spec_paths=[str(tmp_path / "s.yaml")]), now=0.0)
    assert store.update(job.id, only_from=("queued", "running"), state="cancelled", finished_at=1.0)
    assert not store.update(job.id, only_from=("queued",), state="running", started_at=1.0)  # the late start
    current = store.get(job.id)
    assert current is not None and current.state == "cancelled"
    assert not store.update(job.id, only_from=("queued", "running"), state="cancelled")  # again: refused
    other = store.create(JobRequest(model="m", spec_paths=[str(tmp_path / "s.yaml")]), now=0.0)
    assert store.update(other.id, only_from=("queued",), state="running", started_at=1.0)
    assert store.update(other.id, only_from=("running",), state="done", finished_at=2.0)
    assert not store.update(other.id, only_from=("queued", "running"), state="cancelled")
    done = store.get(other.id)
    assert done is not None and done.state == "done"
