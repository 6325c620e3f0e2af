"""Concurrent async probes: health and metrics of every server, each under its own timeout."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

from fedpool.registry.adapters import MetricsParseError, adapter_for
from fedpool.registry.records import ServerRecord
from fedpool.registry.snapshot import ProbeResult, probe_to_row

log = logging.getLogger("fedpool.registry")

PROBE_BATCH = 50  # servers probed at once within a paced cycle
PACE_FRACTION = 0.6  # share of the interval over which a cycle's batches are spread


async def probe_server(
    session: aiohttp.ClientSession,
    record: ServerRecord,
    *,
    timeout_s: float,
    check_health: bool = True,
    generate: bool = False,
    busy: bool = False,
    clock: Callable[[], float] = time.time,
    perf: Callable[[], float] = time.perf_counter,
) -> ProbeResult:
    """Health, then metrics. Health failing is a failed probe; unparseable metrics only lose the load.

    With `check_health=False` (most cycles at scale) only /metrics is fetched and an answer from it is
    the liveness signal: one request per server per cycle instead of two. With `generate` (servers that
    dispatchers reported failures of), the probe also asks for one token (`max_tokens: 1`): a server whose
    /health answers but that generates nothing within the timeout fails the probe."""
    adapter = adapter_for(record.engine)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    metrics_only = not check_health and adapter.metrics_path is not None
    start = perf()
    try:
        if not metrics_only:
            async with session.get(record.url + adapter.health_path, timeout=timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    why = f"health returned HTTP {resp.status}"
                    return ProbeResult(record.id, False, perf() - start, clock(), why)
        latency = perf() - start
        load = None
        error = None
        if adapter.metrics_path is not None:
            try:
                async with session.get(record.url + adapter.metrics_path, timeout=timeout) as resp:
                    text = await resp.text()
                    status = resp.status
                if metrics_only:
                    latency = perf() - start
                if status == 200:
                    load = adapter.parse_metrics(text, clock())
                elif metrics_only:
                    return ProbeResult(record.id, False, latency, clock(), f"metrics returned HTTP {status}")
                else:
                    error = f"metrics returned HTTP {status}"
            except MetricsParseError as exc:
                error = str(exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                if metrics_only:
                    raise
                error = f"metrics unreadable: {type(exc).__name__}"
        if generate:
            failed = await _generate_one_token(session, record, timeout)
            if failed is not None:
                return ProbeResult(record.id, False, perf() - start, clock(), failed, load, busy=busy)
        return ProbeResult(record.id, True, latency, clock(), error, load)
    except (TimeoutError, aiohttp.ClientError) as exc:
        timed_out = isinstance(exc, TimeoutError)  # (only a probe that timed out says the engine was busy)
        return ProbeResult(record.id, False, perf() - start, clock(), _failure(exc, timeout_s, busy),
                           busy=busy and timed_out)


def _failure(exc: TimeoutError | aiohttp.ClientError, timeout_s: float, busy: bool) -> str:
    """Why a probe failed, in words, from the exception that ended it (a timeout first: some are client errors)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g}s" + (" (engine busy)" if busy else "")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect: {exc.os_error}"
    return f"{type(exc).__name__}: {exc}"


