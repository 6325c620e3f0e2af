"""Gateway capacity, side by side with what users put in front of their engines today: the direct path,
fedpool's gateway (1, 2 and 4 processes on one port), HAProxy round-robin and LiteLLM's proxy, over the same
zero-latency emulated backends, driven by the same open-loop load generator.

    python -m fedpool.benchmarks.gateway_capacity

Backends: two emulated servers (profile `instant`: no engine time, so what a proxy adds is all there is),
started by `fedpool up --engine emulated` with its gateway. Load: one generator process, open loop (requests
sent on schedule whatever the answers do, one every 1/rate s), non-streaming completions of 4 tokens (and a
streaming sweep), at most 512 connections, a 5 s timeout. Per rate: 1 s warm-up, 4 s measured. "Added" latency
is the proxy's p50/p99 minus the direct path's at the same rate, measured in the same run. The sustained rate
of a path is the highest swept rate with every request answered 200, at least 95% of the offered rate achieved
and its p99 no more than 10 ms above the direct path's (the direct path: p99 under 10 ms). Overload: the
same path at 1.5x and 2x its sustained rate; goodput is the 200s per second, and the excess should be refused
at once (429/503 with Retry-After) with file descriptors bounded.

HAProxy is Debian's `haproxy` (`apt-get install haproxy`; what NVIDIA's NeMo Evaluator puts in front of its
instances), LiteLLM's proxy is `litellm[proxy]` in its own venv (`scripts/install_tools.sh`); a path whose
tool is missing is reported as such. Writes benchmarks/results/gateway_capacity.md, ending with
`result: fedpool_rps=X direct_rps=X haproxy_rps=X litellm_rps=X overload_goodput_ratio=X
fedpool_p99_added_ms_1k=X haproxy_p50_added_ms=X fedpool_p50_added_ms=X`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report

MODEL = "emu-model"
# This run's key, fresh each run and never written to a report; in the environment so that the load-generator
# processes (which import this module again) present the same one.
LOADGEN_KEY = os.environ.setdefault("FEDPOOL_BENCH_LOADGEN_KEY", "sk-" + secrets.token_hex(32))
RATES = (250, 500, 1000, 1500, 2000, 2500, 3000)
LITELLM_RATES = (25, 50, 100, 200, 400)
WARMUP_S = 1.0
MEASURE_S = 4.0
TIMEOUT_S = 5.0
CONNECTIONS = 512
ADDED_P99_LIMIT_MS = 10.0
TOOLS_HOME = Path.home() / ".cache" / "fedpool" / "tools"


# ---- the load generator (its own process) -----------------------------------------------------------------
@dataclass
class Sample:
    rate: float
    stream: bool
    offered: int = 0
    achieved_rps: float = 0.0
    ok: int = 0
    refused: int = 0  # 429 / 503: shed at once
    failed: int = 0  # other statuses, timeouts, connection errors
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    refused_p99_ms: float = 0.0
    goodput_rps: float = 0.0
    cpu_ms_per_request: float = 0.0
    max_fds: int = 0
    statuses: dict[str, int] = field(default_factory=dict)


async def _generate(urls: Sequence[str], rate: float, stream: bool) -> dict[str, Any]:
    import aiohttp

    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "temperature": 0, "stream": stream}
    connector = aiohttp.TCPConnector(limit=CONNECTIONS, force_close=False)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    results: list[tuple[float, int, float]] = []  # (scheduled time, status, latency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int, at: float) -> None:
            url = urls[i % len(urls)] + "/v1/completions"
            start = time.perf_counter()
            status = 0
            try:
                async with session.post(url, json=body, headers={"Authorization": f"Bearer {LOADGEN_KEY}"}) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError, OSError):
                status = 0
            results.append((at, status, time.perf_counter() - start))

        loop = asyncio.get_running_loop()
        total = int(rate * (WARMUP_S + MEASURE_S))
        began = loop.time()
        tasks = []
        lateness = 0.0
        for i in range(total):
            at = began + i / rate
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lateness = max(lateness, -delay)
            tasks.append(asyncio.create_task(one(i, at - began)))
        sent_for = loop.time() - began
        await asyncio.gather(*tasks)
    return {"results": results, "sent_for": sent_for, "lateness": lateness, "total": total}


def _loadgen_main(urls: list[str], rate: float, stream: bool, out: str) -> None:
    data = asyncio.run(_generate(urls, rate, stream))
    Path(out).write_text(json.dumps(data))


def drive(urls: Sequence[str], rate: float, stream: bool, watch: Sequence[psutil.Process]) -> Sample:
    """One measured point: the generator in its own process; the target processes' CPU and fds watched."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    ctx = mp.get_context("spawn")
    cpu_before = sum(_cpu(p) for p in watch)
    proc = ctx.Process(target=_loadgen_main, args=(list(urls), rate, stream, out))
    proc.start()
    max_fds = 0
    while proc.is_alive():
        max_fds = max(max_fds, sum(_fds(p) for p in watch))
        proc.join(0.2)
    cpu_after = sum(_cpu(p) for p in watch)
    data = json.loads(Path(out).read_text())
    os.unlink(out)
    measured = [(at, status, lat) for at, status, lat in data["results"] if at >= WARMUP_S]
    ok = [lat for _, status, lat in measured if status == 200]
    refused = [lat for _, status, lat in measured if status in (429, 503)]
    statuses: dict[str, int] = {}
    for _, status, _ in measured:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    offered = len(measured)
    sample = Sample(rate=rate, stream=stream, offered=offered,
                    achieved_rps=data["total"] / max(data["sent_for"], 1e-9), ok=len(ok), refused=len(refused),
                    failed=offered - len(ok) - len(refused), max_fds=max_fds, statuses=statuses)
    if ok:
        ordered = sorted(ok)
        sample.p50_ms = statistics.median(ordered) * 1000
        sample.p99_ms = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000
    if refused:
        ordered = sorted(refused)
        sample.refused_p99_ms = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000
    sample.goodput_rps = len(ok) / MEASURE_S
    sample.cpu_ms_per_request = (cpu_after - cpu_before) * 1000 / max(1, data["total"])
    return sample


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system + sum(c.cpu_times().user + c.cpu_times().system
                                       for c in p.children(recursive=True) if c.name().startswith("python"))
    except psutil.Error:
        return 0.0


