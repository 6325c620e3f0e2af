"""The dispatch core's value types: requests and results on the dispatcher's path (frozen; built by clients,
filled by the dispatcher), how a dispatcher is configured and what it reports, and the `Transport` interface
through which it reaches a server (implemented over HTTP in federation/gateway/transport.py, in process by tests
and the simulator)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from fedpool.registry import ServerEntry

if TYPE_CHECKING:
    from fedpool.federation.core.errors import FailureKind


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


# OpenAI generation fields fedpool reads itself; every other field of a body is passed through as given.
TYPED_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Generation parameters, typed where fedpool reads them (the hot path never looks into a dict)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # other OpenAI fields, sent as given

    @property
    def greedy(self) -> bool:
        """Temperature 0: a second copy of the request gives the same answer (modulo batch numerics)."""
        return self.temperature == 0

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> SamplingParams:
        """From a body's generation fields. Values of the wrong type raise ValueError naming the field."""
        return cls._read(fields, _TYPED)

    @classmethod
    def _read(cls, fields: Mapping[str, Any], not_extra: frozenset[str]) -> SamplingParams:
        get = fields.get
        stop = get("stop")
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        elif stop is not None:
            raise ValueError("field 'stop' must be a string or a list of strings")
        return cls(_number(get("max_tokens"), "max_tokens", int), _number(get("temperature"), "temperature", float),
                   _number(get("top_p"), "top_p", float), _number(get("seed"), "seed", int), stop,
                   {k: v for k, v in fields.items() if k not in not_extra})


def _number(value: Any, name: str, kind: type) -> Any:
    if value is None or type(value) is kind:
        return value
    try:
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
            raise ValueError
    except (ValueError, OverflowError):  # (int() of an infinity overflows)
        raise ValueError(f"field {name!r} must be {'an integer' if kind is int else 'a number'}") from None
    return kind(value)


