"""Gateway capacity: what one request through fedpool's gateway costs, beside a bare aiohttp pass-through proxy
(Python's floor for the same job) and HAProxy, over zero-latency nginx backends, driven by wrk, in one run.

    python -m fedpool.benchmarks.gateway_capacity [--repeats 3] [--seconds 8]

Backends: Debian's nginx, two ports (one worker) answering a fixed OpenAI completion body, /health, /v1/models
and a vLLM-style /metrics, registered in a real registry (local Ray) as two vLLM servers. Load: Debian's wrk,
one thread, 16 connections, POST /v1/completions with a small body. Paths (each its own process):

- direct: wrk against one nginx port;
- bare, bare+uvloop: `aiohttp` pass-through proxy (read the body, POST it round-robin to a backend on one shared
  session, answer its bytes), on asyncio's loop and on uvloop's;
- bare+keepalive: the same proxy on uvloop relaying through fedpool's own HTTP client (federation/gateway/transport.py,
  which the gateway's plain answers take) instead of aiohttp's: the floor of fedpool's data path, shown beside
  the headline's bare proxy (the issue's floor, aiohttp's client);
- fedpool: `fedpool gateway` (the CLI, as an operator runs it) over the registry;
- fedpool+asyncio, fedpool+uvloop: the same composition (registry client, PoolConnection, Gateway) started by
  this module, on asyncio's loop and on uvloop's (the CLI's loop is the CLI's choice);
- fedpool-noleases: that composition on asyncio's loop without capacity leases (`PoolConnection(leases=False)`),
  to show what the leases cost a gateway;
- haproxy: Debian's HAProxy, one thread, round-robin over both backends.

Per repeat, each path runs saturated (closed loop: 16 requests always outstanding) for `--seconds`: its rate, its
process CPU time per request (user + system of the proxy's process, over the run) and latency; then each path runs
paced at half of fedpool's own saturated rate of that repeat (wrk's `delay()`: exponential think time per
connection, so the rate is the same whatever a path's latency; a closed loop with think time still hides part of
a stall's queue, which wrk2 would show: not in Debian) and its p99 is compared with the direct path's (p99 added).
Paths run in turn within a repeat, so a busy moment of the shared machine falls on one path, not on all of them
in one repeat; the load average before and after each repeat is printed. With `--profile`, fedpool's composition and
the bare proxy run once more under cProfile and the report splits their CPU per request by component.

Writes benchmarks/results/gateway_capacity.md, ending with
`result: fedpool_rps=X bare_rps=X haproxy_rps=X fedpool_cpu_us=X bare_cpu_us=X p99_added_ms_half=X` (medians over
the repeats; bare: the better of its two loops, the strongest baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report

MODEL = "emu-model"
CONNECTIONS = 16
REQUEST_BODY = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 4, "temperature": 0})
ANSWER = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 1700000000, "model": MODEL,
                     "choices": [{"index": 0, "text": " one two three four", "logprobs": None,
                                  "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}, separators=(",", ":"))
PATHS = ("direct", "bare", "bare+uvloop", "bare+keepalive", "fedpool", "fedpool+asyncio", "fedpool+uvloop",
         "fedpool-noleases", "haproxy")


# ---- the proxies this module starts itself (each in its own process) ----------------------------------------
def serve_bare(port: int, backends: Sequence[str], loop: str, cprofile: Path | None = None,
               client: str = "aiohttp") -> None:
    """A bare aiohttp pass-through proxy: what any Python proxy of this shape costs at the least. `client`:
    aiohttp's, or fedpool's keep-alive pool (federation/gateway/transport.py)."""
    import aiohttp
    from aiohttp import web

    from fedpool.federation.gateway.transport import KeepAlivePool

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        pool = KeepAlivePool()
        rotation = itertools.cycle(backends)
        headers = {"Content-Type": "application/json"}

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            async with session.post(next(rotation) + request.path, data=body, headers=headers) as upstream:
                answer = await upstream.read()
                return web.Response(body=answer, status=upstream.status, content_type=upstream.content_type)

        async def forward_pooled(request: web.Request) -> web.Response:
            body = await request.read()
            upstream = await pool.post(next(rotation) + request.path, body, timeout_s=120.0, connect_s=5.0,
                                       limit=16 * 1024 * 1024)
            return web.Response(body=upstream.body, status=upstream.status, content_type="application/json")

        handler = forward_pooled if client == "keepalive" else forward

        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await _until_terminated()
        await runner.cleanup()
        pool.close()
        await session.close()

    _run(main(), loop, cprofile)


def serve_fedpool(port: int, address: str, state_dir: str, loop: str, leases: bool,
                  cprofile: Path | None = None) -> None:
    """What `fedpool gateway` composes (registry client, pool connection, gateway), on the given loop, with or
    without capacity leases."""

    async def main() -> None:
        import ray

        from fedpool.federation import DispatchConfig, PoolConnection
        from fedpool.federation.gateway.handlers import Gateway, serving
        from fedpool.registry import RegistryClient

        ray.init(address=address, namespace="fedpool", log_to_driver=False, logging_level=logging.ERROR)
        client = await RegistryClient.connect(state_dir=Path(state_dir))
        config = DispatchConfig(no_server_timeout_s=10.0, client_order="shortest_first")  # the CLI's
        async with PoolConnection(client, policy="capacity_weighted", config=config, leases=leases) as pool, \
                serving(Gateway(pool.dispatcher, lambda: pool.snapshot).app(), "127.0.0.1", port, backlog=1024):
            await _until_terminated()

    _run(main(), loop, cprofile)


def _run(coro: object, loop: str, cprofile: Path | None = None) -> None:
    """Run on the chosen loop; with `cprofile`, profile from SIGUSR1 to SIGUSR2 (then write the stats there)."""
    if cprofile is not None:
        import cProfile

        profiler = cProfile.Profile()

        def stop(*_: object) -> None:
            profiler.disable()
            profiler.dump_stats(cprofile)

        signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
        signal.signal(signal.SIGUSR2, stop)
    if loop == "uvloop":
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    else:
        asyncio.run(coro)  # type: ignore[arg-type]


async def _until_terminated() -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()


# ---- the parts this benchmark stands up -------------------------------------------------------------------------
def nginx_config(work: Path, ports: Sequence[int]) -> str:
    listens = "".join(f"    listen 127.0.0.1:{p};\n" for p in ports)
    metrics = 'vllm:num_requests_running{engine="0"} 0\\nvllm:num_requests_waiting{engine="0"} 0\\n'
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "nginx"}]})
    return (
        "worker_processes 1;\ndaemon off;\n"
        f"pid {work}/nginx.pid;\nerror_log {work}/nginx-error.log warn;\n"
        "events { worker_connections 4096; }\n"
        "http {\n  access_log off;\n  keepalive_requests 100000000;\n  keepalive_timeout 300s;\n"
        + "".join(f"  {kind}_temp_path {work}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                           "scgi"))
        + "  server {\n" + listens + "    default_type application/json;\n"
        "    location = /health { return 200 '{\"status\":\"ok\"}'; }\n"
        f"    location = /v1/models {{ return 200 '{models}'; }}\n"
        f"    location = /metrics {{ default_type text/plain; return 200 '{metrics}'; }}\n"
        f"    location = /v1/completions {{ return 200 '{ANSWER}'; }}\n"
        "  }\n}\n"
    )


@contextlib.contextmanager
def nginx(work: Path, ports: Sequence[int]) -> Iterator[list[psutil.Process]]:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    config = work / "nginx.conf"
    config.write_text(nginx_config(work, ports))
    proc = subprocess.Popen([binary, "-c", str(config), "-p", str(work)], stdout=subprocess.DEVNULL,
                            stderr=(work / "nginx.out").open("wb"))
    try:
        for port in ports:
            _wait_http(f"http://127.0.0.1:{port}/health", 20)
        yield psutil.Process(proc.pid).children() or [psutil.Process(proc.pid)]  # the worker does the work
    finally:
        proc.send_signal(signal.SIGQUIT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()


@contextlib.contextmanager
def registry(work: Path, backends: Sequence[str]) -> Iterator[tuple[str, Path]]:
    """Local Ray and a registry actor with the backends registered; yields (Ray address, state dir)."""
    import ray

    from fedpool.registry import Engine, RegistryClient, ServerRecord

    state = work / "registry"
    # A run before in the same --work-dir left its registry's state (the servers it registered, on ports of that
    # run's nginx): this run's registry starts empty.
    shutil.rmtree(state, ignore_errors=True)
    ray.init(address="local", num_cpus=1, namespace="fedpool", include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)

    async def start() -> RegistryClient:
        client = await RegistryClient.start(state, token=secrets.token_hex(16))
        for i, url in enumerate(backends):
            await client.register(ServerRecord(id=f"nginx-{i}", url=url, engine=Engine.VLLM, model=MODEL,
                                               accelerator="cpu", capacity=4096))
        return client

    client = asyncio.run(start())
    try:
        yield ray.get_runtime_context().gcs_address, state
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(client.terminate())
        ray.shutdown()


@contextlib.contextmanager
def process(argv: Sequence[str], log: Path, ready_url: str) -> Iterator[psutil.Process]:
    proc = subprocess.Popen(list(argv), stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_http(ready_url, 120, proc)
        time.sleep(2.0)  # a snapshot in hand, imports settled
        yield psutil.Process(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()


@contextlib.contextmanager
def haproxy(work: Path, port: int, backends: Sequence[str]) -> Iterator[psutil.Process | None]:
    binary = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if binary is None:
        yield None
        return
    servers = "\n".join(f"    server b{i} {u.removeprefix('http://')}" for i, u in enumerate(backends))
    config = work / "haproxy.cfg"
    config.write_text(
        "global\n    maxconn 5000\n    nbthread 1\n"
        "defaults\n    mode http\n    timeout connect 5s\n    timeout client 30s\n    timeout server 30s\n"
        "    option http-keep-alive\n"
        f"frontend fe\n    bind 127.0.0.1:{port}\n    default_backend be\n"
        f"backend be\n    balance roundrobin\n{servers}\n")
    with process([binary, "-f", str(config), "-db"], work / "haproxy.log", f"http://127.0.0.1:{port}/health") as p:
        yield p


def _wait_http(url: str, deadline_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args))} exited with {proc.returncode}")  # type: ignore[arg-type]
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {deadline_s:.0f} s")


# ---- load and measurement -----------------------------------------------------------------------------------
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
local think_ms = {think_ms}
function init(args) math.randomseed(os.time()) end
function delay()
  if think_ms <= 0 then return 0 end
  return math.floor(-math.log(1 - math.random()) * think_ms + 0.5)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max))
end
"""


