"""The registry as a real Ray actor probing real aiohttp servers on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import ray
import ray.exceptions

from fedpool.deploy.emulator import EmulatedServer
from fedpool.deploy.process import free_port
from fedpool.registry import (
    AuthError,
    Engine,
    PoolSnapshot,
    RegistrationError,
    RegistryClient,
    RegistryError,
    ServerRecord,
    ServerStatus,
    UnknownServerError,
)
from fedpool.registry.actor import get_registry_actor
from tests.conftest import TEST_TOKEN, EmulatorFactory

pytestmark = pytest.mark.ray


def record(server: EmulatedServer, sid: str = "emu-0", **kw: object) -> ServerRecord:
    return ServerRecord.model_validate({"id": sid, "url": server.url, "engine": Engine.VLLM, "model": server.model,
                                        "accelerator": "A100", "gpu_count": 1, "capacity": 8, **kw})


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    """Wait for a condition. The bound only turns a hang into a failure: how long the registry took is not what
    these tests check (on 2 shared cores its actor's timers run late), only that it gets there and why."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.1)


async def status_of(registry: RegistryClient, sid: str) -> ServerStatus | None:
    entry = (await registry.snapshot()).get(sid)
    return entry.status if entry else None


async def test_register_probe_and_load(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    server = await emulators.start()
    entry = await registry.register(record(server))
    assert entry.status is ServerStatus.HEALTHY and entry.capacity == 8
    await eventually(lambda: _has_load(registry, "emu-0"))
    snap = await registry.snapshot()
    assert snap.get("emu-0").record.accelerator == "A100"  # type: ignore[union-attr]


async def _has_load(registry: RegistryClient, sid: str) -> bool:
    entry = (await registry.snapshot()).get(sid)
    return entry is not None and entry.load is not None and entry.probe_latency_s is not None


async def test_bad_registrations_are_refused_with_named_reasons(
    registry: RegistryClient, emulators: EmulatorFactory
) -> None:
    server = await emulators.start(model="real-model")
    nowhere = ServerRecord(id="ghost", url=f"http://127.0.0.1:{free_port()}", engine=Engine.VLLM, model="real-model")
    with pytest.raises(RegistrationError) as err:
        await registry.register(nowhere)
    assert err.value.check == "reachable" and "ghost" in str(err.value)
    wrong_model = ServerRecord(id="wm", url=server.url, engine=Engine.VLLM, model="other-model")
    with pytest.raises(RegistrationError) as err:
        await registry.register(wrong_model)
    assert err.value.check == "model" and "real-model" in str(err.value)
    await registry.register(record(server, "first"))
    with pytest.raises(RegistrationError) as err:
        await registry.register(record(server, "second"))
    assert err.value.field == "url" and "first" in str(err.value)
    assert (await registry.snapshot()).ids() == ("first",)


async def test_mutations_need_the_token(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    server = await emulators.start()
    anonymous = RegistryClient(registry.handle, token=None)
    wrong = RegistryClient(registry.handle, token="not-the-token")
    for client in (anonymous, wrong):
        with pytest.raises(AuthError):
            await client.register(record(server))
    await registry.register(record(server))
    for call in (lambda c: c.drain("emu-0"), lambda c: c.deregister("emu-0"), lambda c: c.heartbeat("emu-0", 5)):
        with pytest.raises(AuthError):
            await call(anonymous)
    assert (await anonymous.snapshot()).ids() == ("emu-0",)  # reads are open


async def test_killed_server_goes_down_and_comes_back(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    server = await emulators.start()
    await registry.register(record(server))
    port = int(server.url.rsplit(":", 1)[1])
    await server.stop()
    await eventually(lambda: _is(registry, "emu-0", ServerStatus.DOWN))
    down = (await registry.snapshot()).get("emu-0")
    # down because its probes failed, three in a row (the threshold), each saying why
    assert down is not None and down.consecutive_failures >= 3 and down.probe_failures_total >= 3, down
    assert down.last_error, down
    revived = EmulatedServer(model=server.model, port=port)
    await revived.start()
    try:
        await eventually(lambda: _is(registry, "emu-0", ServerStatus.HEALTHY))
    finally:
        await revived.stop()


async def _is(registry: RegistryClient, sid: str, status: ServerStatus) -> bool:
    return await status_of(registry, sid) is status


async def test_drain_then_removal_when_idle(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    server = await emulators.start()
    await registry.register(record(server))
    entry = await registry.drain("emu-0")
    assert entry.status is ServerStatus.DRAINING
    snap = await registry.snapshot()
    assert snap.filter(model=server.model, routable_only=True).ids() == ()
    await eventually(lambda: _gone(registry, "emu-0"))


async def _gone(registry: RegistryClient, sid: str) -> bool:
    return (await registry.snapshot()).get(sid) is None


async def test_lease_expiry_then_removal(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    server = await emulators.start()
    await registry.register(record(server), lease_ttl_s=1.0)
    await registry.heartbeat("emu-0", 1.0)
    await eventually(lambda: _is(registry, "emu-0", ServerStatus.DOWN))  # no heartbeat within its lease
    await eventually(lambda: _gone(registry, "emu-0"))
    with pytest.raises(UnknownServerError):
        await registry.heartbeat("emu-0", 1.0)


async def test_actor_restart_keeps_every_server_and_state(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    a, b = await emulators.start(), await emulators.start(decode_s=2.0)
    await registry.register(record(a, "a"), lease_ttl_s=60)
    await registry.register(record(b, "b", labels={"rack": "r7"}))
    async with aiohttp.ClientSession() as session:  # keep b busy so its drain cannot finish during the test
        busy = asyncio.create_task(session.post(b.url + "/v1/completions", json={"model": b.model, "prompt": "x"}))
        await eventually(lambda: _running(registry, "b"))
        await _check_restart(registry)
        busy.cancel()


async def _running(registry: RegistryClient, sid: str) -> bool:
    entry = (await registry.snapshot()).get(sid)
    return entry is not None and entry.load is not None and entry.load.running >= 1


async def _check_restart(registry: RegistryClient) -> None:
    await registry.drain("b")
    before = await registry.snapshot()
    first = (await registry.ping())["incarnation"]
    ray.kill(get_registry_actor(), no_restart=False)  # Ray restarts it (max_restarts=-1)
    after = await _snapshot_from_new_incarnation(registry, first)
    assert after.ids() == ("a", "b")
    assert after.version > before.version
    assert after.get("b").status is ServerStatus.DRAINING  # type: ignore[union-attr]
    assert after.get("b").record.labels == {"rack": "r7"}  # type: ignore[union-attr]
    await registry.heartbeat("a", 60)  # the lease survived too


async def _snapshot_from_new_incarnation(registry: RegistryClient, old: str) -> PoolSnapshot:
    for _ in range(150):
        try:
            if (await registry.ping())["incarnation"] != old:
                return await registry.snapshot()
        except ray.exceptions.RayActorError:
            pass  # restarting
        await asyncio.sleep(0.2)
    raise AssertionError("registry did not come back")


async def test_clients_reconnect_to_a_registry_started_again(
    registry: RegistryClient, emulators: EmulatorFactory, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Killed for good (no restart) and started again by an operator: clients holding the old handle (a
    launcher heartbeating, a watcher) find the new actor by name instead of failing forever."""
    server = await emulators.start()
    await registry.register(record(server))
    await registry.terminate()  # killed for good: the name is free when it returns
    with pytest.raises(RegistryError, match="no new one runs"):
        await registry.ping()
    fresh = await RegistryClient.start(tmp_path_factory.mktemp("registry-again"), token=TEST_TOKEN,
                                       probe_interval_s=0.3)
    await fresh.register(record(server, "emu-new"))
    assert (await registry.ping())["servers"] == 1  # the old client found the new actor
    assert (await registry.snapshot()).ids() == ("emu-new",)
    assert (await registry.heartbeat("emu-new", 30.0)).id == "emu-new"


async def test_snapshot_long_poll_returns_on_change(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    server = await emulators.start()
    await registry.register(record(server))
    current = (await registry.snapshot()).version
    # The poll would wait 10 minutes for nothing: a change (a probe's load, or the registration below) ends it.
    poll = asyncio.ensure_future(registry.snapshot(since_version=current, timeout_s=600.0))
    await registry.register(record(await emulators.start(), "emu-1"))
    newer = await asyncio.wait_for(poll, timeout=120)
    assert newer.version > current


async def test_snapshot_version_check_ships_rows_only_when_newer(
    registry: RegistryClient, emulators: EmulatorFactory
) -> None:
    server = await emulators.start()
    await registry.register(record(server))
    held = await registry.snapshot()
    # Ray types an untyped handle's methods as Never (they are remote methods): typed loosely once.
    handle: Any = registry.handle
    # Asking with the version held: the actor answers without rows or records (unless it moved on meanwhile).
    version, _, _, records, rows = await handle.snapshot_wire.remote(-1, 0.0, -1, held.version)
    if version == held.version:
        assert rows is None and records is None
    else:
        assert rows is not None
    # The client returns the very snapshot it holds while the version stands, a new one once it moved.
    again = await registry.snapshot()
    assert (again is held) == (again.version == held.version)
    newer = await registry.snapshot(since_version=held.version, timeout_s=10.0)
    assert newer.version > held.version and newer is not held and newer.get("emu-0") is not None


async def test_prometheus_export_of_the_pool(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    up, gone = await emulators.start(), await emulators.start()
    await registry.register(record(up, "up"))
    await registry.register(record(gone, "gone"))
    await gone.stop()
    await eventually(lambda: _is(registry, "gone", ServerStatus.DOWN))
    await eventually(lambda: _has_load(registry, "up"))
    text = await registry.metrics_text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }
    labels = lambda sid: (("accelerator", "A100"), ("engine", "vllm"), ("model", "emu-model"), ("server_id", sid))  # noqa: E731
    assert samples[("fedpool_server_routable", labels("up"))] == 1.0
    assert samples[("fedpool_server_routable", labels("gone"))] == 0.0
    assert samples[("fedpool_server_probe_failures", labels("gone"))] >= 3
    assert ("fedpool_server_running", labels("up")) in samples
    by_status = {k[1]: v for k, v in samples.items() if k[0] == "fedpool_servers"}
    assert by_status[(("accelerator", "A100"), ("engine", "vllm"), ("status", "down"))] == 1.0
    assert by_status[(("accelerator", "A100"), ("engine", "vllm"), ("status", "healthy"))] == 1.0
    assert TEST_TOKEN not in text


async def test_emulator_speaks_both_protocols_to_the_unchanged_adapters(
    registry: RegistryClient, emulators: EmulatorFactory
) -> None:
    from fedpool.deploy.emulator import PROFILES, EmulatedServer

    vllm_like = await emulators.start(model="m-vllm")
    sglang_like = EmulatedServer(model="m-sglang", profile=PROFILES["sglang-a100-illustrative"])
    await sglang_like.start()
    emulators.servers.append(sglang_like)
    await registry.register(ServerRecord(id="v", url=vllm_like.url, engine=Engine.VLLM, model="m-vllm"))
    entry = await registry.register(ServerRecord(id="s", url=sglang_like.url, engine=Engine.SGLANG, model="m-sglang"))
    assert entry.capacity == 32  # discovered from SGLang's /server_info
    await eventually(lambda: _has_load(registry, "v"))
    await eventually(lambda: _has_load(registry, "s"))
    snap = await registry.snapshot()
    assert snap.get("s").load.kv_cache_usage is not None  # type: ignore[union-attr]
    assert snap.get("v").load.generation_tokens_total is not None  # type: ignore[union-attr]


async def test_starting_with_a_token_the_running_registry_does_not_have_is_refused(
    registry: RegistryClient, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`registry start` against a running registry with another token: refused before anything is written,
    the error naming the running registry's token file (not a client whose every mutation then fails)."""
    other = tmp_path_factory.mktemp("other-state")
    (other / "registry.token").write_text("a-different-token-0123456789\n")
    with pytest.raises(RegistryError) as err:
        await RegistryClient.start(other, probe_interval_s=0.3)
    running_dir = (await registry.ping())["state_dir"]
    assert f"{running_dir}/registry.token" in str(err.value) and str(other / "registry.token") in str(err.value)
    assert (other / "registry.token").read_text() == "a-different-token-0123456789\n"  # untouched
    with pytest.raises(RegistryError, match="token given"):
        await RegistryClient.start(tmp_path_factory.mktemp("given"), token="yet-another-token-abcdef")
    again = await RegistryClient.start(Path(running_dir), probe_interval_s=0.3)  # its own token: fine
    assert (await again.ping())["incarnation"] == (await registry.ping())["incarnation"]


async def test_forged_probe_deliveries_are_refused(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    """Any Ray driver can call the actor's methods; probe results count only with the prober's credential, so a
    forged delivery can neither mark a server down nor change its capacity (in memory or in registry.json)."""
    from fedpool.registry import AuthError
    from fedpool.registry.snapshot import ProbeResult, probe_to_row

    server = await emulators.start()
    await registry.register(record(server))
    forged = [probe_to_row(ProbeResult("emu-0", False, 0.1, time.time(), "forged: down")) for _ in range(5)]
    for credential in ("", "guessed-credential-0123456789"):
        with pytest.raises(AuthError, match="own prober"):
            await _unwrapped_call(registry.handle.deliver_probes.remote(credential, forged))
    entry = (await registry.snapshot()).get("emu-0")
    assert entry is not None and entry.status.value == "healthy"


async def _unwrapped_call(ref: object) -> object:
    from fedpool.registry.client import _unwrapped

    return await _unwrapped(ref)
