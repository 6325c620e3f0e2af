"""vLLM: metrics on by default at /metrics, one series per `engine` label under data parallelism."""

from __future__ import annotations

import aiohttp

from fedpool.registry.adapters.base import EngineAdapter, MetricSamples
from fedpool.registry.records import Engine
from fedpool.registry.snapshot import LoadSample

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"  # a 0..1 fraction despite the name
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # name used before vLLM V1
GENERATION_TOKENS = "vllm:generation_tokens_total"
CACHE_CONFIG = "vllm:cache_config_info"


class VllmAdapter(EngineAdapter, engine=Engine.VLLM):
    health_path = "/health"
    default_capacity = 256  # vLLM's default max_num_seqs on GPUs
    # vLLM's OpenAI server wraps its completion handlers in `with_cancellation`: a disconnect aborts the request.
    cancels_on_disconnect = True
    wanted_metrics = frozenset({RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD, GENERATION_TOKENS})

    def load_from_samples(self, samples: MetricSamples, observed_at: float) -> LoadSample:
        return LoadSample(
            running=samples.total(RUNNING) or 0.0,
            waiting=samples.total(WAITING) or 0.0,
            kv_cache_usage=samples.mean(KV_USAGE, KV_USAGE_OLD),
            generation_tokens_total=samples.total(GENERATION_TOKENS),
            observed_at=observed_at,
        )

    async def discover_kv_cache_tokens(
        self, session: aiohttp.ClientSession, base_url: str, timeout_s: float
    ) -> int | None:
        samples = await self._get_metrics(session, base_url + "/metrics", timeout_s, frozenset({CACHE_CONFIG}))
        return self.kv_cache_tokens(samples) if samples is not None else None

    @staticmethod
    def kv_cache_tokens(samples: MetricSamples) -> int | None:
        """KV-cache size in tokens (blocks × block size) summed over engines, from cache_config_info."""
        total = 0
        for labels, _ in samples.series(CACHE_CONFIG):
            try:
                total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):
                continue
        return total or None
