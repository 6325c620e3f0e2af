"""Prometheus exposition of the pool as the registry sees it (prometheus_client, a fresh registry per
scrape so removed servers vanish instead of lingering as stale series), and of its capacity leases: who holds the
pool, slots leased per server against its slots, re-shares and renewals, per-client requests left (capped)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from fedpool.registry.demand import HOLDER_KINDS
from fedpool.registry.holders import LeaseFigures
from fedpool.registry.snapshot import PoolSnapshot, ServerStatus

SERVER_LABELS = ("server_id", "engine", "accelerator", "model")


def pool_metrics_text(snapshot: PoolSnapshot, registry_stats: Mapping[str, float],
                      leases: LeaseFigures | None = None) -> bytes:
    reg = CollectorRegistry()
    servers = Gauge("fedpool_servers", "Registered servers by status, engine and accelerator.",
                    ("status", "engine", "accelerator"), registry=reg)
    counts = Counter((e.status.value, e.engine.value, e.record.accelerator) for e in snapshot.entries)
    for status in ServerStatus:  # every status present, zero included, so alerts can use absent == 0
        for engine, accel in {(e.engine.value, e.record.accelerator) for e in snapshot.entries}:
            servers.labels(status.value, engine, accel).set(counts.get((status.value, engine, accel), 0))

    def per_server(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, SERVER_LABELS, registry=reg)

    up = per_server("fedpool_server_routable", "1 when the server takes new requests (healthy or suspect).")
    capacity = per_server("fedpool_server_capacity", "Max concurrent sequences (declared or discovered).")
    running = per_server("fedpool_server_running", "Requests running, from the engine's own metrics.")
    waiting = per_server("fedpool_server_waiting", "Requests queued in the engine, from its own metrics.")
    kv = per_server("fedpool_server_kv_cache_usage_ratio", "KV-cache use, 0..1.")
    tps = per_server("fedpool_server_generation_tokens_per_second", "Generated tokens per second.")
    latency = per_server("fedpool_server_probe_latency_seconds", "Latency of the last health probe.")
    failures = per_server("fedpool_server_probe_failures", "Failed probes since registration.")
    streak = per_server("fedpool_server_consecutive_probe_failures", "Failed probes in a row.")
    for e in snapshot.entries:
        labels = (e.id, e.engine.value, e.record.accelerator, e.record.model)
        up.labels(*labels).set(1.0 if e.status.routable else 0.0)
        capacity.labels(*labels).set(e.capacity)
        failures.labels(*labels).set(e.probe_failures_total)
        streak.labels(*labels).set(e.consecutive_failures)
        if e.probe_latency_s is not None:
            latency.labels(*labels).set(e.probe_latency_s)
        if e.load is not None:
            running.labels(*labels).set(e.load.running)
            waiting.labels(*labels).set(e.load.waiting)
            if e.load.kv_cache_usage is not None:
                kv.labels(*labels).set(e.load.kv_cache_usage)
            if e.load.tokens_per_s is not None:
                tps.labels(*labels).set(e.load.tokens_per_s)
    Gauge("fedpool_registry_snapshot_version", "Version of the pool snapshot.", registry=reg).set(snapshot.version)
    for key, doc in (("last_probe_cycle_s", "Duration of the last probe cycle in seconds."),
                     ("probe_cycles", "Probe cycles run since the actor (re)started.")):
        if key in registry_stats:
            Gauge(f"fedpool_registry_{key}", doc, registry=reg).set(registry_stats[key])
    if leases is not None:
        lease_metrics(reg, leases)
    return generate_latest(reg)


def lease_metrics(reg: CollectorRegistry, figures: LeaseFigures) -> None:
    """The lease broker's figures into `reg`. Per-client series are capped where the figures are made
    (holders.lease_figures): the rest are one series, client="other"."""
    holders = Gauge("fedpool_lease_holders", "Processes holding a capacity lease, by kind and state.",
                    ("kind", "state"), registry=reg)
    for kind in HOLDER_KINDS:  # every kind present, zero included
        holders.labels(kind, "active").set(0)
    for (kind_name, state), n in figures.holders.items():
        holders.labels(kind_name, state).set(n)
    slots = Gauge("fedpool_lease_server_slots", "A server's slots as the lease broker shares them (0: not routable).",
                  ("server_id", "model"), registry=reg)
    leased = Gauge("fedpool_lease_server_leased", "Slots of a server leased to every holder together.",
                   ("server_id", "model"), registry=reg)
    for server in figures.servers:
        slots.labels(server.server, server.model).set(server.capacity)
        leased.labels(server.server, server.model).set(server.leased)
    reg.register(_LeaseCounters(figures))
    left = Gauge("fedpool_lease_client_requests_left", "Requests a client says it has left (the clients beyond the "
                 "cap summed as client=\"other\").", ("client", "model"), registry=reg)
    for (client, model), n in figures.requests_left.items():
        left.labels(client, model).set(n)


class _LeaseCounters(Collector):
    """The broker's counters and its re-shares' durations, kept by the lease service across scrapes (as families:
    no `_created` series, which a registry made afresh per scrape would set anew each time)."""

    def __init__(self, figures: LeaseFigures):
        self._figures = figures

    def collect(self) -> list[Metric]:
        f = self._figures
        return [
            CounterMetricFamily("fedpool_lease_over_capacity", "Servers found leased past their slots after a "
                                "re-share (stays 0).", value=f.over_capacity),
            CounterMetricFamily("fedpool_lease_calls", "Lease calls (renewals) the broker answered.", value=f.calls),
            CounterMetricFamily("fedpool_lease_reshares", "Re-shares of every server's slots.", value=f.reshares),
            HistogramMetricFamily("fedpool_lease_reshare_seconds", "How long re-sharing every server's slots took.",
                                  buckets=f.reshare_s.buckets(), sum_value=f.reshare_s.sum_s),
        ]
