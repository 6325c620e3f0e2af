"""Engine adapters, one small module per engine; importing this package registers them all."""

from fedpool.registry.adapters import llamacpp, openai, sglang, vllm  # noqa: F401  (registration side effect)
from fedpool.registry.adapters.base import EngineAdapter, MetricSamples, MetricsParseError, adapter_for

__all__ = ["EngineAdapter", "MetricSamples", "MetricsParseError", "adapter_for"]