@dataclass
class Run:
    path: str
    paced: bool
    requests: int = 0
    rps: float = 0.0
    errors: int = 0
    non_2xx: int = 0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    cpu_us: float = 0.0  # process CPU time per request of the path's own process(es)


def wrk(url: str, seconds: float, watch: Sequence[psutil.Process], work: Path, path: str,
        think_ms: float = 0.0) -> Run:
    script = work / f"wrk-{think_ms:g}.lua"
    script.write_text(WRK_SCRIPT.replace("{body}", REQUEST_BODY).replace("{think_ms}", f"{think_ms:.3f}"))
    before = sum(_cpu(p) for p in watch)
    done = subprocess.run(["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{seconds:g}s", "--timeout", "5s", "-s", str(script),
                           url + "/v1/completions"], capture_output=True, text=True, timeout=seconds + 60)
    after = sum(_cpu(p) for p in watch)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"wrk gave no result for {path}:\n{done.stdout}\n{done.stderr}")
    requests, duration_us, errors, non_2xx, p50, p90, p99, worst = map(int, line.split()[1:])
    return Run(path, think_ms > 0, requests, requests / (duration_us / 1e6), errors, non_2xx, p50 / 1000,
               p90 / 1000, p99 / 1000, worst / 1000, (after - before) * 1e6 / max(1, requests))


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


