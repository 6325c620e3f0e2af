"""Everyone on the pool, in view: real processes sharing one real registry and emulated servers, and what the
operator sees of them — `fedpool pool status --json` (its `holders` against what each process reports holding),
`fedpool pool status` and `fedpool pool top` as text, and the pool page in headless Chromium with three processes
(two `fedpool eval run`, one lm-eval through the gateway), all three listed with their evals' progress. The page's
screenshot is kept under test-artifacts/ when the check fails."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import ray

from fedpool.benchmarks.realtool_speedup import _lm_eval_argv, stories
from fedpool.deploy.process import free_port
from fedpool.registry import PoolHolders, RegistryClient
from tests.conftest import LEASE_POOL_MODEL, wait_http_up
from tests.test_leases_processes import finish, held, holder, lines, until
from tests.test_pool_page import CHROMIUM, CHROMIUM_ARGS, stop

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"  # kept after a failed run (gitignored)
MODEL = LEASE_POOL_MODEL


def fedpool(state: Path, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`fedpool ARGS` on the test's cluster and registry, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "fedpool.cli", *args, "--address",
                           ray.get_runtime_context().gcs_address, "--state-dir", str(state)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


async def test_pool_status_lists_every_holder_as_the_processes_report_it_and_top_shows_them_live(
        lease_pool: tuple[RegistryClient, Path], tmp_path: Path) -> None:
    registry, state = lease_pool
    outs = {name: tmp_path / f"{name}.jsonl" for name in ("alpha", "beta")}
    procs = [await holder(state, out, name, 150) for name, out in outs.items()]
    try:
        await until(lambda: all(held(out) > 0 for out in outs.values()), 60, "both processes hold a lease")
        status = await asyncio.to_thread(fedpool, state, "pool", "status", "--json")
        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        names = {next(line["holder"] for line in lines(out) if "holder" in line): client
                 for client, out in outs.items()}
        listed = {h["holder"]: h for h in data["holders"]}
        assert set(listed) == set(names), (listed.keys(), names)
        for name, client in names.items():
            row = listed[name]
            assert row["kind"] == "other" and row["state"] == "active" and row["host"] and row["pid"] > 0
            (progress,) = row["clients"]
            assert (progress["client"], progress["model"], progress["state"]) == (client, MODEL, "running")
            answered = sum(1 for line in lines(outs[client]) if "answered" in line)
            assert progress["done"] <= answered and 0 < progress["requests_left"] <= 150
            assert 0 < row["slots"] <= 8 and row["fair_share"] == 4  # 2 servers x 4 slots ÷ 2 holders
            assert sum(s["slots"] for s in row["servers"]) == row["slots"]
            assert {(k["kind"], k["capacity"]) for k in row["kinds"]} == {(row["kinds"][0]["kind"], 8)}
        assert all(s["leased"] <= s["capacity"] == 4 for s in data["lease_servers"])
        text = await asyncio.to_thread(fedpool, state, "pool", "status")
        assert text.returncode == 0 and "holders" in text.stdout and "alpha" in text.stdout, text.stdout

        top = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fedpool.cli", "pool", "top", "--interval", "0.5", "--address",
            ray.get_runtime_context().gcs_address, "--state-dir", str(state), cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        await asyncio.sleep(6)
        top.send_signal(signal.SIGTERM)  # as Ctrl-C: it stops at once, exit 0
        out, err = await asyncio.wait_for(top.communicate(), 20)
        assert top.returncode == 0, err.decode()[-2000:]
        shown = out.decode()
        assert "fedpool pool top" in shown and "alpha" in shown and "beta" in shown, shown[-3000:]
        for proc in procs:
            await finish(proc)
        after = PoolHolders.model_validate((await registry.holders()).model_dump())
        assert not after.holders
        assert {(f.client, f.outcome) for f in after.finished} == {("alpha", "done"), ("beta", "done")}
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()


async def wait_for(check: Callable[[], Awaitable[bool]], procs: list[subprocess.Popen[bytes]], logs: Path,
                   what: str, timeout_s: float = 120.0) -> None:
    """Poll `check` until it holds; fails naming `what` after `timeout_s`, or at once when a process exited."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead and asyncio.get_running_loop().time() < deadline, f"{what}: not so; exited {dead}; logs {logs}"
        await asyncio.sleep(0.5)


