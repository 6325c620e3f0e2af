"""The routing baselines the benchmarks compare fedpool's policies against: pickers in fedpool's composition
(`SampledPolicy`: the route's servers with room, then a picker), registered by name on import.

    round_robin      in turn, by server id
    random           one server with room at random
    least_inflight   the fewest of this dispatcher's requests in flight
    power_of_two     the less loaded (in flight + engine queue) of two sampled at random
    prefix_affinity  consistent hashing of the prompt's prefix, with bounded load

No benchmark shows any of them ahead of `capacity_weighted` or the planning policies on any workload
(benchmarks/results/policies.md, scale_sim*.md), so they are not offered by the product: import this module (the
benchmarks and tests do) to make them known to `make_policy`.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Sequence

from fedpool.federation.core.policy import ServerView, V
from fedpool.federation.core.types import InferenceRequest
from fedpool.federation.routing.policies import SampledPolicy

BASELINES = ("round_robin", "random", "least_inflight", "power_of_two", "prefix_affinity")


class _Picker:
    def __init__(self, rng: random.Random):
        self._rng = rng

    def forget_server(self, server_id: str) -> None:
        return None

    def _least(self, candidates: Sequence[V], key: Callable[[V], float]) -> V:
        """Lowest key; ties broken at random so no server always wins a tie."""
        best, tied = None, []
        for c in candidates:
            k = key(c)
            if best is None or k < best:
                best, tied = k, [c]
            elif k == best:
                tied.append(c)
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


class InTurn(_Picker):
    def __init__(self, rng: random.Random):
        super().__init__(rng)
        self._next = 0

    def pick(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        ordered = sorted(candidates, key=lambda c: c.id)
        pick = ordered[self._next % len(ordered)]
        self._next += 1
        return pick


class AtRandom(_Picker):
    def pick(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        return self._rng.choice(candidates)


class FewestInflight(_Picker):
    def pick(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        return self._least(candidates, _inflight)


class LessLoadedOfTwo(_Picker):
    def pick(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        pair = self._rng.sample(list(candidates), 2) if len(candidates) > 2 else candidates
        return self._least(pair, _load)


class PrefixHome(_Picker):
    """Consistent hashing of the prompt prefix with bounded load (at most (1 + epsilon) x the mean in flight)."""

    VIRTUAL_NODES = 64

    def __init__(self, rng: random.Random, epsilon: float = 0.25):
        super().__init__(rng)
        self._epsilon = epsilon

    def pick(self, candidates: Sequence[V], request: InferenceRequest) -> V:
        ring = sorted((_hash(f"{c.id}#{i}"), n) for n, c in enumerate(candidates) for i in range(self.VIRTUAL_NODES))
        keys = [k for k, _ in ring]
        total = sum(c.inflight for c in candidates) + 1
        bound = max(1.0, (1 + self._epsilon) * total / len(candidates))
        start = bisect.bisect(keys, _hash(request.prefix_text()))
        seen: set[int] = set()
        for offset in range(len(ring)):
            n = ring[(start + offset) % len(ring)][1]
            if n in seen:
                continue
            seen.add(n)
            if candidates[n].inflight + 1 <= bound:
                return candidates[n]  # the prefix's home, or the next on the ring when the home is full
        return self._least(candidates, _expected_wait)  # all over the bound


class RoundRobin(SampledPolicy, name="round_robin"):
    def __init__(self, rng: random.Random | None = None):
        rng = rng or random.Random(0)
        super().__init__(InTurn(rng), rng)


class RandomChoice(SampledPolicy, name="random"):
    def __init__(self, rng: random.Random | None = None):
        rng = rng or random.Random(0)
        super().__init__(AtRandom(rng), rng, sample=1)


class LeastInflight(SampledPolicy, name="least_inflight"):
    def __init__(self, rng: random.Random | None = None):
        rng = rng or random.Random(0)
        super().__init__(FewestInflight(rng), rng)


class PowerOfTwo(SampledPolicy, name="power_of_two"):
    def __init__(self, rng: random.Random | None = None):
        rng = rng or random.Random(0)
        super().__init__(LessLoadedOfTwo(rng), rng, sample=2)


class PrefixAffinity(SampledPolicy, name="prefix_affinity"):
    def __init__(self, rng: random.Random | None = None, epsilon: float = 0.25):
        rng = rng or random.Random(0)
        super().__init__(PrefixHome(rng, epsilon), rng)


def _inflight(c: ServerView) -> float:
    return c.inflight


def _load(c: ServerView) -> float:
    return c.inflight + c.scraped_waiting


def _expected_wait(c: ServerView) -> float:
    return c.expected_wait


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")