COMPONENTS = (  # (name, what a profiled function's file path contains), first match wins
    ("gateway (gateway/handlers.py, state.py, streams.py, auth.py, leases.py, pool.py)",
     ("federation/gateway/handlers", "federation/gateway/state", "federation/gateway/streams",
      "federation/gateway/auth", "federation/gateway/leases", "federation/gateway/pool")),
    ("transport, HTTP client and request types (gateway/transport.py, unpooled.py, answers.py, core/types.py)",
     ("federation/gateway/transport", "federation/gateway/unpooled", "federation/gateway/answers",
      "federation/core/types")),
    ("dispatcher and its books (dispatcher, routes, serverbook, ledger, policies, ...)", ("federation/",)),
    ("prometheus_client", ("prometheus_client",)),
    ("aiohttp (the server; the bare proxy's client too)", ("aiohttp", "multidict", "yarl")),
    ("asyncio (loop, handles, futures)", ("asyncio", "selectors.py")),
)


def profile_paths(urls: dict[str, str], pids: dict[str, int], seconds: float, work: Path) -> list[list[str]]:
    """Each profiled path (its launcher started with --cprofile) under saturated wrk: profiled µs and Python calls
    per request by component. cProfile inflates call-heavy code about twofold: the split is the finding."""
    import pstats

    shares: dict[str, dict[str, tuple[float, float]]] = {}
    for name, url in urls.items():
        out = work / f"{name}.prof"
        os.kill(pids[name], signal.SIGUSR1)
        run = wrk(url, seconds, [], work, name)
        os.kill(pids[name], signal.SIGUSR2)
        for _ in range(50):
            if out.exists():
                break
            time.sleep(0.1)
        time.sleep(0.5)
        per: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for (path, _, function), (_, calls, own, _, _) in pstats.Stats(str(out)).stats.items():  # type: ignore[attr-defined]
            if path == "~":
                part = "C functions: socket sends" if "send" in function and "socket" in function else \
                    "C functions: the rest"
            else:
                part = next((n for n, keys in COMPONENTS if any(k in path for k in keys)), "other Python")
            per[part][0] += own * 1e6 / max(1, run.requests)
            per[part][1] += calls / max(1, run.requests)
        shares[name] = {k: (v[0], v[1]) for k, v in per.items()}
    parts = sorted({p for s in shares.values() for p in s}, key=lambda p: -max(s.get(p, (0, 0))[0]
                                                                                for s in shares.values()))
    rows = [[part, *(f"{shares[n].get(part, (0.0, 0.0))[0]:.1f} µs, {shares[n].get(part, (0.0, 0.0))[1]:.0f} calls"
                     for n in urls)] for part in parts]
    rows.append(["total", *(f"{sum(v[0] for v in shares[n].values()):.1f} µs, "
                            f"{sum(v[1] for v in shares[n].values()):.0f} calls" for n in urls)])
    return rows


