"""SGLang: metrics need `--enable-metrics`; capacity from /server_info (older: /get_server_info)."""

from __future__ import annotations

import aiohttp

from fedpool.registry.adapters.base import EngineAdapter, MetricSamples
from fedpool.registry.records import Engine
from fedpool.registry.snapshot import LoadSample

RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
TOKEN_USAGE = "sglang:token_usage"
GEN_THROUGHPUT = "sglang:gen_throughput"
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
LOAD_PATHS = ("/v1/loads", "/get_load")


class SglangAdapter(EngineAdapter, engine=Engine.SGLANG):
    health_path = "/health"
    default_capacity = 256
    # SGLang's tokenizer manager checks `is_disconnected()` while a non-streamed request waits, and aborts it —
    # on the first 4 s timeout of its wait for the request's output (`_wait_one_response`), queued or running.
    cancels_on_disconnect = True
    # At once: the OpenAI endpoints take a request id (`rid`) and /abort_request aborts it by that id.
    abort_path = "/abort_request"
    wanted_metrics = frozenset({RUNNING, WAITING, TOKEN_USAGE, GEN_THROUGHPUT})

    def load_from_samples(self, samples: MetricSamples, observed_at: float) -> LoadSample:
        return LoadSample(
            running=samples.total(RUNNING) or 0.0,
            waiting=samples.total(WAITING) or 0.0,
            kv_cache_usage=samples.mean(TOKEN_USAGE),
            tokens_per_s=samples.total(GEN_THROUGHPUT),
            observed_at=observed_at,
        )

    async def discover_capacity(
        self, session: aiohttp.ClientSession, base_url: str, timeout_s: float
    ) -> int | None:
        return await self._server_info_limit(session, base_url, timeout_s, "max_running_requests")


    async def discover_kv_cache_tokens(
        self, session: aiohttp.ClientSession, base_url: str, timeout_s: float
    ) -> int | None:
        """`max_total_num_tokens` of /server_info (the token pool's size: SGLang's KV cache)."""
        return await self._server_info_limit(session, base_url, timeout_s, "max_total_num_tokens")

    async def _server_info_limit(self, session: aiohttp.ClientSession, base_url: str, timeout_s: float,
                                 key: str) -> int | None:
        """A limit `key` of the first server-info path that states it."""
        for path in SERVER_INFO_PATHS:
            info = await self._get_json(session, base_url + path, timeout_s)
            if isinstance(info, dict):
                value = _find_limit(info, key)
                if value:
                    return value
        return None


def _find_limit(info: dict[str, object], key: str) -> int | None:
    """A limit (`max_running_requests`, `max_total_num_tokens`) sits at the top level, or per data-parallel rank
    under internal_states (then the ranks' sum)."""
    value = info.get(key)
    if isinstance(value, int) and value > 0:
        return value
    states = info.get("internal_states")
    if isinstance(states, list):
        found = [s.get(key) for s in states if isinstance(s, dict)]
        ints = [v for v in found if isinstance(v, int) and v > 0]
        if ints:
            return sum(ints)
    return None
