"""The assignment of one wave (`federation/routing/wave.py`): every request of a set of clients placed on a set of
servers at once, by a small engine model, with roles for the servers.

Why: seeing the whole wave at once, long answers can be packed a full batch to a server and kept off kinds where
their decode chain is far longer, and the rest go where the modelled completion ends soonest.

The model, per server (continuous batching with chunked prefill): its prompts prefill one after another, its answers
decode beside each other after them, and what it already runs (`Room`) decodes on, stalled by the prompts placed
after it. A request may use a kind where its decode chain is within `CHAIN_TOLERANCE` of its quickest kind's (or
shorter than `SHORT_CHAIN_STEPS` steps); a long answer (≥ `LONG_ANSWER_TOKENS`) fills one server a full batch before
the next is opened. O(requests × kinds × log servers); free slots are not a limit. Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LONG_ANSWER_TOKENS = 128  # answers this long are packed a full batch to a server of the kinds that may take them
CHAIN_TOLERANCE = 1.1  # a kind whose decode chain for a request is within this of its quickest kind's may take it
SHORT_CHAIN_STEPS = 100.0  # a decode chain shorter than this many of the quickest kind's steps is no reason to keep
# a request off a kind


@dataclass(frozen=True, slots=True)
class KindModel:
    """What the assignment needs of a server kind: prefill seconds a prompt token, a full batch's step, the batch."""

    prefill_s: float
    step_s: float
    batch: int

    def alone(self, prompt: float, answer: float) -> float:
        return prompt * self.prefill_s + answer * self.step_s


@dataclass(frozen=True, slots=True)
class Room:
    """A server the wave may use: its kind, and when what it already runs will have prefilled and decoded (seconds
    from now)."""

    server: Any  # (handed back as given: the policy's server object)
    kind: str
    prefilled_s: float = 0.0
    decoded_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Demand:
    """One client's requests in the wave: how many, and each one's prompt and answer tokens."""

    client: str
    requests: int
    prompt: float
    answer: float


@dataclass
class _Load:
    kind: str
    prefill_s: float  # when its prompts, the wave's and those before, will have prefilled
    floor_s: float  # when what it ran before the wave will have decoded
    longest: float = 0.0
    answers: float = 0.0
    stall_s: float = 0.0  # the wave's prompts' prefill there (they stall what runs before them)
    long_answers: int = 0

    def completion(self, model: KindModel, prompt: float = 0.0, answer: float = 0.0) -> float:
        """When its answers will have decoded, with one more request of this shape (none: as it is)."""
        added = prompt * model.prefill_s
        steps = max(self.longest, answer, (self.answers + answer) / model.batch)
        return max(self.floor_s + self.stall_s + added, self.prefill_s + added + steps * model.step_s)


@dataclass(frozen=True)
class Assignment:
    """Each client's servers, one a request in the order they were assigned; each used server's modelled prefill
    and completion (seconds from the start); the modelled makespan; requests no server had room for."""

    servers: dict[str, list[Any]]
    modelled: dict[Any, tuple[str, float, float]]  # server -> (its kind, prefilled, completion)
    predicted_s: float
    unplaced: int


def assign(demand: Sequence[Demand], rooms: Iterable[Room], models: Mapping[str, KindModel]) -> Assignment:
    """Place every request of `demand` on one of `rooms` (see the module docstring): the longest alone first; a long
    answer on the server of its kinds being filled (once every server of those kinds holds a full batch, any kind
    may take the next), the rest on the least loaded server of each kind they may use or the least loaded of those
    that run no long answers, where the modelled completion ends soonest."""
    pool = _Pool(rooms, models)
    kinds = {k: models[k] for k in pool.heaps}
    order = sorted(range(len(demand)), key=lambda i: (-min((m.alone(demand[i].prompt, demand[i].answer)
                                                            for m in kinds.values()), default=0.0), i))
    servers: dict[str, list[Any]] = {}
    unplaced = 0
    for i in order:
        want = demand[i]
        prompt, answer, is_long = want.prompt, want.answer, want.answer >= LONG_ANSWER_TOKENS
        allowed = _allowed(kinds, answer)
        out = servers.setdefault(want.client, [])
        for _ in range(want.requests):
            if is_long and len(allowed) < len(kinds) and pool.packed_full(kinds, allowed):
                # every server of its quickest kinds holds a full batch of long answers: a next batch there
                # waits for a whole chain, so every kind may take one, where it completes soonest
                allowed = list(kinds)
            best = pool.best(kinds, allowed, prompt, answer, is_long)
            if best is None:
                unplaced += 1
                continue
            out.append(pool.add(*best, kinds[best[1]], prompt, answer, is_long))
    used = {pool.servers_of[n]: (load.kind, load.prefill_s, pool.current[n]) for n, load in enumerate(pool.loads)
            if load.answers or load.stall_s}
    return Assignment({c: q for c, q in servers.items() if q}, used,
                      max((t for _, _, t in used.values()), default=0.0), unplaced)


