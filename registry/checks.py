"""What the registry verifies before it accepts a server: reachable, healthy, serving the model."""

from __future__ import annotations

import aiohttp

from fedpool.registry.adapters import adapter_for
from fedpool.registry.errors import RegistrationError
from fedpool.registry.records import ServerRecord


async def verify_server(
    session: aiohttp.ClientSession, record: ServerRecord, *, timeout_s: float
) -> tuple[int, int | None]:
    """Check the server and return its capacity (declared, else discovered, else the engine default) and its KV
    cache in tokens (declared, else discovered, else None).

    Raises RegistrationError naming the check that failed: reachable, healthy, model or capacity.
    """
    adapter = adapter_for(record.engine)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(record.url + adapter.health_path, timeout=timeout) as resp:
            await resp.read()
            if resp.status != 200:
                raise RegistrationError(
                    record.id, f"GET {adapter.health_path} answered HTTP {resp.status}", check="healthy"
                )
    except TimeoutError as exc:
        raise RegistrationError(
            record.id, f"{record.url} did not answer within {timeout_s:g}s", check="reachable"
        ) from exc
    except aiohttp.ClientError as exc:
        raise RegistrationError(
            record.id, f"cannot reach {record.url}: {type(exc).__name__}", check="reachable"
        ) from exc

    served = await _served_models(session, record, timeout)
    if record.model not in served:
        raise RegistrationError(
            record.id,
            f"server does not serve model {record.model!r}; /v1/models lists {sorted(served) or 'nothing'}",
            check="model",
        )

    discovered = await adapter.discover_capacity(session, record.url, timeout_s)
    kv = record.kv_cache_tokens or await adapter.discover_kv_cache_tokens(session, record.url, timeout_s)
    if record.capacity is not None:
        return record.capacity, kv
    return discovered or adapter.default_capacity, kv


async def _served_models(
    session: aiohttp.ClientSession, record: ServerRecord, client_timeout: aiohttp.ClientTimeout
) -> set[str]:
    try:
        async with session.get(record.url + "/v1/models", timeout=client_timeout) as resp:
            if resp.status != 200:
                raise RegistrationError(record.id, f"GET /v1/models answered HTTP {resp.status}", check="model")
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise RegistrationError(
            record.id, f"GET /v1/models failed: {type(exc).__name__}", check="model"
        ) from exc
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise RegistrationError(record.id, "/v1/models did not return an OpenAI model list", check="model")
    names: set[str] = set()
    for item in data:
        if isinstance(item, dict):
            for key in ("id",):
                if isinstance(item.get(key), str):
                    names.add(item[key])
    # llama.cpp lists aliases too
    for item in data:
        if isinstance(item, dict) and isinstance(item.get("aliases"), list):
            names.update(a for a in item["aliases"] if isinstance(a, str))
    return names
