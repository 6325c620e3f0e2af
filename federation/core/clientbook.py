"""What the dispatcher knows about each client (an eval, a gateway caller) and the order clients are served in
when the pool is full (`DispatchConfig.client_order`): its weight, what it says it has left, its shape, whether it
has sent everything, how many of its requests wait.

`fair`: the fewest requests in flight per unit of weight first. `shortest_first`: the least work left, as the client
reports it (fedpool's evals do); a caller that says only how many requests it has left (`X-Fedpool-Requests`) by
those x one of its requests' expected service (SRPT); a caller that says nothing by the service it has had so far
(least attained service): the slot-seconds its answers held, on the reported work's scale, a request in flight
counted from the moment it takes its slot. `longest_answers_first`: the longest answers (max_tokens) first. Fair
among equals in every order. In-flight counts are the ledger's. Pure bookkeeping, no I/O; docs/architecture.md
says why service is counted in slot-seconds and from the slot's start.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from fedpool.federation.core.ledger import InflightLedger
from fedpool.federation.core.types import CLIENT_ORDERS, InferenceRequest
from fedpool.registry import Served

DEFAULT_ANSWER_TOKENS = 256.0  # a client that states no max_tokens
# A background client (a Batch API batch) ranks after every other client in every order: its criterion is offset
# by this, more than any client's work (tokens × requests) comes to; among themselves background clients keep the
# order's criterion.
BACKGROUND_RANK = 1e12


@dataclass(frozen=True, slots=True)
class ClientShape:
    """A client's expected prompt length (tokens) and answer budget, before its answers say better."""

    prompt_tokens: float
    max_tokens: float | None
    announced: bool  # said by the client itself (set_client_shape), not guessed from its first request


CHARS_PER_TOKEN = 4.0  # a prompt's tokens guessed from its characters until the client or an answer says
SERVED_DECODE_WEIGHT = 2.0  # a completion token's share of a full batch step against a prompt token's
KV_ANSWER_TOKENS = 256.0  # a client that states no max_tokens: the answer its sequence is expected to grow by
PREFILL_TOKENS_PER_STEP = 512.0  # prompt tokens an engine prefills in one step (llama.cpp's and vLLM's batch order)
KV_ALPHA = 0.2  # one answer's weight in its client's mean sequence length (prompt + completion tokens)