_TYPED = frozenset(TYPED_FIELDS)
_NOT_PARAMS = frozenset(("prompt", "messages", "model", "stream", *TYPED_FIELDS))  # of a whole body


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One OpenAI-compatible request: a prompt (completions) or messages (chat), with typed parameters."""

    request_id: str
    model: str
    endpoint: Endpoint
    prompt: str | tuple[Any, ...] | None = None  # a string, or a batch/token list as OpenAI allows (sent as given)
    messages: tuple[Mapping[str, Any], ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    revision: str | None = None
    client_id: str = "default"
    pinned_engines: tuple[str, ...] | None = None
    pinned_servers: tuple[str, ...] | None = None
    reproducible: bool = False  # bit-for-bit results asked for: never raced against a copy elsewhere
    # A stream can carry its whole answer as the engine would send it unstreamed (`assembles`): set at construction,
    # read on the request path: a server whose engine is asked for streams (`Target.streamed`) gets it as one.
    streamable: bool = field(init=False, default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "streamable", assembles(self))

    @classmethod
    def from_body(cls, body: Mapping[str, Any], **fields: Any) -> InferenceRequest:
        """Split an OpenAI body (without `model` and `stream`) into prompt or messages and parameters."""
        prompt = body.get("prompt")
        messages = body.get("messages")
        return cls(prompt=tuple(prompt) if isinstance(prompt, list) else prompt,
                   messages=tuple(messages) if isinstance(messages, list | tuple) else messages,
                   params=SamplingParams._read(body, _NOT_PARAMS), **fields)

    @property
    def hedgeable(self) -> bool:
        """A copy elsewhere cannot change what is recorded: greedy decoding, and no bit-reproducibility asked."""
        return self.params.greedy and not self.reproducible

    def prompt_chars(self) -> int:
        """Characters of prompt text (content parts other than text are not counted)."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        if self.prompt is not None:
            return sum(len(p) for p in self.prompt if isinstance(p, str))
        total = 0
        for message in self.messages or ():
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
        return total

    def route_key(self) -> tuple[object, ...]:
        """What decides which servers may serve it: model, revision, pinned engines and servers."""
        return (self.model, self.revision, self.pinned_engines, self.pinned_servers)

    def prefix_text(self, length: int = 256) -> str:
        """The start of the prompt, for prefix-affinity routing."""
        if self.prompt is not None:
            return (self.prompt if isinstance(self.prompt, str) else repr(list(self.prompt)))[:length]
        return repr(list(self.messages or ()))[:length]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try at one server."""

    server_id: str
    started_at: float
    latency_s: float
    failure: FailureKind | None = None
    detail: str | None = None
    lost_race: bool = False  # a copy raced against another that answered first, cancelled unfinished


@dataclass(frozen=True, slots=True)
class EngineTimes:
    """An answer's own times as its engine reported them (llama.cpp's `timings`): seconds prefilling its prompt and
    seconds decoding its answer after the first token, and how many prompt tokens it prefilled (a prefix cache hit
    prefills fewer than the prompt has; None: not said)."""

    prefill_s: float
    decode_s: float
    prefill_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """One answer, read from the engine's body. The body itself is kept as the engine sent it (`raw`, with its
    `model` field beside it), so a proxy passes the bytes through instead of re-encoding them."""

    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_content: str | None = None
    raw: bytes | None = field(default=None, compare=False, repr=False)  # the engine's JSON body, as sent
    model: str | None = field(default=None, compare=False, repr=False)  # that body's `model` field
    engine_times: EngineTimes | None = field(default=None, compare=False, repr=False)  # where the engine said them


@dataclass(frozen=True, slots=True)
class InferenceResult:
    """A completed request with its provenance."""

    request_id: str
    completion: Completion
    server_id: str
    engine: str
    accelerator: str
    model_revision: str
    latency_s: float
    attempts: tuple[Attempt, ...] = field(default_factory=tuple)
    hedged: bool = False


# ---- how the dispatcher reaches a server ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Timeouts:
    """Connect, first byte (time to the response head) and total, in seconds."""

    connect_s: float = 5.0
    first_byte_s: float = 120.0
    total_s: float = 600.0


class StreamProgress:
    """Whether a streamed attempt's engine has sent any of its answer yet: its prompt is done and it decodes. The
    dispatcher hands one to `Transport.complete` for an attempt it may give back; the transport marks it at the
    body's first bytes (only a streamed attempt that decodes is given back: federation/core/attempts.py)."""

    __slots__ = ("decoding", "then")

    def __init__(self) -> None:
        self.decoding = False
        self.then: Callable[[], None] | None = None  # called once, as it starts to decode (a give-back deferred)

    def mark(self) -> None:
        """The engine sent the answer's first bytes: the prompt is done."""
        self.decoding = True
        then, self.then = self.then, None
        if then is not None:
            then()


