"""Starting a local Ray cluster on a busy machine (deploy/localpool.py `start_local_ray`): Ray gives its new node a
fixed 30 s to register, and a machine loaded with other work can miss it once. These tests stand in for `ray.init`
(the one part that cannot be made to time out on demand) with a function that starts a real child process the way
a half-started node leaves its own, then fails as Ray does."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import ray

from fedpool.deploy.localpool import RAY_START_TRIES, start_local_ray

RAY_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")


def child(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *argv])


class SlowRay:
    """`ray.init` whose node misses the deadline `fails` times: each failed start leaves a process running one of
    Ray's own programs (its argv names Ray's directory), as a half-started node leaves its GCS and raylet."""

    def __init__(self, fails: int, error: Exception = RAY_TIMEOUT):
        self.fails = fails
        self.error = error
        self.calls: list[dict[str, object]] = []
        self.left_behind: list[subprocess.Popen[bytes]] = []

    def __call__(self, **kwargs: object) -> None:
        self.calls.append(kwargs)
        if len(self.calls) <= self.fails:
            self.left_behind.append(child(os.path.join(os.path.dirname(ray.__file__), "core", "src", "ray", "raylet")))
            raise self.error


def test_a_node_that_missed_rays_deadline_is_stopped_and_started_once_more(caplog: pytest.LogCaptureFixture) -> None:
    bystander = child("not-ray")  # a child of this process that is none of Ray's: left alone
    init = SlowRay(fails=1)
    try:
        with caplog.at_level(logging.WARNING, logger="fedpool.localpool"):
            start_local_ray(3, init)
        assert len(init.calls) == 2 and all(call["address"] == "local" and call["num_cpus"] == 3
                                            for call in init.calls)
        assert init.left_behind[0].wait(timeout=10) is not None  # the half-started node's process was stopped
        assert bystander.poll() is None
        assert "did not register within Ray's 30 s" in caplog.text and "stopped its 1 processes" in caplog.text
    finally:
        for process in (bystander, *init.left_behind):
            process.kill()
            process.wait()


@pytest.mark.parametrize("init", [SlowRay(fails=RAY_START_TRIES), SlowRay(fails=1, error=RuntimeError("bad port"))],
                         ids=["missed-every-time", "another-error"])
def test_ray_start_gives_up_after_its_tries_and_never_retries_other_errors(init: SlowRay) -> None:
    try:
        with pytest.raises(type(init.error), match=str(init.error)[:20]):
            start_local_ray(2, init)
        assert len(init.calls) == (RAY_START_TRIES if init.error is RAY_TIMEOUT else 1)
    finally:
        for process in init.left_behind:
            process.kill()
            process.wait()
