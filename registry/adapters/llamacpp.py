"""llama.cpp's server: metrics need `--metrics`; slot count from /props (total_slots) or /slots."""

from __future__ import annotations

import aiohttp

from fedpool.registry.adapters.base import EngineAdapter, MetricSamples
from fedpool.registry.records import Engine
from fedpool.registry.snapshot import LoadSample

PROCESSING = "llamacpp:requests_processing"
DEFERRED = "llamacpp:requests_deferred"
TOKENS_PREDICTED = "llamacpp:tokens_predicted_total"
KV_USAGE = "llamacpp:kv_cache_usage_ratio"  # exported by older builds only


class LlamaCppAdapter(EngineAdapter, engine=Engine.LLAMACPP):
    health_path = "/health"
    default_capacity = 1  # llama-server's default is one slot unless -np is given
    # A non-streamed request runs to the end after its client hangs up (httplib blocks on the result: no
    # disconnect event; llama.cpp #9273): a losing copy would hold its slot. Only streams notice.
    cancels_on_disconnect = False
    wanted_metrics = frozenset({PROCESSING, DEFERRED, TOKENS_PREDICTED, KV_USAGE})

    def load_from_samples(self, samples: MetricSamples, observed_at: float) -> LoadSample:
        return LoadSample(
            running=samples.total(PROCESSING) or 0.0,
            waiting=samples.total(DEFERRED) or 0.0,
            kv_cache_usage=samples.mean(KV_USAGE),
            generation_tokens_total=samples.total(TOKENS_PREDICTED),
            observed_at=observed_at,
        )

    async def discover_capacity(
        self, session: aiohttp.ClientSession, base_url: str, timeout_s: float
    ) -> int | None:
        props = await self._get_json(session, base_url + "/props", timeout_s)
        if isinstance(props, dict):
            slots = props.get("total_slots")
            if isinstance(slots, int) and slots > 0:
                return slots
        slot_list = await self._get_json(session, base_url + "/slots", timeout_s)
        if isinstance(slot_list, list) and slot_list:
            return len(slot_list)
        return None