# ---- the benchmark -------------------------------------------------------------------------------------------
@dataclass
class Measured:
    runs: list[Run] = field(default_factory=list)
    loads: list[tuple[str, str]] = field(default_factory=list)  # (before, after) each repeat
    profile: list[list[str]] = field(default_factory=list)
    profiled: tuple[str, ...] = ()
    missing: dict[str, str] = field(default_factory=dict)


def run(args: argparse.Namespace, work: Path) -> Measured:
    from fedpool.deploy.process import free_port

    measured = Measured()
    backend_ports = [free_port(), free_port()]
    backends = [f"http://127.0.0.1:{p}" for p in backend_ports]
    me = [sys.executable, "-m", "fedpool.benchmarks.gateway_capacity"]
    with contextlib.ExitStack() as stack:
        workers = stack.enter_context(nginx(work, backend_ports))
        address, state = stack.enter_context(registry(work, backends))
        urls: dict[str, str] = {"direct": backends[0]}
        watch: dict[str, list[psutil.Process]] = {"direct": workers}
        for name in args.paths:
            if name == "direct":
                continue
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            ready = url + "/health"
            if name.startswith("bare"):
                loop = "asyncio" if name == "bare" else "uvloop"
                client = "keepalive" if name == "bare+keepalive" else "aiohttp"
                proc = stack.enter_context(process([*me, "bare", "--port", str(port), "--backends", *backends,
                                                    "--loop", loop, "--client", client], work / f"{name}.log",
                                                   url + "/nothing"))
            elif name == "fedpool":
                proc = stack.enter_context(process(
                    [sys.executable, "-m", "fedpool.cli", "gateway", "--address", address, "--state-dir", str(state),
                     "--port", str(port), "--quiet"], work / "fedpool.log", ready))
            elif name in ("fedpool+asyncio", "fedpool+uvloop", "fedpool-noleases"):
                options = {"fedpool+asyncio": ["--loop", "asyncio"], "fedpool+uvloop": ["--loop", "uvloop"],
                           "fedpool-noleases": ["--loop", "asyncio", "--no-leases"]}[name]
                proc = stack.enter_context(process(
                    [*me, "fedpool", "--port", str(port), "--address", address, "--state-dir", str(state),
                     *options], work / f"{name}.log", ready))
            elif name == "haproxy":
                found = stack.enter_context(haproxy(work, port, backends))
                if found is None:
                    measured.missing[name] = "haproxy is not installed (apt-get install haproxy)"
                    continue
                proc = found
            else:
                raise ValueError(f"unknown path {name}")
            urls[name], watch[name] = url, [proc]
        paths = [p for p in args.paths if p in urls]
        for repeat in range(args.repeats):
            before = load_average()
            saturated = {}
            for name in paths:
                saturated[name] = wrk(urls[name], args.seconds, watch[name], work, name)
                measured.runs.append(saturated[name])
                _say(repeat, saturated[name])
            half = saturated["fedpool"].rps / 2 if "fedpool" in saturated else 500.0
            think_ms = CONNECTIONS / half * 1000
            for name in paths:
                paced = wrk(urls[name], args.seconds, watch[name], work, name, think_ms=think_ms)
                measured.runs.append(paced)
                _say(repeat, paced)
            measured.loads.append((before, load_average()))
            print(f"[capacity] repeat {repeat + 1}: load average {before} -> {measured.loads[-1][1]}", flush=True)
        if args.profile:
            profiled = {}
            for name, role, extra in (("fedpool", "fedpool", ["--address", address, "--state-dir", str(state),
                                                              "--loop", "asyncio"]),
                                      ("bare", "bare", ["--backends", *backends, "--loop", "asyncio"])):
                port = free_port()
                ready = f"http://127.0.0.1:{port}" + ("/health" if role == "fedpool" else "/nothing")
                proc = stack.enter_context(process([*me, role, "--port", str(port), "--cprofile",
                                                    str(work / f"{name}.prof"), *extra], work / f"{name}-prof.log",
                                                   ready))
                profiled[name] = (f"http://127.0.0.1:{port}", proc.pid)
            measured.profiled = tuple(profiled)
            measured.profile = profile_paths({n: u for n, (u, _) in profiled.items()},
                                             {n: pid for n, (_, pid) in profiled.items()}, args.seconds, work)
    return measured


