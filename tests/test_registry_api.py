"""The registry's HTTP API (registry/api.py) on a real registry actor, through the real HTTP client: the same pool
as through Ray, leases and failure reports, the operator calls, refused without the token, bad bodies named, a
stale URL file, and an actor Ray restarted on another port found again."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import ray

from fedpool.deploy.process import free_port
from fedpool.registry import (
    AuthError,
    DemandReport,
    Engine,
    RegistrationError,
    RegistryClient,
    RegistryError,
    ServerRecord,
    ServerStatus,
    UnknownServerError,
)
from fedpool.registry.actor import get_registry_actor
from fedpool.registry.api import API_FILE, read_api_file
from fedpool.registry.httpclient import RegistryHttpClient, RegistryUnreachable, find_registry_api
from fedpool.registry.leases import ClientDemand, ModelDemand
from tests.conftest import TEST_TOKEN, EmulatorFactory, wait_http_up

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parent.parent


async def api_of(registry: RegistryClient) -> tuple[RegistryHttpClient, Path]:
    state = Path((await registry.ping())["state_dir"])
    client = await asyncio.to_thread(find_registry_api, url=None, token=TEST_TOKEN, state_dir=state, environ={})
    assert client is not None, f"no API found in {state}"
    return client, state


async def register_two(registry: RegistryClient, emulators: EmulatorFactory) -> None:
    for i in range(2):
        server = await emulators.start(max_running=4)
        await registry.register(ServerRecord(id=f"emu-{i}", url=server.url, engine=Engine.VLLM, model="emu-model",
                                             accelerator="A100", capacity=4, labels={"rack": f"r{i}"}))


async def test_the_api_serves_the_pool_the_ray_client_sees(registry: RegistryClient,
                                                           emulators: EmulatorFactory) -> None:
    await register_two(registry, emulators)
    api, _ = await api_of(registry)
    try:
        over_ray = await registry.snapshot()
        over_http = await api.snapshot()
        assert over_http.ids() == over_ray.ids() == ("emu-0", "emu-1")
        for sid in over_ray.ids():
            a, b = over_ray.get(sid), over_http.get(sid)
            assert a is not None and b is not None
            assert (b.record, b.capacity, b.weight) == (a.record, a.capacity, a.weight)
        # The version held comes back as the very object; a long poll ends when the pool changes.
        again = await api.snapshot()
        assert (again is over_http) == (again.version == over_http.version)
        poll = asyncio.ensure_future(api.snapshot(since_version=again.version, timeout_s=25.0))
        await registry.drain("emu-1")
        newer = await asyncio.wait_for(poll, 60)
        assert newer.version > again.version and newer is not again
        assert await api.report_failure("emu-0", "connect") is True
        assert await api.report_failure("no-such-server", "connect") is False
    finally:
        await api.aclose()


async def test_leases_over_the_api_share_the_slots_with_ray_holders(registry: RegistryClient,
                                                                    emulators: EmulatorFactory) -> None:
    await register_two(registry, emulators)
    api, _ = await api_of(registry)

    def report(holder: str, wanted: int) -> DemandReport:
        return DemandReport(holder=holder, models=(ModelDemand(model="emu-model", clients=(
            ClientDemand(client=holder, wanted=wanted),)),))

    try:
        await api.snapshot()
        first = await api.lease(report("http-holder", 8))
        assert sum(first.slots.values()) == 8 and first.holder == "http-holder"
        # A holder through Ray wants as much: the broker is the same one, so it shares and never grants a slot twice.
        other = await registry.lease(report("ray-holder", 8))
        assert sum(other.slots.values()) + sum(first.slots.values()) <= 8
        stats = await registry.leases()
        assert {"http-holder", "ray-holder"} <= set(stats["holders"])
        await api.release_lease("http-holder")
        assert "http-holder" not in (await registry.leases())["holders"]
    finally:
        await api.aclose()


async def test_the_api_refuses_without_the_token_and_names_bad_input(registry: RegistryClient) -> None:
    api, state = await api_of(registry)
    await api.aclose()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{api.url}/v1/snapshot") as response:
            assert response.status == 401 and "token" in (await response.json())["error"]
        wrong = {"Authorization": "Bearer " + "x" * 32}
        async with session.post(f"{api.url}/v1/lease/release", json={"holder": "h"}, headers=wrong) as response:
            assert response.status == 401
        good = {"Authorization": f"Bearer {TEST_TOKEN}"}
        async with session.post(f"{api.url}/v1/lease", json={"known_version": 1}, headers=good) as response:
            assert response.status == 400 and "'report'" in (await response.json())["error"]
        async with session.post(f"{api.url}/v1/lease", json={"report": {"holder": ""}}, headers=good) as response:
            assert response.status == 400 and "holder" in (await response.json())["error"]
        async with session.post(f"{api.url}/v1/failure", data=b"{not json", headers=good) as response:
            assert response.status == 400 and "not JSON" in (await response.json())["error"]
        async with session.get(f"{api.url}/v1/snapshot?since=soon", headers=good) as response:
            assert response.status == 400 and "since" in (await response.json())["error"]
        async with session.get(f"{api.url}/v1/ping") as response:  # open, and says the token was not given
            info = await response.json()
            assert info["fedpool_registry"] == 1 and info["token_ok"] is False
    # A token from elsewhere: the state dir's API is not this token's registry, so Ray; given explicitly, refused.
    assert await asyncio.to_thread(find_registry_api, url=None, token="y" * 32, state_dir=state, environ={}) is None
    with pytest.raises(AuthError, match="refused this process's token"):
        await asyncio.to_thread(find_registry_api, url=api.url, token="y" * 32, state_dir=None, environ={})
    with pytest.raises(AuthError, match="needs the registry's token"):
        await asyncio.to_thread(find_registry_api, url=api.url, token=None, state_dir=None, environ={})
    with pytest.raises(RegistryError, match="http:// or https://"):
        RegistryHttpClient("file:///etc/passwd", TEST_TOKEN)


async def test_operator_calls_over_the_api_as_through_ray(registry: RegistryClient,
                                                           emulators: EmulatorFactory) -> None:
    """`fedpool registry status` and `server add | show | drain | remove` over the HTTP API (a command beside a pool
    needs no Ray driver): the same entries and the same typed errors as through Ray; refused without the token."""
    server, other = await emulators.start(), await emulators.start()
    api, _ = await api_of(registry)
    try:
        added = await api.register(ServerRecord(id="emu-op", url=server.url, engine=Engine.VLLM, model="emu-model",
                                                accelerator="A100", capacity=4, labels={"rack": "r1"}))
        shown, through_ray = await api.get("emu-op"), await registry.get("emu-op")
        assert added.record == shown.record == through_ray.record and shown.capacity == through_ray.capacity == 4
        with pytest.raises(UnknownServerError, match="no server with id 'nope' is registered"):
            await api.get("nope")
        with pytest.raises(RegistrationError) as refused:  # the registry's check of the server, as through Ray
            await api.register(ServerRecord(id="emu-x", url=other.url, engine=Engine.VLLM, model="other-model"))
        assert refused.value.check == "model" and refused.value.server_id == "emu-x"
        assert (await api.drain("emu-op")).status is ServerStatus.DRAINING
        await api.register(ServerRecord(id="emu-gone", url=other.url, engine=Engine.VLLM, model="emu-model"))
        assert (await api.deregister("emu-gone")).url == other.url
        assert "emu-gone" not in (await registry.snapshot()).ids()
        await api.register(ServerRecord(id="emu-keep", url=other.url, engine=Engine.VLLM, model="emu-model"))
        status = await api.ping()
        assert status["api_url"] == api.url and status["state_dir"] == (await registry.ping())["state_dir"]
    finally:
        await api.aclose()
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer " + "x" * 32}) as session:
        for method, path in (("POST", "/v1/servers"), ("POST", "/v1/servers/emu-keep/drain"), ("GET", "/v1/status"),
                             ("DELETE", "/v1/servers/emu-keep"), ("GET", "/v1/servers/emu-keep")):
            async with session.request(method, f"{api.url}{path}", json={}) as response:
                assert response.status == 401, (method, path)
    assert (await registry.get("emu-keep")).status is not ServerStatus.DRAINING  # (the refused calls changed nothing)


async def test_a_stale_url_file_means_ray_and_a_given_url_must_answer(tmp_path: Path) -> None:
    dead = "http://127.0.0.1:1"
    (tmp_path / API_FILE).write_text(json.dumps({"url": dead, "incarnation": "gone"}), encoding="utf-8")
    assert read_api_file(tmp_path) == dead
    assert await asyncio.to_thread(find_registry_api, url=None, token=TEST_TOKEN, state_dir=tmp_path,
                                   environ={}) is None
    assert await asyncio.to_thread(find_registry_api, url=None, token=None, state_dir=tmp_path, environ={}) is None
    with pytest.raises(RegistryUnreachable, match=re.escape(f"no fedpool registry answers at {dead}")):
        await asyncio.to_thread(find_registry_api, url=None, token=TEST_TOKEN, state_dir=None,
                                environ={"FEDPOOL_REGISTRY_URL": dead})
    (tmp_path / API_FILE).write_text("{half", encoding="utf-8")
    assert read_api_file(tmp_path) is None


async def test_a_registry_ray_restarted_is_found_again_on_its_new_port(registry: RegistryClient,
                                                                       emulators: EmulatorFactory) -> None:
    await register_two(registry, emulators)
    api, state = await api_of(registry)
    try:
        before = await api.snapshot()
        old_url = api.url
        ray.kill(get_registry_actor(), no_restart=False)  # Ray restarts it; its API comes back on a free port
        deadline = time.monotonic() + 60
        while read_api_file(state) in (None, old_url):
            assert time.monotonic() < deadline, "the restarted registry never served its API again"
            await asyncio.sleep(0.2)
        after = await api.snapshot()  # the old URL refuses; the client reads the state dir again
        assert api.url != old_url and after.ids() == before.ids()
        lease = await api.lease(DemandReport(holder="after-restart"))
        assert lease.holder == "after-restart"
    finally:
        await api.aclose()


async def test_a_fixed_port_or_no_api_as_the_operator_chose(ray_cluster: None,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    port = free_port()
    fixed_dir, off_dir = tmp_path_factory.mktemp("api-fixed"), tmp_path_factory.mktemp("api-off")
    fixed = await RegistryClient.start(fixed_dir, token=TEST_TOKEN, api_port=port, namespace="fedpool-api-fixed")
    try:
        assert (await fixed.ping())["api_url"] == f"http://127.0.0.1:{port}" == read_api_file(fixed_dir)
    finally:
        await fixed.terminate()
    off = await RegistryClient.start(off_dir, token=TEST_TOKEN, api_port=None, namespace="fedpool-api-off")
    try:
        assert (await off.ping())["api_url"] is None and not (off_dir / API_FILE).exists()
        assert await asyncio.to_thread(find_registry_api, url=None, token=TEST_TOKEN, state_dir=off_dir,
                                       environ={}) is None  # clients go through Ray
    finally:
        await off.terminate()


async def test_a_gateway_without_jobs_reaches_the_registry_over_its_api_without_ray(
        registry: RegistryClient, emulators: EmulatorFactory) -> None:
    await register_two(registry, emulators)
    state = (await registry.ping())["state_dir"]
    port = free_port()
    probe = ("import sys; from fedpool.cli import main; rc = main(sys.argv[1:]); "
             "print('RAY-IMPORTED' if 'ray' in sys.modules else 'NO-RAY', file=sys.stderr); sys.exit(rc)")
    argv = [sys.executable, "-c", probe, "gateway", "--address", ray.get_runtime_context().gcs_address, "--state-dir",
            state, "--port", str(port)]
    proc = await asyncio.to_thread(subprocess.Popen, argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_http_up, url, proc, "gateway")
        async with aiohttp.ClientSession() as session:
            for i in range(8):
                async with session.post(f"{url}/v1/completions", json={"model": "emu-model", "prompt": f"q{i}",
                                                                        "max_tokens": 4}) as response:
                    assert response.status == 200 and response.headers["X-Fedpool-Server"] in ("emu-0", "emu-1")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == 0, err
    assert "fedpool: registry API http://127.0.0.1:" in err and "NO-RAY" in err, err
