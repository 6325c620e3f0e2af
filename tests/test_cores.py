"""benchmarks/cores.py: the engines' cores and everyone else's, on real processes (Linux's affinity calls)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from fedpool.benchmarks import cores

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")


def test_split_keeps_cores_for_the_engines_and_leaves_the_rest() -> None:
    usable = sorted(os.sched_getaffinity(0))
    assert cores.split(0) is None  # 0: everything shares every core
    assert cores.split(len(usable)) is None  # nothing left for the clients
    assert cores.split(-1) is None
    if len(usable) < 2:
        assert cores.split(None) is None
        return
    half = cores.split(None)
    assert half is not None
    assert half.engines == frozenset(usable[: len(usable) // 2])
    assert half.others == frozenset(usable[len(usable) // 2:])
    assert half.engines.isdisjoint(half.others) and half.engines | half.others == frozenset(usable)
    one = cores.split(1)
    assert one is not None and one.engines == frozenset(usable[:1]) and len(one.others) == len(usable) - 1
    assert "engines on core(s)" in one.describe()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pin_moves_every_thread_of_a_running_process_and_its_later_threads_inherit() -> None:
    target = frozenset(sorted(os.sched_getaffinity(0))[:1])
    # a child with a second thread already running, which starts a third after it is told to
    code = ("import os, sys, threading, time\n"
            "ev = threading.Event()\n"
            "threading.Thread(target=ev.wait, daemon=True).start()\n"
            "print('up', flush=True); sys.stdin.readline()\n"
            "t = threading.Thread(target=ev.wait, daemon=True); t.start()\n"
            "print(sorted(os.sched_getaffinity(t.native_id)), flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "up"
        assert cores.pin(child.pid, target) >= 2  # the main thread and the waiting one
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert all(frozenset(os.sched_getaffinity(int(t))) == target for t in tids)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == str(sorted(target))  # a thread started after: the same set
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ProcessLookupError):
        cores.pin(child.pid, target)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_kept_to_gives_this_process_its_cores_back() -> None:
    before = frozenset(os.sched_getaffinity(0))
    one = frozenset(sorted(before)[-1:])
    with cores.kept_to(one):
        assert frozenset(os.sched_getaffinity(0)) == one
        seen: list[frozenset[int]] = []
        worker = threading.Thread(target=lambda: seen.append(frozenset(os.sched_getaffinity(0))))
        worker.start()
        worker.join()
        assert seen == [one]  # started inside: inherits
    assert frozenset(os.sched_getaffinity(0)) == before
    assert all(frozenset(os.sched_getaffinity(int(t))) == before for t in os.listdir(f"/proc/{os.getpid()}/task"))
