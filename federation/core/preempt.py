"""Giving slots back when this process's capacity lease shrinks below what it has in flight.

The lease broker (registry/leases.py) shrinks a process's lease when another process's client comes first (a
short eval launched while a long one fills the pool) or is owed its share. In-flight work used not to be taken
back, so the slots moved only as this process's requests ended — a whole answer later: a short eval started a
fraction of a second after two long ones in other processes got its first slot 7.3 s after its start, against
0.4 s in one process (benchmarks/results/multiprocess.md). A request that started moments ago has done little
work, so the dispatcher gives its slot back at once: the attempt is cancelled and the request goes back to its
client's queue, to run again when its lease has room. Only on engines that drop a request whose client has gone
(`ENGINE_CANCEL_S`): elsewhere the engine would go on running it and queue the request sent in its place. Only
attempts younger than `PREEMPT_MAX_AGE_S` are taken (the youngest first), so at most that
much engine time is lost per slot moved; older ones run to their end. An attempt racing a copy (hedge or steal)
is never taken.

The same give-back serves the client order inside one process (`take_for`): under `shortest_first`, a caller
ranked by the service it has had (a tool behind the gateway: it reports no work left) waits while a caller ranked
far behind it holds young attempts — the other's requests reached an idle pool a moment first (two lm-eval
processes released together: the long eval's eight arrived 4 ms before the short one's and took seven of the
eight slots for 6.7 s, and the short eval ended later than on a server of its own) — and those attempts give
their slots back, as many as keep the order the same after the swap.

The same give-back serves a window shrunk by a scrape of the engine's queue (`DispatchConfig.give_back_queued`):
the youngest attempts there are the ones the engine has queued, not started — of any age, as a queued request
has used no engine time however long it waited (the engines admit first come, first served).

Pure bookkeeping over the attempts' tasks; the dispatcher cancels nothing itself but through `over_limit`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from fedpool.federation.core.tail import Racer
from fedpool.federation.gateway.transport import StreamProgress

PREEMPT_MAX_AGE_S = 1.0  # attempts younger than this may give their slot back to a shrunk lease
# How long an engine goes on with a request whose connection closed, by engine: the slot stays counted that long
# after the give-back, so no request lands on an engine still running the one it replaced. vLLM's API server
# cancels a handler as its client disconnects (as fedpool's emulator does). llama.cpp's server (this pool's build)
# runs a non-streamed request to its end after its client has gone — four cancelled 200-token requests kept all 4
# slots busy 6 s later, and a give-back there queued the next requests in the engine (4 deep for 5 s,
# benchmarks/multiprocess.py) — but stops a streamed one at its next token, so the transport asks it for streams
# (transport.STREAMED_ENGINES) and only those are given back, and only once they decode: llama.cpp reads a cancel
# between its batches, and a prompt is one batch, so a stream cancelled in its prompt holds its slot to the
# prompt's end — four streams of ~400 prompt tokens cancelled 0.1 s in (no token yet) kept all 4 slots 3.6–6.9 s,
# where four decoding streams let go of theirs 0.06 s after the cancel (the engine's requests_processing, 50 ms
# samples, 2 runs each; 0.5 s held here before, and the multiprocess run's engine queued 4 as leases settled).
# So a streamed attempt is taken only once its engine has sent a byte (`transport.StreamProgress`), and its slot
# stays counted 0.2 s more (over 3× what was measured). SGLang notices a closed connection only on the first 4 s
# timeout of its wait for the request's output (`_wait_one_response`; deploy/emulator.py `abort_check_s`), but the
# transport aborts a cancelled attempt there at once by its id (`HttpTransport`, /abort_request). Other servers
# are not checked: never asked to give a slot back.
ENGINE_CANCEL_S = {"vllm": 0.0, "sglang": 0.0}
STREAMED_CANCEL_S = {"vllm": 0.0, "llamacpp": 0.2}


def engine_cancel_s(engine: str | None, streamed: bool = False) -> float | None:
    """Seconds the engine may run a request after its client went away (`streamed`: the request was sent as a
    stream); None: until its end (never taken)."""
    return (STREAMED_CANCEL_S if streamed else ENGINE_CANCEL_S).get(engine or "")


Task = asyncio.Task[Any]


class Preemptions:
    def __init__(self, clock: Callable[[], float], max_age_s: float = PREEMPT_MAX_AGE_S):
        self._clock = clock
        self._max_age_s = max_age_s
        self.running: dict[str, dict[Task, float]] = {}  # server id -> attempt's task -> when it started
        self.client_of: dict[Task, str] = {}  # the client of each attempt in `running`
        self._taken: dict[Task, str] = {}  # attempts cancelled to give their slot back -> their server
        # Streamed attempts running: taken only once their engine sends (`StreamProgress.decoding`; see above).
        self.streams: dict[Task, StreamProgress] = {}
        self.count = 0  # attempts given back
        self.lost_s = 0.0  # the engine time they had used

    def ended(self, server_id: str, task: Task | None) -> None:
        """The attempt let its slot go (answered, failed, cancelled or taken)."""
        running = self.running.get(server_id)
        if running is not None and task is not None and running.pop(task, None) is not None and not running:
            del self.running[server_id]
        if task is not None:
            self.client_of.pop(task, None)
        if self.streams and task is not None:
            self.streams.pop(task, None)

    def over_limit(self, server_id: str, excess: int, racers: Mapping[Task, Racer] | None,
                   max_age_s: float | None = None) -> int:
        """Take up to `excess` attempts on the server (beyond those already taken), the youngest first and only
        those younger than the age limit (`max_age_s`, else the one given at construction) and racing no copy;
        returns how many were taken now."""
        max_age = self._max_age_s if max_age_s is None else max_age_s
        self.pending()  # (drops the taken ones that ended before they could see their cancel)
        running = self.running.get(server_id)
        if not running or excess <= 0:
            return 0
        excess -= sum(1 for t in running if t in self._taken)
        now = self._clock()
        taken = 0
        for task, started in reversed(running.items()):  # (noted as each attempt starts: the youngest last)
            if taken >= excess or now - started >= max_age:
                break
            taken += self._take(task, server_id, started, now, racers)
        return taken

    def pending(self) -> int:
        """Attempts taken whose slots have not come back yet."""
        for gone in [t for t in self._taken if t.done()]:  # (ended before it could see its cancel)
            del self._taken[gone]
        return len(self._taken)

    def take_for(self, client: str, servers: set[str], count: int, racers: Mapping[Task, Racer] | None) -> int:
        """Take up to `count` of `client`'s attempts on those servers, the youngest first, each younger than the age
        limit and racing no copy (and, streamed, decoding); returns how many were taken."""
        now = self._clock()
        young = [(started, task, sid) for sid in servers if (running := self.running.get(sid))
                 for task, started in running.items()
                 if now - started < self._max_age_s and self.client_of.get(task) == client]
        young.sort(key=lambda t: t[0], reverse=True)
        taken = 0
        for started, task, sid in young:
            if taken >= count:
                break
            taken += self._take(task, sid, started, now, racers)
        return taken

    def _take(self, task: Task, server_id: str, started: float, now: float,
              racers: Mapping[Task, Racer] | None) -> bool:
        """Cancel the attempt to give its slot back, unless it is taken already, ended, racing a copy or (streamed)
        still in its prompt; whether it was taken."""
        racer = racers.get(task) if racers is not None else None
        if task in self._taken or task.done() or (racer is not None and racer.copy_server is not None):
            return False
        progress = self.streams.get(task)
        if progress is not None and not progress.decoding:
            return False  # still in its prompt: the engine would hold the slot to the prompt's end anyway
        if racer is not None:
            racer.racing = False  # no copy may start for it now
        self._taken[task] = server_id
        self.lost_s += now - started
        task.cancel()
        return True

    def requeue(self, task: Task | None) -> bool:
        """Called where the request's attempt was cancelled: True when the cancel was a give-back alone (the
        caller did not cancel too): the cancel is withdrawn and the request goes back to its queue."""
        if task is None or self._taken.pop(task, None) is None:
            return False
        if task.cancelling() != 1:
            return False  # the caller cancelled as well: the request is cancelled
        task.uncancel()
        self.count += 1
        return True
