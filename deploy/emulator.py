"""An OpenAI-compatible server that speaks like vLLM or SGLang (metric names, labels, health, extra
endpoints), for tests and benchmarks without GPUs.

Timing comes from `deploy.batching.BatchEngine`, a continuous-batching model (admission up to
`max_running`, chunked prefill, per-step decode cost growing with the batch, KV budget with
preemption, prefix cache). Profiles (`deploy.emulator_profiles`, re-exported here) say where their figures come
from.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fedpool.deploy.batching import Aborted, BatchEngine, Generation, PromptTooLong, prompt_blocks
from fedpool.deploy.emulator_profiles import PROFILES, SGLANG_ABORT_CHECK_S, EmulatorProfile, profile_from_json

__all__ = ["PROFILES", "SGLANG_ABORT_CHECK_S", "EmulatedServer", "EmulatorProfile", "Faults", "main",
           "profile_from_json", "request_shape"]

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")


@dataclass(frozen=True, slots=True)
class Faults:
    """Fault injection: every figure is off by default."""

    error_rate: float = 0.0  # fraction of requests answered with HTTP 500
    malformed_rate: float = 0.0  # fraction answered 200 with a body that is not a completion
    hang: bool = False  # accept requests, never answer
    crash_after: int | None = None  # close the listener after this many completions


@dataclass
class _Stats:
    running: int = 0
    waiting: int = 0
    completed: int = 0
    generation_tokens: int = 0
    prompt_tokens: int = 0
    requests_by_status: dict[str, int] = field(default_factory=dict)


class EmulatedServer:
    """`server = EmulatedServer(model="m"); await server.start(); ...; await server.stop()`."""

    def __init__(
        self,
        *,
        model: str,
        profile: EmulatorProfile | None = None,
        faults: Faults | None = None,
        seed: int = 0,
        speedup: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 0,
        per_request_metrics: bool = False,
    ):
        self.model = model
        # vLLM's `--enable-per-request-metrics` (a vllm-protocol profile): each non-streamed answer carries a `metrics`
        # object — time to first token from its scheduling, generation time after it, and queue time, in ms
        self.per_request_metrics = per_request_metrics
        self._profile = profile or EmulatorProfile()
        self.faults = faults or Faults()
        self._rng = random.Random(seed)
        self._seed = seed
        self._speedup = speedup
        self._host = host
        self._port = port
        self._stats = _Stats()
        self.engine = BatchEngine(self.profile, speedup=speedup)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._hung: list[asyncio.Future[None]] = []
        self.url = ""

    @property
    def profile(self) -> EmulatorProfile:
        return self._profile

    @profile.setter
    def profile(self, profile: EmulatorProfile) -> None:
        """Change the engine's speed while it runs (tests of learning and breakers)."""
        self._profile = profile
        self.engine.profile = profile

    @property
    def stats(self) -> _Stats:
        s = self._stats
        s.running, s.waiting = self.engine.running, self.engine.waiting
        return s

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        if self.profile.protocol == "sglang":
            for path in ("/server_info", "/get_server_info"):
                app.router.add_get(path, self._server_info)
            for path in ("/v1/loads", "/get_load"):
                app.router.add_get(path, self._loads)
            app.router.add_post("/abort_request", self._abort_request)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def start(self) -> str:
        # A short shutdown grace: stopping the emulator behaves like a killed engine, not a polite drain.
        # handler_cancellation: a client that goes away aborts its request, as vLLM and SGLang abort a
        # disconnected request's sequence (the loser of a hedge race frees its place in the batch).
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, shutdown_timeout=0.2,
                                     handler_cancellation=True)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self._host, self._port)
        await self._site.start()
        sockets = self._site._server.sockets  # type: ignore[union-attr]
        self._port = sockets[0].getsockname()[1]
        self.url = f"http://{self._host}:{self._port}"
        return self.url

    async def stop(self) -> None:
        for fut in self._hung:
            if not fut.done():
                fut.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.close()

    async def crash(self) -> None:
        """Stop listening and drop every connection, like a killed process."""
        await self.stop()

    # ---- handlers -----------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fedpool-emulator"}]}
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        """SGLang's server info: the fields clients read (max_running_requests, model path, version)."""
        kv = {"max_total_num_tokens": self.profile.kv_cache_tokens} if self.profile.kv_cache_tokens else {}
        return web.json_response({
            "model_path": self.model, "served_model_name": self.model, "tp_size": 1, "dp_size": 1,
            "max_running_requests": self.profile.max_running, "enable_metrics": True, **kv,
            "version": "emulated", "internal_states": [{"max_running_requests": self.profile.max_running}],
        })

    async def _abort_request(self, request: web.Request) -> web.Response:
        """SGLang's abort by request id (`{"rid": ...}`, the id a completion request carried as `rid`): the request
        leaves the engine at once, queued or running. 200 whether or not it was still there, as SGLang answers."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            return web.json_response({"error": {"message": "rid must be a non-empty string",
                                                "type": "BadRequestError"}}, status=400)
        self.engine.abort(rid)
        return web.Response()

    async def _loads(self, request: web.Request) -> web.Response:
        s = self.stats
        return web.json_response([{"dp_rank": 0, "num_reqs": s.running + s.waiting, "num_waiting_reqs": s.waiting,
                                   "num_running_reqs": s.running}])

    def _sglang_metrics(self) -> str:
        s = self.stats
        labels = f'model_name="{self.model}",tp_rank="0",dp_rank="0"'
        c = self.engine.counters
        hit_rate = c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0
        gen_tps = s.running / max(self.profile.decode_s_per_token, 1e-9) * self._speedup if s.running else 0.0
        return (
            "# HELP sglang:num_running_reqs The number of running requests.\n"
            "# TYPE sglang:num_running_reqs gauge\n"
            f"sglang:num_running_reqs{{{labels}}} {float(s.running)}\n"
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
            "# TYPE sglang:num_queue_reqs gauge\n"
            f"sglang:num_queue_reqs{{{labels}}} {float(s.waiting)}\n"
            "# HELP sglang:token_usage The token usage\n"
            "# TYPE sglang:token_usage gauge\n"
            f"sglang:token_usage{{{labels}}} {self.engine.kv_usage:.4f}\n"
            "# HELP sglang:gen_throughput The generation throughput (token/s).\n"
            "# TYPE sglang:gen_throughput gauge\n"
            f"sglang:gen_throughput{{{labels}}} {gen_tps:.2f}\n"
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE sglang:generation_tokens_total counter\n"
            f"sglang:generation_tokens_total{{{labels}}} {float(s.generation_tokens)}\n"
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n"
            "# TYPE sglang:prompt_tokens_total counter\n"
            f"sglang:prompt_tokens_total{{{labels}}} {float(s.prompt_tokens)}\n"
            "# HELP sglang:cache_hit_rate The prefix cache hit rate.\n"
            "# TYPE sglang:cache_hit_rate gauge\n"
            f"sglang:cache_hit_rate{{{labels}}} {hit_rate:.4f}\n"
        )

    def _emulator_metrics(self) -> str:
        """The emulator's own accounting (no engine has these): engine-seconds of steps and step count, so a
        benchmark can check that the emulated GPU computed for as long as wall time × speedup says."""
        c = self.engine.counters
        return (
            "# HELP fedpool_emulator_busy_seconds_total Engine seconds spent in steps with work.\n"
            "# TYPE fedpool_emulator_busy_seconds_total counter\n"
            f"fedpool_emulator_busy_seconds_total {c.busy_s:.6f}\n"
            "# HELP fedpool_emulator_steps_total Engine steps taken.\n"
            "# TYPE fedpool_emulator_steps_total counter\n"
            f"fedpool_emulator_steps_total {float(c.steps)}\n"
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.profile.protocol == "sglang":
            return web.Response(text=self._sglang_metrics() + self._emulator_metrics(), content_type="text/plain",
                                charset="utf-8")
        s, c = self.stats, self.engine.counters
        labels = f'engine="0",model_name="{self.model}"'
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(s.running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {float(s.waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {self.engine.kv_usage:.4f}\n"
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            f"vllm:generation_tokens_total{{{labels}}} {float(s.generation_tokens)}\n"
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
            "# TYPE vllm:prompt_tokens_total counter\n"
            f"vllm:prompt_tokens_total{{{labels}}} {float(s.prompt_tokens)}\n"
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n"
            "# TYPE vllm:num_preemptions_total counter\n"
            f"vllm:num_preemptions_total{{{labels}}} {float(c.preemptions)}\n"
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(c.prefix_queries)}\n"
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(c.prefix_hits)}\n"
        ) + self._cache_config() + self._emulator_metrics()
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def _cache_config(self) -> str:
        """vLLM's `cache_config_info` (an info gauge whose labels carry the KV cache's blocks), when the profile has a
        KV budget: blocks of 16 tokens, as vLLM's default block size."""
        kv = self.profile.kv_cache_tokens
        if not kv:
            return ""
        return ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",'
                f'num_gpu_blocks="{kv // 16}",num_cpu_blocks="0"}} 1.0\n')

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "body is not JSON", "type": "invalid_request"}}, status=400)
        refused = self._refusal(body)
        if refused is not None:
            return refused
        if self.faults.hang:
            fut = asyncio.get_running_loop().create_future()
            self._hung.append(fut)
            await fut
        roll = self._rng.random()
        if roll < self.faults.error_rate:
            self._count("500")
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        prompt, words, prompt_tokens, out_tokens = request_shape(body, chat, self.profile, self._seed)
        if self.profile.request_overhead_s > 0:
            await asyncio.sleep(self.profile.request_overhead_s / self._speedup)
        rid = body.get("rid") if self.profile.protocol == "sglang" else None
        timed = self.per_request_metrics and self.profile.protocol == "vllm"
        loop = asyncio.get_running_loop()
        began, first = loop.time(), []
        try:
            gen = await self.engine.generate(prompt_tokens, out_tokens, prompt_blocks(words),
                                             rid if isinstance(rid, str) else None,
                                             (lambda: first.append(loop.time())) if timed else None)
        except PromptTooLong as exc:
            self._count("400")
            return web.json_response({"error": {"message": str(exc), "type": "BadRequestError"}}, status=400)
        except Aborted:
            self._count("400-aborted")
            return web.json_response({"error": {"message": "Request aborted", "type": "BadRequestError"}},
                                     status=400)
        self._stats.prompt_tokens += prompt_tokens
        self._stats.generation_tokens += out_tokens
        cached = gen.cached_tokens
        if roll < self.faults.error_rate + self.faults.malformed_rate:
            self._count("200-malformed")
            return web.Response(text='{"choices": [{"text": ', content_type="application/json")
        text = self._answer(prompt, out_tokens)
        self._stats.completed += 1
        self._count("200")
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": out_tokens,
                                 "total_tokens": prompt_tokens + out_tokens}
        if body.get("stream"):
            options = body.get("stream_options")
            return await self._stream(request, text, chat,
                                      usage if isinstance(options, dict) and options.get("include_usage") else None)
        if self.faults.crash_after is not None and self._stats.completed >= self.faults.crash_after:
            asyncio.get_running_loop().create_task(self.crash())
        if self.profile.prefix_cache:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        timing = (began, first[0], gen) if timed and first else None
        return web.json_response(self._completion(text, chat, usage, timing))

    def _refusal(self, body: Any) -> web.Response | None:
        """The error answer to a request body the engine refuses (not an object, another model, max_tokens < 1)."""
        if not isinstance(body, dict) or body.get("model") != self.model:
            return web.json_response(
                {"error": {"message": f"model must be {self.model!r}", "type": "NotFoundError"}}, status=404
            )
        max_tokens_given = body.get("max_tokens", self.profile.default_output_tokens)
        if not isinstance(max_tokens_given, int) or max_tokens_given < 1:
            return web.json_response(
                {"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError"}}, status=400
            )
        return None

    def _completion(self, text: str, chat: bool, usage: dict[str, Any],
                    timing: tuple[float, float, Generation] | None) -> dict[str, Any]:
        """A non-streamed answer; `timing` (when it began, its first token, its generation): vLLM's per-request
        `metrics`."""
        created = int(time.time())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
            obj = "text_completion"
        answer: dict[str, Any] = {"id": f"cmpl-{self._stats.completed}", "object": obj, "created": created,
                                  "model": self.model, "choices": [choice], "usage": usage}
        if timing is not None:
            began, first, gen = timing
            queued = gen.queued_s / self._speedup
            answer["metrics"] = {"time_to_first_token_ms": max(0.0, first - began - queued) * 1000,
                                 "generation_time_ms": (asyncio.get_running_loop().time() - first) * 1000,
                                 "queue_time_ms": queued * 1000}
        return answer

    async def _stream(self, request: web.Request, text: str, chat: bool,
                      usage: dict[str, Any] | None) -> web.StreamResponse:
        """Server-sent events in vLLM's format, one token a chunk, with `stream_options.include_usage` an event
        with no choices and the usage, then `data: [DONE]`."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created, rid = int(time.time()), f"cmpl-{self._stats.completed}"
        words = text.split(" ")[1:]
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, word in enumerate(words):
            last = i == len(words) - 1
            piece = " " + word
            if chat:
                delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": "length" if last else None}
            chunk = {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [choice]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if usage is not None:
            chunk = {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _answer(self, prompt: str, tokens: int) -> str:
        """Deterministic in (seed, prompt): the same request gets the same answer from any replica."""
        digest = hashlib.sha256(f"{self._seed}:{prompt}".encode()).digest()
        return " " + " ".join(WORDS[digest[i % len(digest)] % len(WORDS)] for i in range(tokens))

    def _count(self, status: str) -> None:
        self._stats.requests_by_status[status] = self._stats.requests_by_status.get(status, 0) + 1


def request_shape(body: Mapping[str, Any], chat: bool, profile: EmulatorProfile,
                  seed: int) -> tuple[str, list[str], int, int]:
    """What the emulated engine makes of a request body: (prompt text, its words, prompt tokens, answer tokens).
    A token is a word; the answer is `max_tokens` long with `ignore_eos` (vLLM's extension), else where the
    model stops: the profile's answer length, or earlier by a prompt-determined fraction (`output_spread`).
    Shared by the HTTP emulator and the in-process simulator (benchmarks/simulator.py)."""
    max_tokens = body.get("max_tokens", profile.default_output_tokens)
    prompt = _prompt_text(body, chat)
    words = prompt.split()
    if body.get("ignore_eos") is True:
        return prompt, words, max(1, len(words)), max_tokens
    limit = min(max_tokens, profile.default_output_tokens)
    spread = profile.output_spread
    if spread > 0:
        u = int.from_bytes(hashlib.sha256(f"len:{seed}:{prompt}".encode()).digest()[:4], "big") / 2**32
        limit = max(1, round(limit * (1 - spread * u)))
    return prompt, words, max(1, len(words)), limit


def _prompt_text(body: Mapping[str, Any], chat: bool) -> str:
    if not chat:
        prompt = body.get("prompt", "")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    parts = []
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            content = message.get("content")
            parts.append(content if isinstance(content, str) else json.dumps(content))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    """`python -m fedpool.deploy.emulator --model NAME --port N [--profile P] [--speedup K] [faults]`."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m fedpool.deploy.emulator", description="vLLM-style emulated server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0: a free port of its choosing (printed)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="tiny")
    parser.add_argument("--profile-json", help="a full profile as JSON (overrides --profile)")
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--malformed-rate", type=float, default=0.0)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--crash-after", type=int)
    parser.add_argument("--enable-per-request-metrics", action="store_true",
                        help="as vLLM's flag: each answer carries its own timings (`metrics`)")
    args = parser.parse_args(argv)
    try:
        profile = profile_from_json(args.profile_json) if args.profile_json else PROFILES[args.profile]
    except (ValueError, TypeError) as exc:
        parser.error(f"--profile-json: {exc}")

    async def run() -> None:
        server = EmulatedServer(
            model=args.model, profile=profile, seed=args.seed, speedup=args.speedup,
            host=args.host, port=args.port, per_request_metrics=args.enable_per_request_metrics,
            faults=Faults(error_rate=args.error_rate, malformed_rate=args.malformed_rate, hang=args.hang,
                          crash_after=args.crash_after),
        )
        await server.start()
        print(f"emulated {profile.name} server for {args.model} on {server.url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(run())


if __name__ == "__main__":
    main()
