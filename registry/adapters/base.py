"""The engine adapter interface: each engine's health path, metric names and capacity discovery."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import aiohttp

from fedpool.registry.records import Engine
from fedpool.registry.snapshot import LoadSample

_ADAPTERS: dict[Engine, type[EngineAdapter]] = {}


class MetricsParseError(ValueError):
    """The /metrics text was not valid Prometheus exposition format."""


def select_families(text: str, wanted: frozenset[str]) -> str:
    """Keep only the lines of the wanted metric families (a real vLLM /metrics is tens of KB of
    histograms we never read); the kept text is then parsed by prometheus_client as usual."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            token = parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else None
        else:
            token = line.split("{", 1)[0].split(None, 1)[0] if line.strip() else None
        if token is not None and (token in wanted or token.removesuffix("_total") in wanted):
            kept.append(line)
    return "\n".join(kept) + "\n"


class MetricSamples:
    """Samples of one exposition text indexed by sample name (counters keep their `_total`)."""

    def __init__(self, text: str, wanted: frozenset[str] | None = None):
        self._values: dict[str, list[tuple[dict[str, str], float]]] = {}
        if wanted is not None:
            text = select_families(text, wanted | {n.removesuffix("_total") for n in wanted})
        from prometheus_client.parser import text_string_to_metric_families  # (its package: ~40 ms a start)

        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    self._values.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
        except (ValueError, TypeError, IndexError) as exc:  # the parser's documented failure modes
            raise MetricsParseError(f"unparseable metrics text: {exc}") from exc

    def has(self, name: str) -> bool:
        return name in self._values

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return list(self._values.get(name, ()))

    def total(self, *names: str) -> float | None:
        """Sum over every series of the first name present (data-parallel engines export one per rank)."""
        for name in names:
            values = [v for _, v in self._values.get(name, ()) if not math.isnan(v)]
            if values:
                return float(sum(values))
        return None

    def mean(self, *names: str) -> float | None:
        """Mean over series of the first name present: right for per-engine fractions such as KV use."""
        for name in names:
            values = [v for _, v in self._values.get(name, ()) if not math.isnan(v)]
            if values:
                return float(sum(values) / len(values))
        return None


class EngineAdapter(ABC):
    """What the registry needs to know about one engine. Subclasses register with `engine=`."""

    engine: ClassVar[Engine]
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str | None] = "/metrics"
    default_capacity: ClassVar[int] = 16
    wanted_metrics: ClassVar[frozenset[str] | None] = None  # families to keep before parsing; None = all
    # A non-streamed request whose client hangs up is aborted (its slot freed) rather than run to the end. Copies
    # of a request (hedging, stealing) race only on engines that do: the losing copy is cancelled by hanging up.
    cancels_on_disconnect: ClassVar[bool] = False
    # Where to POST `{"rid": id}` to abort a request the caller named with `rid` in its body (None: the engine
    # learns only from the closed connection). A request fedpool gives up on is aborted there at once.
    abort_path: ClassVar[str | None] = None

    def __init_subclass__(cls, *, engine: Engine | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if engine is not None:
            cls.engine = engine
            _ADAPTERS[engine] = cls

    @abstractmethod
    def load_from_samples(self, samples: MetricSamples, observed_at: float) -> LoadSample:
        """Turn one parsed /metrics text into a LoadSample."""

    def parse_metrics(self, text: str, observed_at: float) -> LoadSample:
        return self.load_from_samples(MetricSamples(text, self.wanted_metrics), observed_at)

    async def discover_capacity(
        self, session: aiohttp.ClientSession, base_url: str, timeout_s: float
    ) -> int | None:
        """Max concurrent sequences as the engine reports it, or None when it does not say."""
        return None

    async def discover_kv_cache_tokens(
        self, session: aiohttp.ClientSession, base_url: str, timeout_s: float
    ) -> int | None:
        """The KV cache's size in tokens as the engine reports it, or None when it does not say."""
        return None

    @staticmethod
    async def _get_metrics(session: aiohttp.ClientSession, url: str, timeout_s: float,
                           wanted: frozenset[str]) -> MetricSamples | None:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return None
                return MetricSamples(await resp.text(), wanted)
        except (aiohttp.ClientError, TimeoutError, ValueError, MetricsParseError):
            return None

    @staticmethod
    async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> object | None:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None


def adapter_for(engine: Engine | str) -> EngineAdapter:
    """The adapter instance for an engine name."""
    return _ADAPTERS[Engine(engine)]()

