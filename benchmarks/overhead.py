"""What routing through fedpool costs: dispatcher decisions per second, and the latency the gateway adds
over calling the server directly, at fixed request rates (open loop) against a zero-latency server.

    python -m fedpool.benchmarks.overhead --rates 200 1000 --duration 10 --repeats 5

Baseline printed beside the result: the same requests sent straight to the emulated server; and
LiteLLM's documented ~12 ms median overhead at ~1k RPS with two instances (its docs).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import statistics
import time
from multiprocessing.synchronize import Event

import aiohttp

from fedpool.benchmarks.report import markdown_table, write_report
from fedpool.federation import Completion, InferenceRequest
from fedpool.federation.core.types import StreamBody, StreamProgress, Target
from fedpool.federation.gateway.transport import HttpTransport

LITELLM_MEDIAN_MS = 12.0


def _serve(kind: str, port_out: mp.Queue, stop: Event, upstream: str | None) -> None:  # child process
    from aiohttp import web

    from fedpool.deploy.emulator import EmulatedServer, EmulatorProfile

    async def main() -> None:
        if kind == "emulator":
            server = EmulatedServer(model="bench-model", profile=EmulatorProfile(decode_s_per_token=0.0))
            port_out.put(await server.start())
            await asyncio.to_thread(stop.wait)
            await server.stop()
            return
        from fedpool.federation import DispatchConfig, Dispatcher, make_policy, new_session
        from fedpool.federation.gateway.handlers import Gateway
        from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus

        record = ServerRecord(id="emu-0", url=upstream or "", engine=Engine.VLLM, model="bench-model", capacity=512)
        snap = PoolSnapshot(1, 0.0, (ServerEntry(record, ServerStatus.HEALTHY, 512, 1.0),))
        async with new_session() as session:
            config = DispatchConfig(adaptive_windows=False, hedging=False)
            dispatcher = Dispatcher(HttpTransport(session, config.timeouts), lambda: snap,
                                    make_policy("capacity_weighted"), config=config)
            runner = web.AppRunner(Gateway(dispatcher, lambda: snap).app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port_out.put(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
            await asyncio.to_thread(stop.wait)
            await runner.cleanup()

    asyncio.run(main())


async def open_loop(url: str, rate: float, duration_s: float) -> tuple[list[float], int]:
    """Send at a fixed rate regardless of answers (open loop); returns latencies and errors."""
    latencies: list[float] = []
    errors = 0
    body = {"model": "bench-model", "prompt": "hello", "max_tokens": 1}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal errors
            start = time.perf_counter()
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
                        return
            except aiohttp.ClientError:
                errors += 1
                return
            latencies.append(time.perf_counter() - start)

        tasks = []
        start = time.perf_counter()
        n = int(rate * duration_s)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies, errors


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def spread(values: list[float]) -> str:
    """The median over repeats with its range: one run's p99 is one stall away from any figure."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


async def decisions_per_second(n: int = 200_000, servers: int = 64) -> float:
    """Placement decisions (policy choice + in-flight accounting) without I/O: acquire then release."""
    from fedpool.federation import Dispatcher, InferenceRequest, make_policy, new_session
    from fedpool.federation.core.types import Endpoint
    from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus

    entries = tuple(
        ServerEntry(ServerRecord(id=f"s{i}", url=f"http://127.0.0.1:{20000 + i}", engine=Engine.VLLM, model="m",
                                 capacity=8), ServerStatus.HEALTHY, 8, 1.0)
        for i in range(servers)
    )
    snap = PoolSnapshot(1, 0.0, entries)
    request = InferenceRequest("r", "m", Endpoint.COMPLETIONS, prompt="x")
    async with new_session() as session:
        dispatcher = Dispatcher(HttpTransport(session), lambda: snap,
                                make_policy("capacity_weighted", random.Random(0)))
        start = time.perf_counter()
        for _ in range(n):
            state, _ = await dispatcher._acquire(request, set())  # the decision path of submit(), minus HTTP
            dispatcher._release(state, request.client_id)
        return n / (time.perf_counter() - start)


class _Instant:
    """A Transport whose servers answer at once (the next loop turn): what is left is the dispatcher's own cost."""

    async def complete(self, server: Target, request: InferenceRequest,
                       progress: StreamProgress | None = None) -> Completion:
        await asyncio.sleep(0)
        return Completion("ok", "length", 4, 1)

    async def open_stream(self, server: Target, request: InferenceRequest) -> StreamBody:
        raise NotImplementedError


