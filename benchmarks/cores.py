"""Engines on cores of their own, for the benchmarks that run real engines beside their clients on one machine.

In the deployments fedpool is for, the engines compute on GPUs of their own machines and the eval processes,
gateways and registry on other CPUs; on a small machine that runs everything, every CPU-second a client process
spends is taken from the CPU engines beside it, so N client processes measure the machine's cores, not the
coordination between them. `split(n)` keeps the first n cores for the engines and the rest for everything else:
this process pins itself (and so every process it starts after: Ray, the registry, the clients) to the rest, and
each engine process, all its threads, to the engines' cores once it is up. Linux only (`sched_setaffinity`);
`split` answers None where the machine has too few cores or pinning is not available.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CoreSplit:
    engines: frozenset[int]
    others: frozenset[int]

    def describe(self) -> str:
        return f"engines on core(s) {_cores(self.engines)}; every other process on {_cores(self.others)}"


def _cores(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def split(engine_cpus: int | None) -> CoreSplit | None:
    """The first `engine_cpus` of the cores this process may use for the engines (None: half of them, at least
    one), the rest for everything else; None when `engine_cpus` is 0, the machine leaves nothing for the rest, or
    the platform cannot pin."""
    if not hasattr(os, "sched_getaffinity") or engine_cpus == 0:
        return None
    usable = sorted(os.sched_getaffinity(0))
    n = max(1, len(usable) // 2) if engine_cpus is None else engine_cpus
    if n < 0 or n >= len(usable):
        return None
    return CoreSplit(frozenset(usable[:n]), frozenset(usable[n:]))


def pin(pid: int, cpus: frozenset[int]) -> int:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit the set); the threads pinned.
    A thread that ended meanwhile is skipped; a process that is gone raises ProcessLookupError."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.exists():
        raise ProcessLookupError(pid)
    pinned = 0
    for task in tasks.iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            pinned += 1
        except ProcessLookupError:
            continue
    return pinned


@contextlib.contextmanager
def kept_to(cpus: frozenset[int]) -> Iterator[None]:
    """This process's threads on `cpus` while inside (the processes it starts meanwhile inherit the set); every
    thread back on the cores this one had before, after."""
    before = frozenset(os.sched_getaffinity(0))
    pin(os.getpid(), cpus)
    try:
        yield
    finally:
        pin(os.getpid(), before)
