"""Concurrent async probes: health and metrics of every server, each under its own timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import aiohttp

from registry.adapters import MetricsParseError, adapter_for
from registry.records import ServerRecord
from registry.snapshot import ProbeResult


async def probe_server(
    session: aiohttp.ClientSession,
    record: ServerRecord,
    *,
    timeout_s: float,
    busy: bool = False,
    clock: Callable[[], float] = time.time,
    perf: Callable[[], float] = time.perf_counter,
) -> ProbeResult:
    """Health, then metrics. Health failing is a failed probe; unparseable metrics only lose the load."""
    adapter = adapter_for(record.engine)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    start = perf()
    try:
        async with session.get(record.url + adapter.health_path, timeout=timeout) as resp:
            await resp.read()
            if resp.status != 200:
                return ProbeResult(record.id, False, perf() - start, clock(), f"health returned HTTP {resp.status}")
        latency = perf() - start
        load = None
        error = None
        if adapter.metrics_path is not None:
            try:
                async with session.get(record.url + adapter.metrics_path, timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status == 200:
                        load = adapter.parse_metrics(text, clock())
                    else:
                        error = f"metrics returned HTTP {resp.status}"
            except MetricsParseError as exc:
                error = str(exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = f"metrics unreadable: {type(exc).__name__}"
        return ProbeResult(record.id, True, latency, clock(), error, load)
    except TimeoutError:
        why = f"no answer within {timeout_s:g}s" + (" (engine busy)" if busy else "")
        return ProbeResult(record.id, False, perf() - start, clock(), why, busy=busy)
    except aiohttp.ClientConnectorError as exc:
        return ProbeResult(record.id, False, perf() - start, clock(), f"cannot connect: {exc.os_error}")
    except aiohttp.ClientError as exc:
        return ProbeResult(record.id, False, perf() - start, clock(), f"{type(exc).__name__}: {exc}")


async def probe_all(
    session: aiohttp.ClientSession,
    records: Iterable[ServerRecord],
    *,
    timeout_s: float,
    busy_ids: frozenset[str] = frozenset(),
    clock: Callable[[], float] = time.time,
) -> list[ProbeResult]:
    """Probe every server at once; a hung server costs its own timeout and delays nobody else."""
    return list(
        await asyncio.gather(
            *(probe_server(session, r, timeout_s=timeout_s, busy=r.id in busy_ids, clock=clock) for r in records)
        )
    )