def _say(repeat: int, r: Run) -> None:
    print(f"[capacity] {repeat + 1} {r.path:<15} {'paced' if r.paced else 'saturated':<9} {r.rps:8.0f} req/s "
          f"cpu {r.cpu_us:6.1f} us/req p50 {r.p50_ms:6.2f} p99 {r.p99_ms:7.2f} max {r.max_ms:7.1f} ms "
          f"errors {r.errors} non-2xx {r.non_2xx}", flush=True)


def _spread(values: Sequence[float], fmt: str = "{:.0f}") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def _median(runs: Sequence[Run], path: str, paced: bool, attr: str) -> float:
    values = [getattr(r, attr) for r in runs if r.path == path and r.paced == paced]
    return statistics.median(values) if values else float("nan")


def added_p99(runs: Sequence[Run], path: str) -> list[float]:
    """Per repeat: the path's paced p99 minus the direct path's in the same repeat."""
    mine = [r.p99_ms for r in runs if r.path == path and r.paced]
    direct = [r.p99_ms for r in runs if r.path == "direct" and r.paced]
    return [a - b for a, b in zip(mine, direct, strict=False)]


def body(measured: Measured, args: argparse.Namespace) -> str:
    runs = measured.runs
    paths = list(dict.fromkeys(r.path for r in runs))
    fed_rps = _median(runs, "fedpool", False, "rps")
    lines = [
        f"Backends: nginx (1 worker, two ports) answering a fixed completion body, registered as two vLLM servers "
        f"in a real registry (local Ray). Load: wrk, 1 thread, {CONNECTIONS} connections, {args.seconds:g} s a run, "
        f"{args.repeats} repeats; paths in turn within each repeat. Everything on this machine's {os.cpu_count()} "
        "cores: wrk, nginx, the proxy under test, Ray, and whatever else the machine runs (load averages below).",
        "",
        "## Saturated (closed loop, 16 outstanding)",
        "",
        "Median over the repeats (min–max). CPU: the path's own process, user + system, per request answered.",
        "",
        markdown_table(
            ["path", "req/s", "CPU µs/request", "p50 ms", "p99 ms", "max ms", "errors", "non-2xx"],
            [[p, _spread([r.rps for r in runs if r.path == p and not r.paced]),
              _spread([r.cpu_us for r in runs if r.path == p and not r.paced], "{:.1f}"),
              _spread([r.p50_ms for r in runs if r.path == p and not r.paced], "{:.2f}"),
              _spread([r.p99_ms for r in runs if r.path == p and not r.paced], "{:.2f}"),
              _spread([r.max_ms for r in runs if r.path == p and not r.paced], "{:.1f}"),
              sum(r.errors for r in runs if r.path == p), sum(r.non_2xx for r in runs if r.path == p)]
             for p in paths]),
        "",
        f"## Paced at half of fedpool's saturated rate (~{fed_rps / 2:.0f} req/s)",
        "",
        "p99 added: the path's p99 minus the direct path's in the same repeat.",
        "",
        markdown_table(
            ["path", "req/s", "CPU µs/request", "p50 ms", "p99 ms", "p99 added ms", "max ms"],
            [[p, _spread([r.rps for r in runs if r.path == p and r.paced]),
              _spread([r.cpu_us for r in runs if r.path == p and r.paced], "{:.1f}"),
              _spread([r.p50_ms for r in runs if r.path == p and r.paced], "{:.2f}"),
              _spread([r.p99_ms for r in runs if r.path == p and r.paced], "{:.2f}"),
              "-" if p == "direct" else _spread(added_p99(runs, p), "{:+.2f}"),
              _spread([r.max_ms for r in runs if r.path == p and r.paced], "{:.1f}")] for p in paths]),
        "",
        "## Machine load (1, 5, 15 min load averages, before → after each repeat)",
        "",
        *[f"- repeat {i + 1}: {a} → {b}" for i, (a, b) in enumerate(measured.loads)],
        "",
    ]
    for name, why in measured.missing.items():
        lines += [f"- {name}: not measured ({why})"]
    if measured.profile:
        lines += ["## Where the CPU goes: fedpool beside the bare proxy (cProfile, saturated)", "",
                  "Both on asyncio's loop, each profiled (cProfile) through one more saturated run: profiled µs of "
                  "the functions' own time and Python calls, per request, by component. cProfile inflates "
                  "call-heavy code about twofold, so the split, not the sum, is the finding; fedpool here is the "
                  "same composition as the CLI's (registry client, capacity leases, gateway), started by this "
                  "module.", "",
                  markdown_table(["component", *measured.profiled], measured.profile), ""]
    return "\n".join(lines)


