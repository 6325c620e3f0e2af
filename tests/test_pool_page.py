"""The live pool page in headless Chromium (Debian's, driven by Playwright): it loads, shows the servers of
a real test pool, and updates by itself when a server goes down; it shows the batches in progress (Batch API), and
drops one once it has ended. Saves a screenshot of each state."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from fedpool.deploy.process import free_port
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.conftest import TEST_TOKEN, EmulatorFactory, wait_http_up

pytestmark = [pytest.mark.ray, pytest.mark.chromium]
ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As the machine's notes say: without the background-networking flags Chromium tries to reach Google's
# hosts, which a closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def start_gateway(tmp_path: Path, port: int, *more: str) -> subprocess.Popen[bytes]:
    (tmp_path / "registry.token").write_text(TEST_TOKEN)
    return subprocess.Popen(
        [sys.executable, "-m", "fedpool.cli", "gateway", "--address", ray.get_runtime_context().gcs_address,
         "--token-file-path", str(tmp_path / "registry.token"), "--port", str(port), *more],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


async def test_pool_page_shows_servers_and_follows_a_failure(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path: Path
) -> None:
    from playwright.async_api import async_playwright

    assert shutil.which(CHROMIUM), "Debian's chromium is needed (make test installs it)"
    first = await emulators.start(model="page-model")
    second = await emulators.start(model="page-model", seed=1)
    await registry.register(ServerRecord(id="gpu-a", url=first.url, engine=Engine.VLLM, model="page-model",
                                         accelerator="A100", capacity=8))
    await registry.register(ServerRecord(id="gpu-b", url=second.url, engine=Engine.VLLM, model="page-model",
                                         accelerator="V100", capacity=4))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_gateway(tmp_path, port)
    try:
        await asyncio.to_thread(wait_http_up, url, proc, "gateway")
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = await browser.new_page(viewport={"width": 1400, "height": 700})
            await page.goto(url + "/")
            rows = page.locator("#servers tbody tr")
            await rows.nth(1).wait_for(timeout=15000)
            assert await rows.count() == 2
            row_a = page.locator('#servers tr[data-id="gpu-a"]')
            assert "A100" in await row_a.inner_text() and "healthy" in await row_a.inner_text()
            assert "V100" in await page.locator('#servers tr[data-id="gpu-b"]').inner_text()
            # Traffic through the gateway shows in the live charts (a point every 2 s, rates between points).
            import aiohttp

            async with aiohttp.ClientSession() as session:
                for i in range(30):
                    async with session.post(url + "/v1/completions", json={
                            "model": "page-model", "prompt": f"q{i}", "max_tokens": 4}) as resp:
                        assert resp.status == 200
            await page.wait_for_function(
                "() => [...document.querySelectorAll('#chart-requests_per_s polyline')].some("
                "l => l.getAttribute('points').split(' ').length >= 2)", timeout=20000)
            servers_charted = await page.eval_on_selector_all(
                "#chart-requests_per_s polyline", "lines => lines.map(l => l.dataset.server)")
            assert set(servers_charted) <= {"gpu-a", "gpu-b"} and servers_charted
            assert "gpu-a" in await page.locator("#legend").inner_text()
            retried = page.locator('#servers thead th[title*="keep-alive"]')
            assert await retried.count() == 1  # stale keep-alive resets have their own column, not "errors"
            await page.screenshot(path=str(tmp_path / "pool-healthy.png"), full_page=True)

            await second.stop()  # the V100 server goes away; the registry's probes mark it down
            status_b = page.locator('#servers tr[data-id="gpu-b"] .status')
            await page.wait_for_function(
                "() => document.querySelector('#servers tr[data-id=\"gpu-b\"] .status')?.textContent === 'down'",
                timeout=30000)
            assert await status_b.inner_text() == "down"
            assert "healthy" in await row_a.inner_text()  # the other server is untouched
            failures = await page.locator("#failures tbody").inner_text()
            assert "gpu-b" in failures
            await page.screenshot(path=str(tmp_path / "pool-one-down.png"), full_page=True)
            await browser.close()
        assert await asyncio.to_thread(os.path.getsize, tmp_path / "pool-healthy.png") > 10_000
        print(f"screenshots: {tmp_path / 'pool-healthy.png'}, {tmp_path / 'pool-one-down.png'}")
    finally:
        stop(proc)


def fedpool_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDPOOL_")}
    return subprocess.run([sys.executable, "-m", "fedpool.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)


async def test_pool_page_shows_batches_in_progress(registry: RegistryClient, emulators: EmulatorFactory,
                                                   tmp_path: Path) -> None:
    from playwright.async_api import async_playwright

    server = await emulators.start(model="page-model", decode_s=0.05)  # a request of 8 tokens: ~0.4 s
    await registry.register(ServerRecord(id="gpu-a", url=server.url, engine=Engine.VLLM, model="page-model",
                                         accelerator="A100", capacity=4))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_gateway(tmp_path, port, "--batches-dir", str(tmp_path / "batches"))
    try:
        await asyncio.to_thread(wait_http_up, url, proc, "gateway")
        lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "page-model", "prompt": f"question {i}", "max_tokens": 8}} for i in range(120)]
        (tmp_path / "batch.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        submitted = await asyncio.to_thread(fedpool_cli, "batch", "submit", str(tmp_path / "batch.jsonl"),
                                            "--endpoint", "/v1/completions", "--url", url, "--json")
        assert submitted.returncode == 0, submitted.stderr
        batch_id = json.loads(submitted.stdout)["id"]
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            await page.goto(url + "/")
            row = page.locator(f'#batches tr[data-id="{batch_id}"]')
            await row.wait_for(timeout=15000)
            # Progress moves while the page watches: the done count of the row grows past 0.
            await page.wait_for_function(
                f"() => {{ const c = document.querySelector('#batches tr[data-id=\"{batch_id}\"] td:nth-child(6)');"
                " return c && parseInt(c.textContent) > 0; }", timeout=30000)
            text = await row.inner_text()
            assert "in_progress" in text and "page-model" in text and "/v1/completions" in text and "/ 120" in text
            assert text.rstrip().endswith("–")  # whose batch it is: only to a caller with a key
            await page.screenshot(path=str(tmp_path / "pool-batch.png"), full_page=True)
            cancelled = await asyncio.to_thread(fedpool_cli, "batch", "cancel", batch_id, "--url", url)
            assert cancelled.returncode == 0, cancelled.stderr
            await page.locator("#batches td.empty").wait_for(timeout=30000)  # ended: no longer in progress
            assert await page.locator("#batches tbody").inner_text() == "no batch in progress"
            await browser.close()
        assert await asyncio.to_thread(os.path.getsize, tmp_path / "pool-batch.png") > 10_000
        print(f"screenshot: {tmp_path / 'pool-batch.png'}")
    finally:
        stop(proc)