class ClientBook:
    def __init__(self, order: str, ledger: InflightLedger):
        if order not in CLIENT_ORDERS:
            raise ValueError(f"client_order must be one of {', '.join(CLIENT_ORDERS)}, not {order!r}")
        self.order = order
        self._ledger = ledger
        self._weights: dict[str, float] = {}
        self._work_left: dict[str, float] = {}
        self._requests_left: dict[str, int] = {}
        self._declared: set[str] = set()  # clients that say only how many requests they have left
        self._background: set[str] = set()  # clients served only with the capacity the others leave (batches)
        self._answer: dict[str, float] = {}  # the answer length each client asks for (max_tokens)
        self._served_s: dict[str, float] = {}  # slot-seconds of the client's answered requests ...
        self._answers: dict[str, int] = {}  # ... and how many there were (their mean: one request's expected)
        self._all_work = 0.0  # every answer's work (prompt + 2 × completion tokens) ...
        self._all_s = 0.0  # ... and slot-seconds: the scale that puts service on the reported work's units
        self._all_answer_tokens = 0.0  # every answer's completion tokens (a request's slot-seconds, guessed)
        self.pool_served = Served()  # every lease holder's answers (the broker's sum): the prices before our first
        self._shapes: dict[str, ClientShape] = {}
        self._sequence: dict[str, float] = {}  # mean KV its answers held: prompt + half the completion tokens
        self.done_sending: set[str] = set()
        self.waiting: Counter[str] = Counter()  # requests queued for a slot, per client
        self._seen: dict[str, float] = {}  # client -> when it last submitted or was answered (insertion-ordered)
        # When a client that was not a background one as it submitted (an online caller) last did: a batch that has
        # ended is in the foreground again (it says nothing any more), and is not an online caller for it.
        self._foreground_at = float("-inf")

    # ---- what clients say ---------------------------------------------------------------------------
    def set_weight(self, client_id: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError("client weight must be positive")
        self._weights[client_id] = weight

    def weight(self, client_id: str) -> float:
        return self._weights.get(client_id, 1.0)

    def set_remaining(self, client_id: str, work: float, requests: int | None = None) -> None:
        self._work_left[client_id] = max(0.0, work)
        if requests is not None:
            self._requests_left[client_id] = max(0, requests)

    def declare_requests(self, client_id: str, requests: int | None, *, background: bool = False) -> None:
        """A caller that says only how many requests it has still to complete (None: it says nothing any more):
        ranked by them × its requests' expected work (`expected_work`, in the reported work's units). A client
        that reports its work itself (`set_remaining`) is ranked by that. `background`: it ranks after every
        client that is not (BACKGROUND_RANK), until it says nothing any more."""
        if requests is None:
            self._background.discard(client_id)
            if client_id in self._declared:
                self._declared.discard(client_id)
                self._requests_left.pop(client_id, None)
            return
        self._declared.add(client_id)
        self._requests_left[client_id] = max(0, requests)
        if background:
            self._background.add(client_id)
        else:
            self._background.discard(client_id)

    def before_background(self, client_id: str) -> bool:
        """Whether the client is in the foreground while background clients are about (an online caller beside
        Batch API batches): served at once, not paced by a plan made for the background work."""
        return bool(self._background) and client_id not in self._background

    def background_about(self) -> bool:
        """Whether a background client (a Batch API batch) has said it has requests left."""
        return bool(self._background)

    def foreground_since(self, since: float) -> bool:
        """Whether a client that was not a background one as it submitted (an online caller) submitted a request
        at `since` or later."""
        return self._foreground_at >= since

    def announce_shape(self, client_id: str, prompt_tokens: float, max_tokens: float | None) -> None:
        self._shapes[client_id] = ClientShape(max(1.0, prompt_tokens), max_tokens, announced=True)

    def note_request(self, client_id: str, request: InferenceRequest, now: float) -> None:
        """Every submitted request: its answer budget (for longest_answers_first) and, for a client that
        announced nothing, a guessed shape from its first request."""
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            self._answer[client_id] = float(max_tokens)
        if client_id not in self._shapes:
            self._shapes[client_id] = ClientShape(max(1.0, request.prompt_chars() / CHARS_PER_TOKEN), max_tokens,
                                                  False)
        seen = self._seen
        if client_id in seen:
            del seen[client_id]  # most recent last: the idle sweep looks at the front only
        seen[client_id] = now
        if client_id not in self._background:
            self._foreground_at = now

    def note_served(self, client_id: str, prompt_tokens: int | None, completion_tokens: int | None,
                    slot_s: float) -> None:
        """An answer came back after holding an engine slot for `slot_s` seconds."""
        self._served_s[client_id] = self._served_s.get(client_id, 0.0) + slot_s
        self._answers[client_id] = self._answers.get(client_id, 0) + 1
        if prompt_tokens is not None:
            # What the request held in the engine's KV cache on average over its life: its prompt, and its answer
            # growing a token a step (half of it on average): the engine admits on what it holds now.
            length = prompt_tokens + 0.5 * (completion_tokens or 0)
            mean = self._sequence.get(client_id)
            self._sequence[client_id] = length if mean is None else mean + KV_ALPHA * (length - mean)
        self._all_work += (prompt_tokens or 0) + SERVED_DECODE_WEIGHT * (completion_tokens or 0)
        self._all_s += slot_s
        self._all_answer_tokens += completion_tokens or 0

    def served_s(self, client_id: str) -> float | None:
        """The service a client ranked by its service (shortest_first, no work left reported) has attained by
        `now`: the slot-seconds of its answered requests and of those in flight — each counted as one request's
        expected slot-seconds from when it took its slot (as `served` ranks inside the process), or as the
        seconds they have held their slots so far where that is more (before any answer says what to expect);
        else None. Counting those in flight keeps it continuous: a long request's seconds do not arrive all at
        once when it ends, so two processes' clients ranked on it do not swap places each time a long answer
        lands. None too before any answer anywhere (here or, as the broker last said, at any holder): no seconds
        to count in yet, and the broker shares by its requests' shapes (`request_s`: their decode steps); counted
        in seconds held, two replicas' callers read equal and were leased 4 and 4 of 8 slots where one gateway
        gives the short caller nearly all."""
        if self.order != "shortest_first" or client_id in self._work_left or client_id in self._declared:
            return None
        if self._totals().slot_s <= 0:
            return None
        n = self._ledger.of_client(client_id)
        return self._served_s.get(client_id, 0.0) + max(0.0, self._ledger.held_s(client_id),
                                                         n * self.expected_s(client_id))

    def request_s(self, client_id: str) -> tuple[float | None, int]:
        """What one of the client's requests adds to its service, and how many it has in flight: the broker shares
        by levels of service with them (registry/fills.py `level_fill`). One request's slot-seconds (`expected_s`,
        what `served_s` counts each in flight at); before any answer anywhere, when there are no seconds to count
        in and `served_s` is None, its shape's decode steps (`shape_steps`: the broker prices them as the pool's
        answer tokens once it has some) — ranked strictly by its shape instead, a caller whose requests were in
        flight passed behind the other and back as their counts changed, and each pass cancelled the young
        attempts of one of them (llama.cpp: 16-34 requests cancelled per server in an 8-15 s lm-eval run).
        (None, 0) where it is not ranked by service or nothing prices it yet."""
        if not self.by_service(client_id):
            return None, 0
        running = self._ledger.of_client(client_id)
        if self._totals().slot_s <= 0:
            shape = self._shapes.get(client_id)
            return (shape_steps(shape) if shape is not None else None), running
        expected = self.expected_s(client_id)
        return (expected if expected > 0 else None), running

    def served_totals(self) -> Served:
        """Every answer's work, slot-seconds (the scale `served` uses) and completion tokens."""
        return Served(self._all_work, self._all_s, self._all_answer_tokens)

    def _totals(self) -> Served:
        """This process's answers; before its first, the pool's (`pool_served`, from the lease broker)."""
        return self.served_totals() if self._all_s > 0 else self.pool_served

    def served(self, client_id: str) -> float:
        """The service a client has had, in the reported work's units (see the module docstring): its answered
        requests' slot-seconds on the work scale and, for each attempt holding a slot now, one request's expected
        work. Changes only when the client starts or ends an attempt or is answered (the serving order's heap is
        touched then), not as time passes."""
        scale = self._scale()
        served = self._served_s.get(client_id, 0.0) * scale
        running = self._ledger.of_client(client_id)
        if running:
            served += running * self._expected_work(client_id, scale)
        return served

    def by_service(self, client_id: str) -> bool:
        """Whether the client is ranked by the service it has had (shortest_first, no work left reported)."""
        return self.order == "shortest_first" and client_id not in self._work_left and client_id not in self._declared

    def gives_way(self, client_id: str) -> bool:
        """Whether the client's young attempts may give their slots back to a client ahead of it in the order, and
        it may take them (`GrantPass._take_for_order`): a caller behind the gateway, ranked by the service it has
        had or by the requests it says it has left (shortest_first) — whichever caller's requests reach a free
        slot first take it, and a moment's lead is not a rank. fedpool's evals (reporting their work) start
        together behind their start line."""
        return self.order == "shortest_first" and client_id not in self._work_left

    def expected_work(self, client_id: str) -> float:
        """One of the client's requests, in the units `served` ranks in."""
        return self._expected_work(client_id, self._scale())

    def _scale(self) -> float:
        work, slot_s, _ = self._totals()
        return work / slot_s if slot_s > 0 and work > 0 else 1.0

    def _expected_work(self, client_id: str, scale: float) -> float:
        """One of the client's requests, in work: its answers' mean slot-seconds on the work scale; before its
        first, `expected_s` on it; before any answer anywhere (here or at another lease holder), its shape's work
        (prompt + 2 × its answer budget: the first requests of a caller asking for 64 tokens and of one asking for
        4 already rank apart)."""
        answers = self._answers.get(client_id)
        if answers:
            return self._served_s[client_id] / answers * scale
        if self._totals().slot_s > 0:
            return self.expected_s(client_id) * scale
        shape = self._shapes.get(client_id)
        if shape is None:
            return 0.0
        answer = KV_ANSWER_TOKENS if shape.max_tokens is None else shape.max_tokens
        return shape.prompt_tokens + SERVED_DECODE_WEIGHT * answer

    def expected_s(self, client_id: str) -> float:
        """The slot-seconds one of the client's requests is expected to hold: its answers' mean. Before its first,
        the more of its shape's work at the pool's slot-seconds per unit of work and its answer budget at the
        pool's slot-seconds per answer token (a sequence holds its slot about one decode step per answer token, a
        prompt a step or a few: guessed by work alone, a long-answer caller was ranked as short). The pool's: this
        process's answers; before its first, every lease holder's (`pool_served`: a gateway replica started beside
        another priced a long-answer caller at 0 until its own first answer, ~5 s on llama.cpp, and the broker
        shared the slots evenly with a short one meanwhile). 0 before any answer anywhere."""
        answers = self._answers.get(client_id)
        if answers:
            return self._served_s[client_id] / answers
        shape = self._shapes.get(client_id)
        work, slot_s, tokens = self._totals()
        if shape is None or slot_s <= 0:
            return 0.0
        answer = KV_ANSWER_TOKENS if shape.max_tokens is None else shape.max_tokens
        by_work = (shape.prompt_tokens + SERVED_DECODE_WEIGHT * answer) * slot_s / work if work > 0 else 0.0
        by_steps = answer * slot_s / tokens if tokens > 0 else 0.0
        return max(by_work, by_steps)

    def idle(self, now: float, ttl_s: float) -> list[str]:
        """Clients not seen for `ttl_s` with nothing in flight or waiting (oldest first; O(those))."""
        out = []
        for client_id, seen in self._seen.items():
            if now - seen < ttl_s:
                break
            if not self._ledger.of_client(client_id) and not self.waiting.get(client_id):
                out.append(client_id)
        return out

    def forget(self, client_id: str) -> None:
        """Drop everything kept about a client that has gone (a weight it was given by configuration stays)."""
        for table in (self._work_left, self._answer, self._served_s, self._seen, self._sequence):
            table.pop(client_id, None)
        self._answers.pop(client_id, None)
        self._requests_left.pop(client_id, None)
        self._declared.discard(client_id)
        self._background.discard(client_id)
        self._shapes.pop(client_id, None)
        self.done_sending.discard(client_id)

    def known(self) -> int:
        """Clients the book holds anything for."""
        return len(self._seen | self._shapes | self._served_s)

    # ---- reads --------------------------------------------------------------------------------------
    def requests_left(self) -> dict[str, int]:
        """Clients that said how many requests they have still to complete."""
        return dict(self._requests_left)

    def requests_left_of(self, client_id: str) -> int | None:
        """The requests the client said it has still to complete (None: it said nothing)."""
        return self._requests_left.get(client_id)

    def answered(self, client_id: str) -> int:
        """The client's requests answered so far (since it was last forgotten)."""
        return self._answers.get(client_id, 0)

    def shape(self, client_id: str) -> ClientShape | None:
        return self._shapes.get(client_id)

    def kv_tokens(self, client_id: str) -> float:
        """The KV cache one of the client's requests is expected to hold on an engine, on average over its life:
        its answers' mean prompt + half their completion tokens (the engine's own counts, media included), else
        its shape's prompt and half its answer budget."""
        mean = self._sequence.get(client_id)
        if mean is not None:
            return mean
        shape = self._shapes.get(client_id)
        answer = KV_ANSWER_TOKENS if shape is None or shape.max_tokens is None else shape.max_tokens
        return (shape.prompt_tokens if shape is not None else 0.0) + 0.5 * answer

    def first(self, client_id: str) -> float:
        """The order's own criterion (smaller first); 0 for every client under `fair`; a background client's
        offset by BACKGROUND_RANK."""
        if self.order == "shortest_first":
            first = self._shortest(client_id)
        elif self.order == "longest_answers_first":
            first = -self._answer.get(client_id, 0.0)
        else:
            first = 0.0
        return first + BACKGROUND_RANK if client_id in self._background else first

    def work_left(self, client_id: str) -> float | None:
        """The work a client says it has left, whatever the order: what it reports (fedpool's evals), else the
        requests it declared it has left × one request's expected work (a gateway caller with
        `X-Fedpool-Requests`); None where it says nothing. The lease broker rounds shares towards the holders
        nearest their end (registry/leases.py)."""
        work = self._work_left.get(client_id)
        if work is not None:
            return work
        if client_id in self._declared:
            return self._requests_left.get(client_id, 0) * self.expected_work(client_id)
        return None

    def open_ended(self, client_id: str) -> bool:
        """Whether the client's run has no end in view: it says nothing of what it has left and has not said it
        sent its last request (a gateway caller streaming its requests). Nothing can outlast such a run."""
        return client_id not in self.done_sending and self.work_left(client_id) is None

    def _shortest(self, client_id: str) -> float:
        """shortest_first's criterion: the work the client reports left; else the requests it says it has left ×
        one request's expected work; else the service it has had."""
        work = self.work_left(client_id)
        return self.served(client_id) if work is None else work

    def key(self, client_id: str) -> tuple[float, float]:
        """Smaller first: the criterion, then requests in flight per unit of weight."""
        return self.first(client_id), self._ledger.clients.get(client_id, 0) / self._weights.get(client_id, 1.0)


def shape_steps(shape: ClientShape) -> float:
    """The engine steps a request of this shape holds its slot for: one per answer token (its budget) and its
    prompt's, a step per PREFILL_TOKENS_PER_STEP tokens and at least one (engines prefill a prompt in batches)."""
    answer = KV_ANSWER_TOKENS if shape.max_tokens is None else shape.max_tokens
    return answer + max(1.0, shape.prompt_tokens / PREFILL_TOKENS_PER_STEP)


def client_size(shape: Any) -> tuple[float, float] | None:
    """(prompt tokens, answer tokens) of a `ClientShape` (None: unknown)."""
    if shape is None:
        return None
    return float(shape.prompt_tokens), float(shape.max_tokens or DEFAULT_ANSWER_TOKENS)
