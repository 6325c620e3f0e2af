"""What a request costs on a server, for planned routing: a prior from the accelerator's data sheet, replaced by
what the server's answers show.

**Priors** (not fitted; round figures, each a stated share of the data sheet's peak, deliberately not anyone's
measurement of the pool at hand): prefill is compute-bound — 2 FLOP per parameter per token at the data
sheet's dense fp16 TFLOPS × `PREFILL_EFFICIENCY`; a decode step reads the weights once — 2 bytes per
parameter at the data sheet's HBM bandwidth × `DECODE_BW_EFFICIENCY` — for the whole batch, and a full
batch's step costs `FULL_BATCH_STEP_FACTOR` × a batch-of-one step (KV reads, a wider MLP). Costs are for a
nominal model of 1 B parameters.

**Fitted** (per server kind, from its answers): `CostFit` regresses each server's busy seconds over short
windows on the prompt and completion tokens it answered in them (busy ≈ a·prefill prior·P + b·decode
prior·C), so both the kind's speed and its prefill-to-decode ratio are learned; a ridge term holds (a, b)
to the kind's overall speed (one factor for both) where the windows' mix does not tell them apart. Within a
kind, `SpeedCalibration` (priced work per busy second) splits the kind's share among its members.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fedpool.federation.learning import BusyRate
from fedpool.federation.ledger import InflightLedger
from fedpool.registry import ServerEntry, accelerator_roofline

PREFILL_EFFICIENCY = 0.6  # prior: long prompts reach about 50-70% of dense fp16 peak in FlashAttention-class kernels
DECODE_BW_EFFICIENCY = 0.8  # prior: a memory-bound step streams weights at about 70-90% of HBM peak
FULL_BATCH_STEP_FACTOR = 1.5  # prior: a full batch's decode step against a batch of one
FIT_WINDOW_S = 2.0  # seconds of answers per regression row (per server)
FIT_MIN_ROWS = 3  # rows a kind needs before its fit replaces the prior
RIDGE = 0.01  # the fit's pull towards one speed factor for prefill and decode alike (share of each one's data)


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


@dataclass
class _Stats:
    """Decayed sufficient statistics of one kind's regression rows: x = (prior prefill × P, prior decode × C)."""

    xx: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # Σx0², Σx0x1, Σx1²
    xy: list[float] = field(default_factory=lambda: [0.0, 0.0])
    rows: float = 0.0
    at: float | None = None

    def add(self, now: float, tau_s: float, x0: float, x1: float, y: float) -> None:
        if self.at is not None and now > self.at:
            keep = math.exp(-(now - self.at) / tau_s)
            self.xx = [v * keep for v in self.xx]
            self.xy = [v * keep for v in self.xy]
            self.rows *= keep
        self.at = now
        self.xx[0] += x0 * x0
        self.xx[1] += x0 * x1
        self.xx[2] += x1 * x1
        self.xy[0] += x0 * y
        self.xy[1] += x1 * y
        self.rows += 1

    def factors(self) -> tuple[float, float] | None:
        """(a, b): busy seconds per prior-priced second of prefill and of decode; ridge towards a = b."""
        (s00, s01, s11), (y0, y1) = self.xx, self.xy
        total = s00 + 2 * s01 + s11
        if total <= 0:
            return None
        speed = (y0 + y1) / total  # the one factor that fits best for both (least squares with a = b)
        lam0, lam1 = RIDGE * s00, RIDGE * s11  # each factor pulled in proportion to its own data's weight
        a00, a01, a11 = s00 + lam0, s01, s11 + lam1
        b0, b1 = y0 + lam0 * speed, y1 + lam1 * speed
        det = a00 * a11 - a01 * a01
        if det <= 0:
            return speed, speed
        a = (b0 * a11 - a01 * b1) / det
        b = (a00 * b1 - a01 * b0) / det
        floor = 0.05 * speed  # a fit driven negative by noise falls back towards the common speed
        return max(a, floor), max(b, floor)


@dataclass
class _Window:
    started: float
    busy_at_start: float
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
        window = self._windows.get(server.id)
        if window is None:  # the first answer's busy time is already behind `busy`: windows start after it
            self._windows[server.id] = _Window(now, busy)
            return
        window.prompt += prompt_tokens
        window.completion += completion_tokens
        if now - window.started >= self._window_s:
            prior = server_cost(server)
            row_busy = busy - window.busy_at_start
            if row_busy > 0:
                self._stats.setdefault(kind, _Stats()).add(
                    now, self._tau, window.prompt * prior.prefill_s_per_token,
                    window.completion * prior.decode_s_per_token, row_busy)
            self._windows[server.id] = _Window(now, busy)

    def costs(self, kinds: Mapping[str, Sequence[ServerEntry]]) -> dict[str, ServerCost]:
        """One cost per kind on one scale: fitted where a kind has enough rows; the prior scaled by the fitted
        kinds' mean speed elsewhere (1 where none is fitted yet)."""
        fitted: dict[str, tuple[float, float]] = {}
        if self.enabled:
            for kind in kinds:
                stats = self._stats.get(kind)
                if stats is not None and stats.rows >= FIT_MIN_ROWS and (ab := stats.factors()) is not None:
                    fitted[kind] = ab
        mean = (sum((a + b) / 2 for a, b in fitted.values()) / len(fitted)) if fitted else 1.0
        out = {}
        for kind, members in kinds.items():
            a, b = fitted.get(kind, (mean, mean))
            out[kind] = server_cost(members[0]).scaled(a, b)
        return out

    def fitted_kinds(self) -> dict[str, tuple[float, float]]:
        """Kind -> fitted (prefill, decode) factors against the prior, for logs and reports."""
        return {k: ab for k, s in self._stats.items() if s.rows >= FIT_MIN_ROWS and (ab := s.factors()) is not None}


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