class Target(Protocol):
    """The server an attempt goes to (a dispatcher's ServerState): its id, base URL, whether its engine is
    asked for streamed answers (`STREAMED_ENGINES`), and where it aborts a request by id (`abort_path`, from its
    engine's adapter; None: it learns only from the closed connection)."""

    @property
    def id(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def streamed(self) -> bool: ...

    @property
    def abort_path(self) -> str | None: ...


class StreamBody(Protocol):
    """An opened streaming response: its head, its body lines, and release() when done."""

    @property
    def headers(self) -> Any: ...

    @property
    def content(self) -> Any: ...  # `await content.readline()` -> bytes (b"" at the end)

    def release(self) -> Any: ...


class Transport(Protocol):
    """One attempt at one server. Failures are AttemptError (typed); cancellation propagates as is. `progress`,
    where given, is marked once a streamed answer's first bytes arrive."""

    async def complete(self, server: Target, request: InferenceRequest,
                       progress: StreamProgress | None = None) -> Completion: ...

    async def open_stream(self, server: Target, request: InferenceRequest) -> StreamBody: ...


# llama.cpp's server (this pool's build) runs a non-streamed request to its end after its client has gone but stops
# a streamed one at its next token, so requests to these engines are sent as streams and assembled (every such
# request asks for `Connection: close`: no pooled connection is reused after the engine closed it).
STREAMED_ENGINES = frozenset({"llamacpp"})
# Fields whose streamed form differs from the whole answer's by engine (several choices, per-token log
# probabilities, the prompt echoed, the caller's own stream options): such requests are sent unstreamed.
_WHOLE_ONLY = ("logprobs", "top_logprobs", "echo", "best_of", "stream_options", "suffix")


def assembles(request: InferenceRequest) -> bool:
    """Whether a stream can carry this request's whole answer as the engine would send it unstreamed: one prompt
    (or messages), one choice, no log probabilities, no echo."""
    extra = request.params.extra
    if extra and (any(name in extra for name in _WHOLE_ONLY) or extra.get("n", 1) != 1):
        return False
    return request.prompt is None or isinstance(request.prompt, str)


# ---- how a dispatcher is configured, and what it reports -------------------------------------------------------

CLIENT_ORDERS = ("fair", "shortest_first", "longest_answers_first")


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    max_attempts: int = 8
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    no_server_timeout_s: float = 60.0
    window_factor: float = 1.0  # admission window ceiling = engine capacity × this
    adaptive_windows: bool = True  # grow/shrink each server's window from what the dispatcher observes
    learn_throughput: bool = True  # weigh servers by observed tokens/s once known (prior: accelerator)
    # A server whose KV cache (ServerRecord.kv_cache_tokens) this dispatcher's attempts are expected to fill takes
    # no more until some end: long prompts (video) do not pile up in the engine's queue behind a window sized on
    # short ones. Off by default: on Table 7's pool it held the V100s below what their engines ran
    # (docs/architecture.md).
    kv_admission: bool = False
    # A scrape that shows most of this dispatcher's attempts on a server queued in its engine shrinks that
    # server's window at once (windows.SCRAPE_QUEUE_SHARE), and with this on, the attempts beyond the new window
    # started less than a second ago are taken back to their queues (on engines that drop a request whose client
    # has gone): a plan or window that sent a server far more than it runs is undone at the next scrape instead of
    # draining for seconds while other servers idle.
    give_back_queued: bool = True
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    hedging: bool = True  # duplicate stragglers at the tail; only greedy requests (temperature 0)
    hedge_factor: float = 2.0  # hedge once an attempt takes this × the model's median latency
    hedge_min_delay_s: float = 0.2
    learn_period_s: float = 2.0  # how often each server's throughput and admission window are re-decided
    # Which waiting request is served first when the pool is full. "fair": the client with the fewest
    # requests in flight per unit of weight (every eval progresses at the same pace). "shortest_first": the
    # client with the least work left (as it reports with set_client_remaining), fair among equals: evals
    # finish one after another, so results arrive sooner on average while the pool stays as busy.
    client_order: str = "fair"


@dataclass(frozen=True, slots=True)
class ServerStats:
    server_id: str
    answered: int
    failures: dict[str, int]
    inflight: int
    window: int
    completion_tokens: int
    busy_s: float
    learned_tokens_per_s: float | None = None
    window_reason: str | None = None


@dataclass(frozen=True, slots=True)
class DispatcherStats:
    submitted: int
    completed: int
    failed: int
    retries: int
    hedges: int
    inflight_total: int
    servers: tuple[ServerStats, ...]
    waiting: int = 0  # requests waiting for a slot
    decisions: int = 0  # slots granted (each a routing decision)
    decision_s: float = 0.0  # CPU time spent granting them (queue order, policy, slot accounting)
    loop_stalled_s: float = 0.0  # seconds this process's loop stood still with attempts in flight (not charged)
    preempted: int = 0  # attempts that gave their slot back to a shrunk lease or window (federation/core/attempts.py)
    preempted_lost_s: float = 0.0  # the engine time those attempts had used


@dataclass(frozen=True, slots=True)
class Slot:
    """A place held in a server's admission window for one attempt of a client's request."""

    server: ServerEntry
    client_id: str
    acquired_at: float


@dataclass(frozen=True, slots=True)
class OpenStream:
    """An upstream response being streamed; read `response.content`."""

    server: ServerEntry
    response: StreamBody
    attempts: tuple[Attempt, ...]
