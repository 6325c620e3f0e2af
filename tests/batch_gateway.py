"""A gateway process serving the Batch API, for tests/test_batches.py's restart test: it reaches the test's registry
over its HTTP API (no Ray driver), serves the pool app (`serving_pool`) with `--batches` on `--port`, says `ready`
on stdout, and serves until it is killed.

    python -m tests.batch_gateway --state-dir S --port P --batches DIR
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from fedpool.clients.poolapp import serving_pool
from fedpool.federation import DispatchConfig, PoolConnection
from fedpool.registry.auth import resolve_client_token
from fedpool.registry.httpclient import find_registry_api


async def serve(args: argparse.Namespace) -> None:
    state = Path(args.state_dir)
    api = await asyncio.to_thread(find_registry_api, url=None, state_dir=state,
                                  token=resolve_client_token(state_dir=state))
    assert api is not None, "no registry API in the state dir"
    config = DispatchConfig(no_server_timeout_s=5.0, client_order="shortest_first")
    async with PoolConnection(api, config=config) as pool:
        await pool.refresh()
        async with serving_pool(pool, "<html></html>", "127.0.0.1", args.port, batches_dir=Path(args.batches)):
            print("ready", flush=True)
            await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--batches", required=True)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
