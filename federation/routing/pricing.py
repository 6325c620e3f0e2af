"""What a request costs on a server, for the routing policies: a prior from the accelerator's data sheet, replaced
by what the server's answers show.

**Priors** (not fitted; round figures, each a stated share of the data sheet's peak): prefill is compute-bound — 2
FLOP per parameter per token at the dense fp16 TFLOPS × `PREFILL_EFFICIENCY`; a decode step reads the weights once —
2 bytes per parameter at the HBM bandwidth × `DECODE_BW_EFFICIENCY` — for the whole batch, and a full batch's step
costs `FULL_BATCH_STEP_FACTOR` × a batch-of-one step. Costs are for a nominal model of 1 B parameters.

**Fitted**: `CostFit` scales each kind's prior by busy seconds ÷ prior-priced seconds of what its servers answered
(decayed); the prefill-to-decode ratio stays the data sheets', since busy time does not split additively when prompt
chunks and decode steps share the engine's steps. `SpeedCalibration` splits a kind's share among its members;
`EngineTimedCosts` reads a kind's costs from its answers' own engine times (`earliest_finish`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fedpool.federation.core.ledger import BusyRate, InflightLedger
from fedpool.registry import ServerEntry, accelerator_roofline

PREFILL_EFFICIENCY = 0.6  # prior: long prompts reach about 50-70% of dense fp16 peak in FlashAttention-class kernels
DECODE_BW_EFFICIENCY = 0.8  # prior: a memory-bound step streams weights at about 70-90% of HBM peak
FULL_BATCH_STEP_FACTOR = 1.5  # prior: a full batch's decode step against a batch of one
FIT_WINDOW_S = 2.0  # seconds of answers per regression row (per server)
FIT_MIN_ROWS = 3  # rows a kind needs before its fit replaces the prior
PREFILL_MIN_TOKENS = 32  # answers whose engine prefilled at least this many prompt tokens measure prefill ...
DECODE_MIN_TOKENS = 8  # ... and at least this many answer tokens the decode step
PREFILL_QUANTILE = 0.1  # prefill cost: this quantile of prefill seconds a token, over the kind's latest rows
PREFILL_ROWS = 200
DECODE_ROWS = 1000


@dataclass(frozen=True, slots=True)
class ServerCost:
    """Seconds per token: prefill, and decode at full batch. Priors are in nominal units (1 B parameters), fitted
    costs in the server's busy seconds; the plan compares kinds on one scale (`CostFit.costs`)."""

    prefill_s_per_token: float
    decode_s_per_token: float  # per generated token when the batch is full

    def of(self, prompt_tokens: float, completion_tokens: float) -> float:
        return prompt_tokens * self.prefill_s_per_token + completion_tokens * self.decode_s_per_token

    def scaled(self, prefill: float, decode: float) -> ServerCost:
        return ServerCost(self.prefill_s_per_token * prefill, self.decode_s_per_token * decode)


def kind_key(server: ServerEntry) -> str:
    """A server's kind, for the plan's columns and the horizon: its accelerator, GPU count and capacity."""
    return server.kind


def server_cost(entry: ServerEntry) -> ServerCost:
    """The data-sheet prior for one server (see the module docstring)."""
    tflops, hbm_tbs = accelerator_roofline(entry.record.accelerator)
    gpus = max(1, entry.record.gpu_count)
    flops = 2e9  # per token, 1 B parameters
    weight_bytes = 2e9
    prefill = flops / (tflops * 1e12 * PREFILL_EFFICIENCY * gpus)
    step = weight_bytes / (hbm_tbs * 1e12 * DECODE_BW_EFFICIENCY * gpus)
    batch = max(1, entry.capacity)
    return ServerCost(prefill, step * FULL_BATCH_STEP_FACTOR / batch)


def step_cost(entry: ServerEntry, batch: float) -> float:
    """The prior's seconds for one decode step of `batch` sequences: a batch-of-one step, rising linearly to
    `FULL_BATCH_STEP_FACTOR` × that at the server's capacity."""
    _, hbm_tbs = accelerator_roofline(entry.record.accelerator)
    step = 2e9 / (hbm_tbs * 1e12 * DECODE_BW_EFFICIENCY * max(1, entry.record.gpu_count))
    capacity = max(1, entry.capacity)
    share = (batch - 1) / (capacity - 1) if capacity > 1 else 1.0
    return step * (1 + (FULL_BATCH_STEP_FACTOR - 1) * min(1.0, max(0.0, share)))


@dataclass
class _Stats:
    """Decayed sums of one kind's windows: busy seconds, and the prior-priced seconds of what was answered."""

    busy: float = 0.0
    priced: float = 0.0
    rows: float = 0.0
    at: float | None = None

    def add(self, now: float, tau_s: float, priced: float, busy: float) -> None:
        if self.at is not None and now > self.at:
            keep = math.exp(-(now - self.at) / tau_s)
            self.busy *= keep
            self.priced *= keep
            self.rows *= keep
        self.at = now
        self.busy += busy
        self.priced += priced
        self.rows += 1

    def factor(self) -> float | None:
        """Busy seconds per prior-priced second (1: as fast as the prior says; 2: half as fast)."""
        return self.busy / self.priced if self.priced > 0 else None


@dataclass
class _Window:
    started: float
    busy_at_start: float
    occupancy_at_start: float
    prompt: float = 0.0
    completion: float = 0.0


