"""Shared fixtures: real local Ray, real emulated (aiohttp) servers, real llama.cpp servers."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

import fedpool.benchmarks.baselines  # noqa: F401 (registers the baseline policies the tests route by)
from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile, Faults
from fedpool.deploy.llamacpp import LlamaServerConfig, llama_server_binary
from fedpool.deploy.models import GEMMA_ALIAS, ensure_gemma
from fedpool.deploy.process import free_port
from fedpool.registry import Engine, RegistryClient, ServerRecord
from tests.fakes import FakePool

TEST_TOKEN = "test-registry-token-7f3a9c"


# The files that take longest (minutes of lm-eval, engine and Ray processes) run first: `make test`'s two workers
# take files in this order, and a long file started last would leave one worker alone at the end.
LONGEST_FIRST = ("test_multiprocess_bench.py", "test_realtool.py", "test_chaos.py", "test_cli.py", "test_vllm_cpu.py",
                 "test_docs.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every async test checks that it leaves no task of its own running; the longest files come first."""
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.fixturenames.insert(0, "no_leaked_tasks")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What a test asks to have said at the end of the run (`record_property("docs_test", text)`: the docs test's
    count of documented commands run and skipped), also from pytest-xdist's workers."""
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, value in getattr(report, "user_properties", []):
            if name == "docs_test":
                terminalreporter.write_line(str(value))


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fails the test if a task it started is still pending once its fixtures are torn down (set up first, so
    torn down last)."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)  # tasks finishing at this very moment
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
    for task in leaked:
        task.cancel()
    await asyncio.gather(*leaked, return_exceptions=True)
    assert not leaked, f"the test left tasks running: {[t.get_name() + ' ' + repr(t.get_coro()) for t in leaked]}"


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One real local Ray for the whole session (starting it costs ~8 s)."""
    ray.init(address="local", num_cpus=2, namespace="fedpool", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
async def registry(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RegistryClient]:
    """A fresh registry actor per test, probing fast; killed (not restarted) afterwards. Its state dir
    (with the token file) is outside the test's tmp_path, which artifact scans read."""
    client = await RegistryClient.start(
        tmp_path_factory.mktemp("registry"), token=TEST_TOKEN, probe_interval_s=0.3, probe_timeout_s=1.0,
        check_timeout_s=3.0,
        lease_grace_s=1.0, drain_timeout_s=30.0,
    )
    await client.ping()
    yield client
    await client.terminate()


@dataclass
class EmulatorFactory:
    servers: list[EmulatedServer]

    async def start(
        self, model: str = "emu-model", *, max_running: int = 4, decode_s: float = 0.002,
        faults: Faults | None = None, seed: int = 0, prefill_s: float = 0.0,
    ) -> EmulatedServer:
        server = EmulatedServer(
            model=model, profile=EmulatorProfile(max_running=max_running, decode_s_per_token=decode_s,
                                                 prefill_s_per_token=prefill_s),
            faults=faults, seed=seed,
        )
        await server.start()
        self.servers.append(server)
        return server


@pytest.fixture
async def emulators() -> AsyncIterator[EmulatorFactory]:
    factory = EmulatorFactory([])
    yield factory
    for server in factory.servers:
        await server.stop()


LEASE_POOL_MODEL = "emu-model"


@pytest.fixture
async def lease_pool(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory,
                     emulators: EmulatorFactory) -> AsyncIterator[tuple[RegistryClient, Path]]:
    """A registry with a 2 s lease TTL and two emulated servers of 4 slots serving LEASE_POOL_MODEL, each request
    of 8 tokens ~0.4 s: (the registry, its state dir)."""
    state = tmp_path_factory.mktemp("lease-registry")
    registry = await RegistryClient.start(state, token=TEST_TOKEN, probe_interval_s=0.3, probe_timeout_s=1.0,
                                          check_timeout_s=3.0, capacity_lease_ttl_s=2.0)
    for i in range(2):
        server = await emulators.start(max_running=4, decode_s=0.05)
        await registry.register(ServerRecord(id=f"emu-{i}", url=server.url, engine=Engine.VLLM,
                                             model=LEASE_POOL_MODEL, accelerator="A100", capacity=4))
    yield registry, state
    await registry.terminate()


@pytest.fixture
async def fakes() -> AsyncIterator[FakePool]:
    """In-process fake servers (tests/fakes.py) and virtual-time dispatchers over them; closed afterwards."""
    pool = FakePool()
    yield pool
    await pool.close()


@dataclass(frozen=True)
class LlamaServers:
    urls: tuple[str, ...]
    alias: str
    pids: tuple[int, ...]
    model_path: Path


def _wait_http_ok(url: str, deadline_s: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"llama-server not healthy after {deadline_s}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def llama_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServers]:
    """Two real llama-server processes serving Gemma 3 270M (4 slots, 1 thread each) for the session."""
    model = ensure_gemma()
    binary = llama_server_binary()
    logs = tmp_path_factory.mktemp("llama-logs")
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    try:
        for i in range(2):
            config = LlamaServerConfig(model_path=model, alias=GEMMA_ALIAS, port=free_port(), slots=4, threads=1)
            log = logs / f"llama-{i}.log"
            with log.open("wb") as fh:
                procs.append(subprocess.Popen(config.argv(binary), stdout=fh, stderr=subprocess.STDOUT, env=env))
            urls.append(config.url)
            _wait_http_ok(config.url + "/health", 180, procs[-1], log)
        yield LlamaServers(tuple(urls), GEMMA_ALIAS, tuple(p.pid for p in procs), model)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No engine process may outlive the test session."""
    leftovers = [
        p for p in psutil.Process().children(recursive=True)
        if _safe_name(p) in ("llama-server",)
    ]
    if leftovers:
        for p in leftovers:
            p.kill()
        session.exitstatus = 1
        print(f"\nERROR: test session left engine processes behind: {[p.pid for p in leftovers]}")


def _safe_name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


def files_containing(root: Path, secrets: list[str]) -> list[str]:
    """Every file under root that contains any of the secret strings (for the artifact scans)."""
    hits: list[str] = []
    for path in root.rglob("*"):
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            hits.extend(f"{path}: {s[:4]}…" for s in secrets if s in text)
    return hits


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Each line's JSON object; its values are whatever the file holds (json.loads's Any), for tests to check."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def wait_http_up(url: str, proc: subprocess.Popen[str] | subprocess.Popen[bytes], what: str,
                 timeout_s: float = 60.0) -> None:
    """Until `url`/health answers; fails at once if the server process `proc` has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{what} did not come up")
