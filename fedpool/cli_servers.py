"""`fedpool registry | pool | serve | server`: the registry, the pool it sees, and the servers in it."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpool import options as opt
from fedpool.cli_support import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    ask,
    connect_ray,
    emit,
    pool_registry,
    registry_client,
    stop_on_signals,
)

if TYPE_CHECKING:
    from fedpool.registry import ServerRecord


def cmd_registry_start(args: opt.RegistryStartOptions) -> int:
    from fedpool.registry import RegistryClient

    connect_ray(args)
    token = args.token_file.read_text(encoding="utf-8").strip() if args.token_file else None

    async def start() -> dict[str, Any]:
        client = await RegistryClient.start(
            args.state_dir.expanduser(), token=token, probe_interval_s=args.probe_interval,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host, api_host=args.api_host,
            api_port=None if args.no_api else (args.api_port or 0),
            resources={args.pin_resource: 0.01} if args.pin_resource else {})
        return await client.ping()

    info = asyncio.run(start())
    emit(args, info, lambda i: f"registry running: {i['servers']} server(s), state in {i['state_dir']}; "
         f"token file {Path(i['state_dir']) / 'registry.token'} (mode 0600)"
         + (f"; HTTP API {i['api_url']}" if i.get("api_url") else ""))
    return EXIT_OK


def cmd_registry_status(args: opt.PoolJsonOptions) -> int:
    info = ask(pool_registry(args), lambda c: c.ping())
    emit(args, info, lambda i: f"registry up: version {i['version']}, {i['servers']} server(s), "
         f"{i['probe_cycles']} probe cycles, last cycle {i['last_probe_cycle_s'] * 1000:.0f} ms"
         + (f"; HTTP API {i['api_url']}" if i.get("api_url") else ""))
    return EXIT_OK


def cmd_pool_status(args: opt.PoolJsonOptions) -> int:
    from fedpool.clients.pooltop import pool_status, rendered, status_text

    emit(args, ask(pool_registry(args), pool_status), lambda status: rendered(status_text(status)))
    return EXIT_OK


def cmd_pool_top(args: opt.PoolTopOptions) -> int:
    from fedpool.clients.pooltop import top

    ask(pool_registry(args), lambda c: top(c, stop_on_signals(), interval_s=args.interval))
    return EXIT_OK


def cmd_serve(args: opt.ServeOptions) -> int:
    import socket

    from fedpool.deploy.engines import EngineSpec, detect_accelerator, engine_argv, registry_engine
    from fedpool.deploy.process import engine_variables, free_port

    port = args.port or free_port(args.host)
    spec = EngineSpec(engine=args.engine, model=args.model, port=port, host=args.host, model_path=args.model_path,
                      capacity=args.capacity, gpus=args.gpus or 0, threads=args.threads,
                      python=args.python or sys.executable, profile=args.profile, speedup=args.speedup,
                      extra_args=tuple(args.engine_args))
    try:
        argv = engine_argv(spec)
        adapter = registry_engine(args.engine, args.profile)
        engine_env = engine_variables(args.env, args.env_file)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    accelerator, gpus = (args.accelerator, args.gpus or 0) if args.accelerator else detect_accelerator()
    server_id = args.id or f"{socket.gethostname().split('.')[0]}-{args.engine}-{port}"
    record = server_record({
        "id": server_id, "url": args.advertise_url or f"http://{args.host}:{port}", "engine": adapter,
        "model": args.model, "revision": args.revision, "accelerator": accelerator, "gpu_count": args.gpus or gpus,
        "capacity": args.capacity}, args.label, launched_by="fedpool-serve", engine_kind=args.engine)
    client = registry_client(args)
    return asyncio.run(_serve_engine(client, record, argv, engine_env, args))


async def _serve_engine(client: Any, record: Any, argv: list[str], engine_env: dict[str, str],
                        args: opt.ServeOptions) -> int:
    from fedpool.deploy import EngineProcess, LeaseSettings, ServerLauncher

    log_path = args.log_dir.expanduser() / f"{record.id}.log"
    process = EngineProcess(record.id, argv, log_path, env=engine_env)
    launcher = ServerLauncher(process, record, client, lease=LeaseSettings(args.lease, args.lease / 3),
                              start_deadline_s=args.start_deadline)
    print(f"starting {args.engine} as {record.id} at {record.url}; engine log: {log_path}", flush=True)
    stop = stop_on_signals()
    took = await launcher.start()
    print(f"{record.id} healthy after {took:.1f}s and registered ({record.engine.value}, {record.model}, "
          f"{record.accelerator}); Ctrl-C to stop and deregister", flush=True)
    if await launcher.serve_until(stop):
        print(f"fedpool: error: the engine of {record.id} exited (code {process.returncode}); deregistered; "
              f"see {log_path}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{record.id} was removed from the pool (`fedpool server remove`); its engine stopped"
          if launcher.removed.is_set() else f"{record.id} stopped and deregistered", flush=True)
    return EXIT_OK


def server_record(fields: dict[str, Any], labels: list[str], **more_labels: str) -> ServerRecord:
    """A server's record from the flags (with its --label KEY=VALUE items and `more_labels`); every field that is
    wrong named at once (exit code 2)."""
    from pydantic import ValidationError

    from fedpool.deploy.process import key_values
    from fedpool.registry import ServerRecord

    try:
        return ServerRecord.model_validate({**fields, "labels": {**key_values(labels), **more_labels}})
    except ValidationError as exc:
        raise CliError("; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}"
                                 for err in exc.errors()), EXIT_USAGE) from None
    except ValueError as exc:  # a --label that is not KEY=VALUE
        raise CliError(str(exc), EXIT_USAGE) from None


def cmd_server_add(args: opt.ServerAddOptions) -> int:
    record = server_record({
        "id": args.id, "url": args.url, "engine": args.engine, "model": args.model, "revision": args.revision,
        "accelerator": args.accelerator, "gpu_count": args.gpus, "capacity": args.capacity}, args.label)
    entry = ask(pool_registry(args), lambda c: c.register(record, replace=args.replace))
    emit(args, entry.describe(), lambda e: f"registered {e['id']} ({e['engine']}, {e['model']}, "
         f"{e['accelerator']}), capacity {e['capacity']}, status {e['status']}")
    return EXIT_OK


def cmd_server_list(args: opt.ServerListOptions) -> int:
    snapshot = ask(pool_registry(args), lambda c: c.snapshot())
    if args.model:
        snapshot = snapshot.filter(model=args.model)
    from fedpool.clients.pooltop import server_table

    rows = [e.describe() for e in snapshot.entries]
    emit(args, {"version": snapshot.version, "servers": rows}, lambda _: server_table(rows))
    return EXIT_OK


def cmd_server_show(args: opt.ServerOptions) -> int:
    entry = ask(pool_registry(args), lambda c: c.get(args.server_id))
    emit(args, entry.describe(), lambda e: "\n".join(f"{k:>16}: {v}" for k, v in e.items()))
    return EXIT_OK


def cmd_server_drain(args: opt.ServerOptions) -> int:
    entry = ask(pool_registry(args), lambda c: c.drain(args.server_id))
    emit(args, entry.describe(), lambda e: f"{e['id']} is draining: no new requests; " + (
        "it stays, draining, until `fedpool server remove` stops its launcher" if e["labels"].get("launched_by")
        else "removed once idle"))
    return EXIT_OK


def cmd_server_remove(args: opt.ServerOptions) -> int:
    record = ask(pool_registry(args), lambda c: c.deregister(args.server_id))
    emit(args, record.model_dump(mode="json"), lambda r: f"removed {r['id']} ({r['url']})" + (
        "; its launcher stops it at its next heartbeat" if r["labels"].get("launched_by") else ""))
    return EXIT_OK
