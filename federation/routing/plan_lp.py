"""The planner's linear programs (SciPy's HiGHS): the min-makespan split of clients' requests over server
kinds, and the phased variant in which clients finish one after another. Pure functions of their inputs."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scipy.optimize import linprog
else:
    def linprog(*args: object, **kwargs: object) -> object:
        """SciPy's, imported on the first plan: importing scipy.optimize is costly, and every eval process, gateway
        and Ray worker paid it at start-up though only the `planned` policy solves LPs."""
        from scipy.optimize import linprog as solve

        return solve(*args, **kwargs)


_LOADER = "fedpool-import-scipy"


def preload_solver() -> threading.Thread:
    """Import SciPy's solver in a background thread, once per process (a policy that plans calls this when it is
    made, and `prepare_policy` earlier still): the first plan is made on the grant path, and an import there held
    the event loop just as the evals started sending; begun only when the policy was attached, the import (sharing
    the GIL with a busy loop) was still running at the first plan, which waited for it."""
    for thread in threading.enumerate():
        if thread.name == _LOADER:
            return thread  # (already loading)

    def load() -> None:
        import scipy.optimize  # noqa: F401  (the import is the point)

    thread = threading.Thread(target=load, name=_LOADER, daemon=True)
    thread.start()
    return thread


MIN_SHARE = 1e-6  # placements below this many requests are dropped from a plan


def solve_plan(clients: Sequence[str], servers: Sequence[str], counts: Mapping[str, float],
               cost: Mapping[tuple[str, str], float], held: Mapping[str, float] | None = None,
               capacity: Mapping[str, float] | None = None, tiebreak: float = 0.0,
               ) -> tuple[float, dict[str, dict[str, float]]]:
    """min T s.t. Σ_s x[c,s] = counts[c], held[s] + Σ_c x[c,s]·cost[c,s] ≤ capacity[s]·T, x ≥ 0 (HiGHS).
    `capacity` (default 1): how many servers' worth of work a column stands for. `tiebreak` > 0 adds that weight
    of the work placed (Σ x·cost / capacity) to the objective: among plans of the same T it takes the one that
    spends the least server time, instead of whichever vertex the solver lands on."""
    nc, ns = len(clients), len(servers)
    nvar = nc * ns + 1
    objective = [0.0] * nvar
    objective[-1] = 1.0
    if tiebreak > 0:
        for i, c in enumerate(clients):
            for j, s in enumerate(servers):
                objective[i * ns + j] = tiebreak * cost[c, s] / float((capacity or {}).get(s, 1.0))
    a_eq, b_eq = [], []
    for i, c in enumerate(clients):
        row = [0.0] * nvar
        for j in range(ns):
            row[i * ns + j] = 1.0
        a_eq.append(row)
        b_eq.append(float(counts[c]))
    a_ub, b_ub = [], []
    for j, s in enumerate(servers):
        row = [0.0] * nvar
        for i, c in enumerate(clients):
            row[i * ns + j] = cost[c, s]
        row[-1] = -float((capacity or {}).get(s, 1.0))
        a_ub.append(row)
        b_ub.append(-float((held or {}).get(s, 0.0)))
    result = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * nvar,
                     method="highs")
    if not result.success:
        raise RuntimeError(f"routing plan LP failed: {result.message}")
    plan = {c: {s: float(result.x[i * ns + j]) for j, s in enumerate(servers) if result.x[i * ns + j] > MIN_SHARE}
            for i, c in enumerate(clients)}
    return float(result.x[-1]), plan


def solve_phased_plan(ranked: Sequence[str], servers: Sequence[str], counts: Mapping[str, float],
                      cost: Mapping[tuple[str, str], float], held: Mapping[str, float], limit: float,
                      capacity: Mapping[str, float] | None = None) -> dict[str, dict[str, float]] | None:
    """Clients finish in the order given: phase k ends when client k is done. Variables x[c,s,k] (client c's
    requests on server s during phase k ≤ rank(c)) and phase lengths L_k; each server's work in a phase
    (held work counted in the first) ≤ L_k; every client done by the end of its phase; Σ L_k ≤ limit.
    Minimises Σ_c finish(c) = Σ_k (K − k + 1)·L_k. None when infeasible (the caller keeps the makespan plan)."""
    k_count, ns = len(ranked), len(servers)
    index: dict[tuple[int, int, int], int] = {}
    for i in range(k_count):
        for k in range(i + 1):
            for j in range(ns):
                index[i, j, k] = len(index)
    base = len(index)
    nvar = base + k_count
    objective = [0.0] * nvar
    for k in range(k_count):
        objective[base + k] = float(k_count - k)
    a_eq, b_eq = [], []
    for i, c in enumerate(ranked):
        row = [0.0] * nvar
        for k in range(i + 1):
            for j in range(ns):
                row[index[i, j, k]] = 1.0
        a_eq.append(row)
        b_eq.append(float(counts[c]))
    a_ub, b_ub = [], []
    for k in range(k_count):
        for j, s in enumerate(servers):
            row = [0.0] * nvar
            for i in range(k, k_count):
                row[index[i, j, k]] = cost[ranked[i], s]
            row[base + k] = -float((capacity or {}).get(s, 1.0))
            a_ub.append(row)
            b_ub.append(-float(held.get(s, 0.0)) if k == 0 else 0.0)
    row = [0.0] * nvar
    for k in range(k_count):
        row[base + k] = 1.0
    a_ub.append(row)
    b_ub.append(limit)
    result = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * nvar,
                     method="highs")
    if not result.success:
        return None
    plan: dict[str, dict[str, float]] = {}
    for (i, j, _k), v in index.items():
        if result.x[v] > MIN_SHARE:
            plan.setdefault(ranked[i], {}).setdefault(servers[j], 0.0)
            plan[ranked[i]][servers[j]] += float(result.x[v])
    return plan
