"""What a request costs on a server, for planned routing: a prior from the accelerator's data sheet, and a
correction learned from the answers the server gives.

Priors (not fitted): prefill is compute-bound (2 FLOP per parameter per token at the data sheet's dense
fp16 TFLOPS, times `PREFILL_MFU`); a decode step reads the weights once (2 bytes per parameter at the data
sheet's HBM bandwidth, times `DECODE_BW_EFFICIENCY`) for the whole batch, and a step at full batch costs
`FULL_BATCH_STEP_FACTOR` times one at batch 1. Costs are for a nominal model of 1 B parameters: only ratios
between servers and between prefill and decode matter to the plan.
Fitted (per server, from its answers): `SpeedCalibration`, the priced work it answered per busy second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fedpool.federation.learning import BusyRate
from fedpool.federation.ledger import InflightLedger
from fedpool.registry import ServerEntry, accelerator_roofline

PREFILL_MFU = 0.5  # share of peak tensor FLOPS a prefill reaches (long prompts, bf16)
DECODE_BW_EFFICIENCY = 0.75  # share of peak HBM bandwidth a decode step reaches
FULL_BATCH_STEP_FACTOR = 2.0  # a step at full batch costs about twice a batch-of-one step (KV reads, MLP)


@dataclass(frozen=True, slots=True)
class ServerCost:
    """Seconds per token for a nominal model of 1 B parameters (the unit cancels in the plan)."""

    prefill_s_per_token: float
    decode_s_per_token: float  # per generated token when the batch is full

    def of(self, prompt_tokens: float, completion_tokens: float) -> float:
        return prompt_tokens * self.prefill_s_per_token + completion_tokens * self.decode_s_per_token


def server_cost(entry: ServerEntry) -> ServerCost:
    """The data-sheet prior for one server (see the module docstring)."""
    tflops, hbm_tbs = accelerator_roofline(entry.record.accelerator)
    gpus = max(1, entry.record.gpu_count)
    flops = 2e9  # per token, 1 B parameters
    weight_bytes = 2e9
    prefill = flops / (tflops * 1e12 * PREFILL_MFU * gpus)
    step = weight_bytes / (hbm_tbs * 1e12 * DECODE_BW_EFFICIENCY * gpus)
    batch = max(1, entry.capacity)
    return ServerCost(prefill, step * FULL_BATCH_STEP_FACTOR / batch)


@dataclass
class SpeedCalibration:
    """How fast each server really works against its priced cost: priced work of the requests it answered ÷
    its busy time (the ledger's), decaying with time constant `tau_s`. The data sheet gives ratios an
    engine does not reach (kernels, KV limits, chunking); this corrects them from what is seen."""

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
        """Each server's price divisor: its measured speed against the prior, relative to the others; servers
        not measured yet get the mean of those that are (1.0 when none is)."""
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
