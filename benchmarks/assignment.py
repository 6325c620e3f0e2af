"""Which servers each conventional eval gets, and the bounds every arm is measured against.

- `careful_split`: what a careful user would do from what they know beforehand — dataset sizes, prompt
  lengths, max_tokens, and each server's prefill and decode speed — prefill-aware: an eval's work on a server
  is its requests' prefill plus decode at saturation on that server. Exact (every assignment of evals to
  servers, evals split into equal shards over their servers, tried) for small pools; longest-processing-
  time-first onto the server that finishes it soonest, then single moves while they help, for large ones.
- `best_static_split`: the same search with the true token counts (from the run's records): the oracle
  static split, no conventional assignment can do better.
- `ideal_makespan`: the fractional optimum, every request anywhere at saturated cost (an LP).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fedpool.deploy.emulator import EmulatorProfile
from fedpool.federation.routing.plan_lp import solve_plan

EXACT_LIMIT = 200_000  # assignments searched exhaustively below this count


@dataclass(frozen=True, slots=True)
class Workload:
    """One eval as the split sees it: how many requests, and tokens per request (prompt, completion)."""

    name: str
    size: int
    prompt_tokens: float
    completion_tokens: float


def saturated_cost(profile: EmulatorProfile, prompt: float, completion: float) -> float:
    """Engine seconds one request occupies on a saturated engine: its prefill, plus its share of full
    decode steps (batch as large as max_running and the KV budget allow)."""
    context = prompt + completion
    n = profile.max_running
    if profile.kv_cache_tokens is not None and context > 0:
        n = max(1, min(n, int(profile.kv_cache_tokens // context)))
    step = (profile.decode_s_per_token * (1 + profile.batch_slowdown * (n - 1))
            + profile.attn_s_per_ctx_token * n * (prompt + completion / 2))
    return prompt * profile.prefill_s_per_token + completion * step / n


def _seconds(w: Workload, profile: EmulatorProfile | None) -> float:
    if profile is None:  # a server nothing is known about: tokens, a completion token costing two prompt tokens
        return w.size * (w.prompt_tokens + 2.0 * w.completion_tokens)
    return w.size * saturated_cost(profile, w.prompt_tokens, w.completion_tokens)


def split_makespan(split: Mapping[str, Sequence[str]], work: Sequence[Workload],
                   profiles: Mapping[str, EmulatorProfile | None]) -> float:
    """Engine seconds of the busiest server when each eval runs on its servers in equal shards (servers
    shared by several evals run them side by side: their loads add)."""
    load = dict.fromkeys(profiles, 0.0)
    for w in work:
        servers = split[w.name]
        for s in servers:
            load[s] += _seconds(w, profiles[s]) / len(servers)
    return max(load.values())


def careful_split(work: Sequence[Workload], profiles: Mapping[str, EmulatorProfile | None]
                  ) -> tuple[dict[str, list[str]], float]:
    """(eval -> its servers, predicted engine-seconds makespan): the lowest predicted makespan found."""
    servers = sorted(profiles)
    names = [w.name for w in work]
    options = _server_sets(servers, len(names))
    if len(options) ** len(names) <= EXACT_LIMIT:
        best: tuple[float, dict[str, list[str]]] | None = None
        for choice in itertools.product(options, repeat=len(names)):
            split = {n: list(c) for n, c in zip(names, choice, strict=True)}
            span = split_makespan(split, work, profiles)
            if best is None or span < best[0]:
                best = (span, split)
        if best is not None:
            return best[1], best[0]
    return _lpt(work, profiles)


def _server_sets(servers: list[str], evals: int) -> list[tuple[str, ...]]:
    """The server sets an eval may get: any non-empty subset when there are at least as many servers as
    evals (spare servers shard an eval), one server each otherwise (evals share servers)."""
    if len(servers) < evals:
        return [(s,) for s in servers]
    return [c for k in range(1, len(servers) + 1) for c in itertools.combinations(servers, k)]


def _lpt(work: Sequence[Workload], profiles: Mapping[str, EmulatorProfile | None]
         ) -> tuple[dict[str, list[str]], float]:
    """Heaviest eval first onto the server that would finish it soonest; then single moves while they help."""
    load = dict.fromkeys(profiles, 0.0)
    split: dict[str, list[str]] = {}
    for w in sorted(work, key=lambda w: min(_seconds(w, p) for p in profiles.values()), reverse=True):
        best = min(profiles, key=lambda s: (load[s] + _seconds(w, profiles[s]), s))
        load[best] += _seconds(w, profiles[best])
        split[w.name] = [best]
    span = split_makespan(split, work, profiles)
    improved = True
    while improved:
        improved = False
        for w in work:
            for s in profiles:
                if split[w.name] == [s]:
                    continue
                trial = {**split, w.name: [s]}
                trial_span = split_makespan(trial, work, profiles)
                if trial_span < span - 1e-9:
                    split, span, improved = trial, trial_span, True
    return split, span


def best_static_split(work: Sequence[Workload], profiles: Mapping[str, EmulatorProfile]
                      ) -> tuple[dict[str, list[str]], float]:
    """The oracle: `careful_split` with the true token counts the caller gives."""
    return careful_split(work, profiles)


def ideal_makespan(work: Sequence[Workload], profiles: Mapping[str, EmulatorProfile],
                   counts: Mapping[str, int] | None = None) -> tuple[float, dict[str, dict[str, float]]]:
    """Minimum engine-seconds makespan if every request could go anywhere at saturated cost (an LP: minimise T
    subject to each eval's requests all placed and each server's work ≤ T). With `counts`, each profile
    stands for that many identical servers (their work ≤ count × T): the same optimum with a small LP."""
    evals, servers = sorted(w.name for w in work), sorted(profiles)
    by_name = {w.name: w for w in work}
    cost = {(e, s): saturated_cost(profiles[s], by_name[e].prompt_tokens, by_name[e].completion_tokens)
            for e in evals for s in servers}
    capacity = {s: float((counts or {}).get(s, 1)) for s in servers}
    try:
        makespan, placed = solve_plan(evals, servers, {e: float(by_name[e].size) for e in evals}, cost,
                                      capacity=capacity)
    except RuntimeError as exc:
        raise RuntimeError(f"ideal makespan LP failed: {exc}") from None
    return makespan, {e: {s: placed.get(e, {}).get(s, 0.0) for s in servers} for e in evals}