def _fds(p: psutil.Process) -> int:
    try:
        return p.num_fds()
    except psutil.Error:
        return 0


# ---- the paths ---------------------------------------------------------------------------------------------
@dataclass
class Path_:
    name: str
    urls: list[str]
    processes: list[psutil.Process]
    note: str = ""


def _fedpool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedpool.cli", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


@contextlib.contextmanager
def fedpool_up(work: Path, port: int) -> Iterator[dict[str, Any]]:
    state = work / "up"
    done = _fedpool("up", "--engine", "emulated", "--profile", "instant", "--servers", "2", "--slots", "4096",
                    "--port", str(port), "--state-dir", str(state), "--detach")
    if done.returncode != 0:
        raise RuntimeError(f"fedpool up failed:\n{done.stdout}\n{done.stderr}")
    ready = json.loads((state / "up.json").read_text())
    try:
        listed = _fedpool("server", "list", "--json", "--address", ready["ray_address"], "--state-dir",
                          str(state / "registry"), "--quiet")
        servers = json.loads(listed.stdout)
        rows = servers["servers"] if isinstance(servers, dict) else servers
        ready["backends"] = sorted(r["url"] for r in rows)
        yield ready
    finally:
        _fedpool("down", "--state-dir", str(state))


@contextlib.contextmanager
def gateway_processes(ready: dict[str, Any], port: int, count: int, work: Path) -> Iterator[list[psutil.Process]]:
    procs = []
    logs = []
    for i in range(count):
        log = (work / f"gateway-{count}-{i}.log").open("wb")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fedpool.cli", "gateway", "--address", ready["ray_address"], "--state-dir",
             str(Path(ready["state_dir"]) / "registry"), "--port", str(port), "--reuse-port", "--quiet"],
            stdout=log, stderr=subprocess.STDOUT))
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 60)
        time.sleep(2.0 * count)  # every process bound and holding a snapshot
        yield [psutil.Process(p.pid) for p in procs]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()