class CostFit:
    """Each server kind's cost, fitted from its members' answers (see the module docstring)."""

    def __init__(self, ledger: InflightLedger, clock: Callable[[], float], *, tau_s: float,
                 window_s: float = FIT_WINDOW_S, enabled: bool = True):
        self._ledger = ledger
        self._clock = clock
        self._tau = tau_s
        self._window_s = window_s
        self.enabled = enabled
        self._windows: dict[str, _Window] = {}
        self._stats: dict[str, _Stats] = {}

    def observe(self, server: ServerEntry, kind: str, prompt_tokens: int, completion_tokens: int) -> None:
        now = self._clock()
        busy = self._ledger.busy_s(server.id)
        occupancy = self._ledger.occupancy_s(server.id)
        window = self._windows.get(server.id)
        if window is None:  # the first answer's busy time is already behind `busy`: windows start after it
            self._windows[server.id] = _Window(now, busy, occupancy)
            return
        window.prompt += prompt_tokens
        window.completion += completion_tokens
        if now - window.started >= self._window_s:
            row_busy = busy - window.busy_at_start
            if row_busy > 0:
                batch = min(max(1.0, (occupancy - window.occupancy_at_start) / row_busy), max(1, server.capacity))
                priced = (window.prompt * server_cost(server).prefill_s_per_token
                          + window.completion / batch * step_cost(server, batch))
                self._stats.setdefault(kind, _Stats()).add(now, self._tau, priced, row_busy)
            self._windows[server.id] = _Window(now, busy, occupancy)

    def costs(self, kinds: Mapping[str, Sequence[ServerEntry]]) -> dict[str, ServerCost]:
        """One cost per kind on one scale: the prior × the kind's fitted speed factor where it has enough
        windows; × the fitted kinds' mean factor elsewhere (1 where none is fitted yet)."""
        fitted = self.fitted_kinds() if self.enabled else {}
        fitted = {k: f for k, f in fitted.items() if k in kinds}
        mean = sum(fitted.values()) / len(fitted) if fitted else 1.0
        return {kind: server_cost(members[0]).scaled(fitted.get(kind, mean), fitted.get(kind, mean))
                for kind, members in kinds.items()}

    def fitted_kinds(self) -> dict[str, float]:
        """Kind -> fitted speed factor against the prior (busy seconds per priced second), for logs and reports."""
        return {k: f for k, s in self._stats.items() if s.rows >= FIT_MIN_ROWS and (f := s.factor()) is not None}


@dataclass
class SpeedCalibration:
    """How fast each server really works against its priced cost: priced work of the requests it answered ÷
    its busy time (the ledger's), decaying with time constant `tau_s`. Splits a kind's share among its members."""

    ledger: InflightLedger
    clock: Callable[[], float]
    tau_s: float
    min_answers: int = 20
    enabled: bool = True
    _rates: dict[str, BusyRate] = field(default_factory=dict)

    def observe(self, server: ServerEntry, prompt_tokens: int, completion_tokens: int) -> None:
        rate = self._rates.setdefault(server.id, BusyRate(self.tau_s))
        rate.add(self.clock(), self.ledger.busy_s(server.id), server_cost(server).of(prompt_tokens, completion_tokens))

    def factors(self, servers: Sequence[ServerEntry]) -> dict[str, float]:
        """Each server's speed against the prior, relative to the others; servers not measured yet get the mean
        of those that are (1.0 when none is)."""
        now = self.clock()
        known: dict[str, float] = {}
        if self.enabled:
            for s in servers:
                rate = self._rates.get(s.id)
                value = rate.value(now, self.ledger.busy_s(s.id), self.min_answers) if rate is not None else None
                if value is not None:
                    known[s.id] = value
        mean = sum(known.values()) / len(known) if known else 1.0
        return {s.id: known.get(s.id, mean) / mean for s in servers}


@dataclass
class EngineTimedCosts:
    """A kind's prefill and step costs read from its answers' own engine times (newest rows last): prefill the
    `PREFILL_QUANTILE` of prefill seconds a prompt token (answers that prefilled at least `min_prompt_tokens`), the
    step the least decode seconds a token after the first (answers of at least `DECODE_MIN_TOKENS`): stalls by other
    prompts only lengthen them. The time to first token includes the step that samples it, so the answer's own
    decode step comes off its prefill."""

    min_prompt_tokens: int = PREFILL_MIN_TOKENS
    prefill: deque[float] = field(default_factory=lambda: deque(maxlen=PREFILL_ROWS))  # s a prompt token
    decode: deque[float] = field(default_factory=lambda: deque(maxlen=DECODE_ROWS))  # s a token after the first

    def add(self, prefilled_tokens: int | None, completion_tokens: int | None, prefill_s: float,
            decode_s: float) -> None:
        step = 0.0
        if completion_tokens is not None and completion_tokens >= DECODE_MIN_TOKENS and decode_s > 0:
            step = decode_s / (completion_tokens - 1)
            self.decode.append(step)
        if prefilled_tokens is not None and prefilled_tokens >= self.min_prompt_tokens and prefill_s > step:
            self.prefill.append((prefill_s - step) / prefilled_tokens)

    def fit(self, prior_prefill_s: float, prior_step_s: float) -> tuple[float, float] | None:
        """(prefill, step) now; a cost not measured yet keeps the prior's ratio to the other (None: neither is)."""
        prefill = quantile(self.prefill, PREFILL_QUANTILE) if self.prefill else None
        step = min(self.decode) if self.decode else None
        if prefill is None:
            return None if step is None else (step * prior_prefill_s / prior_step_s, step)
        return prefill, (prefill * prior_step_s / prior_prefill_s if step is None else step)


def quantile(values: Sequence[float] | deque[float], q: float) -> float:
    """The `q` quantile of the values (the lower of two neighbours; at least one value)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]
