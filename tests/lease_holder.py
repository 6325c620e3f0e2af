"""A process holding capacity leases, for tests/test_leases_processes.py: it joins the test's Ray cluster and
registry, sends `--requests` requests of one client `--concurrency` at a time, and writes one JSON line every
50 ms (what it holds and has in flight) and one per answer (the request id): the test reads the file.

    python -m tests.lease_holder --address A --state-dir S --client NAME --requests N --out FILE [--linger S] [--http]

With `--http` it reaches the registry over its HTTP API and is no Ray driver (its last line says whether Ray was
imported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from fedpool.federation import DispatchConfig, Endpoint, InferenceRequest, PoolConnection
from fedpool.registry import PoolRegistry
from fedpool.registry.auth import resolve_client_token
from fedpool.registry.httpclient import find_registry_api


async def hold(args: argparse.Namespace) -> None:
    registry: PoolRegistry
    if args.http:
        api = await asyncio.to_thread(find_registry_api, url=None, state_dir=Path(args.state_dir),
                                      token=resolve_client_token(state_dir=Path(args.state_dir)))
        assert api is not None, "no registry API in the state dir"
        registry = api
    else:
        from fedpool.registry import RegistryClient

        registry = await RegistryClient.connect(state_dir=Path(args.state_dir))
    out = await asyncio.to_thread(Path(args.out).open, "a", encoding="utf-8")

    def write(**fields: object) -> None:
        out.write(json.dumps({"t": time.time(), **fields}) + "\n")
        out.flush()

    async with PoolConnection(registry, config=DispatchConfig(client_order=args.order)) as pool:
        dispatcher = pool.dispatcher
        left = [args.requests]
        dispatcher.set_client_remaining(args.client, float(args.requests * args.max_tokens), args.requests)
        write(started=True, holder=pool.lease_holder)

        async def watch() -> None:
            while True:
                write(held=dispatcher.held(), inflight=sum(dispatcher.inflight().values()))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        pending = list(range(args.requests))

        async def worker() -> None:
            while pending:
                i = pending.pop()
                request = InferenceRequest.from_body({"prompt": f"{args.client} question {i}", "max_tokens":
                                                      args.max_tokens}, request_id=f"{args.client}-{i}",
                                                     model=args.model, endpoint=Endpoint.COMPLETIONS,
                                                     client_id=args.client)
                result = await dispatcher.submit(request)
                left[0] -= 1
                dispatcher.set_client_remaining(args.client, float(left[0] * args.max_tokens), left[0])
                write(answered=result.request_id, server=result.server_id)

        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, max(1, args.requests)))))
        write(done=args.requests)
        await asyncio.sleep(args.linger)
        watcher.cancel()
    await registry.aclose()
    write(ray_imported="ray" in sys.modules)
    out.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--client", required=True)
    parser.add_argument("--model", default="emu-model")
    parser.add_argument("--requests", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--order", default="fair")
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--http", action="store_true")
    args = parser.parse_args()
    if not args.http:
        from fedpool.deploy.localpool import init_loopback_ray

        init_loopback_ray(args.address)
    asyncio.run(hold(args))


if __name__ == "__main__":
    main()
