"""Gateway soak: `fedpool gateway` under steady mixed load for an hour, with servers killed and restarted, its
memory sampled and every error explained.

    python -m fedpool.benchmarks.gateway_soak                 # one hour (what the report's result needs)
    python -m fedpool.benchmarks.gateway_soak --minutes 5     # a short run, to check the soak itself

The pool: three emulated vLLM servers (separate processes, replicas: same model and revision) registered in a real
registry (local Ray), and the real `fedpool gateway` process in front of them, as an operator runs it. The load:
one open-loop generator (a request every 1/`--rate` s, at most `--concurrency` in flight) mixing completions
(40%), chat (30%) and streams (30%, completions and chat), a tenth of the streams cancelled by their client after
their first chunks; each request names its client (`X-Fedpool-Client`), cycling through `--client-ids` distinct
ids (100,000: the gateway tells at most 10,000 apart at once and forgets idle ones). Every `--kill-every-s` one
server (in turn) is killed (SIGKILL) and restarted `--down-s` later on the same port.

Sampled every `--sample-s`: the gateway's RSS, its client-id count and the slots its dispatcher holds. At the end
the load stops, requests in flight finish, and the slots the dispatcher still holds are leaked slots. Growth of
RSS: the median of the last tenth of the samples against the median of the tenth after the first tenth (warm-up:
pools, caches and the client-id table filling). An error is explained when it is a load-shedding answer (503
`gateway_overloaded`, 429) or a failure of a request that overlapped a kill (from the kill to `--grace-s` after the
restart); anything else is unexplained and listed.

Writes benchmarks/results/gateway_soak.md, ending with
`result: hours=X requests=N client_ids=N rss_growth_pct=X leaked_slots=N unexplained_errors=N`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report

MODEL = "soak-model"
REVISION = "soak-1"  # explicit: the servers are replicas (a broken stream may continue on another)
SERVERS = 3
CAPACITY = 48  # sequences each server runs at once
PROFILE = {"name": "soak", "max_running": CAPACITY, "decode_s_per_token": 0.003, "batch_slowdown": 0.01,
           "default_output_tokens": 24, "source": "gateway soak: a small fast engine"}
MIX = ("completion",) * 4 + ("chat",) * 3 + ("stream",) * 2 + ("chat_stream",)  # per 10 requests
CANCELLED_STREAMS = 0.1  # of streams, cancelled by their client after their first chunks
REQUEST_TIMEOUT_S = 120.0
SHED = {("503", "gateway_overloaded"), ("429", "gateway_overloaded")}


# ---- the pool ----------------------------------------------------------------------------------------------
@dataclass
class Server:
    index: int
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedpool.deploy.emulator", "--model", MODEL, "--port", str(self.port),
             "--profile-json", json.dumps(PROFILE), "--seed", "7"],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        _wait_http(self.url + "/health", 60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self.kill()


def _wait_http(url: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {deadline_s:.0f} s")


@contextlib.contextmanager
def registry(work: Path, servers: Sequence[Server]) -> Iterator[tuple[str, Path]]:
    import ray

    from fedpool.registry import Engine, RegistryClient, ServerRecord

    state = work / "registry"
    ray.init(address="local", num_cpus=1, namespace="fedpool", include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)

    async def start() -> RegistryClient:
        client = await RegistryClient.start(state, token=secrets.token_hex(16), probe_interval_s=1.0)
        for server in servers:
            await client.register(ServerRecord(id=f"soak-{server.index}", url=server.url, engine=Engine.VLLM,
                                               model=MODEL, revision=REVISION, accelerator="cpu",
                                               capacity=CAPACITY))
        return client

    client = asyncio.run(start())
    try:
        yield ray.get_runtime_context().gcs_address, state
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(client.terminate())
        ray.shutdown()


@contextlib.contextmanager
def gateway(address: str, state: Path, port: int, log: Path) -> Iterator[psutil.Process]:
    proc = subprocess.Popen([sys.executable, "-m", "fedpool.cli", "gateway", "--address", address, "--state-dir",
                             str(state), "--port", str(port), "--quiet"], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 120)
        yield psutil.Process(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()


# ---- the load ----------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str
    started: float  # loop time
    ended: float
    result: str  # ok | cancelled | error
    status: str = ""  # HTTP status, or the exception's name
    code: str = ""  # the OpenAI error code, when the body had one
    detail: str = ""


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[tuple[float, float, str]] = field(default_factory=list)  # (killed at, restarted at, server)
    samples: list[dict[str, float]] = field(default_factory=list)
    client_ids: set[str] = field(default_factory=set)
    not_sent: int = 0  # scheduled while `concurrency` requests were in flight
    leaked_slots: int = -1
    final_client_ids: float = float("nan")
    statuses: dict[str, float] = field(default_factory=dict)
    gateway_tracebacks: int = 0
    duration_s: float = 0.0
    began: float = 0.0  # loop time the load began (times in the report are from it)


async def one_request(session: object, url: str, i: int, kind: str, client: str, cancel: bool) -> Outcome:
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    loop = asyncio.get_running_loop()
    started = loop.time()
    chat = kind.startswith("chat")
    stream = kind.endswith("stream")
    body: dict[str, object] = {"model": MODEL, "max_tokens": 8 + i % 17, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": f"question {i}: tell me about the number {i % 997}"}]
    else:
        body["prompt"] = f"request {i}: the number {i % 997} is"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with session.post(url + path, json=body, headers={"X-Fedpool-Client": client}) as resp:
            if resp.status != 200:
                text = await resp.text()
                code = ""
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    code = str(json.loads(text)["error"].get("code") or "")
                return Outcome(kind, started, loop.time(), "error", str(resp.status), code, text[:200])
            if not stream:
                answer = await resp.json()
                ok = isinstance(answer, dict) and answer.get("choices")
                return Outcome(kind, started, loop.time(), "ok" if ok else "error", "200", "",
                               "" if ok else "no choices")
            chunks, done, finished = 0, False, False
            while True:
                line = await resp.content.readline()
                if not line:
                    break
                text = line.decode().strip()
                if not text.startswith("data:"):
                    continue
                data = text[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return Outcome(kind, started, loop.time(), "error", "200", str(event["error"].get("code")),
                                   str(event["error"].get("message"))[:200])
                chunks += 1
                finished |= any(c.get("finish_reason") for c in event.get("choices") or [])
                if cancel and chunks >= 2:
                    resp.close()  # the client goes away mid-stream
                    return Outcome(kind, started, loop.time(), "cancelled", "200")
            if done and finished:
                return Outcome(kind, started, loop.time(), "ok", "200")
            return Outcome(kind, started, loop.time(), "error", "200", "truncated",
                           f"{chunks} chunks, [DONE] {'seen' if done else 'missing'}, finish_reason "
                           f"{'seen' if finished else 'missing'}")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Outcome(kind, started, loop.time(), "error", type(exc).__name__, "", str(exc)[:200])


async def drive(soak: Soak, url: str, args: argparse.Namespace, servers: Sequence[Server],
                gateway_proc: psutil.Process) -> None:
    import aiohttp

    loop = asyncio.get_running_loop()
    began = soak.began = loop.time()
    end = began + args.minutes * 60
    inflight: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def run_one(i: int) -> None:
            client = f"soak-client-{i % args.client_ids}"
            soak.client_ids.add(client)
            kind = MIX[i % len(MIX)]
            cancel = kind.endswith("stream") and (i // len(MIX)) % round(1 / CANCELLED_STREAMS) == 0
            soak.outcomes.append(await one_request(session, url, i, kind, client, cancel))

        async def killer() -> None:
            for turn in range(10**9):
                await asyncio.sleep(args.kill_every_s)
                if loop.time() >= end - args.down_s - 5:
                    return
                server = servers[turn % len(servers)]
                killed = loop.time()
                await asyncio.to_thread(server.kill)
                await asyncio.sleep(args.down_s)
                await asyncio.to_thread(server.start)
                soak.kills.append((killed, loop.time(), f"soak-{server.index}"))
                print(f"[soak] {killed - began:7.1f} s: soak-{server.index} killed, restarted after "
                      f"{loop.time() - killed:.1f} s", flush=True)

        async def sampler() -> None:
            while True:
                soak.samples.append(await asyncio.to_thread(sample, url, gateway_proc, loop.time() - began))
                last = soak.samples[-1]
                print(f"[soak] {last['t']:7.1f} s: rss {last['rss_mb']:.1f} MB, client ids {last['client_ids']:.0f}, "
                      f"slots held {last['slots']:.0f}, requests {len(soak.outcomes)}", flush=True)
                await asyncio.sleep(args.sample_s)

        background = [asyncio.create_task(killer()), asyncio.create_task(sampler())]
        try:
            for i in range(10**12):
                at = began + i / args.rate
                if at >= end:
                    break
                if at > loop.time():
                    await asyncio.sleep(at - loop.time())
                if len(inflight) >= args.concurrency:
                    soak.not_sent += 1
                    continue
                task = asyncio.create_task(run_one(i))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            soak.duration_s = loop.time() - began
            if inflight:
                await asyncio.wait(inflight, timeout=REQUEST_TIMEOUT_S + 10)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
    soak.samples.append(await asyncio.to_thread(sample, url, gateway_proc, loop.time() - began))


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(url: str, proc: psutil.Process, t: float) -> dict[str, float]:
    metrics = scrape(url)
    return {"t": t, "rss_mb": proc.memory_info().rss / 2**20,
            "client_ids": metrics.get(("fedpool_gateway_client_ids", ()), float("nan")),
            "slots": sum(v for (name, _), v in metrics.items() if name == "fedpool_gateway_server_inflight")}


# ---- judging ------------------------------------------------------------------------------------------------
def explain(outcome: Outcome, kills: Sequence[tuple[float, float, str]], grace_s: float) -> str | None:
    """Why an error happened, or None when nothing explains it."""
    if (outcome.status, outcome.code) in SHED:
        return "load shed: the gateway refused at once (its loop behind, or at its in-flight cap)"
    for killed, restarted, server in kills:
        if outcome.started <= restarted + grace_s and outcome.ended >= killed:
            return f"overlapped the kill of a server ({server}: killed, restarted, then re-probed)"
    return None


def rss_growth_pct(samples: Sequence[dict[str, float]]) -> float:
    rss = [s["rss_mb"] for s in samples]
    tenth = max(1, len(rss) // 10)
    baseline = statistics.median(rss[tenth:2 * tenth]) if len(rss) >= 3 * tenth else rss[0]
    final = statistics.median(rss[-tenth:])
    return 100 * (final - baseline) / baseline


def report(soak: Soak, args: argparse.Namespace) -> tuple[str, dict[str, object]]:
    errors = [o for o in soak.outcomes if o.result == "error"]
    explained: collections.Counter[str] = collections.Counter()
    unexplained: list[Outcome] = []
    for outcome in errors:
        why = explain(outcome, soak.kills, args.grace_s)
        if why is None:
            unexplained.append(outcome)
        else:
            explained[f"{why}: {outcome.status} {outcome.code}".strip()] += 1
    by_kind = collections.Counter((o.kind, o.result) for o in soak.outcomes)
    kinds = sorted({o.kind for o in soak.outcomes})
    growth = rss_growth_pct(soak.samples)
    rss = [s["rss_mb"] for s in soak.samples]
    ids = [s["client_ids"] for s in soak.samples]
    lines = [
        f"Pool: {SERVERS} emulated vLLM servers (replicas; profile {json.dumps(PROFILE)}) in a real registry (local "
        f"Ray), the real `fedpool gateway` in front. Load: open loop at {args.rate:g} req/s (at most "
        f"{args.concurrency} in flight; {soak.not_sent} scheduled requests not sent for that), mix per 10 requests: "
        f"4 completions, 3 chat, 2 completion streams, 1 chat stream; {CANCELLED_STREAMS:.0%} of streams cancelled "
        f"by their client after two chunks; client ids cycling through {args.client_ids:,}. A server killed every "
        f"{args.kill_every_s:g} s (in turn), restarted {args.down_s:g} s later. Ran {soak.duration_s / 60:.1f} min "
        f"on this machine's {os.cpu_count()} cores (load average at the end: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}).",
        "",
        "## Requests",
        "",
        markdown_table(["kind", "ok", "cancelled by the client", "error"],
                       [[k, by_kind[(k, "ok")], by_kind[(k, "cancelled")], by_kind[(k, "error")]] for k in kinds]),
        "",
        f"The gateway's own count (fedpool_gateway_requests_total by status): "
        f"{', '.join(f'{k} {v:.0f}' for k, v in sorted(soak.statuses.items())) or 'not scraped'}.",
        "",
        "## Errors",
        "",
        markdown_table(["explanation", "count"], [[k, v] for k, v in explained.most_common()]) if explained
        else "No explained errors.",
        "",
        f"Unexplained: {len(unexplained)}" + (":" if unexplained else "."),
        "",
        *[f"- {o.kind} at {o.started - soak.began:.1f}–{o.ended - soak.began:.1f} s: {o.status} {o.code} {o.detail}"
          for o in unexplained[:20]],
        "",
        "## Kills",
        "",
        markdown_table(["server", "killed at (s)", "back at (s)"],
                       [[server, f"{a - soak.began:.0f}", f"{b - soak.began:.0f}"] for a, b, server in soak.kills])
        if soak.kills else "No kill in a run this short.",
        "",
        "## The gateway over time",
        "",
        f"RSS: {rss[0]:.1f} MB at the first sample, {min(rss):.1f}–{max(rss):.1f} MB over the run, "
        f"{rss[-1]:.1f} MB at the end; growth (median of the last tenth against the second tenth): {growth:+.1f}%. "
        f"Client ids told apart: at most {max(ids):.0f} (cap 10,000), {soak.final_client_ids:.0f} at the end. "
        f"Slots held after the load stopped and its requests finished: {soak.leaked_slots}. Tracebacks in the "
        f"gateway's log: {soak.gateway_tracebacks}.",
        "",
        markdown_table(["t (s)", "RSS MB", "client ids", "slots held"],
                       [[f"{s['t']:.0f}", f"{s['rss_mb']:.1f}", f"{s['client_ids']:.0f}", f"{s['slots']:.0f}"]
                        for s in soak.samples[:: max(1, len(soak.samples) // 24)]]),
    ]
    result = {"hours": f"{soak.duration_s / 3600:.2f}", "requests": len(soak.outcomes),
              "client_ids": len(soak.client_ids), "rss_growth_pct": f"{growth:.1f}",
              "leaked_slots": soak.leaked_slots, "unexplained_errors": len(unexplained) + soak.gateway_tracebacks}
    return "\n".join(lines), result


# ---- the run ------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, work: Path) -> Soak:
    from fedpool.deploy.process import free_port

    soak = Soak()
    servers = [Server(i, free_port(), work / f"server-{i}.log") for i in range(SERVERS)]
    try:
        for server in servers:
            server.start()
        with registry(work, servers) as (address, state):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = work / "gateway.log"
            with gateway(address, state, port, log) as proc:
                time.sleep(3)  # a snapshot with every server routable
                asyncio.run(drive(soak, url, args, servers, proc))
                for _ in range(120):  # in flight back to zero (every request above has finished)
                    if not sample(url, proc, 0)["slots"]:
                        break
                    time.sleep(0.5)
                final = sample(url, proc, 0)
                soak.leaked_slots = int(final["slots"])
                soak.final_client_ids = final["client_ids"]
                for (name, labels), value in scrape(url).items():
                    if name == "fedpool_gateway_requests_total":
                        status = dict(labels).get("status", "?")
                        soak.statuses[status] = soak.statuses.get(status, 0.0) + value
            soak.gateway_tracebacks = log.read_text(errors="replace").count("Traceback")
    finally:
        for server in servers:
            server.stop()
    return soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway_soak", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second (open loop)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--client-ids", type=int, default=100_000)
    parser.add_argument("--kill-every-s", type=float, default=180.0)
    parser.add_argument("--down-s", type=float, default=10.0)
    parser.add_argument("--grace-s", type=float, default=15.0, help="after a restart, errors still explained by it")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedpool-soak-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        soak = run(args, work)
    text, result = report(soak, args)
    path = write_report("gateway_soak", "Gateway soak: steady mixed load, servers killed and restarted", text, result,
                        results_dir=args.results_dir)
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
