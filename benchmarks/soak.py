"""Load and soak, bounded: the gateway under many concurrent streaming clients, and the dispatcher over
100,000 requests; afterwards nothing may be left behind (tasks, file descriptors, in-flight counts) and
memory may not keep growing.

    python -m fedpool.benchmarks.soak [--clients 500] [--duration 60] [--dispatcher-requests 100000]

Loopback only: a zero-latency emulated server and the gateway each run in their own process; the clients
run here, each streaming chat completions one after another until the time is up (loops bounded in count
and time). The gateway process's RSS, open file descriptors and asyncio tasks are read after a warm-up
and again when the clients have stopped, and once more after the keep-alive time of its connections to the
engine (they close idle), against the reading before any load. Then the dispatcher alone sends
`--dispatcher-requests` requests through a pool of zero-latency emulated servers in this process and its
counters must return to zero.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import time
from multiprocessing.synchronize import Event
from typing import Any

import aiohttp
import psutil

import fedpool.benchmarks.baselines  # noqa: F401 (registers the baseline policies it routes by)
from fedpool.benchmarks.report import markdown_table, write_report
from fedpool.federation.gateway.transport import IDLE_S, HttpTransport

MODEL = "soak-model"


def _emulator_child(port_out: mp.Queue, stop: Event) -> None:  # runs in a child process
    from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile

    async def main() -> None:
        server = EmulatedServer(model=MODEL, profile=EmulatorProfile(decode_s_per_token=0.0, max_running=4096))
        port_out.put(await server.start())
        await asyncio.to_thread(stop.wait)
        await server.stop()

    asyncio.run(main())


def _gateway_child(port_out: mp.Queue, stop: Event, measure: Event, tasks_out: mp.Queue,
                   upstream: str) -> None:  # runs in a child process
    from aiohttp import web

    from fedpool.federation import DispatchConfig, Dispatcher, make_policy, new_session
    from fedpool.federation.gateway.handlers import Gateway
    from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus

    async def main() -> None:
        record = ServerRecord(id="emu-0", url=upstream, engine=Engine.VLLM, model=MODEL, capacity=1024)
        snap = PoolSnapshot(1, 0.0, (ServerEntry(record, ServerStatus.HEALTHY, 1024, 1.0),))
        async with new_session() as session:
            config = DispatchConfig(adaptive_windows=False)
            dispatcher = Dispatcher(HttpTransport(session, config.timeouts), lambda: snap,
                                    make_policy("least_inflight"), config=config)
            runner = web.AppRunner(Gateway(dispatcher, lambda: snap).app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port_out.put(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
            while not stop.is_set():
                if measure.is_set():
                    measure.clear()
                    stats = dispatcher.stats()
                    tasks_out.put((len(asyncio.all_tasks()), stats.inflight_total, stats.waiting))
                await asyncio.sleep(0.05)
            await runner.cleanup()

    asyncio.run(main())


async def stream_clients(url: str, clients: int, duration_s: float, max_each: int) -> tuple[int, int, int]:
    """(streams completed, errors, chunks) from `clients` coroutines streaming back to back."""
    done = errors = chunks = 0
    deadline = time.perf_counter() + duration_s
    connector = aiohttp.TCPConnector(limit=0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a short story"}], "max_tokens": 16,
            "stream": True}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def one(i: int) -> None:
            nonlocal done, errors, chunks
            await asyncio.sleep(random.Random(i).uniform(0, 1.0))  # spread the start
            for _ in range(max_each):
                if time.perf_counter() > deadline:
                    return
                try:
                    async with session.post(url + "/v1/chat/completions", json=body) as resp:
                        if resp.status != 200:
                            errors += 1
                            await resp.read()
                            continue
                        finished = False
                        async for line in resp.content:
                            if line.startswith(b"data: "):
                                chunks += 1
                                finished = finished or line.strip() == b"data: [DONE]"
                        if finished:
                            done += 1
                        else:
                            errors += 1
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1

        await asyncio.gather(*(one(i) for i in range(clients)))
    return done, errors, chunks


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def gateway_figures(proc: psutil.Process, measure: Event, tasks_out: mp.Queue, gateway_url: str,
                    upstream_url: str) -> dict[str, float]:
    """The gateway process's RSS, descriptors and tasks, with its TCP sockets told apart by peer: those of
    clients (on its listening port), those to the engine (its keep-alive connections) and any other."""
    measure.set()
    tasks, inflight, waiting = tasks_out.get(timeout=30)
    listen, engine = _port(gateway_url), _port(upstream_url)
    to_clients = to_engine = other = 0
    for conn in proc.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            continue
        if conn.laddr and conn.laddr.port == listen:
            to_clients += 1
        elif conn.raddr and conn.raddr.port == engine:
            to_engine += 1
        else:
            other += 1
    return {"rss_mb": proc.memory_info().rss / 2**20, "fds": float(proc.num_fds()), "tasks": float(tasks),
            "inflight": float(inflight), "waiting": float(waiting), "to_clients": float(to_clients),
            "to_engine": float(to_engine), "other_sockets": float(other)}


async def soak_gateway(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    tasks_out: mp.Queue = ctx.Queue()
    stop, measure = ctx.Event(), ctx.Event()
    emulator = ctx.Process(target=_emulator_child, args=(ports, stop), daemon=True)
    emulator.start()
    upstream = await asyncio.to_thread(ports.get, True, 60)
    gateway = ctx.Process(target=_gateway_child, args=(ports, stop, measure, tasks_out, upstream), daemon=True)
    gateway.start()
    url = await asyncio.to_thread(ports.get, True, 60)
    proc = psutil.Process(gateway.pid)

    def figures() -> dict[str, float]:
        return gateway_figures(proc, measure, tasks_out, url, upstream)

    try:
        idle = await asyncio.to_thread(figures)
        warm = await stream_clients(url, args.clients, args.warmup, 10**9)
        warmed = await asyncio.to_thread(figures)
        started = time.perf_counter()

        async def midway() -> dict[str, float]:
            await asyncio.sleep(args.duration / 2)
            return await asyncio.to_thread(figures)

        (done, errors, chunks), loaded = await asyncio.gather(
            stream_clients(url, args.clients, args.duration, 10**9), midway())
        elapsed = time.perf_counter() - started
        await asyncio.sleep(2.0)  # the clients' connections close, handlers finish
        after = await asyncio.to_thread(figures)
        # The gateway's idle keep-alive connections to the engine (its working set: one per concurrent stream
        # at the peak) close once idle for the keep-alive time; both pools sweep on that period, so a connection
        # goes within two of them. What is still open after that is kept by nobody: a leak.
        await asyncio.sleep(args.settle)
        end = await asyncio.to_thread(figures)
    finally:
        stop.set()
        gateway.join(20)
        emulator.join(20)
    return {"idle": idle, "warm": warmed, "loaded": loaded, "after": after, "end": end, "streams": done,
            "errors": errors + warm[1], "chunks": chunks, "elapsed_s": elapsed, "warm_streams": warm[0]}


async def soak_dispatcher(requests: int, servers: int) -> dict[str, Any]:
    from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile
    from fedpool.federation import (
        DispatchConfig,
        Dispatcher,
        Endpoint,
        InferenceRequest,
        SamplingParams,
        make_policy,
        new_session,
    )
    from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus

    emus = [EmulatedServer(model=MODEL, profile=EmulatorProfile(decode_s_per_token=0.0, max_running=256), seed=i)
            for i in range(servers)]
    for emu in emus:
        await emu.start()
    entries = tuple(ServerEntry(ServerRecord(id=f"emu-{i}", url=e.url, engine=Engine.VLLM, model=MODEL, capacity=64),
                                ServerStatus.HEALTHY, 64, 1.0) for i, e in enumerate(emus))
    snap = PoolSnapshot(1, 0.0, entries)
    sent = 0
    started = time.perf_counter()
    async with new_session() as session:
        dispatcher = Dispatcher(HttpTransport(session), lambda: snap, make_policy("capacity_weighted"),
                                config=DispatchConfig())

        async def client(cid: int, count: int) -> None:
            for k in range(count):
                await dispatcher.submit(InferenceRequest(
                    request_id=f"c{cid}-{k}", model=MODEL, endpoint=Endpoint.COMPLETIONS,
                    prompt="x", params=SamplingParams(max_tokens=1), client_id=f"eval-{cid % 8}"))

        workers = min(256, requests)
        per, extra = divmod(requests, workers)
        await asyncio.gather(*(client(c, per + (c < extra)) for c in range(workers)))
        sent = requests
        stats = dispatcher.stats()
    elapsed = time.perf_counter() - started
    for emu in emus:
        await emu.stop()
    return {"requests": sent, "completed": stats.completed, "failed": stats.failed,
            "inflight_total": stats.inflight_total, "waiting": stats.waiting,
            "server_inflight": sum(s.inflight for s in stats.servers), "elapsed_s": elapsed,
            "per_s": sent / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the baseline reading")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--dispatcher-requests", type=int, default=100_000)
    parser.add_argument("--dispatcher-servers", type=int, default=4)
    parser.add_argument("--settle", type=float, default=2 * IDLE_S + 5,
                        help="seconds after the load before the last reading: idle keep-alive connections close")
    args = parser.parse_args()
    g = asyncio.run(soak_gateway(args))
    d = asyncio.run(soak_dispatcher(args.dispatcher_requests, args.dispatcher_servers))
    warm, after, end, idle, loaded = g["warm"], g["after"], g["end"], g["idle"], g["loaded"]
    growth = (end["rss_mb"] / warm["rss_mb"] - 1) * 100
    # Tasks against the reading after the warm-up (what the gateway starts once and keeps); descriptors against
    # the idle reading before any load: once the keep-alive time has passed, every connection is gone again.
    leaked_tasks = end["tasks"] - warm["tasks"]
    leaked_fds = end["fds"] - idle["fds"]
    readings = (idle, warm, loaded, after, end)

    def sockets(key: str) -> str:
        return " / ".join(f"{r[key]:.0f}" for r in readings)
    counters_zero = int(d["inflight_total"] == 0 and d["waiting"] == 0 and d["server_inflight"] == 0
                        and d["completed"] == d["requests"])
    rows = [
        (f"gateway: {args.clients} streaming clients for {args.duration:g} s (after {args.warmup:g} s warm-up)",
         f"{g['streams']} streams, {g['chunks']} chunks, {g['streams'] / g['elapsed_s']:.0f} streams/s",
         f"errors {g['errors']}", "0 errors"),
        ("gateway RSS: idle / after warm-up / end", f"{idle['rss_mb']:.1f} / {warm['rss_mb']:.1f} / "
         f"{end['rss_mb']:.1f} MiB", f"growth after warm-up {growth:+.1f}%", "< 10%"),
        ("gateway asyncio tasks: idle / after warm-up / under load / after", f"{idle['tasks']:.0f} / "
         f"{warm['tasks']:.0f} / {loaded['tasks']:.0f} / {end['tasks']:.0f}",
         f"left behind {leaked_tasks:+.0f}", "0"),
        (f"gateway open file descriptors: idle / after warm-up / under load / 2 s after / {args.settle:g} s later",
         sockets("fds"), f"left behind {leaked_fds:+.0f} (last against idle)", "0"),
        ("… of them TCP to clients (same readings)", sockets("to_clients"), "", "0 at the end"),
        ("… of them TCP to the engine: keep-alive connections (same readings)", sockets("to_engine"), "",
         "0 at the end"),
        ("… of them other TCP sockets (same readings)", sockets("other_sockets"), "", ""),
        ("gateway dispatcher after the load: in flight / waiting", f"{end['inflight']:.0f} / {end['waiting']:.0f}",
         "", "0 / 0"),
        (f"dispatcher: {d['requests']} requests, {min(256, d['requests'])} concurrent callers, "
         f"{args.dispatcher_servers} zero-latency servers",
         f"{d['completed']} completed, {d['failed']} failed, {d['per_s']:.0f} req/s",
         f"in flight {d['inflight_total']}, waiting {d['waiting']}, per-server in flight {d['server_inflight']}",
         "all 0"),
    ]
    body = ("Loopback only; the emulated server answers at once. All on one 2-core machine. The gateway's "
            f"descriptors are read five times; the last comes {args.settle:g} s after the load, past the keep-alive "
            f"time ({IDLE_S:g} s, swept on that period) of its connections to the engine, and is checked against "
            "the reading before any load.\n\n"
            + markdown_table(("what", "figures", "check", "target"), rows))
    for row in rows:
        print(" | ".join(map(str, row)))
    write_report("soak", "Load and soak", body, {
        "clients": args.clients, "errors": g["errors"], "leaked_tasks": int(leaked_tasks),
        "leaked_fds": int(leaked_fds), "mem_growth_pct": f"{growth:.1f}",
        "dispatcher_requests": d["requests"], "counters_zero": counters_zero,
    })


if __name__ == "__main__":
    main()