def headline(measured: Measured) -> dict[str, object]:
    runs = measured.runs
    bares = [p for p in ("bare", "bare+uvloop") if any(r.path == p for r in runs)]
    bare = max(bares, key=lambda p: _median(runs, p, False, "rps"), default="bare")  # the strongest baseline
    bare_cpu = min((_median(runs, p, False, "cpu_us") for p in bares), default=float("nan"))
    added = added_p99(runs, "fedpool")
    return {
        "fedpool_rps": f"{_median(runs, 'fedpool', False, 'rps'):.0f}",
        "bare_rps": f"{_median(runs, bare, False, 'rps'):.0f}",
        "haproxy_rps": f"{_median(runs, 'haproxy', False, 'rps'):.0f}",
        "fedpool_cpu_us": f"{_median(runs, 'fedpool', False, 'cpu_us'):.1f}",
        "bare_cpu_us": f"{bare_cpu:.1f}",
        "p99_added_ms_half": f"{statistics.median(added):.2f}" if added else "nan",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway_capacity", description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="role")
    bare = sub.add_parser("bare", help="(internal) run the bare pass-through proxy")
    bare.add_argument("--port", type=int, required=True)
    bare.add_argument("--backends", nargs="+", required=True)
    bare.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    bare.add_argument("--cprofile", type=Path)
    bare.add_argument("--client", choices=("aiohttp", "keepalive"), default="aiohttp")
    fed = sub.add_parser("fedpool", help="(internal) run fedpool's gateway on a chosen loop")
    fed.add_argument("--port", type=int, required=True)
    fed.add_argument("--address", required=True)
    fed.add_argument("--state-dir", required=True)
    fed.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop")
    fed.add_argument("--no-leases", dest="leases", action="store_false")
    fed.add_argument("--cprofile", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--profile", action="store_true", help="cProfile fedpool and the bare proxy (one more run)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args(argv)
    if args.role == "bare":
        serve_bare(args.port, args.backends, args.loop, args.cprofile, args.client)
        return 0
    if args.role == "fedpool":
        serve_fedpool(args.port, args.address, args.state_dir, args.loop, args.leases, args.cprofile)
        return 0
    if shutil.which("wrk") is None or (shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists()):
        print("needs Debian's wrk and nginx: apt-get install wrk nginx haproxy", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fedpool-capacity-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        measured = run(args, work)
    result = headline(measured)
    path = write_report("gateway_capacity", "Gateway capacity: fedpool beside a bare aiohttp proxy, HAProxy and "
                        "the direct path", body(measured, args), result, results_dir=args.results_dir)
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
