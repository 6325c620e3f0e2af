"""How fedpool makes its CPU actors (stage workers, media encoders, verifier judges).

Ray starts worker processes at niceness 15 so that its own daemons stay responsive. fedpool's CPU actors
do an eval's own work (loading, scoring, judging), on the eval's critical path: at niceness 15, any
process beside them at the default 0 — a CPU inference engine on the same machine, the case of every
llama.cpp or vLLM-CPU pool — takes nearly all of a shared core from them (the scheduler's weights for the two
nice levels). So they run at the priority the eval's own process has, the one the conventional baseline's
in-process stages have too.
"""

from __future__ import annotations

from typing import Any

WORKER_NICENESS = 0


def cpu_actor_options(num_cpus: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ray actor options for a restartable CPU actor at niceness WORKER_NICENESS: Ray starts it again if
    its node dies and retries the calls that were in flight. `extra` adds or overrides options; environment
    variables of an `extra` runtime_env are merged with the niceness setting, not dropped."""
    extra = dict(extra or {})
    runtime_env = dict(extra.pop("runtime_env", None) or {})
    env_vars = {"RAY_worker_niceness": str(WORKER_NICENESS), **(runtime_env.get("env_vars") or {})}
    return {"num_cpus": num_cpus, "max_restarts": -1, "max_task_retries": -1,
            "runtime_env": {**runtime_env, "env_vars": env_vars}, **extra}
