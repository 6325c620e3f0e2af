"""One wave: when everything a route's clients have left fits the room its servers have now, measure each server
kind once, then place all of it together.

Why: in a pool larger than its work every request is placed before any answer has come back; placed one at a time
by the data-sheet priors, the long answers spread over the fastest kind and the long prompts placed after stall them.

Per route, a small state machine (forgotten when its wave is placed; `Waves._start` says when a route is in one):
1. Probe: each kind no probe has measured yet for the model gets one request alone on an idle server.
2. The long answers (≥ `LONG_ANSWER_TOKENS`) are assigned at once; the rest wait for the probes (`probe_limit_s`).
3. Assign (`waveplan.assign`, once): every waiting request not assigned yet, at the measured costs.
4. Follow: each request goes to one of its client's assigned servers with room whose earlier prompts leave fewer
   than `queue_tokens` to prefill; held while every one is full or prefilling.
No I/O, no clock of its own; what it keeps is bounded (`MAX_WAVES`, `MAX_MEASURED`, the clients of a wave).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fedpool.federation.core.policy import Hold, RouteView
from fedpool.federation.routing.waveplan import LONG_ANSWER_TOKENS, Assignment, Demand, KindModel, Room, assign

MIN_PER_SERVER = 2.0  # a wave has at least this many requests a server (fewer: each nearly has a server alone)
PROBE_LIMIT_S = 5.0  # a kind whose probe has not answered within this is priced as the policy prices it unheard
MAX_WAVES = 256  # routes with a wave in progress kept at once (the policy's own bound on routes)
MAX_MEASURED = 1024  # (model, kind) pairs whose probes are kept (the registry's models × kinds)
TIMED_ENGINES = frozenset({"vllm", "llamacpp"})  # engines whose answers can carry their own prefill and decode
# times (vLLM with `--enable-per-request-metrics`, llama.cpp's `timings`): a probe goes to one where the kind has one
IDLE_SHARE = 0.01  # a route is idle with at most this share of its waiting requests (and the probes) in flight
QUEUE_TOKENS = 8192.0  # a server is sent its next assigned prompt while those sent before leave fewer than this
# many prompt tokens to prefill: one step's token budget (vLLM V1's `max_num_batched_tokens` and SGLang's
# `chunked_prefill_size` default), so the engine holds at most one prompt waiting for its first chunk — a queue its
# scrape would show, and the dispatcher take back


class WaveHost(Protocol):
    """What a wave needs of the policy that places with it (`finish.EarliestFinish`)."""

    def wave_model(self, model: str, kind: str, members: Mapping[str, Any]) -> KindModel:
        """The kind's costs for the model as the policy prices it now (for a kind no probe has measured)."""
        ...

    def wave_prior(self, kind: str) -> tuple[float, float] | None:
        """The kind's data-sheet prior (prefill seconds a prompt token, a full batch's step), once the policy has
        seen the kind (its ratios to a measured kind's price a kind no probe has measured)."""
        ...

    def wave_shape(self, client: str) -> tuple[float, float] | None:
        """(prompt tokens, answer tokens) expected of the client's requests (None: unknown)."""
        ...

    def wave_inflight(self) -> int:
        """The dispatcher's requests in flight (every route)."""
        ...

    def wave_key(self, client: str) -> Any:
        """The client's place in the serving order (for `RouteView.park`)."""
        ...

    def wave_sent_all(self, client: str, waiting: int) -> bool:
        """Whether the client has said how many requests it has left, and all of them wait or are in flight."""
        ...

    def wave_busy(self, server_id: str) -> tuple[float, float] | None:
        """When the server's requests in flight will have prefilled and decoded, as the policy models them."""
        ...

    def wave_placed(self, context: Any, kind: str, server: Any, prefilled: float, decoded: float) -> None:
        """The wave's modelled times for the server (absolute): the policy's model of it starts from them
        (`context`: what the policy passed to `Waves.place`)."""
        ...