@contextlib.contextmanager
def haproxy(backends: Sequence[str], port: int, work: Path) -> Iterator[psutil.Process | None]:
    binary = shutil.which("haproxy")
    if binary is None:
        yield None
        return
    servers = "\n".join(f"    server b{i} {u.removeprefix('http://')}" for i, u in enumerate(backends))
    cfg = work / "haproxy.cfg"
    # maxconn 5000 (more than any rate here keeps open): HAProxy reserves two descriptors per connection and
    # refuses to start (it printed nothing) when that exceeds the hard open-files limit, 20,000 on this machine.
    cfg.write_text(
        "global\n    maxconn 5000\n    nbthread 1\n"
        "defaults\n    mode http\n    timeout connect 5s\n    timeout client 30s\n    timeout server 30s\n"
        "    option http-keep-alive\n"
        f"frontend fe\n    bind 127.0.0.1:{port}\n    default_backend be\n"
        f"backend be\n    balance roundrobin\n{servers}\n")
    proc = subprocess.Popen([binary, "-f", str(cfg), "-db"], stdout=(work / "haproxy.log").open("wb"),
                            stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", 20)
        yield psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def litellm(backends: Sequence[str], port: int, work: Path) -> Iterator[psutil.Process | None]:
    binary = TOOLS_HOME / "litellm" / "bin" / "litellm"
    if not binary.exists():
        yield None
        return
    deployments = "\n".join(
        f"  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n      api_base: {u}/v1\n"
        f"      api_key: sk-unused" for u in backends)
    cfg = work / "litellm.yaml"
    cfg.write_text(f"model_list:\n{deployments}\nrouter_settings:\n  routing_strategy: simple-shuffle\n"
                   "litellm_settings:\n  drop_params: true\n  telemetry: false\n")
    # LiteLLM 1.108 refuses to start without a strong master key; the load generator presents it on every path
    # (the others ignore it, or take it as the client's name).
    env = {**os.environ, "LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "true", "LITELLM_TELEMETRY": "False",
           "LITELLM_MASTER_KEY": LOADGEN_KEY}
    proc = subprocess.Popen([str(binary), "--config", str(cfg), "--port", str(port), "--host", "127.0.0.1",
                             "--num_workers", "1"], stdout=(work / "litellm.log").open("wb"),
                            stderr=subprocess.STDOUT, env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health/liveliness", 120)
        yield psutil.Process(proc.pid)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()


def _wait_http(url: str, deadline_s: float) -> None:
    import urllib.error
    import urllib.request

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {deadline_s:.0f} s")


# ---- the benchmark ---------------------------------------------------------------------------------------
@dataclass
class PathResult:
    name: str
    sweep: list[Sample]
    stream_sweep: list[Sample] = field(default_factory=list)
    overload: list[Sample] = field(default_factory=list)
    sustained: float = 0.0
    missing: str = ""


def sustained_rate(sweep: Sequence[Sample], direct: dict[float, Sample] | None) -> float:
    best = 0.0
    for s in sweep:
        base = direct.get(s.rate) if direct is not None else None
        added = s.p99_ms - (base.p99_ms if base else 0.0)
        good = (s.ok == s.offered and s.achieved_rps >= 0.95 * s.rate
                and (added <= ADDED_P99_LIMIT_MS if direct is not None else s.p99_ms <= ADDED_P99_LIMIT_MS))
        if good:
            best = max(best, s.rate)
        else:
            break
    return best


def _why_not_sustained(result: PathResult, direct: dict[float, Sample]) -> str:
    """For a path that sustained no swept rate: what its lowest rate missed (the criterion's terms)."""
    if result.sustained or not result.sweep:
        return ""
    first = result.sweep[0]
    base = direct.get(first.rate, direct[min(direct)]) if direct else None
    misses = []
    if first.ok != first.offered:
        misses.append(f"{first.ok}/{first.offered} answered 200")
    if first.achieved_rps < 0.95 * first.rate:
        misses.append(f"sent {first.achieved_rps:.0f}/s")
    added = first.p99_ms - (base.p99_ms if base else 0.0)
    if added > ADDED_P99_LIMIT_MS:
        misses.append(f"p99 {added:+.1f} ms over direct (limit +{ADDED_P99_LIMIT_MS:.0f})")
    return (f"at its lowest rate, {first.rate:.0f}/s: " + ", ".join(misses)
            + f"; {first.cpu_ms_per_request:.1f} ms CPU a request")


def sweep(urls: Sequence[str], rates: Sequence[float], watch: Sequence[psutil.Process], label: str,
          stream: bool = False, stop_after_failures: bool = True) -> list[Sample]:
    out = []
    for rate in rates:
        s = drive(urls, rate, stream, watch)
        out.append(s)
        print(f"[capacity] {label:<14} {'stream' if stream else 'plain '} {rate:6.0f}/s: ok {s.ok}/{s.offered} "
              f"refused {s.refused} failed {s.failed} p50 {s.p50_ms:6.2f} ms p99 {s.p99_ms:7.2f} ms "
              f"sent {s.achieved_rps:6.0f}/s fds {s.max_fds}", flush=True)
        if stop_after_failures and (s.failed + s.refused > 0.05 * max(1, s.offered) or s.p99_ms > 1000):
            break
    return out


def run(args: argparse.Namespace, work: Path) -> dict[str, PathResult]:
    from fedpool.deploy.process import free_port

    results: dict[str, PathResult] = {}
    with fedpool_up(work, free_port()) as ready:
        backends = ready["backends"]
        up_proc = psutil.Process(ready["pid"])
        backend_procs = [c for c in up_proc.children(recursive=True) if "fedpool.deploy.emulator" in " ".join(
            _cmdline(c))]
        direct = PathResult("direct", sweep(backends, args.rates, backend_procs, "direct"))
        direct.stream_sweep = sweep(backends, args.stream_rates, backend_procs, "direct", stream=True)
        direct.sustained = sustained_rate(direct.sweep, None)
        results["direct"] = direct
        by_rate = {s.rate: s for s in direct.sweep}
        for count in args.processes:
            port = free_port()
            name = "fedpool" if count == 1 else f"fedpool x{count}"
            with gateway_processes(ready, port, count, work) as procs:
                url = [f"http://127.0.0.1:{port}"]
                result = PathResult(name, sweep(url, args.rates, procs, name))
                result.sustained = sustained_rate(result.sweep, by_rate)
                if count == 1:
                    result.stream_sweep = sweep(url, args.stream_rates, procs, name, stream=True)
                    if result.sustained:
                        result.overload = sweep(url, [1.5 * result.sustained, 2.0 * result.sustained], procs,
                                                name + " over", stop_after_failures=False)
                results[name] = result
        port = free_port()
        with haproxy(backends, port, work) as proc:
            if proc is None:
                results["haproxy"] = PathResult("haproxy", [], missing="haproxy is not installed")
            else:
                result = PathResult("haproxy", sweep([f"http://127.0.0.1:{port}"], args.rates, [proc], "haproxy"))
                result.sustained = sustained_rate(result.sweep, by_rate)
                result.stream_sweep = sweep([f"http://127.0.0.1:{port}"], args.stream_rates, [proc], "haproxy",
                                            stream=True)
                results["haproxy"] = result
        port = free_port()
        with litellm(backends, port, work) as proc:
            if proc is None:
                results["litellm"] = PathResult("litellm", [], missing="litellm[proxy] is not installed")
            else:
                result = PathResult("litellm", sweep([f"http://127.0.0.1:{port}"], LITELLM_RATES, [proc], "litellm"))
                result.sustained = sustained_rate(result.sweep, None if not by_rate else {
                    r: by_rate.get(r, by_rate[min(by_rate)]) for r in LITELLM_RATES})
                results["litellm"] = result
    return results


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _at(sweep_: Sequence[Sample], rate: float) -> Sample | None:
    return next((s for s in sweep_ if s.rate == rate), None)


def body(results: dict[str, PathResult], args: argparse.Namespace) -> str:
    direct = {s.rate: s for s in results["direct"].sweep}
    lines = [
        f"Backends: 2 emulated servers (profile `instant`) behind `fedpool up --engine emulated`. Load: one open-loop "
        f"generator process, up to {CONNECTIONS} connections, {TIMEOUT_S:.0f} s timeout, {WARMUP_S:.0f} s warm-up + "
        f"{MEASURE_S:.0f} s measured per rate; everything on this machine's 2 cores (generator, proxy, backends).",
        "",
        "## Sustained rates",
        "",
        markdown_table(["path", "sustained req/s", "vs direct", "note"],
                       [[r.name, f"{r.sustained:.0f}" if not r.missing else "-",
                         f"{r.sustained / results['direct'].sustained:.2f}" if r.sustained and results[
                             "direct"].sustained else "-", r.missing or _why_not_sustained(r, direct)]
                        for r in results.values()]),
        "",
        "## Every point (non-streaming)",
        "",
    ]
    rows = []
    for r in results.values():
        for s in r.sweep:
            base = direct.get(s.rate)
            rows.append([r.name, f"{s.rate:.0f}", f"{s.achieved_rps:.0f}", f"{s.ok}/{s.offered}", s.refused, s.failed,
                         f"{s.p50_ms:.2f}", f"{s.p99_ms:.2f}",
                         f"{s.p50_ms - base.p50_ms:+.2f}" if base and r.name != "direct" else "-",
                         f"{s.p99_ms - base.p99_ms:+.2f}" if base and r.name != "direct" else "-",
                         f"{s.cpu_ms_per_request:.2f}", s.max_fds])
    lines += [markdown_table(["path", "offered/s", "sent/s", "200", "refused", "failed", "p50 ms", "p99 ms",
                              "added p50", "added p99", "CPU ms/req (path)", "max fds"], rows), ""]
    rows = []
    for r in results.values():
        for s in r.stream_sweep:
            rows.append([r.name, f"{s.rate:.0f}", f"{s.ok}/{s.offered}", s.refused, s.failed, f"{s.p50_ms:.2f}",
                         f"{s.p99_ms:.2f}"])
    if rows:
        lines += ["## Streaming", "", markdown_table(["path", "offered/s", "200", "refused", "failed", "p50 ms",
                                                       "p99 ms"], rows), ""]
    fed = results.get("fedpool")
    if fed is not None and fed.overload:
        rows = [[f"{s.rate:.0f} ({s.rate / fed.sustained:.1f}x)", f"{s.goodput_rps:.0f}",
                 f"{s.goodput_rps / fed.sustained:.2f}", s.refused, f"{s.refused_p99_ms:.1f}", s.failed,
                 f"{s.p99_ms:.1f}", s.max_fds, json.dumps(s.statuses)] for s in fed.overload]
        lines += ["## Overload (fedpool, one process)", "",
                  markdown_table(["offered/s", "goodput/s", "÷ sustained", "refused at once", "refusal p99 ms",
                                  "failed", "p99 of 200s ms", "max fds", "statuses"], rows), ""]
    return "\n".join(lines)


def headline(results: dict[str, PathResult]) -> dict[str, object]:
    direct = {s.rate: s for s in results["direct"].sweep}
    fed = results.get("fedpool")
    hap = results.get("haproxy")

    def added(r: PathResult | None, rate: float, key: str) -> str:
        s = _at(r.sweep, rate) if r is not None else None
        base = direct.get(rate)
        return f"{getattr(s, key) - getattr(base, key):.2f}" if s is not None and base is not None else "nan"

    overload = min((s.goodput_rps / fed.sustained for s in fed.overload), default=0.0) if fed and fed.sustained else 0.0
    return {
        "fedpool_rps": f"{fed.sustained:.0f}" if fed else "0",
        "direct_rps": f"{results['direct'].sustained:.0f}",
        "haproxy_rps": f"{hap.sustained:.0f}" if hap and not hap.missing else "nan",
        "litellm_rps": f"{results['litellm'].sustained:.0f}" if not results["litellm"].missing else "nan",
        "overload_goodput_ratio": f"{overload:.2f}",
        "fedpool_p99_added_ms_1k": added(fed, 1000, "p99_ms"),
        "haproxy_p50_added_ms": added(hap, 1000, "p50_ms"),
        "fedpool_p50_added_ms": added(fed, 1000, "p50_ms"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway_capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--stream-rates", type=float, nargs="+", default=[500, 1000])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedpool-capacity-") as tmp:
        results = run(args, args.work_dir or Path(tmp))
    result = headline(results)
    path = write_report("gateway_capacity", "Gateway capacity: fedpool, HAProxy, LiteLLM and the direct path",
                        body(results, args), result, results_dir=args.results_dir)
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
