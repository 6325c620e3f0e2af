"""`fedpool up`: a local pool that stays up for the eval tools researchers already run, and `fedpool down`.

One process brings up local Ray (started on loopback, or an existing cluster joined), the registry, N local servers
(llama.cpp with the bundled Gemma by default, vLLM's CPU build, or the emulator), the OpenAI-compatible gateway and
the pool page; prints the base URL and paste-ready commands; and on Ctrl-C / SIGTERM stops everything it started.
`--detach` runs it in the background (pid in STATE_DIR/up.pid, log in STATE_DIR/up.log); `fedpool down` stops it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from fedpool.cli_support import EXIT_BUSY, EXIT_FAILED, EXIT_USAGE, CliError, pool_page, run_server, stop_on_signals
from fedpool.deploy.recipes import recipes
from fedpool.options import DownOptions, UpOptions

UP_DIR: Path = UpOptions.model_fields["state_dir"].default

if TYPE_CHECKING:
    from fedpool.deploy.localpool import LocalPoolSpec


def cmd_up(args: UpOptions) -> int:
    from fedpool.deploy.process import port_problem
    from fedpool.deploy.updir import PoolAlreadyUp, refuse_running

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        raise CliError("`fedpool up` serves loopback only (its gateway has no keys); for a shared pool use "
                       "`fedpool gateway --api-key-file`", EXIT_USAGE)
    try:
        refuse_running(args.state_dir.expanduser().resolve())
        if (busy := port_problem(args.host, args.port)) is not None:  # checked before anything starts
            raise CliError(busy, EXIT_USAGE)
        from fedpool.deploy.localpool import LocalPoolSpec

        spec = LocalPoolSpec(engine=args.engine, count=args.servers, slots=args.slots, threads=args.threads,
                             model_path=args.model_path, profile=args.profile, model=args.model,
                             ctx_per_slot=args.ctx_per_slot)
        return detach(sys.argv[1:], args) if args.detach else run_up(args, spec)
    except PoolAlreadyUp as exc:
        raise CliError(str(exc), EXIT_BUSY) from None
    except RuntimeError as exc:
        raise CliError(str(exc), EXIT_FAILED) from None


def run_up(options: UpOptions, spec: LocalPoolSpec, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Bring the pool up in this process and keep it up until SIGINT or SIGTERM; 0 after a clean stop."""
    import ray

    from fedpool.deploy.localpool import init_loopback_ray
    from fedpool.deploy.updir import claim_state_dir, release_state_dir
    from fedpool.pipeline.ownership import private_dir

    state = private_dir(options.state_dir.expanduser().resolve())
    claim_state_dir(state)
    try:
        how = init_loopback_ray(options.address)
        print(f"[fedpool up] Ray: {how}", file=err, flush=True)
        try:
            return run_server(_up(options, spec, state, out, err))
        finally:
            ray.shutdown()
    finally:
        release_state_dir(state)


async def _up(options: UpOptions, spec: LocalPoolSpec, state: Path, out: TextIO, err: TextIO) -> int:
    import ray

    from fedpool.clients.poolapp import serving_pool
    from fedpool.deploy.localpool import local_servers
    from fedpool.deploy.updir import REGISTRY_DIR, write_ready
    from fedpool.federation import DispatchConfig, PoolConnection
    from fedpool.registry import RegistryClient

    def say(line: str) -> None:
        print(f"[fedpool up] {line}", file=err, flush=True)

    stop = stop_on_signals()
    registry = await RegistryClient.start(state / REGISTRY_DIR, probe_interval_s=2.0)
    say(f"registry: namespace fedpool, state dir {(await registry.ping())['state_dir']}")
    try:
        say(f"starting {spec.count} {spec.engine} server(s)")
        async with local_servers(registry, spec, state / "logs", on_progress=say):
            config = DispatchConfig(no_server_timeout_s=10.0, client_order="shortest_first")
            async with PoolConnection(registry, policy=options.policy, config=config, holder_kind="gateway") as pool:
                await pool.refresh()
                async with serving_pool(pool, pool_page(), options.host, options.port,
                                        batches_dir=state / "batches") as base:
                    model = spec.served_model()
                    ready = {"url": base, "model": model, "pid": os.getpid(), "servers": spec.count,
                             "engine": spec.engine, "ray_address": ray.get_runtime_context().gcs_address,
                             "state_dir": str(state), "started_at": time.time()}
                    write_ready(state, ready)
                    print(f"fedpool pool up: {spec.count} {spec.engine} server(s) serving {model!r} at {base}/v1 "
                          f"(Ray {ready['ray_address']})\n\n{recipes(base, model, state, UP_DIR)}\n\nCtrl-C (or "
                          f"`fedpool down --state-dir {state}`) stops everything this started.", file=out, flush=True)
                    await stop.wait()
                    say("stopping")
    finally:
        await registry.terminate()
    return 0


def detach(argv: list[str], options: UpOptions, out: TextIO = sys.stdout, timeout_s: float = 900.0) -> int:
    """Start `fedpool up` (these arguments, without --detach) in the background and wait until it is up."""
    from fedpool.deploy.updir import LOG_FILE, start_up_detached
    from fedpool.pipeline.ownership import private_dir

    state = private_dir(options.state_dir.expanduser().resolve())
    command = [sys.executable, "-m", "fedpool.cli", *(a for a in argv if a != "--detach")]
    pid, ready = start_up_detached(command, state, timeout_s)
    print(f"fedpool pool up in the background (pid {pid}, log {state / LOG_FILE}): {ready['servers']} "
          f"{ready['engine']} server(s) serving {ready['model']!r} at {ready['url']}/v1\n\n"
          f"{recipes(ready['url'], ready['model'], Path(ready['state_dir']), UP_DIR)}\n\n"
          f"`fedpool down --state-dir {state}` stops it.", file=out, flush=True)
    return 0


def cmd_down(args: DownOptions, out: TextIO = sys.stdout, timeout_s: float = 60.0) -> int:
    """Stop the `fedpool up` of this state dir and every process of its pool (SIGTERM to it; SIGKILL to whatever
    is left after `timeout_s`). Returns once all of them are gone: 0 when they stopped by themselves."""
    from fedpool.deploy.updir import stop_pool

    state = args.state_dir.expanduser().resolve()
    pid, killed = stop_pool(state, timeout_s)
    if pid is None:
        print(f"no pool is up from {state}", file=out)
    elif killed is None:
        print(f"stopped the pool of {state} (pid {pid})", file=out)
    else:
        print(f"the pool of {state} (pid {pid}) did not stop in {timeout_s:g} s; killed {killed} process(es) of it",
              file=out)
    return 0 if killed is None else 1