@dataclass
class _Wave:
    started: float
    probes: dict[str, str]  # kind -> the client whose next request probes it (until sent)
    unlearned: set[str]  # kinds no probe has measured yet
    models: dict[str, KindModel]  # kind -> the costs the wave places by (priced, then measured)
    sent: dict[str, str] = field(default_factory=dict)  # kind -> the server its probe went to
    assigned: dict[str, dict[Any, int]] = field(default_factory=dict)  # client -> its servers, requests on each
    whole: bool = False  # everything assigned (not only the long answers)
    kind_of: dict[str, str] = field(default_factory=dict)  # server id -> kind (of those assigned)
    prompts: dict[str, float] = field(default_factory=dict)  # client -> its prompt tokens
    prefilled: dict[str, float] = field(default_factory=dict)  # server id -> when the prompts sent there prefill
    # server id -> (its kind, prompt tokens, longest answer, answer tokens) of the long answers assigned at the start
    pinned: dict[str, tuple[str, float, float, float]] = field(default_factory=dict)


@dataclass
class WaveStats:
    """What waves did (for the policy's `describe` and the benchmarks)."""

    waves: int = 0
    probes: int = 0
    assigned: int = 0
    followed: int = 0  # requests placed on their assigned server
    dropped: int = 0  # assigned servers given up (gone, or their breakers open): placed as usual instead
    held: int = 0  # times a request waited for its assigned servers, all full or still prefilling
    predicted_s: float = 0.0  # the last wave's modelled makespan, from its start (its whole assignment's)


