"""A continuous-batching engine model: the timing core of the emulated vLLM/SGLang servers.

As vLLM's V1 scheduler and SGLang's scheduler do: waiting requests join the running batch first-come-first-served
while it has fewer than `max_running` sequences and the KV cache has room for the prompt. Every step decodes one
token for each running sequence past its prefill and spends the rest of its token budget (`max_batched_tokens`,
chunked prefill) on prompts; it costs `decode_s_per_token × (1 + batch_slowdown × (n − 1))`
`+ attn_s_per_ctx_token × Σ context + prefill_s_per_token × prefill tokens`. A decode step that would not fit the
KV budget preempts the most recently admitted sequence (recompute preemption). Prompts are hashed in blocks of
`BLOCK` tokens; leading blocks already computed are not prefilled again (an LRU prefix cache). Steps with no
prefill are taken in runs — the engine sleeps until a sequence would finish or a request could join — so
thousands of sequences cost a few wake-ups, not one per token.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

BLOCK = 16  # tokens per KV block (vLLM's default block size)


class StepProfile(Protocol):
    # Read-only members, so a frozen dataclass (EmulatorProfile) satisfies the protocol.
    @property
    def max_running(self) -> int: ...
    @property
    def prefill_s_per_token(self) -> float: ...
    @property
    def decode_s_per_token(self) -> float: ...
    @property
    def batch_slowdown(self) -> float: ...
    @property
    def attn_s_per_ctx_token(self) -> float: ...
    @property
    def kv_cache_tokens(self) -> int | None: ...
    @property
    def max_batched_tokens(self) -> int: ...
    @property
    def prefix_cache(self) -> bool: ...
    @property
    def abort_check_s(self) -> float: ...


class PromptTooLong(Exception):
    """The prompt alone needs more KV than the engine has: the engine rejects it (HTTP 400)."""


class Aborted(Exception):
    """The request was aborted by its id (`BatchEngine.abort`, SGLang's /abort_request)."""


@dataclass(frozen=True, slots=True)
class Generation:
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    queued_s: float
    preempted: int


@dataclass(eq=False)
class _Seq:
    prompt_tokens: int
    out_tokens: int
    blocks: tuple[int, ...]
    fut: asyncio.Future[Generation]
    arrived: float
    prefill_left: int = 0
    cached: int = 0
    decoded: int = 0
    admitted_at: float | None = None
    preempted: int = 0
    rid: str | None = None  # the caller's id for it, by which it may be aborted
    on_first_token: Callable[[], None] | None = None  # called once, as the step that ends its prompt samples

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.decoded


@dataclass
class EngineCounters:
    prompt_tokens: int = 0  # prefilled (cache hits excluded), as the engines count
    generation_tokens: int = 0
    finished: int = 0
    preemptions: int = 0
    prefix_queries: int = 0  # tokens looked up in the prefix cache
    prefix_hits: int = 0  # tokens found there
    steps: int = 0
    busy_s: float = 0.0  # engine time (unscaled) spent in steps with work


def prompt_blocks(words: Sequence[str]) -> tuple[int, ...]:
    """Chained hashes of the prompt's full blocks: block i's hash covers every token before it."""
    hashes: list[int] = []
    prev = 0
    for start in range(0, len(words) - len(words) % BLOCK, BLOCK):
        prev = hash((prev, tuple(words[start:start + BLOCK])))
        hashes.append(prev)
    return tuple(hashes)


class BatchEngine:
    """`gen = await engine.generate(prompt_tokens, out_tokens, blocks)`; one loop task per engine."""

    def __init__(
        self,
        profile: StepProfile,
        *,
        speedup: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.profile = profile
        self._speedup = speedup
        self._clock = clock
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._kv_used = 0
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._arrival = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._rids: dict[str, _Seq] = {}  # sequences in the engine that carry an id, by it
        self.counters = EngineCounters()

    # ---- state read by the metrics endpoint -------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        budget = self.profile.kv_cache_tokens
        if budget is None:
            return len(self._running) / max(1, self.profile.max_running)
        return min(1.0, self._kv_used / budget)

    # ---- requests -----------------------------------------------------------------------------------
    async def generate(self, prompt_tokens: int, out_tokens: int, blocks: tuple[int, ...] = (),
                       rid: str | None = None, on_first_token: Callable[[], None] | None = None) -> Generation:
        """Run one request to its end; `rid`: the caller's id for it (`abort`); `on_first_token`: called as its
        prompt is done and its first token sampled (where a streamed answer's first event would go out). Raises
        PromptTooLong, or Aborted when aborted by its id."""
        budget = self.profile.kv_cache_tokens
        if budget is not None and prompt_tokens + 1 > budget:
            raise PromptTooLong(f"prompt of {prompt_tokens} tokens exceeds the KV cache ({budget} tokens)")
        p = self.profile
        if p.decode_s_per_token <= 0 and p.prefill_s_per_token <= 0 and p.attn_s_per_ctx_token <= 0:
            # An engine with no cost model (overhead benchmarks): answer at once, no scheduling hops.
            self.counters.finished += 1
            self.counters.prompt_tokens += prompt_tokens
            self.counters.generation_tokens += max(1, out_tokens)
            if on_first_token is not None:
                on_first_token()
            return Generation(prompt_tokens, 0, max(1, out_tokens), 0.0, 0)
        loop = asyncio.get_running_loop()
        seq = _Seq(prompt_tokens, max(1, out_tokens), blocks, loop.create_future(), self._clock(), rid=rid,
                   on_first_token=on_first_token)
        if rid is not None:
            self._rids[rid] = seq
        self._waiting.append(seq)
        self._arrival.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop(), name="emulated-engine")
        try:
            return await asyncio.shield(seq.fut)
        except asyncio.CancelledError:
            check = self.profile.abort_check_s
            if check > 0 and not seq.fut.done():
                # The engine looks for a gone client only every `check` engine seconds of waiting for the
                # sequence's output (SGLang): until that tick the sequence keeps its place, queued or running.
                waited = (self._clock() - seq.arrived) * self._speedup
                loop.call_later((check - waited % check) / self._speedup, self._abort, seq)
            else:
                self._abort(seq)  # the client went away: the engine frees the sequence, as vLLM does
            raise

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for seq in [*self._waiting, *self._running]:
            if not seq.fut.done():
                seq.fut.cancel()
        self._waiting.clear()
        self._running.clear()
        self._rids.clear()
        self._kv_used = 0

    def abort(self, rid: str) -> bool:
        """Drop the request with this id at once, queued or running (SGLang's /abort_request); its caller, if
        still waiting, gets Aborted. False: no such request here (ended, or never came)."""
        seq = self._rids.get(rid)
        if seq is None:
            return False
        self._abort(seq)
        if not seq.fut.done():
            seq.fut.set_exception(Aborted(rid))
            seq.fut.exception()  # (retrieved: a caller that went away does not leave it unread)
        return True

    def _forget_rid(self, seq: _Seq) -> None:
        """The sequence left the engine: its id no longer aborts anything (another request may carry it next)."""
        if seq.rid is not None and self._rids.get(seq.rid) is seq:
            del self._rids[seq.rid]

    def _abort(self, seq: _Seq) -> None:
        self._forget_rid(seq)
        if seq in self._running:
            self._running.remove(seq)
            self._kv_used -= seq.context - seq.prefill_left
        elif seq in self._waiting:
            self._waiting.remove(seq)

    # ---- the scheduler loop --------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[_Seq, int]]:
        """One step's prompt work, as vLLM V1 schedules it: running sequences' unfinished prompts first,
        then waiting requests first-come-first-served, each taking what is left of the step's token budget
        (after one token per decoding sequence) and needing KV room for the chunk. A request only leaves
        the waiting queue when its first chunk is scheduled, so `waiting` is the engine's real queue."""
        p = self.profile
        kv_budget = p.kv_cache_tokens
        decoding = sum(1 for s in self._running if s.prefill_left == 0)
        tokens = max(0, p.max_batched_tokens - decoding)
        kv_free = (kv_budget - self._kv_used - decoding) if kv_budget is not None else None
        chunks: list[tuple[_Seq, int]] = []
        for seq in self._running:
            if seq.prefill_left and tokens > 0:
                take = min(seq.prefill_left, tokens)
                if kv_free is not None:
                    take = min(take, kv_free)
                    if take <= 0:
                        break
                    kv_free -= take
                chunks.append((seq, take))
                tokens -= take
        while self._waiting and tokens > 0 and len(self._running) < p.max_running:
            seq = self._waiting[0]
            cached = min(self._cached_tokens(seq), seq.context - 1) if p.prefix_cache else 0
            take = min(seq.context - cached, tokens)
            if kv_free is not None:
                # The cached blocks are shared, the chunk needs room; do not start a prompt that the cache
                # could never hold beside what runs (it would only be preempted again).
                if take > kv_free or (self._running and seq.context - cached > kv_free + cached):
                    break
                kv_free -= take
            self._waiting.popleft()
            if p.prefix_cache:
                self.counters.prefix_queries += seq.prompt_tokens
                self.counters.prefix_hits += cached
            seq.cached = cached
            seq.prefill_left = seq.context - cached  # a resumed sequence recomputes its generated tokens too
            self._kv_used += cached
            if seq.admitted_at is None:
                seq.admitted_at = self._clock()
            self._running.append(seq)
            chunks.append((seq, take))
            tokens -= take
        return chunks

    def _cached_tokens(self, seq: _Seq) -> int:
        hits = 0
        for block in seq.blocks:
            if block not in self._cache:
                break
            self._cache.move_to_end(block)
            hits += 1
        return hits * BLOCK

    def _remember(self, seq: _Seq) -> None:
        capacity = (self.profile.kv_cache_tokens or 1 << 22) // BLOCK
        for block in seq.blocks:
            self._cache[block] = None
            self._cache.move_to_end(block)
        while len(self._cache) > capacity:
            self._cache.popitem(last=False)

    def _step_cost(self, prefill_tokens: int) -> float:
        p = self.profile
        n = len(self._running)
        context = sum(s.context - s.prefill_left for s in self._running)
        return (
            p.decode_s_per_token * (1 + p.batch_slowdown * max(0, n - 1))
            + p.attn_s_per_ctx_token * context
            + p.prefill_s_per_token * prefill_tokens
        )

    def _finish_done(self) -> None:
        now = self._clock()
        keep = []
        for seq in self._running:
            if seq.prefill_left == 0 and seq.decoded >= seq.out_tokens:
                self._kv_used -= seq.context
                self.counters.finished += 1
                self._forget_rid(seq)
                if not seq.fut.done():
                    queued = (now if seq.admitted_at is None else seq.admitted_at) - seq.arrived
                    seq.fut.set_result(Generation(seq.prompt_tokens, seq.cached, seq.decoded, queued, seq.preempted))
            else:
                keep.append(seq)
        self._running = keep

    def _preempt_one(self) -> None:
        victim = self._running.pop()  # the most recently admitted, as vLLM's FCFS policy preempts
        self._kv_used -= victim.context - victim.prefill_left
        victim.preempted += 1
        self.counters.preemptions += 1
        self._waiting.appendleft(victim)

    async def _sleep_engine_time(self, engine_s: float) -> None:
        if engine_s > 0:
            await asyncio.sleep(engine_s / self._speedup)

    def _log(self, engine_s: float) -> None:
        self.counters.steps += 1
        self.counters.busy_s += engine_s

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._arrival.clear()
                await self._arrival.wait()
                continue
            self._arrival.clear()
            chunks = self._schedule()
            if chunks:
                await self._prefill_step(chunks)
            elif any(s.prefill_left for s in self._running):
                self._preempt_one()  # a prompt stalled mid-way for lack of KV: free the newest sequence
                continue
            elif self._running:
                await self._decode_run()
            else:  # one waiting request that cannot fit the KV cache even alone
                seq = self._waiting.popleft()
                seq.fut.set_exception(PromptTooLong("request does not fit the KV cache"))
                continue
            self._finish_done()

    async def _prefill_step(self, chunks: list[tuple[_Seq, int]]) -> None:
        p = self.profile
        chunked = {id(seq) for seq, _ in chunks}
        decoding = [s for s in self._running if s.prefill_left == 0 and id(s) not in chunked]
        prefill = sum(take for _, take in chunks)
        cost = self._step_cost(prefill)
        await self._sleep_engine_time(cost)
        for seq in decoding:
            seq.decoded += 1
        self._kv_used += prefill + len(decoding)
        self.counters.prompt_tokens += prefill
        self.counters.generation_tokens += len(decoding)
        for seq, take in chunks:
            seq.prefill_left -= take
            if seq.prefill_left == 0:
                if p.prefix_cache:
                    self._remember(seq)
                seq.decoded += 1  # the step that completes a prompt samples its first token
                if seq.on_first_token is not None:
                    seq.on_first_token()
                    seq.on_first_token = None
                self._kv_used += 1
                self.counters.generation_tokens += 1
        self._log(cost)

    async def _decode_run(self) -> None:
        p = self.profile
        n = len(self._running)
        steps = min(s.out_tokens - s.decoded for s in self._running)
        budget = p.kv_cache_tokens
        if budget is not None:
            fit = (budget - self._kv_used) // n
            if fit < 1:
                self._preempt_one()
                return
            steps = min(steps, fit)
        steps = max(1, steps)
        cost = self._step_cost(0)
        start = self._clock()
        # An arrival can only change this run if it could be admitted now: a free slot and KV room.
        can_join = not self._waiting and len(self._running) < p.max_running
        done = steps
        if cost <= 0:
            await asyncio.sleep(0)
        elif not can_join:
            await self._sleep_engine_time(cost * steps)
        else:
            try:
                await asyncio.wait_for(self._arrival.wait(), timeout=cost * steps / self._speedup)
                # Someone arrived mid-run: finish the step in progress, then let the scheduler admit.
                elapsed = (self._clock() - start) * self._speedup
                done = min(steps, max(1, math.ceil(elapsed / cost - 1e-9)))
                await self._sleep_engine_time(done * cost - elapsed)
            except TimeoutError:
                pass
        for seq in self._running:
            seq.decoded += done
        self._kv_used += n * done
        self.counters.generation_tokens += n * done
        self._log(cost * done)