class _Pool:
    """The wave's servers as `assign` fills them: each one's load, and per kind lazy heaps of them by modelled
    completion (all of them, and those running no long answers); a server is its index in `servers_of`."""

    def __init__(self, rooms: Iterable[Room], models: Mapping[str, KindModel]):
        self.loads: list[_Load] = []
        self.servers_of: list[Any] = []
        self.heaps: dict[str, list[tuple[float, int]]] = {}  # kind -> its servers with room, least completion first
        self.short: dict[str, list[tuple[float, int]]] = {}  # kind -> those of them running no long answers
        for room in rooms:
            if room.kind not in models:
                continue
            n = len(self.loads)
            load = _Load(room.kind, room.prefilled_s, room.decoded_s)
            self.loads.append(load)
            self.servers_of.append(room.server)
            now = load.completion(models[room.kind])
            self.heaps.setdefault(room.kind, []).append((now, n))
            self.short.setdefault(room.kind, []).append((now, n))
        for heap in (*self.heaps.values(), *self.short.values()):
            heapq.heapify(heap)
        self.current = [load.completion(models[load.kind]) for load in self.loads]
        self.long_servers: set[int] = set()
        self.packing: dict[str, int] = {}  # kind -> the server its long answers fill now

    def least(self, heap: list[tuple[float, int]], skip_long: bool) -> int | None:
        """The heap's server with the least completion (stale entries, and long-answer servers where skipped, are
        dropped on the way)."""
        while heap:
            t, sid = heap[0]
            if t == self.current[sid] and not (skip_long and sid in self.long_servers):
                return sid
            heapq.heappop(heap)
        return None

    def packed_full(self, kinds: Mapping[str, KindModel], allowed: Sequence[str]) -> bool:
        """Whether every server of the allowed kinds holds a full batch of long answers."""
        return all(self.least(self.short[k], True) is None
                   and (self.packing.get(k) is None or self.loads[self.packing[k]].long_answers % kinds[k].batch == 0)
                   for k in allowed)

    def best(self, kinds: Mapping[str, KindModel], allowed: Sequence[str], prompt: float, answer: float,
             is_long: bool) -> tuple[float, str, int] | None:
        """(completion, kind, server) where one more request of this shape completes soonest (None: no server)."""
        best: tuple[float, str, int] | None = None
        for kind in allowed:
            model = kinds[kind]
            for sid in self._candidates(kind, model, is_long):
                if sid is None:
                    continue
                t = self.loads[sid].completion(model, prompt, answer)
                if best is None or t < best[0]:
                    best = (t, kind, sid)
        return best

    def _candidates(self, kind: str, model: KindModel, is_long: bool) -> tuple[int | None, ...]:
        """A long answer: the kind's server being filled, else the next to open; the rest: the least loaded server of
        the kind and the least loaded running no long answers."""
        if is_long:
            open_one = self.packing.get(kind)
            if open_one is None or self.loads[open_one].long_answers % model.batch == 0:
                open_one = self.least(self.short[kind], True)
                if open_one is None:
                    open_one = self.least(self.heaps[kind], False)
            return (open_one,)
        return (self.least(self.heaps[kind], False), self.least(self.short[kind], True))

    def add(self, t: float, kind: str, sid: int, model: KindModel, prompt: float, answer: float,
            is_long: bool) -> Any:
        """One request placed on the server, completing at `t`; the server (as its room gave it)."""
        load = self.loads[sid]
        load.prefill_s += prompt * model.prefill_s
        load.stall_s += prompt * model.prefill_s
        load.longest = max(load.longest, answer)
        load.answers += answer
        if is_long:
            load.long_answers += 1
            self.packing[kind] = sid
            self.long_servers.add(sid)
        self.current[sid] = t
        heapq.heappush(self.heaps[kind], (t, sid))
        if sid not in self.long_servers:
            heapq.heappush(self.short[kind], (t, sid))
        return self.servers_of[sid]


def _allowed(kinds: Mapping[str, KindModel], answer: float) -> list[str]:
    """The kinds that may take a request with this answer (its decode chain there against its quickest kind's)."""
    chains = {kind: answer * m.step_s for kind, m in kinds.items()}
    if not chains:
        return []
    quickest = min(chains, key=lambda k: chains[k])
    limit = chains[quickest] * CHAIN_TOLERANCE
    if answer < LONG_ANSWER_TOKENS:
        limit = max(limit, SHORT_CHAIN_STEPS * kinds[quickest].step_s)
    return [k for k, c in chains.items() if c <= limit]