async def submit_cpu_us(servers: int, concurrency: int, requests: int = 20_000) -> float:
    """Process CPU time per request through `Dispatcher.submit` against instantly answering in-process servers:
    the whole request path (order, policy, accounting, learning, result) but the network."""
    from fedpool.federation import DispatchConfig, Dispatcher, Endpoint, make_policy
    from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus

    entries = tuple(ServerEntry(ServerRecord(id=f"s{i}", url=f"http://127.0.0.1:{20000 + i}", engine=Engine.VLLM,
                                             model="m", capacity=8), ServerStatus.HEALTHY, 8, 1.0)
                    for i in range(servers))
    snap = PoolSnapshot(1, 0.0, entries)
    dispatcher = Dispatcher(_Instant(), lambda: snap, make_policy("capacity_weighted", random.Random(0)),
                            config=DispatchConfig(hedging=False))
    pending = list(range(requests))

    async def worker() -> None:
        while pending:
            i = pending.pop()
            await dispatcher.submit(InferenceRequest(f"r{i}", "m", Endpoint.COMPLETIONS, prompt="question",
                                                     client_id=f"c{i % 4}"))

    for i in range(200):  # warm: learning and windows settle
        await dispatcher.submit(InferenceRequest(f"w{i}", "m", Endpoint.COMPLETIONS, prompt="q"))
    began = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - began) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[200.0, 1000.0], help="requests per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per rate, path and repeat")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each path per rate, alternating order")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    q: mp.Queue = ctx.Queue()
    emulator = ctx.Process(target=_serve, args=("emulator", q, stop, None), daemon=True)
    emulator.start()
    upstream = q.get(True, 60)
    gateway = ctx.Process(target=_serve, args=("gateway", q, stop, upstream), daemon=True)
    gateway.start()
    gateway_url = q.get(True, 60)
    rows, result = [], {}
    try:
        for rate in args.rates:
            asyncio.run(open_loop(upstream, rate, 1.0))  # warm both paths (connections, first-call costs);
            asyncio.run(open_loop(gateway_url, rate, 1.0))  # not counted
            arms: dict[str, list[float]] = {k: [] for k in ("d50", "d99", "v50", "v99", "a50", "a99")}
            errors = [0, 0]
            answered = []
            for repeat in range(args.repeats):
                # Alternate which arm goes first, so a slow stretch of the machine does not always land on one.
                order = [("direct", upstream), ("via", gateway_url)]
                if repeat % 2:
                    order.reverse()
                runs = {}
                for name, url in order:
                    runs[name] = asyncio.run(open_loop(url, rate, args.duration))
                (direct, d_err), (via, v_err) = runs["direct"], runs["via"]
                errors[0] += d_err
                errors[1] += v_err
                answered.append(len(via) / args.duration)
                for key, values in (("d", direct), ("v", via)):
                    arms[key + "50"].append(pct(values, 0.5))
                    arms[key + "99"].append(pct(values, 0.99))
                arms["a50"].append(arms["v50"][-1] - arms["d50"][-1])
                arms["a99"].append(arms["v99"][-1] - arms["d99"][-1])
                print(f"{rate:>6g} req/s  repeat {repeat + 1}: direct p50/p99 {arms['d50'][-1]:.2f} / "
                      f"{arms['d99'][-1]:.2f} ms  gateway {arms['v50'][-1]:.2f} / {arms['v99'][-1]:.2f} ms")
            rows.append((f"{rate:g}", f"{spread(arms['d50'])} / {spread(arms['d99'])}",
                         f"{spread(arms['v50'])} / {spread(arms['v99'])}",
                         f"{spread(arms['a50'])} / {spread(arms['a99'])}",
                         f"{errors[0]} / {errors[1]}", f"{statistics.median(answered):.0f}"))
            print(f"{rate:>6g} req/s  added p50 / p99 over {args.repeats} repeats: {rows[-1][3]} ms")
            result = {"gateway_p50_added_ms": f"{statistics.median(arms['a50']):.2f}",
                      "gateway_p99_added_ms": f"{statistics.median(arms['a99']):.2f}",
                      "gateway_p99_added_max_ms": f"{max(arms['a99']):.2f}", "repeats": str(args.repeats)}
    finally:
        stop.set()
        gateway.join(10)
        emulator.join(10)
    decisions = asyncio.run(decisions_per_second())
    print(f"dispatcher decisions per second (64 servers, capacity_weighted): {decisions:,.0f}")
    light = asyncio.run(submit_cpu_us(2, 1))
    full = asyncio.run(submit_cpu_us(256, 2 * 256 * 8))
    print(f"CPU per request through submit: {light:.1f} µs (2 servers, one at a time), {full:.1f} µs "
          f"(256 servers, twice their slots waiting)")
    body = (
        "An emulated vLLM-style server answering at once (decode time 0) in one process, the gateway (with "
        "its dispatcher, capacity_weighted, adaptive windows and hedging off) in another, and an open-loop "
        f"load generator in this one, all on the same machine. Each rate runs {args.repeats} times straight to "
        f"the server and {args.repeats} times through the gateway, the two arms alternating which goes first, "
        "after an uncounted second of each to warm the connections. A repeat's added latency is its gateway "
        "percentile minus its direct one; the table gives the median over repeats and, in brackets, the range. "
        f"Baseline: LiteLLM documents ~{LITELLM_MEDIAN_MS:g} ms median overhead at about 1k RPS with two "
        "instances; the target here is p50 ≤ 1 ms and p99 ≤ 5 ms added at 1,000 req/s.\n\n"
        + markdown_table(("rate (req/s)", "direct p50 / p99 (ms)", "via gateway p50 / p99 (ms)",
                          "added p50 / p99 (ms)", "errors direct / gateway", "gateway answers/s"), rows)
        + f"\n\nDispatcher placement decisions (policy choice + in-flight accounting, acquire + release, no I/O) "
        f"over 64 servers: {decisions:,.0f} per second on one core. The whole request path but the network "
        "(`submit` against in-process servers that answer at once: order, policy, accounting, learning, the "
        f"result), as process CPU time per request: {light:.1f} µs with 2 servers and one request at a time, "
        f"{full:.1f} µs with 256 servers and twice their slots waiting."
    )
    write_report("overhead", "Routing overhead", body, {
        **result, "dispatcher_decisions_per_s": f"{decisions:.0f}", "submit_cpu_us_2": f"{light:.1f}",
        "submit_cpu_us_256_saturated": f"{full:.1f}",
    })


if __name__ == "__main__":
    main()