async def _generate_one_token(session: aiohttp.ClientSession, record: ServerRecord,
                              limit: aiohttp.ClientTimeout) -> str | None:
    """None when the server generated a token; else why not. An engine without /v1/completions (404, 405)
    cannot be asked this way and is not held to it."""
    body = {"model": record.model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
    try:
        async with session.post(record.url + "/v1/completions", json=body, timeout=limit) as resp:
            await resp.read()
            if resp.status in (404, 405):
                return None
            if resp.status != 200:
                return f"health answers but generating one token returned HTTP {resp.status}"
    except TimeoutError:
        return f"health answers but it generated no token within {limit.total:g}s"
    except aiohttp.ClientError as exc:
        return f"health answers but generating one token failed: {type(exc).__name__}"
    return None


async def probe_all(
    session: aiohttp.ClientSession,
    records: Iterable[ServerRecord],
    *,
    timeout_s: float,
    busy_ids: frozenset[str] = frozenset(),
    health_ids: frozenset[str] | None = None,
    generate_ids: frozenset[str] = frozenset(),
    clock: Callable[[], float] = time.time,
) -> list[ProbeResult]:
    """Probe every server at once; a hung server costs its own timeout and delays nobody else.
    `health_ids`: servers whose health endpoint is checked this cycle (None: all); `generate_ids`: servers
    also asked for one token."""
    return list(
        await asyncio.gather(
            *(
                probe_server(
                    session, r, timeout_s=timeout_s, busy=r.id in busy_ids, clock=clock,
                    check_health=health_ids is None or r.id in health_ids or r.id in generate_ids,
                    generate=r.id in generate_ids,
                )
                for r in records
            )
        )
    )


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """What the next cycle probes and how; the prober pulls a fresh one from the registry each cycle."""

    records: tuple[ServerRecord, ...] = ()
    busy_ids: frozenset[str] = frozenset()
    need_health: frozenset[str] = frozenset()
    need_generate: frozenset[str] = frozenset()
    interval_s: float = 2.0
    timeout_s: float = 5.0
    health_every: int = 3
    hurry: bool = False


class ProberActor:
    """The probe loop in a process of its own (a Ray actor beside the registry), so that a thousand
    probes a second never hold up the registry's answers to clients. It keeps no state: each cycle it
    pulls the plan from the registry and hands the results back, so either actor can restart alone."""

    MAX_REGISTRY_MISSES = 60  # cycles without a registry before this actor exits

    def __init__(self, registry_name: str, namespace: str):
        self._registry_name = registry_name
        self._namespace = namespace
        self._task: asyncio.Task[None] | None = None
        self._hurry: asyncio.Event | None = None
        self._credential = ""  # handed over by the registry (adopt): its deliveries carry it
        self.cycles = 0

    async def adopt(self, credential: str) -> None:
        """The registry (started or restarted) gives the credential its probe deliveries must carry."""
        self._credential = credential

    async def pid(self) -> int:
        import os

        return os.getpid()

    async def hurry(self) -> None:
        """Start the next cycle now (a dispatcher reported a failure)."""
        if self._hurry is not None:
            self._hurry.set()

    async def start(self) -> bool:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return True

    async def _run(self) -> None:
        import ray
        import ray.actor

        misses = 0
        self._hurry = asyncio.Event()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)) as session:
            while True:
                started = time.perf_counter()
                try:
                    # Ray types an untyped handle's methods as Never (they are remote methods): typed loosely once.
                    registry: Any = await asyncio.to_thread(ray.get_actor, self._registry_name,
                                                            namespace=self._namespace)
                    plan: ProbePlan = await registry.probe_plan.remote()
                    misses = 0
                except Exception:  # registry restarting or gone
                    misses += 1
                    if misses > self.MAX_REGISTRY_MISSES:
                        log.warning("registry gone for %d cycles; prober exits", misses)
                        ray.actor.exit_actor()
                    await asyncio.sleep(1.0)
                    continue
                full = self.cycles % plan.health_every == 0
                # Paced: batches spread over PACE_FRACTION of the interval instead of one burst, so the
                # probes' CPU use is smooth and nobody sharing the machine sees a spike every cycle.
                batches = [plan.records[i:i + PROBE_BATCH] for i in range(0, len(plan.records), PROBE_BATCH)]
                slot_s = plan.interval_s * PACE_FRACTION / max(1, len(batches))
                busy_s = 0.0
                results: list[ProbeResult] = []
                for k, batch in enumerate(batches):
                    batch_started = time.perf_counter()
                    results += await probe_all(
                        session, batch, timeout_s=plan.timeout_s, busy_ids=plan.busy_ids,
                        health_ids=None if full else plan.need_health, generate_ids=plan.need_generate,
                    )
                    busy_s += time.perf_counter() - batch_started
                    wait = started + (k + 1) * slot_s - time.perf_counter()
                    if k < len(batches) - 1 and wait > 0:
                        await asyncio.sleep(wait)
                rows = [probe_to_row(r) for r in results]
                try:  # one delivery per cycle: the registry applies it in slices
                    await registry.deliver_probes.remote(self._credential, rows, time.perf_counter() - started,
                                                         busy_s)
                except Exception:
                    log.warning("could not deliver probe results; the registry may be restarting")
                self.cycles += 1
                remaining = plan.interval_s - (time.perf_counter() - started)
                self._hurry.clear()
                if remaining > 0:
                    try:
                        await asyncio.wait_for(self._hurry.wait(), remaining)
                    except TimeoutError:
                        pass
