"""`fedpool eval run | resume | replay | rescore`: evaluations through the pool, and their artifacts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedpool import options as opt
from fedpool.cli_support import EXIT_INCOMPLETE, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError, emit, registry_client

EVAL_FILE = "eval.json"
REPLAYED_SPECS = "replayed-specs"


def cmd_eval_run(args: opt.EvalRunOptions) -> int:
    from fedpool.pipeline.artifact import write_json_atomic

    out = args.out.resolve()
    plan = {
        "specs": [str(p.resolve()) for p in args.spec], "model": args.model, "revision": args.revision,
        "policy": "planned" if args.planned else args.policy, "concurrency": args.concurrency, "limit": args.limit,
        "client_order": args.client_order, "planned": args.planned or args.policy == "planned",
    }
    # Every input is checked before anything is written: a refused run leaves nothing behind.
    _refuse_existing_run(out)
    specs = check_specs(plan, args.spec)
    client = registry_client(args)
    asyncio.run(require_servers(client, args.model, args.revision, args.wait_for_servers))
    with _owned(out, "fedpool eval run"):
        _refuse_existing_run(out)  # another run may have started here meanwhile
        write_json_atomic(out / EVAL_FILE, plan)
        return _run_eval(args, out, plan, specs, client)


def cmd_eval_resume(args: opt.EvalResumeOptions) -> int:
    out = args.run_dir.resolve()
    with _owned(out, "fedpool eval resume"):
        plan = _read_plan(out)
        specs = check_specs(plan)
        client = registry_client(args)
        asyncio.run(require_servers(client, plan["model"], plan.get("revision"), args.wait_for_servers))
        return _run_eval(args, out, plan, specs, client, retry_failed=not args.keep_failed)


@contextlib.contextmanager
def _owned(out: Path, purpose: str) -> Iterator[None]:
    """The run directory, owned by this process for the run's life (a second resume is refused, named: an
    OwnershipError, exit code 5)."""
    from fedpool.pipeline.ownership import DirectoryLock

    try:
        lock = DirectoryLock(out, purpose).acquire()
    except (NotADirectoryError, FileExistsError):
        raise CliError(f"{out}: not a directory", EXIT_USAGE) from None
    try:
        yield
    finally:
        lock.release()


def _refuse_existing_run(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a directory", EXIT_USAGE)
    if (out / EVAL_FILE).exists():
        raise CliError(f"{out} already holds a run; use `fedpool eval resume {out}` or another --out", EXIT_USAGE)


def _read_plan(out: Path) -> dict[str, Any]:
    path = out / EVAL_FILE
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        from fedpool.pipeline.ownership import LOCK_FILE

        if out.is_dir() and {p.name for p in out.iterdir()} == {LOCK_FILE}:
            raise CliError(f"{out} has no {EVAL_FILE} yet: no `fedpool eval run` has written its run here (one "
                           "stopped before writing anything, or one is still starting), so there is nothing to "
                           f"resume; run `fedpool eval run --out {out}` (again)", EXIT_USAGE) from None
        raise CliError(f"{out} has no {EVAL_FILE}: not a directory made by `fedpool eval run`", EXIT_USAGE) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CliError(f"{path}: not a fedpool run description ({type(exc).__name__}); it was damaged",
                       EXIT_USAGE) from None
    if not isinstance(plan, dict) or not isinstance(plan.get("specs"), list) or not plan.get("model"):
        raise CliError(f"{path}: not a fedpool run description (no specs or model)", EXIT_USAGE)
    return plan


def check_specs(plan: dict[str, Any], given: list[Path] | None = None) -> list[Any]:
    """The run's specs, checked: each file once, names unique and not the run directory's own files, every
    dataset readable (its errors name file and line)."""
    from fedpool.pipeline import load_samples, load_specs
    from fedpool.pipeline.ownership import LOCK_FILE

    paths = [Path(p) for p in plan["specs"]]
    seen: dict[Path, int] = {}
    for i, path in enumerate(paths):
        if path in seen:
            shown = given[i] if given else path
            raise CliError(f"--spec {shown}: given twice (as spec {seen[path] + 1} and {i + 1})", EXIT_USAGE)
        seen[path] = i
    specs = load_specs(paths, plan.get("limit"))
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CliError(f"benchmark names must be unique in one run: {', '.join(twice)} (from --spec "
                       f"{', '.join(str(p) for p, s in zip(paths, specs, strict=True) if s.name in twice)})",
                       EXIT_USAGE)
    reserved = {EVAL_FILE, LOCK_FILE, REPLAYED_SPECS}
    for path, spec in zip(paths, specs, strict=True):
        if spec.name in reserved or spec.name.startswith("."):
            raise CliError(f"{path}: benchmark name {spec.name!r} is a file of the run directory itself; rename it",
                           EXIT_USAGE)
    for spec in specs:
        load_samples(spec)  # a DataError names file and line (exit code 2)
    return specs


async def require_servers(client: Any, model: str, revision: str | None, wait_s: float | None) -> None:
    """Refuse a model no registered server serves before anything is written, or wait up to `wait_s` for one
    to register. Servers that are registered but down still count: the run waits for them as it would."""
    deadline = time.monotonic() + (wait_s or 0.0)
    while True:
        snapshot = await client.snapshot()
        if snapshot.filter(model=model, revision=revision, routable_only=False).entries:
            return
        if time.monotonic() >= deadline:
            served = sorted({e.record.model for e in snapshot.entries})
            rev = f" revision {revision!r}" if revision else ""
            waited = f" after waiting {wait_s:g} s" if wait_s else ""
            raise CliError(
                f"no registered server serves model {model!r}{rev}{waited} (the pool serves: "
                f"{', '.join(served) or 'nothing'}); register one, or pass --wait-for-servers SECONDS",
                EXIT_UNAVAILABLE)
        await asyncio.sleep(min(1.0, max(0.05, deadline - time.monotonic())))


def cmd_eval_replay(args: opt.EvalReplayOptions) -> int:
    from fedpool.pipeline.artifact import write_json_atomic
    from fedpool.pipeline.reproduce import replay_specs

    source = args.artifact.resolve()
    saved = replay_specs(source)  # an ArtifactError names what is wrong with it (exit code 2)
    before = _read_plan(source) if (source / EVAL_FILE).exists() else {}
    models = {(b.config.get("model"), b.config.get("revision")) for b in saved}
    if len(models) != 1:
        raise CliError(f"{source}: its benchmarks were run against different models {sorted(map(str, models))}",
                       EXIT_USAGE)
    (model, revision), = models
    if not isinstance(model, str):
        raise CliError(f"{source}: its configuration names no model", EXIT_USAGE)
    out = args.out.resolve()
    _refuse_existing_run(out)
    client = registry_client(args)
    asyncio.run(require_servers(client, model, revision, args.wait_for_servers))
    with _owned(out, "fedpool eval replay"):
        _refuse_existing_run(out)
        spec_dir = out / REPLAYED_SPECS  # the specs as saved, so `fedpool eval resume` works on the replay too
        paths = []
        for b in saved:
            path = spec_dir / f"{b.spec.name}.json"
            write_json_atomic(path, b.spec.model_dump(mode="json"))
            paths.append(str(path))
        plan = {"specs": paths, "model": model, "revision": revision,
                "policy": before.get("policy", "capacity_weighted"), "concurrency": before.get("concurrency", 64),
                "limit": None, "replay_of": str(source), "client_order": before.get("client_order", "fair"),
                "planned": before.get("planned", False)}
        write_json_atomic(out / EVAL_FILE, plan)
        return _run_eval(args, out, plan, [b.spec for b in saved], client)


def cmd_eval_rescore(args: opt.EvalRescoreOptions) -> int:
    from fedpool.pipeline import load_spec
    from fedpool.pipeline.reproduce import benchmark_dirs, load_saved, rescoring_spec

    # An ArtifactError or a SpecError names its culprit (exit code 2).
    saved = [load_saved(d, check_data=False) for d in benchmark_dirs(args.artifact)]
    new_specs = {s.name: s for s in (load_spec(p) for p in args.spec)}
    unknown = sorted(set(new_specs) - {b.spec.name for b in saved})
    if unknown:
        raise CliError(f"--spec for {', '.join(unknown)}: not a benchmark of {args.artifact}", EXIT_USAGE)
    use = [rescoring_spec(b.spec, new_specs.get(b.spec.name)) for b in saved]
    out = args.out.resolve()
    if any((out / spec.name).exists() for spec in use):
        raise CliError(f"{out} already holds a rescore of these benchmarks; use another --out", EXIT_USAGE)
    needs_judge = any(spec.verifier for spec in use)
    if needs_judge:
        from fedpool.deploy.localpool import init_local_ray

        init_local_ray()
    summaries = asyncio.run(_rescore_all(saved, use, out, args, needs_judge))
    emit(args, {"out": str(out), "benchmarks": summaries}, lambda _: "\n".join(
        f"{s['benchmark']}: {s['records']} records rescored ({s['failed']} failed); {scores(s)}; "
        f"{out / s['benchmark']}" for s in summaries))
    return EXIT_OK


async def _rescore_all(saved: list[Any], use: list[Any], out: Path, args: opt.EvalRescoreOptions,
                       needs_judge: bool) -> list[dict[str, Any]]:
    from fedpool.pipeline.reproduce import rescore_benchmark

    verifier = verifier_pool(args) if needs_judge else None
    try:
        if verifier is not None:
            await verifier.ready()
        judge = verifier.judge if verifier is not None else None
        return list(await asyncio.gather(*(rescore_benchmark(b, out, spec=s, judge=judge) for b, s in zip(
            saved, use, strict=True))))
    finally:
        if verifier is not None:
            verifier.shutdown()


def verifier_pool(args: opt.VerifierOptions) -> Any:
    from fedpool.deploy.models import ensure_gemma
    from fedpool.pipeline.verifier import VerifierConfig, VerifierPool

    model = args.verifier_model or ensure_gemma()
    try:
        return VerifierPool(VerifierConfig(model_path=str(model), actors=args.verifier_actors,
                                           threads=args.verifier_threads))
    except FileNotFoundError as exc:
        raise CliError(f"--verifier-model: {exc}", EXIT_USAGE) from None


def scores(summary: dict[str, Any]) -> str:
    """A benchmark's scores on one line: `exact_match 61.7, f1 70.2`."""
    return ", ".join(f"{x['metric']} {x['value']:.1f}" for x in summary["scores"])


