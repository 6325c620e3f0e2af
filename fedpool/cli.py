"""The `fedpool` command line: click commands built from the option models in options.py. Thin: it reads the
command line, settles each option's value (config.py), calls the rooms, prints tables or --json."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

import click
from click.core import ParameterSource
from pydantic.fields import FieldInfo

from fedpool import cli_eval as evals
from fedpool import cli_jobs as jobs
from fedpool import cli_servers as servers
from fedpool import options as opt
from fedpool import up
from fedpool.cli_support import (
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    pool_page,
    pool_registry,
    registry_client,
    run_server,
    stop_on_signals,
)
from fedpool.config import ConfigError, Layers, apply_defaults, find_config_file, load_settings, read_config_file, show
from fedpool.options import EnvOnly, Flag, OneOf, Options, Positional, flag_names, key_of, marker

CONFIG_FLAGS = ("config", "show_config")
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


@dataclass(frozen=True)
class Leaf:
    """A command that runs (`eval run`), its options, what runs it, and its help."""

    name: str
    options: type[Options]
    run: Callable[[Any], int]
    help: str
    description: str | None = None


@dataclass(frozen=True)
class Chosen:
    """What the command line asked for, before the environment and the config file are read."""

    leaf: Leaf
    flags: dict[str, Any]
    config: Path | None
    show_config: bool


# ---- commands -----------------------------------------------------------------------------------
def cmd_demo(args: opt.DemoOptions) -> int:
    from fedpool.demo import run_demo

    report = run_demo(args, out=sys.stderr if args.json_output else sys.stdout)
    if args.json_output:
        print(json.dumps(report.as_json(), indent=2, default=str))
    return EXIT_OK


def cmd_bench_speedup(bench_args: Sequence[str]) -> int:
    """The speedup benchmark is a program of its own (`python -m fedpool.benchmarks.speedup`): the face runs it
    rather than importing benchmark code into the product."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "fedpool.benchmarks.speedup", *bench_args]).returncode


