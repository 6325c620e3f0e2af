"""The assignment of one wave (`federation/routing/wave.py`): every request of a set of clients placed on a set of
servers at
once, by a small engine model, with roles for the servers.

The model, per server (continuous batching with chunked prefill): its prompts prefill one after another, its answers
decode beside each other — the longest answer's steps, or the steps its answers' tokens take at a full batch,
whichever is more — after its prompts (a step that carries a prefill chunk takes the chunk's time), and what it
already runs (`Room`) decodes on, stalled by the prompts placed after it. The roles: a request may use a kind where
its decode chain is within `CHAIN_TOLERANCE` of its quickest kind's, or shorter than `SHORT_CHAIN_STEPS` of that
kind's steps; a long answer (≥ `LONG_ANSWER_TOKENS`) fills one server of its kinds a full batch before the next is
opened — its decode chain is paid once per server, not once per request; once every server of those kinds holds a
full batch, any kind may take the next where it completes soonest; the rest, the longest alone first, go
where the modelled completion ends soonest: the least loaded server of each kind they may use, and the least loaded
of them that runs no long answers (lazy heaps: O(requests × kinds × log servers)). Free slots are not a limit.
`benchmarks/scale_oracle.py` runs the same assignment with the engine model's own costs (a bound: 1.114× the ideal
at 4,096 × 512). Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LONG_ANSWER_TOKENS = 128  # answers this long are packed a full batch to a server of the kinds that may take them
CHAIN_TOLERANCE = 1.1  # a kind whose decode chain for a request is within this of its quickest kind's may take it
SHORT_CHAIN_STEPS = 100.0  # a decode chain shorter than this many of the quickest kind's steps is no reason to keep
# a request off a kind (a caption's 96 tokens: 1.0 s on an A100, 2.4 s on a V100; a video's 32 on a V100: 0.8 s)


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
    """Place every request of `demand` on one of `rooms` (see the module docstring)."""
    loads: list[_Load] = []  # (a server is its index in `servers_of`)
    servers_of: list[Any] = []
    heaps: dict[str, list[tuple[float, int]]] = {}  # kind -> its servers with room, least completion first
    short: dict[str, list[tuple[float, int]]] = {}  # kind -> those of them running no long answers
    for room in rooms:
        if room.kind not in models:
            continue
        n = len(loads)
        load = _Load(room.kind, room.prefilled_s, room.decoded_s)
        loads.append(load)
        servers_of.append(room.server)
        now = load.completion(models[room.kind])
        heaps.setdefault(room.kind, []).append((now, n))
        short.setdefault(room.kind, []).append((now, n))
    for heap in (*heaps.values(), *short.values()):
        heapq.heapify(heap)
    current = [load.completion(models[load.kind]) for load in loads]
    long_servers: set[int] = set()

    def least(heap: list[tuple[float, int]], skip_long: bool) -> int | None:
        while heap:
            t, sid = heap[0]
            if t == current[sid] and not (skip_long and sid in long_servers):
                return sid
            heapq.heappop(heap)
        return None

    kinds = {k: models[k] for k in heaps}
    order = sorted(range(len(demand)), key=lambda i: (-min((m.alone(demand[i].prompt, demand[i].answer)
                                                            for m in kinds.values()), default=0.0), i))
    packing: dict[str, int] = {}  # kind -> the server its long answers fill now
    servers: dict[str, list[Any]] = {}
    unplaced = 0
    for i in order:
        want = demand[i]
        prompt, answer, is_long = want.prompt, want.answer, want.answer >= LONG_ANSWER_TOKENS
        allowed = _allowed(kinds, answer)
        out = servers.setdefault(want.client, [])
        for _ in range(want.requests):
            best: tuple[float, str, int] | None = None
            if is_long and len(allowed) < len(kinds) and all(
                    least(short[k], True) is None and (packing.get(k) is None
                                                      or loads[packing[k]].long_answers % kinds[k].batch == 0)
                    for k in allowed):
                # every server of its quickest kinds holds a full batch of long answers: a next batch there
                # waits for a whole chain, so every kind may take one, where it completes soonest
                allowed = list(kinds)
            for kind in allowed:
                model = kinds[kind]
                if is_long:
                    open_one = packing.get(kind)
                    if open_one is None or loads[open_one].long_answers % model.batch == 0:
                        open_one = least(short[kind], True)
                        if open_one is None:
                            open_one = least(heaps[kind], False)
                    candidates: tuple[int | None, ...] = (open_one,)
                else:
                    candidates = (least(heaps[kind], False), least(short[kind], True))
                for sid in candidates:
                    if sid is None:
                        continue
                    t = loads[sid].completion(model, prompt, answer)
                    if best is None or t < best[0]:
                        best = (t, kind, sid)
            if best is None:
                unplaced += 1
                continue
            t, kind, sid = best
            load, model = loads[sid], kinds[kind]
            load.prefill_s += prompt * model.prefill_s
            load.stall_s += prompt * model.prefill_s
            load.longest = max(load.longest, answer)
            load.answers += answer
            if is_long:
                load.long_answers += 1
                packing[kind] = sid
                long_servers.add(sid)
            current[sid] = t
            heapq.heappush(heaps[kind], (t, sid))
            if sid not in long_servers:
                heapq.heappush(short[kind], (t, sid))
            out.append(servers_of[sid])
    used = {servers_of[n]: (load.kind, load.prefill_s, current[n]) for n, load in enumerate(loads)
            if load.answers or load.stall_s}
    return Assignment({c: q for c, q in servers.items() if q}, used,
                      max((t for _, _, t in used.values()), default=0.0), unplaced)


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
