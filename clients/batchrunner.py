"""Runs the Batch API's batches (federation/gateway/batches.py takes them in) over the pool's dispatcher. Each batch
is one client of the dispatcher that says, before its first request, how many requests it has left and their shape,
so batches are served shortest first and planned over server kinds as fedpool's evals are, behind every online
caller (background clients: they fill the capacity online traffic leaves, and hand over no more while the
gateway's loop is behind). Each line's result is kept in the store as it ends, a few at a time;
after a restart a batch sends only the lines that have none, so each custom_id lands once in its output or error
file. Retries are the dispatcher's, as for an online request; a line that fails after them goes to the error file
with the gateway's answer for it and the batch goes on. While no server serves its model a batch waits, its window
running. Cancel sends nothing more and lets what is in flight end; expiry stops what is in flight too."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

from fedpool.federation import (
    Dispatcher,
    Endpoint,
    InferenceRequest,
    NoServerError,
    PoolSnapshot,
    RequestFailed,
    ServerEntry,
)
from fedpool.federation.gateway.answers import dumps, loads
from fedpool.federation.gateway.batchstore import (
    BatchStore,
    InputSummary,
    LineResult,
    RequestLine,
    StoredBatch,
    iter_lines,
    new_id,
    parse_line,
)
from fedpool.federation.gateway.handlers import answer_bytes, upstream_failure
from fedpool.federation.gateway.state import LAG_LIMIT_S, Overload
from fedpool.federation.routing.pricing import step_cost
from fedpool.pipeline.ownership import DirectoryLock

log = logging.getLogger("fedpool.batches")

MIN_WAITING = 8  # requests a batch keeps handed to the dispatcher, at least ...
MAX_WAITING = 1024  # ... at most, and otherwise twice its model's slots: enough to fill them as answers come back
READ_LINES = 256  # input lines read at a time
FLUSH_S = 0.2  # results wait at most this long to be kept (a process killed loses at most these: run again)
NO_SERVER_RETRY_S = 5.0
MAX_PASSES = 3  # passes over a batch's input before lines still without a result fail it (a bug, not the pool)
# Batches hand over no more requests while the gateway's event loop is this far behind (half the lag at which
# it refuses online callers, `Overload`): the batch's own answers are what loads it, and online callers go first.
YIELD_LAG_S = LAG_LIMIT_S / 2
YIELD_POLL_S = 0.05
ONLINE_ABOUT_S = 30.0  # online traffic is about (`OnlineReserve`) for this long after its last request
# Servers per model batches leave to online callers while they are about (`OnlineReserve`), by default: a batch is
# background work (OpenAI's Batch API: results within a window, online traffic first), and an online request beside
# batch prefill waits 80-100 times its idle time (docs/operators.md, "Batches and online traffic"); 0 lets batches
# fill every server even then.
ONLINE_RESERVE = 1


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    max_waiting: int = MAX_WAITING
    flush_s: float = FLUSH_S
    no_server_retry_s: float = NO_SERVER_RETRY_S
    yield_lag_s: float | None = YIELD_LAG_S  # None: batches never wait for the loop


class OnlineReserve:
    """`--online-reserve N`: while online callers are about (a request that is not a batch's in the last
    `about_s`), a batch starts nothing new on the N servers of its model an online request is answered soonest on
    (the least data-sheet step time, `pricing.step_cost`; ties by id), and always keeps one server; and while a batch
    has requests left, an online request goes to those N first (`online`: the gateway's steer). Why: a batch fills
    every engine's steps with prompts (up to its chunked-prefill budget, 8,192 tokens a step by default), so an
    online request beside it decodes each token in a step that prefills too (docs/operators.md, "Batches and online
    traffic"); the servers held answer online at idle speed, at the price of their share of the batches' work. Requests
    already there end where they are; when online traffic has been gone `about_s`, batches use every server again."""

    def __init__(self, servers: int, dispatcher: Dispatcher, snapshot: Callable[[], PoolSnapshot | None], *,
                 about_s: float = ONLINE_ABOUT_S):
        self.servers, self.dispatcher, self.snapshot, self.about_s = servers, dispatcher, snapshot, about_s
        self._of: tuple[PoolSnapshot | None, dict[str, tuple[tuple[ServerEntry, ...], tuple[str, ...]]]] = (None, {})

    def pins(self, model: str) -> tuple[str, ...] | None:
        """The servers a batch request for `model` may go to now (None: any of them)."""
        if self.servers <= 0 or not self.dispatcher.online_within(self.about_s):
            return None
        held, rest = self._split(model)
        return rest if held else None

    def online(self, request: InferenceRequest) -> tuple[str, ...] | None:
        """The servers an online request goes to first (None: any): while a batch has requests left, those held
        for online callers, unless each has as many of this gateway's requests in flight as it has slots (online
        traffic past what the reserve holds spreads as it would without one). One online request sent beside the
        batches to a V100 read 4.05 s where the held A100 answered in 0.035 s (the batch bench's Table 7 pool)."""
        if self.servers <= 0 or not self.dispatcher.background_about():
            return None
        held, _ = self._split(request.model)
        ledger = self.dispatcher.ledger  # (per held server: O(N), not O(servers), on each online request)
        if not held or all(ledger.on_server(e.id) >= e.capacity for e in held):
            return None
        return tuple(e.id for e in held)

    def _split(self, model: str) -> tuple[tuple[ServerEntry, ...], tuple[str, ...]]:
        """The servers of `model` held for online callers, and the ids of the rest (none held: a pool of one)."""
        snapshot = self.snapshot()
        if snapshot is None:
            return (), ()
        if self._of[0] is not snapshot:  # (a new snapshot every registry poll: ranked once per model each)
            self._of = (snapshot, {})
        memo = self._of[1]
        if model not in memo:
            view = snapshot.filter(model=model, routable_only=True)
            entries = sorted(view.entries, key=lambda e: (step_cost(e, 1), e.id))
            held = max(0, min(self.servers, len(entries) - 1))
            memo[model] = (tuple(entries[:held]), tuple(sorted(e.id for e in entries[held:])))
        return memo[model]


class BatchRunner:
    """Runs every unfinished batch of a store over one dispatcher; owns the store's directory while it runs."""

    def __init__(self, store: BatchStore, dispatcher: Dispatcher, slots: Callable[[str], int], *,
                 config: RunnerConfig | None = None, clock: Callable[[], float] = time.time,
                 reserve: OnlineReserve | None = None):
        self.store, self.dispatcher, self.reserve = store, dispatcher, reserve
        self.slots = slots  # the slots of the servers that serve a model now
        self.config = config or RunnerConfig()
        self.clock = clock
        self._lock = DirectoryLock(store.root, "fedpool batches")
        self._runs: dict[str, _Run] = {}
        self._lag = Overload(dispatcher)

    async def give_way(self, stopping: Callable[[], bool]) -> None:
        """Wait while the gateway's event loop is behind (`RunnerConfig.yield_lag_s`): batch work is what sheds
        load first, before the gateway refuses an online caller. The lag fades while no grant pass measures it,
        so this never waits for ever."""
        limit = self.config.yield_lag_s
        while limit is not None and not stopping():
            if self._lag.lag_s() <= limit:
                return
            await asyncio.sleep(YIELD_POLL_S)  # (a measure, not an event: polled)

    async def start(self) -> None:
        """Take the batches directory (a second process on it is refused: OwnershipError naming this one) and go on
        with every batch a stopped process left unfinished."""
        await asyncio.to_thread(self._lock.acquire)
        for batch in await asyncio.to_thread(self.store.active):
            self.started(batch.id)

    async def stop(self) -> None:
        """Stop every run: what was in flight is sent again at the next start (a restart is not a cancel)."""
        runs = list(self._runs.values())
        for run in runs:
            run.task.cancel()
        await asyncio.gather(*(run.task for run in runs), return_exceptions=True)
        self._lock.release()

    def started(self, batch_id: str) -> None:
        """A batch to run (new, or left unfinished)."""
        if batch_id not in self._runs:
            run = self._runs[batch_id] = _Run(self, batch_id)
            run.task.add_done_callback(lambda _: self._runs.pop(batch_id, None))

    def cancelled(self, batch_id: str) -> None:
        """The batch was set cancelling: send nothing more of it."""
        run = self._runs.get(batch_id)
        if run is not None:
            run.stop_sending()

    def running(self) -> list[str]:
        return list(self._runs)


class _Run:
    """One batch, from validating to its end."""

    def __init__(self, runner: BatchRunner, batch_id: str):
        self.runner, self.batch_id = runner, batch_id
        self.stopping = False  # nothing more is sent (cancelled or expired)
        self.expired = False
        self._inflight: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._left = 0
        self._results = _Results(runner.store, batch_id, runner.config.flush_s)
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"batch-{batch_id}")

    def stop_sending(self) -> None:
        self.stopping = True
        self._room.set()

    async def _run(self) -> None:
        store, now = self.runner.store, self.runner.clock
        batch: StoredBatch | None = None
        try:
            for _ in range(MAX_PASSES + 4):  # (validating, the passes, finalizing, the end, its read)
                batch = await asyncio.to_thread(store.batch, self.batch_id, None)
                if batch is None or not await self._step(batch):
                    return
            await asyncio.to_thread(store.fail, self.batch_id, "internal_error", f"lines still without a result after "
                                    f"{MAX_PASSES} passes over the input", now())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must end the batch, not leave it running for ever
            log.exception("batch %s failed", self.batch_id)
            await asyncio.to_thread(store.fail, self.batch_id, "internal_error", f"{type(exc).__name__}: {exc}", now())
        finally:
            if batch is not None:
                self._quiet(batch.model)

    async def _step(self, batch: StoredBatch) -> bool:
        """One step of the batch's life; whether there is another."""
        store, now = self.runner.store, self.runner.clock()
        if batch.status == "validating":
            await asyncio.to_thread(store.set_status, batch.id, "in_progress", now, ("validating",))
            return True
        if batch.status == "in_progress" and batch.left > 0 and now < batch.expires_at and not self.expired:
            await self._execute(batch)
            return True
        if batch.status == "in_progress" and batch.left > 0:
            await asyncio.to_thread(store.finalize, batch.id, "expired", now, ("in_progress",))
            return True
        if batch.status == "in_progress":
            await asyncio.to_thread(store.set_status, batch.id, "finalizing", now, ("in_progress",))
            return True
        if batch.status in ("finalizing", "cancelling"):
            final = "completed" if batch.status == "finalizing" else "cancelled"
            await asyncio.to_thread(store.finalize, batch.id, final, now, (batch.status,))
            return True
        return False  # (ended)

    async def _execute(self, batch: StoredBatch) -> None:
        """Send every line of the batch without a result (until stopped), then wait for those in flight."""
        store = self.runner.store
        source = await asyncio.to_thread(store.file, batch.input_file_id, None)
        if source is None or source.summary is None:
            await asyncio.to_thread(store.fail, batch.id, "input_file_missing", f"the input file "
                                    f"{batch.input_file_id} is gone", self.runner.clock())
            return
        done = await asyncio.to_thread(store.done_lines, batch.id)
        self._left = batch.total - len(done)
        self._announce(batch, source.summary)
        loop = asyncio.get_running_loop()
        expiry = loop.call_at(loop.time() + max(0.0, batch.expires_at - self.runner.clock()), self._expire)
        lines = _pending(store.file_path(source.id), done)
        try:
            await self._feed(batch, lines)
            self.runner.dispatcher.client_done_sending(batch.id)
            while self._inflight:
                await asyncio.wait(list(self._inflight))
        finally:
            expiry.cancel()
            with contextlib.suppress(ValueError):  # (a read cancelled mid-way may still hold the generator)
                await asyncio.to_thread(lines.close)
            for task in self._inflight:
                task.cancel()
            await asyncio.gather(*self._inflight, return_exceptions=True)
            await self._results.close()

    def _announce(self, batch: StoredBatch, summary: InputSummary) -> None:
        """Tell the dispatcher what this batch is: its requests left (it is ranked by them × one's work, shortest
        first, and gives way to callers ahead of it), their shape (the planner's prior) and the demand coming."""
        dispatcher = self.runner.dispatcher
        dispatcher.client_done_sending(batch.id, False)
        dispatcher.set_client_shape(batch.id, summary.prompt_tokens,
                                    round(summary.max_tokens) if summary.max_tokens is not None else None)
        dispatcher.set_client_requests_left(batch.id, self._left, background=True)
        dispatcher.expect(batch.id, batch.model, min(self._target(batch.model), self._left))

    def _quiet(self, model: str) -> None:
        """The batch sends nothing more: the dispatcher forgets its size and demand."""
        dispatcher = self.runner.dispatcher
        dispatcher.set_client_requests_left(self.batch_id, None)
        dispatcher.expect(self.batch_id, model, 0)
        dispatcher.client_done_sending(self.batch_id)

    def _target(self, model: str) -> int:
        """How many of its requests the batch keeps handed to the dispatcher."""
        return min(self.runner.config.max_waiting, max(MIN_WAITING, 2 * self.runner.slots(model)))

    async def _feed(self, batch: StoredBatch, lines: Iterator[RequestLine]) -> None:
        """Hand the lines to the dispatcher, keeping `_target` of them there, until all are or the batch stops."""
        endpoint = Endpoint(batch.endpoint)
        while not self.stopping:
            chunk = await asyncio.to_thread(lambda: list(itertools.islice(lines, READ_LINES)))
            if not chunk:
                return
            for line in chunk:
                while len(self._inflight) >= self._target(batch.model) and not self.stopping:
                    self._room.clear()
                    await self._room.wait()
                await self.runner.give_way(lambda: self.stopping)
                if self.stopping:
                    return
                task = asyncio.get_running_loop().create_task(self._one(batch, endpoint, line))
                self._inflight.add(task)
                task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._room.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s: a line's task failed", self.batch_id, exc_info=task.exception())

    def _expire(self) -> None:
        """The completion window is over: nothing more is sent, and what is in flight is given up."""
        self.expired = True
        self.stop_sending()
        for task in self._inflight:
            task.cancel()

    async def _one(self, batch: StoredBatch, endpoint: Endpoint, line: RequestLine) -> None:
        """One line, to its result (kept), or to nothing if the batch stops while no server serves its model."""
        request_id = f"{batch.id}-{line.number}"
        request = InferenceRequest.from_body(line.body, request_id=request_id, model=batch.model, endpoint=endpoint,
                                             client_id=batch.id)
        reserve = self.runner.reserve
        while True:
            if reserve is not None:
                request = dataclasses.replace(request, pinned_servers=reserve.pins(batch.model))
            try:
                result = await self.runner.dispatcher.submit(request)
                break
            except NoServerError:
                if self.stopping:
                    return
                await asyncio.sleep(self.runner.config.no_server_retry_s)
            except RequestFailed as exc:
                status, error, _ = upstream_failure(exc)
                self._done(LineResult(line.number, line.custom_id, False,
                                      response_line(line.custom_id, status, request_id, dumps({"error": error}))))
                return
        completion = result.completion
        body = answer_bytes(completion, batch.model, endpoint, request_id)
        self._done(LineResult(line.number, line.custom_id, True, response_line(line.custom_id, 200, request_id, body),
                              completion.prompt_tokens or 0, completion.completion_tokens or 0))

    def _done(self, result: LineResult) -> None:
        self._results.add(result)
        self._left = max(0, self._left - 1)
        self.runner.dispatcher.set_client_requests_left(self.batch_id, self._left, background=True)


def response_line(custom_id: str, status: int, request_id: str, body: bytes) -> str:
    """An output or error file line with the response the request got (the engine's body as it came, unless it
    spans lines)."""
    body = body.strip()
    if b"\n" in body or b"\r" in body:
        body = dumps(loads(body))
    return (f'{{"id": {json.dumps(new_id("batch_req_"))}, "custom_id": {json.dumps(custom_id)}, "response": '
            f'{{"status_code": {status}, "request_id": {json.dumps(request_id)}, "body": {body.decode()}}}, '
            f'"error": null}}')


def _pending(path: Path, done: set[int]) -> Generator[RequestLine, None, None]:
    """The input's requests that have no result yet, in order (read lazily: a big input is not held in memory)."""
    for number, raw in iter_lines(path):
        if number not in done:
            yield parse_line(number, raw)


class _Results:
    """Results waiting to be kept: written together at most `period_s` after the first of them."""

    def __init__(self, store: BatchStore, batch_id: str, period_s: float):
        self._store, self._batch_id, self._period_s = store, batch_id, period_s
        self._items: list[LineResult] = []
        self._later: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def add(self, result: LineResult) -> None:
        self._items.append(result)
        if self._later is None or self._later.done():
            self._later = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self._period_s)
        await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            items, self._items = self._items, []
            if items:  # (a cancel while it writes does not stop the write: the thread commits them)
                await asyncio.to_thread(self._store.record, self._batch_id, items)

    async def close(self) -> None:
        """Keep everything added so far."""
        if self._later is not None:
            self._later.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._later
        await self.flush()
