"""A run directory of `fedpool eval run | resume | replay`: the run's plan (eval.json), written before the first
request and read back by a resume; its specs, checked before anything is written; the directory owned by one
process for the run's life; and the check that some registered server serves the run's model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedpool.pipeline import BenchmarkSpec, PipelineError, load_samples, load_specs
from fedpool.pipeline.artifact import write_json_atomic
from fedpool.pipeline.ownership import LOCK_FILE, DirectoryLock
from fedpool.pipeline.reproduce import SavedBenchmark

log = logging.getLogger("fedpool.eval")

EVAL_FILE = "eval.json"
REPLAYED_SPECS = "replayed-specs"  # a replay's specs as saved, so that `fedpool eval resume` works on it too


# The flags that point a command at its pool, by option name: a run records those it was given, so that the
# command it suggests (`eval resume`) carries them and a resume given none of them finds the same pool.
POOL_FLAGS = {"state_dir": "--state-dir", "address": "--address", "registry_url": "--registry-url",
              "token_path": "--token-file-path", "gateway": "--gateway"}
PATH_FLAGS = ("state_dir", "token_path")


class RunDirError(PipelineError):
    """A run directory or its specs cannot be used as asked; the message names the culprit."""


class NoServerError(PipelineError):
    """No registered server serves the model asked for (after waiting, if asked to)."""


class RunPlan(BaseModel):
    """What `fedpool eval run` was asked, as written to RUN_DIR/eval.json: a resume runs exactly this again."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    specs: list[str] = Field(min_length=1)
    model: str = Field(min_length=1)
    revision: str | None = None
    policy: str = "capacity_weighted"
    concurrency: int = Field(64, ge=1)
    limit: int | None = None
    client_order: str = "fair"
    planned: bool = False
    replay_of: str | None = None
    pool: dict[str, str] = Field(default_factory=dict)  # the pool flags the run was given (POOL_FLAGS)

    def resume_command(self, out: Path) -> str:
        """`fedpool eval resume` for this run, with the pool flags the run was given."""
        flags = [f"{flag} {shlex.quote(self.pool[k])}" for k, flag in POOL_FLAGS.items() if k in self.pool]
        return " ".join(["fedpool eval resume", *flags, shlex.quote(str(out))])

    def pool_settings(self) -> dict[str, object]:
        """The pool flags the run was given, as a command's settings (paths as paths)."""
        return {k: Path(v) if k in PATH_FLAGS else v for k, v in self.pool.items() if k in POOL_FLAGS}

    @property
    def routing(self) -> str:
        """The policy the dispatcher runs (runs saved before `planned` was a policy say so in `planned`)."""
        return "planned" if self.planned else self.policy

    def write(self, out: Path) -> None:
        write_json_atomic(out / EVAL_FILE, self.model_dump(mode="json"))

    @classmethod
    def read(cls, out: Path) -> RunPlan:
        path = out / EVAL_FILE
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            if out.is_dir() and {p.name for p in out.iterdir()} == {LOCK_FILE}:
                raise RunDirError(f"{out} has no {EVAL_FILE} yet: no `fedpool eval run` has written its run here "
                                  "(one stopped before writing anything, or one is still starting), so there is "
                                  f"nothing to resume; run `fedpool eval run --out {out}` (again)") from None
            raise RunDirError(f"{out} has no {EVAL_FILE}: not a directory made by `fedpool eval run`") from None
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            kinds = {e["type"] for e in exc.errors()}
            if kinds & {"json_invalid", "model_type", "json_type"}:
                raise RunDirError(f"{path}: not a fedpool run description (not a JSON object); it was "
                                  "damaged") from None
            where = ", ".join(sorted({str(e["loc"][0]) for e in exc.errors() if e["loc"]}))
            raise RunDirError(f"{path}: not a fedpool run description ({where or 'its fields'} missing or "
                              "wrong)") from None


# Records refused as they are (the engine's HTTP 400, data that cannot be read): a resume sends them the same way.
FAILED_FOR_GOOD = ("request_error", "data")


def failed_records_hint(errors: Iterable[Mapping[str, int]], failed: int, resume: str) -> str:
    """What to say of a run's `failed` records (`errors`: each benchmark's count of them by how they failed):
    `resume` for those another try may answer, and none for those refused as they are."""
    for_good = sum(n for counts in errors for kind, n in counts.items() if kind in FAILED_FOR_GOOD)
    hints = [f"{failed - for_good} record(s) failed; `{resume}` runs them again"] if failed > for_good else []
    if for_good:
        hints.append(f"{for_good} record(s) refused as they are (the engine's HTTP 400: a prompt over the servers' "
                     "context, say; or data that cannot be read): resume will not help; each record's error says "
                     "why")
    return "; ".join(hints)


