"""Status derived from facts: probe history, lease, drain request and passive failure reports."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fedpool.registry.snapshot import ProbeResult, ServerStatus


@dataclass(frozen=True, slots=True)
class StatusThresholds:
    """Hysteresis: several failures to mark a server down, several successes to bring it back."""

    down_after_failures: int = 3
    up_after_successes: int = 2
    suspect_after_passive_failures: int = 3
    passive_window_s: float = 30.0
    busy_timeouts_tolerated: int = 5  # slow probes of a busy engine in a row before they count as failures


def derive_status(
    probes: Iterable[ProbeResult],
    *,
    thresholds: StatusThresholds,
    now: float,
    lease_expired: bool = False,
    draining: bool = False,
    passive_failure_times: Iterable[float] = (),
) -> ServerStatus:
    """Fold the probe history (oldest first) through the hysteresis state machine.

    A server starts healthy because registration already checked it. A failed probe makes a healthy
    server suspect; `down_after_failures` in a row make it down; a down server needs
    `up_after_successes` in a row to come back, a suspect one a single success. A probe that timed out
    while the engine was busy is ignored, up to `busy_timeouts_tolerated` in a row (a hung engine still
    goes down).
    """
    state = ServerStatus.HEALTHY
    failures = successes = busy_streak = 0
    for probe in probes:
        if not probe.ok and probe.busy:
            busy_streak += 1
            if busy_streak <= thresholds.busy_timeouts_tolerated:
                continue  # a probe that is slow because the server is busy is not a failure
        else:
            busy_streak = 0
        if probe.ok:
            successes, failures = successes + 1, 0
            if state is ServerStatus.SUSPECT or (
                state is ServerStatus.DOWN and successes >= thresholds.up_after_successes
            ):
                state = ServerStatus.HEALTHY
        else:
            failures, successes = failures + 1, 0
            if failures >= thresholds.down_after_failures:
                state = ServerStatus.DOWN
            elif state is ServerStatus.HEALTHY:
                state = ServerStatus.SUSPECT
    if lease_expired:
        state = ServerStatus.DOWN
    if state is ServerStatus.HEALTHY:
        recent = sum(1 for t in passive_failure_times if now - t <= thresholds.passive_window_s)
        if recent >= thresholds.suspect_after_passive_failures:
            state = ServerStatus.SUSPECT
    if draining and state is not ServerStatus.DOWN:
        return ServerStatus.DRAINING
    return state