def cmd_gateway(args: opt.GatewayOptions) -> int:
    from fedpool.clients.jobs.api import ensure_jobs_token
    from fedpool.federation.gateway.handlers import parse_api_keys

    keys = None
    if args.api_key_file:
        try:
            keys = parse_api_keys(args.api_key_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CliError(f"{args.api_key_file}: {exc}", EXIT_USAGE) from None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        raise CliError("refusing to serve on a non-loopback address without --api-key-file", EXIT_USAGE)
    jobs_dir = args.jobs_dir.expanduser().resolve() if args.jobs_dir else None
    given = args.jobs_token_file.read_text(encoding="utf-8").strip() if jobs_dir and args.jobs_token_file else None
    jobs_token = ensure_jobs_token(jobs_dir, given) if jobs_dir is not None else None
    # Without jobs the gateway needs nothing of Ray but the registry: over its HTTP API where found (no Ray driver in
    # the gateway's process). Jobs may need CPU actors (judges, media encoders): that server joins Ray.
    if jobs_dir is not None and args.registry_url and not args.quiet:
        print("fedpool: --registry-url is not used with jobs (they may need Ray's CPU actors): joining Ray",
              file=sys.stderr)
    client = pool_registry(args) if jobs_dir is None else registry_client(args)
    run_server(_serve_gateway(client, args, keys, jobs_dir, jobs_token))
    return EXIT_OK


async def _serve_gateway(client: Any, args: opt.GatewayOptions, keys: Any, jobs_dir: Path | None,
                         jobs_token: str | None) -> None:
    from fedpool.clients.jobs import JobRunner, JobStore
    from fedpool.clients.poolapp import raise_open_files_limit, serving_pool
    from fedpool.federation import DispatchConfig, PoolConnection
    from fedpool.pipeline.ownership import private_dir

    raise_open_files_limit()
    # A model whose servers are all unroutable is answered 503 (with Retry-After) after 10 s, not a minute.
    config = DispatchConfig(no_server_timeout_s=10.0, client_order=args.client_order)
    try:
        async with PoolConnection(client, policy=args.policy, config=config,
                                  holder_kind="jobs server" if jobs_dir else "gateway") as pool:
            runner = None if jobs_dir is None else JobRunner(
                JobStore(jobs_dir), pool.dispatcher, max_running=args.max_running_jobs,
                verifier_factory=lambda: evals.verifier_pool(args),
                roots=[r.expanduser().resolve() for r in args.root] or [private_dir(jobs_dir / "data")])
            async with serving_pool(pool, pool_page(), args.host, args.port, api_keys=keys,
                                    max_inflight=args.max_inflight, runner=runner, jobs_token=jobs_token, backlog=1024,
                                    reuse_port=args.reuse_port or None, online_reserve=args.online_reserve,
                                    batches_dir=args.batches_dir and args.batches_dir.expanduser().resolve()) as base:
                stop = stop_on_signals()
                print(f"fedpool gateway on {base}/v1 (policy {args.policy}, "
                      f"{'api keys required' if keys else 'open, loopback only'}); pool page {base}/", flush=True)
                if jobs_dir is not None:
                    print(f"jobs API on {base}/jobs (token in {jobs_dir / 'jobs.token'}, jobs in {jobs_dir})",
                          flush=True)
                print((f"Batch API on {base}/v1/batches (batches in {args.batches_dir})\n" if args.batches_dir else "")
                      + "Ctrl-C to stop", flush=True)
                await stop.wait()
    finally:
        await client.aclose()


LEAVES = (
    Leaf("demo", opt.DemoOptions, cmd_demo, "run the main job on the embedded default: local Ray, 2 llama.cpp "
         "servers, 3 concurrent evals", "Start local Ray and a registry, launch real llama.cpp servers serving "
         "Gemma 3 270M, register them, run the bundled benchmarks concurrently through the pool, print scores, "
         "wall time, requests per server and where the artifacts are."),
    Leaf("up", opt.UpOptions, up.cmd_up, "bring up a local pool and keep it up: Ray, the registry, N servers, the "
         "gateway and pool page", "Starts local Ray on loopback (or joins --address), the registry, N local servers "
         "(llama.cpp with the bundled Gemma 3 270M by default, --engine vllm for vLLM's CPU build, --engine emulated "
         "--profile P), and the OpenAI-compatible gateway with the pool page; prints the base URL and paste-ready "
         "commands for lm-eval, inspect_ai, the openai SDK and vLLM's benchmark. Ctrl-C or SIGTERM stops everything "
         "it started."),
    Leaf("down", opt.DownOptions, up.cmd_down, "stop the pool `fedpool up --detach` started"),
    Leaf("registry start", opt.RegistryStartOptions, servers.cmd_registry_start, "create the registry actor (detached, "
         "namespace fedpool)"),
    Leaf("registry status", opt.PoolJsonOptions, servers.cmd_registry_status, "show whether the registry runs and how"),
    Leaf("gateway", opt.GatewayOptions, cmd_gateway, "serve an OpenAI-compatible endpoint that routes through the "
         "pool", "OpenAI-compatible /v1/completions, /v1/chat/completions (streaming too) and /v1/models in front of "
         "every registered server; /metrics for Prometheus; the pool page at /."),
    Leaf("jobs serve", opt.JobsServeOptions, cmd_gateway, "serve the jobs API with the gateway and the pool page "
         "(one process, one pool connection)", "Jobs are kept in SQLite under --jobs-dir; a restarted server resumes "
         "the jobs that were running from their artifacts. Every /jobs call needs the token in JOBS_DIR/jobs.token "
         "(or FEDPOOL_JOBS_TOKEN)."),
    Leaf("jobs submit", opt.JobsSubmitOptions, jobs.cmd_jobs_submit, "submit benchmark specs as a job (sent inline)"),
    Leaf("jobs list", opt.JobsClientOptions, jobs.cmd_jobs_list, "every job, newest first"),
    Leaf("jobs show", opt.JobOptions, jobs.cmd_jobs_show, "one job: state, progress, scores"),
    Leaf("jobs cancel", opt.JobOptions, jobs.cmd_jobs_cancel, "cancel a queued or running job"),
    Leaf("jobs logs", opt.JobOptions, jobs.cmd_jobs_logs, "a job's log"),
    Leaf("batch submit", opt.BatchSubmitOptions, jobs.cmd_batch_submit, "submit a JSONL file of OpenAI requests"),
    Leaf("batch list", opt.BatchClientOptions, jobs.cmd_batch_list, "your batches, newest first"),
    Leaf("batch show", opt.BatchOptions, jobs.cmd_batch_show, "one batch: status, counts, files, estimate"),
    Leaf("batch cancel", opt.BatchOptions, jobs.cmd_batch_cancel, "cancel a batch (what finished is kept)"),
    Leaf("batch download", opt.BatchDownloadOptions, jobs.cmd_batch_download, "an ended batch's output, errors"),
    Leaf("pool status", opt.PoolJsonOptions, servers.cmd_pool_status, "servers by status, engine and accelerator; "
         "capacity and load; who holds what (every process on the pool, its evals' progress and ETAs)"),
    Leaf("pool top", opt.PoolTopOptions, servers.cmd_pool_top, "who holds what, refreshed live (Ctrl-C to quit)"),
    Leaf("eval run", opt.EvalRunOptions, evals.cmd_eval_run, "run benchmark specs concurrently through the pool"),
    Leaf("eval resume", opt.EvalResumeOptions, evals.cmd_eval_resume, "finish a run in RUN_DIR: its missing records, "
         "and (unless --keep-failed) its failed ones again"),
    Leaf("eval replay", opt.EvalReplayOptions, evals.cmd_eval_replay, "run a finished run's exact configuration again",
         "Reads each benchmark's saved configuration (spec, prompt, generation parameters, model and revision) from "
         "ARTIFACT, checks that every dataset is unchanged (SHA-256), and runs it again through the pool into --out."),
    Leaf("eval rescore", opt.EvalRescoreOptions, evals.cmd_eval_rescore, "recompute post-processing, metrics and the "
         "verifier from an artifact, no inference", "Reads every record of ARTIFACT (a run directory or one "
         "benchmark's directory) and writes a new artifact to --out with post-processing, metrics and, for specs "
         "with `verifier: true`, the verifier's judgments computed again. --spec may change postprocess, metrics "
         "and verifier; anything that decides the model's answers (prompt, generation, data) needs a new run."),
    Leaf("serve", opt.ServeOptions, servers.cmd_serve, "start an engine, register it, heartbeat, deregister at exit",
         "Start vLLM, SGLang, llama.cpp or an emulated server as a child process (its output in a log file), wait "
         "until healthy, register it (accelerator detected with nvidia-smi unless given), renew its lease, and "
         "deregister on SIGTERM/SIGINT or when the engine dies. Arguments after -- go to the engine."),
    Leaf("server add", opt.ServerAddOptions, servers.cmd_server_add, "register a running server (checked first)"),
    Leaf("server list", opt.ServerListOptions, servers.cmd_server_list, "registered servers, status and load"),
    Leaf("server show", opt.ServerOptions, servers.cmd_server_show, "one server in detail"),
    Leaf("server drain", opt.ServerOptions, servers.cmd_server_drain, "no new requests to a server; removed once idle "
         "(one `fedpool serve` runs stays, draining, until removed)"),
    Leaf("server remove", opt.ServerOptions, servers.cmd_server_remove, "deregister a server now (its `fedpool serve` "
         "stops it)"),
)
GROUPS = {
    "registry": "start or inspect the registry actor in a running Ray cluster",
    "jobs": "remote evaluation jobs: serve the API, submit, list, show, cancel, logs",
    "batch": "OpenAI Batch API batches on a pool's gateway: submit, list, show, cancel, download",
    "pool": "the pool at a glance",
    "eval": "run evaluations through a running pool, or resume a killed run",
    "bench": "measure fedpool: speedup over conventional per-process evaluation",
    "server": "register, list, show, drain and remove inference servers",
}


# ---- the command line, from the option models ---------------------------------------------------
def _click_param(key: str, field: FieldInfo) -> click.Parameter:
    place = marker(field, Positional)
    if place is not None:
        return click.Argument([key], nargs=-1 if place.rest else 1, type=click.UNPROCESSED if place.rest else None)
    names = [*flag_names(key, field), key]
    if field.annotation is bool:
        return click.Option(names, is_flag=True, help=field.description)
    flag, one_of = marker(field, Flag), marker(field, OneOf)
    metavar = (flag.metavar if flag and flag.metavar else f"[{'|'.join(one_of.choices())}]" if one_of
               else _metavar(field))
    default = field.default if isinstance(field.default, str | int | float | Path) else None
    # Values reach the model as text: its types check them, and say what is wrong, for flags, the environment and
    # the config file alike.
    return click.Option(names, type=click.STRING, metavar=metavar, help=field.description, default=default,
                        show_default=default is not None, multiple=get_origin(field.annotation) is list)


def _metavar(field: FieldInfo) -> str:
    """What help calls a value: N, NUMBER, PATH or TEXT, from the option's type (`int | None`, `list[Path]`)."""
    inner = [a for a in get_args(field.annotation) if a is not type(None)] or [field.annotation]
    return {int: "N", float: "NUMBER", Path: "PATH"}.get(inner[0], "TEXT")


def _config_params() -> list[click.Parameter]:
    """`--config PATH` and `--show-config` on every command (before or after the command's name)."""
    return [click.Option(["--config"], type=click.Path(path_type=Path), help="config file (TOML or YAML; default "
                         "$FEDPOOL_CONFIG, ./fedpool.toml, ~/.fedpool/config.toml)"),
            click.Option(["--show-config"], is_flag=True, help="print the configuration this command would run "
                         "with (secrets masked), then exit")]


def _chosen(leaf: Leaf) -> Chosen:
    """The flags given to `leaf` and to the commands above it, the innermost --config winning."""
    contexts = [click.get_current_context()]
    while contexts[-1].parent is not None:
        contexts.append(contexts[-1].parent)
    flags = {key: list(value) if isinstance(value, tuple) else value for ctx in reversed(contexts)
             for key, value in ctx.params.items()
             if key not in CONFIG_FLAGS and ctx.get_parameter_source(key) is ParameterSource.COMMANDLINE}
    config = next((ctx.params["config"] for ctx in contexts if ctx.params.get("config")), None)
    return Chosen(leaf, flags, config and config.expanduser(), any(c.params.get("show_config") for c in contexts))


def _command(leaf: Leaf) -> click.Command:
    params = [_click_param(key_of(name, field), field) for name, field in leaf.options.model_fields.items()
              if name not in Options.model_fields and marker(field, EnvOnly) is None]
    return click.Command(leaf.name.split()[-1], params=params + _config_params(), help=leaf.description or leaf.help,
                         short_help=leaf.help, callback=lambda **_: _chosen(leaf), context_settings=CONTEXT)


def _bench_speedup() -> click.Command:
    # Its options are the benchmark script's own: every word after `speedup` goes to it, --help too.
    return click.Command("speedup", params=[click.Argument(["bench_args"], nargs=-1, type=click.UNPROCESSED)],
                         callback=cmd_bench_speedup, short_help="the same evals conventionally and through fedpool "
                         "on the same servers (--help for options)", add_help_option=False,
                         context_settings={"ignore_unknown_options": True})


def _root() -> click.Group:
    verbose = Options.model_fields["verbose"]
    root = click.Group("fedpool", help="Federated inference-pool scheduler for model evaluation.",
                       params=[_click_param("verbose", verbose), *_config_params()], context_settings=CONTEXT)
    groups: dict[str, click.Group] = {}
    for name, text in GROUPS.items():
        groups[name] = click.Group(name, help=text, short_help=text, params=_config_params(), context_settings=CONTEXT)
        root.add_command(groups[name])
    groups["bench"].add_command(_bench_speedup())
    for leaf in LEAVES:
        *parent, _ = leaf.name.split()
        (groups[parent[0]] if parent else root).add_command(_command(leaf))
    return root


class Cli:
    """The `fedpool` command line: `parse_args` gives the settings a command line would run with."""

    def __init__(self) -> None:
        self.options = {leaf.name: leaf.options for leaf in LEAVES}  # what config files are checked against
        self.root = _root()

    def choose(self, argv: Sequence[str]) -> Chosen | int:
        """What the command line asks for; an exit code where click answered it (--help, `bench speedup`)."""
        chosen: Chosen | int = self.root.main(list(argv), prog_name="fedpool", standalone_mode=False)
        return chosen

    def settle(self, chosen: Chosen, environ: Mapping[str, str]) -> tuple[Options, Layers]:
        """The chosen command's settings: flags > environment > config file > defaults."""
        path = find_config_file(chosen.config, environ)
        applied = apply_defaults(self, read_config_file(path) if path else {}, path, environ)
        return load_settings(chosen.leaf.options, chosen.leaf.name, chosen.flags, applied)

    def parse_args(self, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Options:
        chosen = self.choose(argv)
        if not isinstance(chosen, Chosen):
            raise CliError(f"{' '.join(argv)}: not a command with settings", EXIT_USAGE)
        return self.settle(chosen, os.environ if environ is None else environ)[0]


def build_parser() -> Cli:
    return Cli()


def _file_problem(exc: OSError | UnicodeDecodeError) -> str:
    """`PATH: is a directory` instead of `[Errno 21] Is a directory: 'PATH'`."""
    if isinstance(exc, UnicodeDecodeError):
        return f"a file given is not UTF-8 text ({exc.reason} at byte {exc.start})"
    kinds = ((IsADirectoryError, "is a directory, not a file"), (NotADirectoryError, "is not a directory"),
             (FileNotFoundError, "no such file or directory"), (PermissionError, "permission denied"))
    what = next((text for kind, text in kinds if isinstance(exc, kind)), exc.strerror or type(exc).__name__)
    return f"{exc.filename}: {what}" if exc.filename else f"{what}: {exc.strerror}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from fedpool.deploy.raycluster import command_stdout, ray_token_auth_if_available

    ray_token_auth_if_available()  # before Ray is imported (the policy names import it): it reads the mode once
    cli = build_parser()
    try:
        chosen = cli.choose(argv)
        if isinstance(chosen, int):
            return chosen
        settings, layers = cli.settle(chosen, os.environ)
    except click.ClickException as exc:  # said as every other error is, with where to find the usage
        usage = f" (`{exc.ctx.command_path} --help`)" if isinstance(exc, click.UsageError) and exc.ctx else ""
        print(f"fedpool: error: {exc.format_message()}{usage}", file=sys.stderr)
        return exc.exit_code
    except click.Abort:
        print("fedpool: interrupted", file=sys.stderr)
        return 130
    except ConfigError as exc:
        print(f"fedpool: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if chosen.show_config:
        print(json.dumps(show(settings, chosen.leaf.name, layers), indent=2, default=str))
        return EXIT_OK
    logging.basicConfig(level=logging.DEBUG if settings.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with command_stdout():  # stdout is the command's: what Ray's driver prints about the cluster goes to stderr
        return _run(chosen.leaf, settings)


def _run(leaf: Leaf, settings: Options) -> int:
    """The command, its failures as one line on stderr and an exit code (docs/reference.md)."""
    try:
        return leaf.run(settings)
    except KeyboardInterrupt:
        print("fedpool: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        code = _exit_code(exc)
        if code is None:
            raise
        print(f"fedpool: error: {_file_problem(exc) if isinstance(exc, FILE_PROBLEMS) else exc}", file=sys.stderr)
        return code


FILE_PROBLEMS = (IsADirectoryError, NotADirectoryError, FileNotFoundError, PermissionError, UnicodeDecodeError)


def _exit_code(exc: Exception) -> int | None:
    """The exit code of a failure the command reports in one line; None for a bug (its traceback is shown)."""
    from fedpool.clients.batchclient import BatchError
    from fedpool.clients.jobs.client import JobsApiError
    from fedpool.clients.rundir import NoServerError
    from fedpool.deploy import EngineStartError, LlamaServerNotInstalled
    from fedpool.pipeline import PipelineError
    from fedpool.pipeline.errors import ArtifactWriteError, OwnershipError
    from fedpool.registry import RegistryError
    from fedpool.registry.httpclient import RegistryUnreachable

    if isinstance(exc, CliError):
        return exc.code
    if isinstance(exc, BatchError | JobsApiError):  # (a server that does not answer: OSError, below)
        return {"input": EXIT_USAGE, "unavailable": EXIT_UNAVAILABLE}.get(exc.kind, EXIT_FAILED)
    if isinstance(exc, OwnershipError):
        return EXIT_BUSY  # a run or jobs directory another process holds (named in the message)
    if isinstance(exc, NoServerError | RegistryUnreachable | EngineStartError | LlamaServerNotInstalled):
        return EXIT_UNAVAILABLE  # the pool, a server or an engine is wanting, not the command
    if isinstance(exc, ArtifactWriteError | RegistryError):
        return EXIT_FAILED
    if isinstance(exc, (PipelineError, *FILE_PROBLEMS)):
        return EXIT_USAGE  # a spec, a dataset, an artifact or a path given is not what it must be
    return EXIT_UNAVAILABLE if isinstance(exc, OSError) else None


if __name__ == "__main__":
    sys.exit(main())
