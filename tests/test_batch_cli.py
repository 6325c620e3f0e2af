"""`fedpool batch submit | list | show | cancel | download` as a user runs them (real subprocesses) against a real
gateway with the Batch API over emulated servers: a batch submitted with --wait (progress and ETA on stderr), listed,
shown and downloaded (the files are the gateway's, line for line), another cancelled; errors (an unknown id, a bad
file, no gateway) exit with their codes and one line naming the culprit. And `fedpool gateway --batches-dir`: a
caller without a key is known by its name, the pool page's data lists the batch, a second gateway on the same
directory is refused."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import ray

from fedpool.clients.batchclient import ProgressBar
from fedpool.clients.poolapp import build_app
from fedpool.deploy.process import free_port
from fedpool.federation.gateway.handlers import Gateway, serving
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import TEST_TOKEN, EmulatorFactory, read_jsonl, wait_http_up
from tests.test_batches import KEYS, VLLM_FILE, jsonl, request_line, served

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parent.parent


async def fedpool(*args: str, key: str | None = None, within_s: float = 120) -> subprocess.CompletedProcess[str]:
    """`fedpool ARGS` in a process of its own (FEDPOOL_API_KEY = `key`), while the test's gateway serves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDPOOL_")}
    env.update({"FEDPOOL_API_KEY": key} if key else {})
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fedpool.cli", *args], capture_output=True,
                                   text=True, timeout=within_s, cwd=ROOT, env=env)


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command ends with (no traceback)."""
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


def gateway_file(url: str, file_id: str, key: str) -> bytes:
    request = urllib.request.Request(f"{url}/v1/files/{file_id}/content", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        data: bytes = response.read()
    return data


def ids_of(lines: Sequence[dict[str, Any]]) -> list[str]:
    return [line["custom_id"] for line in lines]


async def test_submit_wait_list_show_download_and_cancel(registry: RegistryClient, emulators: EmulatorFactory,
                                                         tmp_path: Path) -> None:
    async with served(registry, emulators, tmp_path, decode_s=0.05) as pool:  # a request of 8 tokens: ~0.4 s
        key = KEYS[0].secret
        small = tmp_path / "small.jsonl"
        small.write_bytes(jsonl([request_line(i, max_tokens=4) for i in range(6)]))
        done = await fedpool("batch", "submit", str(small), "--endpoint", "/v1/completions", "--url", pool.url + "/v1",
                             "--wait", "--metadata", "eval=arith", "--json", key=key)
        assert done.returncode == 0, done.stderr
        batch = json.loads(done.stdout)
        assert batch["status"] == "completed" and batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
        assert batch["metadata"] == {"eval": "arith"}
        progress = done.stderr.splitlines()
        assert progress[0] == f"fedpool: {batch['id']}: 6 requests; waiting (Ctrl-C stops the waiting, not the batch)"
        assert progress[-1].startswith(f"{batch['id']} completed") and "6/6 (0 failed)" in progress[-1]
        assert progress[-1].endswith(" done") and "[" + "#" * 24 + "]" in progress[-1]

        listed = await fedpool("batch", "list", "--url", pool.url, key=key)
        assert listed.returncode == 0, listed.stderr
        header, row = listed.stdout.splitlines()
        assert header.split()[:4] == ["ID", "STATUS", "DONE/TOTAL", "FAILED"]
        assert row.split() == [batch["id"], "completed", "6/6", "0", "/v1/completions", "emu-model"]
        shown = await fedpool("batch", "show", batch["id"], "--url", pool.url, key=key)
        assert shown.returncode == 0 and f"output file: {batch['output_file_id']}" in shown.stdout
        assert "metadata: eval=arith" in shown.stdout

        out = tmp_path / "downloads"
        got = await fedpool("batch", "download", batch["id"], "--url", pool.url, "--out", str(out), key=key)
        assert got.returncode == 0, got.stderr
        written = out / f"{batch['id']}.output.jsonl"
        assert got.stdout.strip() == f"output: {written}" and sorted(os.listdir(out)) == [written.name]
        assert written.read_bytes() == await asyncio.to_thread(gateway_file, pool.url, batch["output_file_id"], key)
        assert ids_of(read_jsonl(written)) == [f"req-{i}" for i in range(6)]  # line for line, in input order
        assert all(line["response"]["status_code"] == 200 for line in read_jsonl(written))

        big = tmp_path / "big.jsonl"
        big.write_bytes(jsonl([request_line(i, max_tokens=8) for i in range(200)]))
        submitted = await fedpool("batch", "submit", str(big), "--endpoint", "/v1/completions", "--url", pool.url,
                                  "--json", key=key)
        assert submitted.returncode == 0, submitted.stderr
        other = json.loads(submitted.stdout)["id"]
        # The pool page's data lists it while it runs; whose it is, only to a caller with a key.
        [row] = (await asyncio.to_thread(gateway_json, pool.url + "/pool.json", key))["batches"]
        assert (row["id"], row["total"], row["owner"]) == (other, 200, "team-a")
        assert [r["owner"] for r in (await asyncio.to_thread(gateway_json, pool.url + "/pool.json"))["batches"]] == [
            None]
        early = await fedpool("batch", "download", other, "--url", pool.url, "--out", str(out), key=key)
        assert early.returncode == 1 and f"batch {other} is " in error_line(early)
        assert not (out / f"{other}.output.jsonl").exists()
        cancelled = await fedpool("batch", "cancel", other, "--url", pool.url, "--json", key=key)
        assert cancelled.returncode == 0, cancelled.stderr
        assert json.loads(cancelled.stdout)["status"] in ("cancelling", "cancelled")
        ended = await pool_batch_final(pool.url, other, key)
        assert ended["status"] == "cancelled"
        got = await fedpool("batch", "download", other, "--url", pool.url, "--out", str(out), "--json", key=key)
        files = json.loads(got.stdout)
        lines = read_jsonl(Path(files["errors"])) + (read_jsonl(Path(files["output"])) if "output" in files else [])
        assert Counter(ids_of(lines)) == Counter(f"req-{i}" for i in range(200))  # each line once, ran or not
        assert any(line["error"] and line["error"]["code"] == "batch_cancelled" for line in lines)
        again = await fedpool("batch", "cancel", other, "--url", pool.url, key=key)
        assert again.returncode == 1 and "cannot cancel batch" in error_line(again)

        # Whose: another key sees none of these.
        unseen = await fedpool("batch", "show", batch["id"], "--url", pool.url, key=KEYS[1].secret)
        assert unseen.returncode == 1
        assert error_line(unseen) == f"fedpool: error: gateway: No such Batch object: {batch['id']}"
        listed = await fedpool("batch", "list", "--url", pool.url, key=KEYS[1].secret)
        assert listed.returncode == 0 and listed.stdout.startswith("(no batches;")


async def test_a_vllm_run_batch_file_as_it_is(registry: RegistryClient, emulators: EmulatorFactory,
                                              tmp_path: Path) -> None:
    async with served(registry, emulators, tmp_path, model="meta-llama/Meta-Llama-3-8B-Instruct") as pool:
        done = await fedpool("batch", "submit", str(VLLM_FILE), "--endpoint", "/v1/chat/completions", "--url",
                             pool.url, "--wait", "--json", key=KEYS[0].secret)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


async def pool_batch_final(url: str, batch_id: str, key: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The batch once it has ended, by `fedpool batch show --json`."""
    for _ in range(int(timeout_s)):
        shown = await fedpool("batch", "show", batch_id, "--url", url, "--json", key=key)
        batch: dict[str, Any] = json.loads(shown.stdout)
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        await asyncio.sleep(0.5)
    raise AssertionError(f"batch {batch_id} did not end")