class Waves:
    """Per route: whether it is in a wave, and its probes and assignment (see the module docstring)."""

    def __init__(self, host: WaveHost, *, min_prompt: float, min_answer: float,
                 min_per_server: float = MIN_PER_SERVER, probe_limit_s: float = PROBE_LIMIT_S,
                 queue_tokens: float = QUEUE_TOKENS):
        self._host = host
        self._queue_tokens = queue_tokens
        self._min_prompt, self._min_answer = min_prompt, min_answer  # a probe measures prefill and decode
        self._min_per_server = min_per_server
        self._probe_limit_s = probe_limit_s
        self._waves: dict[Any, _Wave] = {}
        # (model, kind) -> (prefill s a prompt token, step s) from a probe's answer alone: answers that shared their
        # server price its prompts by whatever shared its steps, so only probes are kept
        self._measured: dict[tuple[str, str], tuple[float, float]] = {}
        self._failed: set[tuple[str, str]] = set()  # probes whose answer could not price their kind
        self._probes: set[str] = set()  # servers a probe went to, until it is answered
        self.stats = WaveStats()

    def probed(self, server_id: str) -> bool:
        """Whether a wave's probe went to this server and has not been answered (the policy then tells `measured`
        what its answer showed)."""
        return server_id in self._probes

    def measured(self, server_id: str, model: str, kind: str, costs: tuple[float, float] | None) -> None:
        """A probe's answer: its kind's (prefill seconds a prompt token, a step's seconds), from that one answer
        alone (None: it could not tell; the kind is priced as the policy prices it)."""
        self._probes.discard(server_id)
        if costs is None:
            self._failed.add((model, kind))
            return
        self._failed.discard((model, kind))
        if (model, kind) not in self._measured and len(self._measured) >= MAX_MEASURED:
            del self._measured[next(iter(self._measured))]
        self._measured[(model, kind)] = costs

    def place(self, route: RouteView, request: Any, now: float, members: Mapping[str, Mapping[str, Any]],
              context: Any = None) -> Any:
        """The request's server or Hold while its route is in a wave; None: not in one (place it as usual).
        `members`: the route's servers by kind (id -> server); `context` goes back to `WaveHost.wave_placed`."""
        client = request.client_id
        wave = self._waves.get(route.key)
        if wave is not None and wave.whole and client not in wave.assigned and \
                not any(route.queues.get(c) for c in wave.assigned):
            # Over: what is left of its assignment was for requests that went elsewhere (retried after a failure).
            del self._waves[route.key]
            wave = None
        if wave is None:
            wave = self._start(route, request.model, now, members, context)
            if wave is None:
                return None
        if not wave.whole:
            for kind in list(wave.unlearned):
                if (request.model, kind) in self._measured or (request.model, kind) in self._failed:
                    wave.unlearned.discard(kind)
            if not wave.unlearned or now - wave.started >= self._probe_limit_s:
                self._assign(route, wave, request.model, now, members, context)
            elif client not in wave.assigned:
                return self._probe(route, wave, client)
        return self._follow(route, wave, client, now)

    def forget_client(self, client: str) -> None:
        for key, wave in list(self._waves.items()):
            self._done_with(key, wave, client)

    def known(self) -> int:
        """Routes with a wave in progress."""
        return len(self._waves)

    # ---- the state machine ----------------------------------------------------------------------------
    def _start(self, route: RouteView, model: str, now: float, members: Mapping[str, Mapping[str, Any]],
               context: Any) -> _Wave | None:
        """A new wave on the route if it is in one now, else None (looked at once a grant pass): its probes chosen,
        its long answers assigned. A route is in a wave when it has more than one server kind, at least
        `min_per_server` × its servers requests waiting and no more than its servers have free slots for, every
        waiting client has said how many requests it has left and has sent all of them (they wait, or are in
        flight), and the route is idle (at most `IDLE_SHARE` of that in flight: later in a run every answer has
        shared its server, and costs learned from them would misplace the wave)."""
        memo = route.memo
        if memo.get(_NOT_A_WAVE):
            return None
        memo[_NOT_A_WAVE] = True
        room = self._room(route, members)
        shapes = self._waiting_shapes(route, room) if room is not None else None
        if shapes is None:
            return None
        if route.key not in self._waves and len(self._waves) >= MAX_WAVES:
            del self._waves[next(iter(self._waves))]
        models = {kind: self._model(model, kind, m) for kind, m in members.items()}
        unlearned = {kind for kind in members if (model, kind) not in self._measured}
        self._failed.difference_update((model, kind) for kind in unlearned)
        probes = self._probe_clients(models, unlearned, shapes)
        wave = self._waves[route.key] = _Wave(now, probes, unlearned & probes.keys(), models)
        self.stats.waves += 1
        memo.pop(_NOT_A_WAVE, None)
        if wave.unlearned:
            self._pin_long_answers(route, wave, shapes, now, members, context)
        return wave

    def _room(self, route: RouteView, members: Mapping[str, Mapping[str, Any]]) -> int | None:
        """The free slots of the route's servers with room, if its kinds, its waiting requests and what is in flight
        allow a wave (cheap bounds first: waiting against servers, against servers with room × the widest window,
        against what is in flight); else None."""
        if len(members) < 2:
            return None
        waiting, servers = route.waiting, len(route.servers)
        if waiting < self._min_per_server * servers:
            return None
        if self._host.wave_inflight() > IDLE_SHARE * waiting + len(members):
            return None  # (not idle: what runs was placed by answers that shared their servers)
        widest = max((s.window for kind in members.values() for s in kind.values()), default=0)
        free = [s for kind in members for s in route.free_in(kind)]
        if len(free) * widest < waiting:
            return None
        room = sum(max(0, s.window - s.inflight) for s in free)
        return None if room < waiting else room

    def _waiting_shapes(self, route: RouteView, room: int) -> dict[str, tuple[int, float, float]] | None:
        """Each waiting client's (requests waiting, prompt tokens, answer tokens), if every one has a shape and has
        sent all it has, and together they fit the room and fill the route's servers enough; else None."""
        host, live = self._host, 0
        shapes: dict[str, tuple[int, float, float]] = {}
        for client, queue in route.queues.items():
            n = len(queue)
            if not n:
                continue
            shape = host.wave_shape(client)
            if shape is None or not host.wave_sent_all(client, n):
                return None
            live += n
            shapes[client] = (n, *shape)
        if live > room or live < self._min_per_server * len(route.servers):
            return None
        return shapes

    def _pin_long_answers(self, route: RouteView, wave: _Wave, shapes: Mapping[str, tuple[int, float, float]],
                          now: float, members: Mapping[str, Mapping[str, Any]], context: Any) -> None:
        """The long answers go now: their kinds and packing hardly depend on the costs (their decode chains are the
        run's longest, and waiting for the probes would add the probes' time to them)."""
        long = [Demand(c, n, p, a) for c, (n, p, a) in shapes.items() if a >= LONG_ANSWER_TOKENS]
        if long:
            result = self._place_all(route, wave, long, wave.models, now, members, context)
            for client, placed in result.servers.items():
                _, prompt, answer = shapes[client]
                for server in placed:
                    kind, tokens, longest, answers = wave.pinned.get(server.id, (wave.kind_of[server.id], 0.0,
                                                                                  0.0, 0.0))
                    wave.pinned[server.id] = (kind, tokens + prompt, max(longest, answer), answers + answer)
        for kind in list(wave.unlearned):  # (a kind the long answers filled has no server for a probe alone)
            if not any(not s.inflight and s.id not in wave.pinned and route.usable(s) for s in route.free_in(kind)):
                wave.unlearned.discard(kind)
                wave.probes.pop(kind, None)

    def _probe_clients(self, models: Mapping[str, KindModel], kinds: set[str],
                       shapes: Mapping[str, tuple[int, float, float]]) -> dict[str, str]:
        """Per kind to probe, the waiting client whose request is quickest there among those that measure both
        prefill and decode (any, where none does); not one with long answers (those go at once)."""
        out: dict[str, str] = {}
        for kind in kinds:
            best: tuple[bool, float, str] | None = None
            for client, (_, prompt, answer) in shapes.items():
                if answer >= LONG_ANSWER_TOKENS:
                    continue
                measures = prompt >= self._min_prompt and answer >= self._min_answer
                entry = (not measures, models[kind].alone(prompt, answer), client)
                if best is None or entry < best:
                    best = entry
            if best is not None:
                out[kind] = best[2]
        return out

    def _probe(self, route: RouteView, wave: _Wave, client: str) -> Any:
        for kind, prober in list(wave.probes.items()):
            if prober != client or kind in wave.sent:
                continue
            alone = [s for s in route.free_in(kind) if not s.inflight and s.id not in wave.pinned and route.usable(s)]
            timed = [s for s in alone if s.entry is not None and s.entry.record.engine.value in TIMED_ENGINES]
            if alone:
                server = (timed or alone)[0]
                wave.sent[kind] = server.id
                del wave.probes[kind]
                self._probes.add(server.id)
                self.stats.probes += 1
                return server
        return Hold.CLIENT_HELD  # (asked again on the next grant pass: a probe's answer makes one)

    def _assign(self, route: RouteView, wave: _Wave, model: str, now: float,
                members: Mapping[str, Mapping[str, Any]], context: Any) -> None:
        """Everything waiting that the wave has not assigned yet, at the costs measured (the long answers assigned
        at the start counted where they went)."""
        wave.whole = True
        # A probe not answered by now (its attempt failed, or it outlasted `probe_limit_s`) is no probe any more:
        # the next answer from its server shares that server with the wave.
        self._probes.difference_update(wave.sent.values())
        models = wave.models = {kind: self._model(model, kind, m) for kind, m in members.items()}
        host = self._host
        demand = []
        for client, queue in route.queues.items():
            shape = host.wave_shape(client)
            n = len(queue) - sum(wave.assigned.get(client, {}).values())  # (not assigned yet)
            if n > 0 and shape is not None:
                demand.append(Demand(client, n, *shape))
        elapsed = now - wave.started
        pinned = {}
        for sid, (kind, tokens, longest, answers) in wave.pinned.items():
            m = models[kind]
            prefilled = tokens * m.prefill_s
            decoded = prefilled + max(longest, answers / m.batch) * m.step_s
            pinned[sid] = (max(0.0, prefilled - elapsed), max(0.0, decoded - elapsed))
        self._place_all(route, wave, demand, models, now, members, context, pinned)
        if not wave.assigned:
            self._waves.pop(route.key, None)

    def _place_all(self, route: RouteView, wave: _Wave, demand: Sequence[Demand], models: Mapping[str, KindModel],
                   now: float, members: Mapping[str, Mapping[str, Any]], context: Any,
                   pinned: Mapping[str, tuple[float, float]] | None = None) -> Assignment:
        """`assign` over the route's usable servers (each with what it runs: `pinned`, else as the policy models
        it); the result added to the wave's, and told to the policy."""
        host = self._host
        rooms = []
        for kind, group in members.items():
            for sid, server in group.items():
                if not route.usable(server) and (server.inflight < server.window or server.open_until is not None):
                    continue  # (gone, or its breaker open; a full one frees slots as its answers come)
                busy = pinned.get(sid) if pinned is not None else None
                if busy is None and server.inflight:
                    modelled = host.wave_busy(sid)
                    if modelled is not None:
                        busy = (max(0.0, modelled[0] - now), max(0.0, modelled[1] - now))
                rooms.append(Room(server, kind, *(busy or (0.0, 0.0))))
        result = assign(demand, rooms, models)
        for server, (kind, prefilled, decoded) in result.modelled.items():
            host.wave_placed(context, kind, server, now + prefilled, now + decoded)
            wave.kind_of[server.id] = kind
        for want in demand:
            wave.prompts[want.client] = want.prompt
        for client, servers in result.servers.items():
            mine = wave.assigned.setdefault(client, {})
            for server in servers:
                mine[server] = mine.get(server, 0) + 1
            self.stats.assigned += len(servers)
        self.stats.predicted_s = now - wave.started + result.predicted_s
        return result

    def _follow(self, route: RouteView, wave: _Wave, client: str, now: float) -> Any:
        """The client's next request on one of its assigned servers with room, whose prompts sent before leave fewer
        than `queue_tokens` to prefill; held while every one is full or prefilling; None: nothing assigned to it."""
        servers = wave.assigned.get(client)
        if not servers:
            self._done_with(route.key, wave, client)
            return None
        kinds: set[str] = set()
        gone: list[Any] = []
        prompt = wave.prompts.get(client, 0.0)
        placed = None
        for server in servers:  # any of its servers (a client's requests are alike)
            kind = wave.kind_of.get(server.id, "")
            if route.usable(server):
                model = wave.models.get(kind)
                start = wave.prefilled.get(server.id, now)
                if model is not None and start - now > self._queue_tokens * model.prefill_s:
                    kinds.add(kind)  # still prefilling what was sent there: later (the next tick)
                    continue
                if model is not None:
                    wave.prefilled[server.id] = max(start, now) + prompt * model.prefill_s
                placed = server
                break
            if server.inflight < server.window or server.window <= 0:
                # Room, yet not usable (gone, or its breaker open); or no room it can ever free for this process (a
                # window of 0: its lease there went to another process): waiting for it would be for ever.
                gone.append(server)
            else:
                kinds.add(kind)
        for server in gone:
            n = servers.pop(server)
            self.stats.dropped += n
        if placed is not None:
            if servers[placed] > 1:
                servers[placed] -= 1
            else:
                del servers[placed]
            self.stats.followed += 1
            if not servers or len(route.queues.get(client, ())) <= 1:
                # (its last request waiting: what is left of its assignment was for requests that went elsewhere —
                # retried after a failure, or placed before the wave)
                self._done_with(route.key, wave, client)
            if wave.whole and route.waiting <= 1:
                self._waves.pop(route.key, None)  # (the route's last request waiting: the wave is over)
            return placed
        if not servers:
            self._done_with(route.key, wave, client)
            return None
        # every one full or prefilling: until one of those kinds frees a slot, or the next tick
        route.park(client, tuple(sorted(kinds)), self._host.wave_key(client), until_freed=True)
        self.stats.held += 1
        return Hold.CLIENT_HELD

    def _model(self, model: str, kind: str, members: Mapping[str, Any]) -> KindModel:
        """The kind's costs for the model: measured by a probe; else, where other kinds were, its data-sheet prior on
        their scale (their measured ÷ prior costs: answers that shared their servers price prompts by whatever shared
        their steps); else the policy's."""
        measured = self._measured.get((model, kind))
        priced = self._host.wave_model(model, kind, members)
        if measured is not None:
            return KindModel(measured[0], measured[1], priced.batch)
        prefill = step = 0.0
        n = 0
        for (m, other), (other_prefill, other_step) in self._measured.items():
            prior = self._host.wave_prior(other) if m == model else None
            if prior is not None:
                prefill += other_prefill / prior[0]
                step += other_step / prior[1]
                n += 1
        own = self._host.wave_prior(kind)  # (known: pricing it above saw the kind)
        if not n or own is None:
            return priced
        return KindModel(own[0] * prefill / n, own[1] * step / n, priced.batch)

    def _done_with(self, key: Any, wave: _Wave, client: str) -> None:
        wave.assigned.pop(client, None)
        if wave.whole and not wave.assigned:
            self._waves.pop(key, None)


_NOT_A_WAVE = "wave: not one"  # (a route memo key: checked once a grant pass)