def _run_eval(args: opt.PoolEvalOptions, out: Path, plan: dict[str, Any], specs: list[Any], client: Any, *,
              retry_failed: bool = False) -> int:
    """Runs the evals; exit code 0 when every record has a prediction, EXIT_INCOMPLETE when some failed (their
    errors are in the records; `fedpool eval resume` runs them again)."""
    from fedpool.clients import EvalTarget
    from fedpool.clients.poolrun import run_evals_through_pool
    from fedpool.federation import DispatchConfig

    dispatch = DispatchConfig(client_order=plan.get("client_order", "fair"), no_server_timeout_s=args.no_server_timeout)
    policy = "planned" if plan.get("planned") else plan["policy"]  # runs saved before `planned` was a policy
    summaries = asyncio.run(run_evals_through_pool(
        client, specs, out, EvalTarget(model=plan["model"], revision=plan["revision"]), policy=policy,
        dispatch=dispatch, concurrency=plan["concurrency"], verifier=lambda: verifier_pool(args),
        media_actors=args.media_actors, metric_actors=args.metric_actors, progress="quiet" if args.quiet else "auto",
        retry_failed=retry_failed, run_info={"policy": plan["policy"], "concurrency": plan["concurrency"],
                                             "client_order": dispatch.client_order, "planned": policy == "planned"}))
    rows = {s.benchmark: {**s.summary, "artifact_dir": str(s.artifact_dir), "written_now": s.written}
            for s in summaries}
    emit(args, {"run_dir": str(out), "benchmarks": rows}, lambda _: "\n".join(
        f"{s.benchmark}: {s.summary['records']} records ({s.resumed} from before, {s.written} now, "
        f"{s.summary['failed']} failed); {scores(s.summary)}; {s.artifact_dir}" for s in summaries))
    failed = sum(s.summary["failed"] for s in summaries)
    if failed:
        print(f"fedpool: {failed} record(s) failed; `fedpool eval resume {out}` runs them again", file=sys.stderr)
        return EXIT_INCOMPLETE
    return EXIT_OK