async def test_errors_exit_with_their_codes_and_name_the_culprit(registry: RegistryClient,
                                                                 emulators: EmulatorFactory, tmp_path: Path) -> None:
    async with served(registry, emulators, tmp_path) as pool:
        key = KEYS[0].secret
        unknown = await fedpool("batch", "show", "batch_nope", "--url", pool.url, key=key)
        assert unknown.returncode == 1
        assert error_line(unknown) == "fedpool: error: gateway: No such Batch object: batch_nope"
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(jsonl([request_line(0)]) + b"{not json\n")
        refused = await fedpool("batch", "submit", str(bad), "--endpoint", "/v1/completions", "--url", pool.url,
                                key=key)
        assert refused.returncode == 2
        assert error_line(refused) == "fedpool: error: gateway: the file is refused: line 2: not valid JSON"
        mismatched = tmp_path / "chat.jsonl"
        mismatched.write_bytes(jsonl([request_line(0), request_line(1, endpoint="/v1/chat/completions")]))
        refused = await fedpool("batch", "submit", str(mismatched), "--endpoint", "/v1/completions", "--url",
                                pool.url, key=key)
        assert refused.returncode == 2 and "line 2: url /v1/chat/completions is not the batch's endpoint" in (
            error_line(refused))
        listed = await asyncio.to_thread(gateway_json, pool.url + "/v1/files", key)
        assert listed["data"] == []  # the refused batch's upload was deleted again: nothing half-accepted
        missing = await fedpool("batch", "submit", str(tmp_path / "nope.jsonl"), "--endpoint", "/v1/completions",
                                "--url", pool.url, key=key)
        assert missing.returncode == 2 and error_line(missing).endswith("nope.jsonl: no such file or directory")
        worded = await fedpool("batch", "submit", str(bad), "--endpoint", "/v1/completions", "--url", pool.url,
                               "--metadata", "eval", key=key)
        assert worded.returncode == 2 and "--metadata: expected KEY=VALUE, got 'eval'" in error_line(worded)
        wrong_key = await fedpool("batch", "list", "--url", pool.url, key="sk-not-a-key-0123456789")
        assert wrong_key.returncode == 1 and error_line(wrong_key) == "fedpool: error: gateway: invalid API key"
        async with serving(build_app(Gateway(pool.pool.dispatcher, lambda: pool.pool.snapshot), pool.pool,
                                     "<html></html>")) as bare:  # a gateway without --batches-dir
            none = await fedpool("batch", "list", "--url", bare)
        assert none.returncode == 3 and "the gateway serves no Batch API (GET /v1/batches" in error_line(none)
        # No --url: the gateway of the `fedpool up` whose state dir is given (its up.json, as `fedpool up` writes it).
        up = tmp_path / "up"
        (up / "registry").mkdir(parents=True)
        (up / "registry" / "registry.token").write_text(TEST_TOKEN)
        (up / "up.json").write_text(json.dumps({"url": pool.url, "ray_address": "127.0.0.1:1"}))
        found = await fedpool("batch", "list", "--state-dir", str(up), key=key)
        assert found.returncode == 0 and found.stdout.startswith("(no batches;"), found.stderr
    nobody = f"http://127.0.0.1:{free_port()}"
    unreachable = await fedpool("batch", "list", "--url", nobody, key=key)
    assert unreachable.returncode == 3 and f"cannot reach the gateway at {nobody}" in error_line(unreachable)
    no_pool = await fedpool("batch", "list", "--state-dir", str(tmp_path / "no-pool"))
    assert no_pool.returncode == 3 and "no gateway: no `fedpool up` is up from" in error_line(no_pool)


