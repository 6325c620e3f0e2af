"""Capture llama-server's /metrics while requests are in flight: `python capture_llamacpp.py URL MODEL`."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp


async def main(url: str, model: str) -> None:
    async with aiohttp.ClientSession() as session:

        async def complete(i: int) -> None:
            body = {"model": model, "prompt": f"Count from {i} to 100:", "max_tokens": 64, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()

        await complete(0)  # so the counters are non-zero
        tasks = [asyncio.create_task(complete(i)) for i in range(4)]
        await asyncio.sleep(1.0)
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
        await asyncio.gather(*tasks)
    (Path(__file__).parent / "llamacpp.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
