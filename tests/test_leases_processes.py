"""Capacity leases between real processes (tests/lease_holder.py), on a real registry and emulated servers: a
killed process's slots come back, an idle one holds nothing, shortest_first holds across processes, and the
registry dying mid-run loses and doubles nothing; and a connection says what its evals will want from its first
report on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

from fedpool.federation import PoolConnection
from fedpool.registry import RegistryClient
from tests.conftest import LEASE_POOL_MODEL

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # each test starts lease-holding processes: 8-11 s
ROOT = Path(__file__).resolve().parent.parent
SLOTS = 8  # two servers of 4


async def holder(state: Path, out: Path, client: str, requests: int, **options: object) -> asyncio.subprocess.Process:
    address = ray.get_runtime_context().gcs_address
    args = [sys.executable, "-m", "tests.lease_holder", "--address", address, "--state-dir", str(state), "--client",
            client, "--requests", str(requests), "--out", str(out)]
    for name, value in options.items():
        flag = f"--{name.replace('_', '-')}"
        args += ([flag] if value else []) if isinstance(value, bool) else [flag, str(value)]
    return await asyncio.create_subprocess_exec(*args, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def held(path: Path) -> int:
    """What the holder held at its latest sample (0 before its first)."""
    samples = [line for line in lines(path) if "held" in line]
    return sum(samples[-1]["held"].values()) if samples else 0


async def until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until `condition` holds; returns when (monotonic). Fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic()


async def finish(proc: asyncio.subprocess.Process) -> None:
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]


async def test_a_killed_process_s_slots_are_granted_to_another_within_5_s(
        lease_pool: tuple[RegistryClient, Path], tmp_path: Path) -> None:
    _registry, state = lease_pool
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    # The one killed reaches the registry over its HTTP API, the survivor through Ray: one broker for both.
    a = await holder(state, a_out, "a", 400, concurrency=16, http=True)
    await until(lambda: held(a_out) == SLOTS, 60, "the first process holding every slot")
    b = await holder(state, b_out, "b", 400, concurrency=16)
    await until(lambda: held(b_out) > 0 and held(b_out) + held(a_out) <= SLOTS, 60, "both holding a share")
    assert held(b_out) < SLOTS
    os.kill(a.pid, signal.SIGKILL)  # its lease is never given back: the broker must let it expire
    killed = time.monotonic()
    regranted = await until(lambda: held(b_out) == SLOTS, 30, "the survivor holding every slot")
    await a.wait()
    assert regranted - killed <= 5.0, regranted - killed
    b.send_signal(signal.SIGTERM)
    await b.wait()


async def test_an_idle_process_holds_no_slots(lease_pool: tuple[RegistryClient, Path], tmp_path: Path) -> None:
    registry, state = lease_pool
    idle_out, busy_out = tmp_path / "idle.jsonl", tmp_path / "busy.jsonl"
    idle = await holder(state, idle_out, "idle", 0, linger=6)
    await until(lambda: any("done" in line for line in lines(idle_out)), 60, "the idle process connected")
    busy = await holder(state, busy_out, "busy", 60, concurrency=16)
    await until(lambda: held(busy_out) == SLOTS, 60, "the busy process holding every slot")
    (started,) = [line for line in lines(idle_out) if "started" in line]
    leases = await registry.leases()
    assert leases["holders"].get(started["holder"], {}) == {}  # known to the broker, holding nothing
    assert held(idle_out) == 0
    await finish(busy)
    await finish(idle)
    assert [line["done"] for line in lines(busy_out) if "done" in line] == [60]


async def test_connections_started_together_each_hold_a_share_before_their_first_request(
        lease_pool: tuple[RegistryClient, Path]) -> None:
    """Two connections that say which evals they are about to run (`expect`, as `eval run` does for its specs) are
    each leased half the slots before either sends a request: the first to send cannot fill every slot while the
    other is still loading (four eval processes started together: the first to report what it wanted took all 8,
    and the others' first requests waited 0.8-1.1 s for those attempts to be given back). A connection that
    expects nothing holds nothing."""
    registry, _ = lease_pool
    async with (PoolConnection(registry, expect=[("a", LEASE_POOL_MODEL, 64)]) as a,
                PoolConnection(registry, expect=[("b", LEASE_POOL_MODEL, 64)]) as b,
                PoolConnection(registry) as idle):
        await until(lambda: sum(a.dispatcher.held().values()) == sum(b.dispatcher.held().values()) == SLOTS // 2,
                    10, "each connection leased half the slots")
        assert idle.dispatcher.held() == {}
        leases = await registry.leases()
        assert leases["holders"][a.lease_holder] and leases["holders"][b.lease_holder]


async def test_two_processes_with_unequal_work_finish_in_shortest_first_order(
        lease_pool: tuple[RegistryClient, Path], tmp_path: Path) -> None:
    """As inside one process: the client with the least work left anywhere is served first. The long eval
    starts first and holds every slot; the short one starts in another process and takes them over."""
    _registry, state = lease_pool
    long_out, short_out = tmp_path / "long.jsonl", tmp_path / "short.jsonl"
    long = await holder(state, long_out, "long", 96, concurrency=32, order="shortest_first")
    await until(lambda: held(long_out) == SLOTS, 60, "the long eval holding every slot")
    short = await holder(state, short_out, "short", 16, concurrency=16, order="shortest_first")
    await finish(short)
    await finish(long)
    short_lines, long_lines = lines(short_out), lines(long_out)
    short_done = next(line["t"] for line in short_lines if "done" in line)
    long_done = next(line["t"] for line in long_lines if "done" in line)
    assert short_done < long_done
    # While the short eval ran, it held (nearly) every slot: the long one's share went to it.
    short_peak = max(sum(line["held"].values()) for line in short_lines if "held" in line)
    assert short_peak >= SLOTS - 1, short_peak
    assert len({line["answered"] for line in long_lines if "answered" in line}) == 96


@pytest.mark.parametrize("http", [False, True], ids=["ray", "http"])
async def test_the_registry_killed_mid_run_loses_and_doubles_nothing(
        lease_pool: tuple[RegistryClient, Path], tmp_path: Path, http: bool) -> None:
    """Through Ray, or over the HTTP API: Ray restarts the actor, whose API comes back on another port (found again
    in the state dir); leases ride out the gap."""
    registry, state = lease_pool
    out = tmp_path / "run.jsonl"
    proc = await holder(state, out, "run", 120, concurrency=16, http=http)
    await until(lambda: sum("answered" in line for line in lines(out)) >= 30, 60, "a quarter answered")
    ray.kill(registry.handle, no_restart=False)  # Ray restarts it; its broker learns for one TTL
    await finish(proc)
    answered = [line["answered"] for line in lines(out) if "answered" in line]
    assert len(answered) == 120 and len(set(answered)) == 120
    assert (await registry.ping())["servers"] == 2
    assert [line["ray_imported"] for line in lines(out) if "ray_imported" in line] == [not http]
