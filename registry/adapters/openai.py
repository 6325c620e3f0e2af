"""Any OpenAI-compatible server without metrics: health is /v1/models, load comes from passive signals."""

from __future__ import annotations

from fedpool.registry.adapters.base import EngineAdapter, MetricSamples
from fedpool.registry.records import Engine
from fedpool.registry.snapshot import LoadSample


class OpenAIAdapter(EngineAdapter, engine=Engine.OPENAI):
    health_path = "/v1/models"
    metrics_path = None
    default_capacity = 8

    def load_from_samples(self, samples: MetricSamples, observed_at: float) -> LoadSample:
        return LoadSample(running=0.0, waiting=0.0, observed_at=observed_at)