def gateway_json(url: str, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def start_gateway(tmp_path: Path, port: int, batches: Path) -> subprocess.Popen[str]:
    """`fedpool gateway --batches-dir BATCHES` (no keys) over the test's registry."""
    (tmp_path / "registry.token").write_text(TEST_TOKEN)
    return subprocess.Popen(
        [sys.executable, "-m", "fedpool.cli", "gateway", "--address", ray.get_runtime_context().gcs_address,
         "--token-file-path", str(tmp_path / "registry.token"), "--port", str(port), "--batches-dir", str(batches)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def test_gateway_batches_dir_names_callers_without_keys_and_lists_batches_on_the_page(
        registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path) -> None:
    server = await emulators.start(model="emu-model", decode_s=0.05)
    await registry.register(ServerRecord(id="emu-0", url=server.url, engine=Engine.VLLM, model="emu-model",
                                         accelerator="A100", capacity=4))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_gateway(tmp_path, port, tmp_path / "batches")
    try:
        await asyncio.to_thread(wait_http_up, url, proc, "gateway")
        requests = tmp_path / "requests.jsonl"
        requests.write_bytes(jsonl([request_line(i, max_tokens=8) for i in range(100)]))
        submitted = await fedpool("batch", "submit", str(requests), "--endpoint", "/v1/completions", "--url", url,
                                  "--client", "alice", "--json")
        assert submitted.returncode == 0, submitted.stderr
        batch_id = json.loads(submitted.stdout)["id"]
        page = await asyncio.to_thread(gateway_json, url + "/pool.json")
        [shown] = page["batches"]
        assert shown["id"] == batch_id and shown["total"] == 100 and shown["model"] == "emu-model"
        assert shown["owner"] is None  # whose, only to a caller with a key or the jobs token
        other = await fedpool("batch", "show", batch_id, "--url", url, "--client", "bob")
        assert other.returncode == 1 and "No such Batch object" in error_line(other)
        second = await fedpool("gateway", "--address", ray.get_runtime_context().gcs_address, "--token-file-path",
                               str(tmp_path / "registry.token"), "--port", str(free_port()), "--batches-dir",
                               str(tmp_path / "batches"))
        assert second.returncode == 5, second.stderr  # one process owns a batches directory
        cancelled = await fedpool("batch", "cancel", batch_id, "--url", url, "--client", "alice", "--json")
        assert cancelled.returncode == 0 and json.loads(cancelled.stdout)["status"] in ("cancelling", "cancelled")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0


def test_the_progress_line_has_a_bar_a_rate_and_an_eta() -> None:
    shown = io.StringIO()
    bar = ProgressBar(shown, clock=lambda: 1_000.0)
    running = {"id": "batch_x", "status": "in_progress", "in_progress_at": 990, "request_counts": {
        "total": 40, "completed": 9, "failed": 1}, "fedpool": {"estimate": {"seconds": 50.0}}}
    assert bar.line(running) == f"batch_x in_progress [{'#' * 6}{'.' * 18}] 10/40 (1 failed) 1.0/s ETA 30 s"
    waiting = {**running, "status": "validating", "in_progress_at": None, "request_counts": {"total": 40}}
    assert bar.line(waiting).endswith("0/40 (0 failed) -/s ETA ~50 s (estimate)")
    bar(running)
    bar({**running, "status": "completed", "request_counts": {"total": 40, "completed": 39, "failed": 1}})
    out = shown.getvalue().splitlines()  # not a terminal: a line at each change
    assert len(out) == 2 and out[-1].endswith("40/40 (1 failed) 4.0/s done")
