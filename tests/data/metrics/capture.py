"""Capture a real engine's /metrics while requests are in flight:

    python tests/data/metrics/capture.py URL MODEL OUT_NAME [--concurrency N] [--max-tokens N]

writes tests/data/metrics/OUT_NAME. One request first, so the counters are non-zero; then `concurrency`
completions at once, and the metrics are read a second later, while they run (and, with more of them than
the engine's slots, while some wait).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import aiohttp


async def capture(url: str, model: str, concurrency: int, max_tokens: int) -> str:
    async with aiohttp.ClientSession() as session:

        async def complete(i: int) -> None:
            body = {"model": model, "prompt": f"Count from {i} to 100:", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()

        await complete(0)
        tasks = [asyncio.create_task(complete(i)) for i in range(concurrency)]
        await asyncio.sleep(1.0)
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
        await asyncio.gather(*tasks)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("model")
    parser.add_argument("out_name", help="file name under tests/data/metrics/")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    text = asyncio.run(capture(args.url.rstrip("/"), args.model, args.concurrency, args.max_tokens))
    (Path(__file__).parent / args.out_name).write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