def refuse_existing_run(out: Path) -> None:
    """A run directory must be new (or empty of runs): `eval resume` continues one."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out}: exists and is not a directory")
    if (out / EVAL_FILE).exists():
        try:
            resume = RunPlan.read(out).resume_command(out)
        except RunDirError:
            resume = f"fedpool eval resume {shlex.quote(str(out))}"
        raise RunDirError(f"{out} already holds a run; use `{resume}` or another --out")


def pool_flags_given(values: Mapping[str, object], defaults: Mapping[str, object]) -> dict[str, str]:
    """The pool flags among `values` not at their defaults, as text (paths made absolute): what a run records."""
    given = {}
    for key in POOL_FLAGS:
        value = values.get(key)
        if value is not None and value != defaults.get(key):
            given[key] = str(value.expanduser().resolve()) if isinstance(value, Path) else str(value)
    return given


@contextlib.contextmanager
def owned(out: Path, purpose: str) -> Iterator[None]:
    """The run directory, owned by this process for the run's life (a second resume is refused, named: an
    OwnershipError)."""
    try:
        lock = DirectoryLock(out, purpose).acquire()
    except (NotADirectoryError, FileExistsError):
        raise RunDirError(f"{out}: not a directory") from None
    try:
        yield
    finally:
        lock.release()


def duplicate_names(specs: Sequence[BenchmarkSpec]) -> list[str]:
    """The benchmark names given more than once: each benchmark writes its own directory and is one client of
    the pool, so names must differ within a run (or a job)."""
    names = [s.name for s in specs]
    return sorted({n for n in names if names.count(n) > 1})


def check_specs(paths: Sequence[Path], limit: int | None, given: Sequence[Path] | None = None) -> list[BenchmarkSpec]:
    """The run's specs, checked before anything is written: each file once, names unique and not the run
    directory's own files, every dataset readable (its errors name file and line)."""
    seen: dict[Path, int] = {}
    for i, path in enumerate(paths):
        if path in seen:
            shown = given[i] if given else path
            raise RunDirError(f"--spec {shown}: given twice (as spec {seen[path] + 1} and {i + 1})")
        seen[path] = i
    specs = load_specs(list(paths), limit)
    if twice := duplicate_names(specs):
        culprits = ", ".join(str(p) for p, s in zip(paths, specs, strict=True) if s.name in twice)
        raise RunDirError(f"benchmark names must be unique in one run: {', '.join(twice)} (from --spec {culprits})")
    for path, spec in zip(paths, specs, strict=True):
        if spec.name in (EVAL_FILE, LOCK_FILE, REPLAYED_SPECS) or spec.name.startswith("."):
            raise RunDirError(f"{path}: benchmark name {spec.name!r} is a file of the run directory itself; rename it")
    for spec in specs:
        load_samples(spec)  # a DataError names file and line
    return specs


async def wait_for_model(registered: Callable[[], Awaitable[Mapping[str, Collection[str]]]], model: str,
                         revision: str | None, wait_s: float, how_to_wait: str) -> None:
    """Return once a registered server (routable or not: a run waits for a server that is down, as it would
    mid-run) serves `model` (at `revision`, when given); NoServerError after `wait_s` seconds without one."""
    deadline = time.monotonic() + wait_s
    while True:
        served = await registered()
        if model in served and (revision is None or revision in served[model]):
            return
        if time.monotonic() >= deadline:
            rev = f" revision {revision!r}" if revision else ""
            waited = f" after waiting {wait_s:g} s" if wait_s else ""
            raise NoServerError(f"no registered server serves model {model!r}{rev}{waited} (the pool serves: "
                                f"{', '.join(sorted(served)) or 'nothing'}); {how_to_wait}")
        await asyncio.sleep(min(1.0, max(0.05, deadline - time.monotonic())))


async def require_servers(client: Any, model: str, revision: str | None, wait_s: float | None,
                          announce: object | None = None) -> None:
    """Refuse a model no registered server serves before anything is written, or wait up to `wait_s` for one; then
    send `announce` (the run's DemandReport) to the lease broker (best effort). `client` is the registry; its
    connections are let go after (they belong to this event loop; the run starts another)."""

    async def registered() -> dict[str, set[str]]:
        return (await client.snapshot()).revisions()

    try:
        how = ("register one (`fedpool serve`, `fedpool server add`), or wait longer for one: a larger "
               "--wait-for-servers" if wait_s else "register one (`fedpool serve`, `fedpool server add`), or pass "
               "--wait-for-servers SECONDS to wait for one")
        await wait_for_model(registered, model, revision, wait_s or 0.0, how)
        if announce is not None:
            try:
                await asyncio.wait_for(client.lease(announce), 2.0)
            except Exception as exc:  # (the run's own lease client reports in a moment anyway)
                log.debug("could not announce this run's evals to the lease broker: %s", type(exc).__name__)
    finally:
        await client.aclose()


def replay_plan(source: Path, saved: Sequence[SavedBenchmark], out: Path) -> RunPlan:
    """The plan of a replay of `source` into `out`: its benchmarks' saved specs (`write_replayed_specs`), the
    one model and revision they were run against, and the routing the run had."""
    models = {(b.config.get("model"), b.config.get("revision")) for b in saved}
    if len(models) != 1:
        raise RunDirError(f"{source}: its benchmarks were run against different models {sorted(map(str, models))}")
    (model, revision), = models
    if not isinstance(model, str):
        raise RunDirError(f"{source}: its configuration names no model")
    before = RunPlan.read(source) if (source / EVAL_FILE).exists() else None
    routing = before.model_dump(include={"policy", "concurrency", "client_order", "planned"}) if before else {}
    return RunPlan(specs=[str(_replayed(out, b)) for b in saved], model=model,
                   revision=revision if isinstance(revision, str) else None, replay_of=str(source), **routing)


def write_replayed_specs(out: Path, saved: Sequence[SavedBenchmark]) -> None:
    """The specs as saved, under the replay's directory, so that `fedpool eval resume` works on a replay too."""
    for b in saved:
        write_json_atomic(_replayed(out, b), b.spec.model_dump(mode="json"))


def _replayed(out: Path, saved: SavedBenchmark) -> Path:
    return out / REPLAYED_SPECS / f"{saved.spec.name}.json"