def spawn(argv: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    """A process of the test, its output into `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)


def eval_spec(work: Path, name: str, n: int, tokens: int) -> Path:
    workload = stories(name, n, tokens)
    data = work / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in workload.rows), encoding="utf-8")
    spec = work / f"{name}.yaml"
    spec.write_text(workload.fedpool_spec(data), encoding="utf-8")
    return spec


@pytest.mark.chromium
@pytest.mark.lmeval
async def test_the_pool_page_lists_three_processes_and_their_evals(lease_pool: tuple[RegistryClient, Path],
                                                                   tmp_path: Path) -> None:
    from playwright.async_api import async_playwright

    assert shutil.which(CHROMIUM), "Debian's chromium is needed (make test installs it)"
    registry, state = lease_pool
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = tmp_path / "logs"
    logs.mkdir()
    gateway = spawn([sys.executable, "-m", "fedpool.cli", "gateway", "--address", ray.get_runtime_context().gcs_address,
                     "--state-dir", str(state), "--port", str(port)], logs / "gateway.log")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await asyncio.to_thread(wait_http_up, url, gateway, "gateway")
        tasks = tmp_path / "tasks"
        tasks.mkdir()
        lm = stories("lm_long", 400, 16)  # (each process stops once the page is checked)
        (tasks / "lm_long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lm.rows), encoding="utf-8")
        (tasks / "lm_long.yaml").write_text(lm.lm_eval_yaml(tasks / "lm_long.jsonl"), encoding="utf-8")
        procs.append(spawn(_lm_eval_argv(MODEL, url, "lm_long", tasks, tmp_path / "lm-out", 8), logs / "lm_eval.log",
                           cwd=tmp_path))

        async def running(kinds: list[str]) -> bool:
            view = await registry.holders()
            return sorted(h.kind for h in view.holders if any(c.state == "running" and c.done > 0
                                                                for c in h.clients)) == kinds

        await wait_for(lambda: running(["gateway"]), procs, logs, "lm-eval's requests through the gateway")
        for name in ("story_a", "story_b"):  # (started once lm-eval sends: its start-up takes longer)
            spec = eval_spec(tmp_path, name, 300, 16)
            procs.append(spawn(
                [sys.executable, "-m", "fedpool.cli", "eval", "run", "--quiet", "--spec", str(spec), "--model", MODEL,
                 "--out", str(tmp_path / f"run-{name}"), "--address", ray.get_runtime_context().gcs_address,
                 "--state-dir", str(state)], logs / f"{name}.log"))
        await wait_for(lambda: running(["eval run", "eval run", "gateway"]), procs, logs,
                       "three processes running together")
        view = await registry.holders()
        kinds = sorted(h.kind for h in view.holders)
        assert kinds == ["eval run", "eval run", "gateway"], kinds

        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = await browser.new_page(viewport={"width": 1400, "height": 1200})
            try:
                await page.goto(url + "/")
                await page.wait_for_function(
                    "() => document.querySelectorAll('#holders tbody tr[data-id]').length === 3"
                    " && [...document.querySelectorAll('#holders tbody tr')].every(r => r.dataset.id)",
                    timeout=20000)
                shown_kinds = await page.locator("#holders tbody tr td:nth-child(2)").all_inner_texts()
                assert sorted(shown_kinds) == ["eval run", "eval run", "gateway"], shown_kinds
                evals = page.locator("#evals tbody")
                await page.wait_for_function(
                    "() => ['story_a', 'story_b'].every(n => document.querySelector('#evals tbody').innerText"
                    ".includes(n)) && document.querySelectorAll('#evals tbody tr').length >= 3", timeout=20000)
                evals_text = await evals.inner_text()
                assert "gateway" in evals_text, evals_text  # the lm-eval run, as the gateway's client
                for name in ("story_a", "story_b"):
                    row = page.locator(f'#evals tr[data-id$="/{name}"]')
                    cells = await row.locator("td").all_inner_texts()
                    done, total = (int(x) for x in cells[4].split(" / "))
                    assert 0 < done < total == 300, cells
                    width = await row.locator(".bar > span").evaluate("e => parseFloat(e.style.width)")
                    assert 0 < width < 100, cells
                await page.wait_for_function(
                    "() => [...document.querySelectorAll('#chart-holders polyline')].length >= 3", timeout=20000)
                await page.screenshot(path=str(tmp_path / "pool-holders.png"), full_page=True)
            except BaseException:
                ARTIFACTS.mkdir(exist_ok=True)
                shot = ARTIFACTS / "pool-holders-failure.png"
                await page.screenshot(path=str(shot), full_page=True)
                print(f"screenshot of the failed check: {shot}")
                raise
            finally:
                await browser.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        stop(gateway)

