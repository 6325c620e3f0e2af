"""`fedpool eval run | resume | replay | rescore`: evaluations through the pool, and their artifacts."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpool import options as opt
from fedpool.cli_support import EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE, CliError, ask, connect_ray, emit, pool_registry

if TYPE_CHECKING:
    from fedpool.clients.rundir import RunPlan
    from fedpool.pipeline.verifier import VerifierPool


def cmd_eval_run(args: opt.EvalRunOptions) -> int:
    from fedpool.clients.rundir import RunPlan, check_specs, owned, refuse_existing_run

    out = args.out.resolve()
    plan = RunPlan(specs=[str(p.resolve()) for p in args.spec], model=args.model, revision=args.revision,
                   policy="planned" if args.planned else args.policy, concurrency=args.concurrency, limit=args.limit,
                   client_order=args.client_order, planned=args.planned or args.policy == "planned",
                   pool=_pool_given(args))
    # Every input is checked before anything is written: a refused run leaves nothing behind.
    refuse_existing_run(out)
    specs = check_specs([Path(p) for p in plan.specs], plan.limit, given=args.spec)
    client, holder = _reach_pool(args, plan, specs)
    with owned(out, "fedpool eval run"):
        refuse_existing_run(out)  # another run may have started here meanwhile
        plan.write(out)
        return _run_eval(args, out, plan, specs, client, holder=holder)


def cmd_eval_resume(args: opt.EvalResumeOptions) -> int:
    from fedpool.clients.rundir import RunPlan, check_specs, owned

    out = args.run_dir.resolve()
    with owned(out, "fedpool eval resume"):
        plan = RunPlan.read(out)
        if not _pool_given(args):  # no pool flag given: the pool the run was given
            args = args.model_copy(update=plan.pool_settings())
        specs = check_specs([Path(p) for p in plan.specs], plan.limit)
        client, holder = _reach_pool(args, plan, specs)
        return _run_eval(args, out, plan, specs, client, retry_failed=not args.keep_failed, holder=holder)


def _reach_pool(args: opt.PoolEvalOptions, plan: RunPlan, specs: list[Any], announce: bool = True
                ) -> tuple[Any, str | None]:
    """The registry, once some registered server serves the plan's model (NoServerError, before anything is
    written, when none does), and this process's name at the lease broker, to which it announced its evals, each
    loading: known to the broker before the run's heavier start-up, they keep their loading shares when it asks."""
    from fedpool.clients.delegate import check_gateway
    from fedpool.clients.rundir import require_servers
    from fedpool.registry import holder_id, loading_report

    if args.gateway is not None:  # (the gateway's pool: no registry, no lease of this process's own)
        return check_gateway(args.gateway, args.api_key, plan.model, args.wait_for_servers), None  # (as the client)
    client, holder = pool_registry(args), holder_id() if announce else None
    report = None if holder is None else loading_report(holder, plan.model, ((s.name, s.at_once(plan.concurrency))
                                                                             for s in specs))
    asyncio.run(require_servers(client, plan.model, plan.revision, args.wait_for_servers, announce=report))
    return client, holder


def _pool_given(args: opt.PoolEvalOptions) -> dict[str, str]:
    """The flags pointing at the pool that the command was given (clients/rundir.py's POOL_FLAGS)."""
    from fedpool.clients.rundir import POOL_FLAGS, pool_flags_given

    return pool_flags_given({k: getattr(args, k) for k in POOL_FLAGS},
                            {k: opt.PoolEvalOptions.model_fields[k].default for k in POOL_FLAGS})


def cmd_eval_replay(args: opt.EvalReplayOptions) -> int:
    from fedpool.clients.rundir import owned, refuse_existing_run, replay_plan, write_replayed_specs
    from fedpool.pipeline.reproduce import replay_specs

    source, out = args.artifact.resolve(), args.out.resolve()
    saved = replay_specs(source)  # an ArtifactError names what is wrong with it (exit code 2)
    plan = replay_plan(source, saved, out).model_copy(update={"pool": _pool_given(args)})
    refuse_existing_run(out)
    client, _ = _reach_pool(args, plan, [], announce=False)
    with owned(out, "fedpool eval replay"):
        refuse_existing_run(out)
        write_replayed_specs(out, saved)
        plan.write(out)
        return _run_eval(args, out, plan, [b.spec for b in saved], client)


def cmd_eval_rescore(args: opt.EvalRescoreOptions) -> int:
    from fedpool.pipeline import load_spec
    from fedpool.pipeline.reproduce import rescore_all, rescore_plan

    out = args.out.resolve()
    plan = rescore_plan(args.artifact, [load_spec(p) for p in args.spec], out)  # errors name the culprit (exit 2)
    if any(spec.verifier for _, spec in plan):
        from fedpool.deploy.localpool import init_local_ray

        init_local_ray()
    summaries = asyncio.run(rescore_all(plan, out, lambda: verifier_pool(args)))
    emit(args, {"out": str(out), "benchmarks": summaries}, lambda _: "\n".join(
        f"{s['benchmark']}: {s['records']} records rescored ({s['failed']} failed); "
        + ", ".join(f"{x['metric']} {x['value']:.1f}" for x in s["scores"]) + "; "
        f"{out / s['benchmark']}" for s in summaries))
    return EXIT_OK


def verifier_pool(args: opt.VerifierOptions, default_model: Path | None = None,
                  shares_engine_cores: bool = False) -> VerifierPool:
    """The judges of specs with `verifier: true`: --verifier-model, else `default_model` or the bundled Gemma."""
    from fedpool.deploy.models import ensure_gemma
    from fedpool.pipeline.verifier import VerifierConfig, VerifierPool

    model = args.verifier_model or ensure_gemma(default_model)
    try:
        return VerifierPool(VerifierConfig(model_path=str(model), actors=args.verifier_actors,
                                           threads=args.verifier_threads, shares_engine_cores=shares_engine_cores))
    except FileNotFoundError as exc:
        raise CliError(f"--verifier-model: {exc}", EXIT_USAGE) from None


def _run_eval(args: opt.PoolEvalOptions, out: Path, plan: RunPlan, specs: list[Any], client: Any, *,
              retry_failed: bool = False, holder: str | None = None) -> int:
    """Runs the evals; exit code 0 when every record has a prediction, EXIT_INCOMPLETE when some failed (their
    errors are in the records; `fedpool eval resume` runs them again)."""
    from fedpool.clients import EvalTarget
    from fedpool.clients.poolrun import run_evals_through_pool
    from fedpool.clients.report import RunReport
    from fedpool.clients.rundir import failed_records_hint
    from fedpool.federation import DispatchConfig

    dispatch = DispatchConfig(client_order=plan.client_order, no_server_timeout_s=args.no_server_timeout)
    started = time.monotonic()
    summaries = ask(client, lambda c: run_evals_through_pool(
        c, specs, out, EvalTarget(model=plan.model, revision=plan.revision), policy=plan.routing, dispatch=dispatch,
        concurrency=plan.concurrency, verifier=lambda: verifier_pool(args), media_actors=args.media_actors,
        metric_actors=args.metric_actors, progress="quiet" if args.quiet else "auto", retry_failed=retry_failed,
        join_ray=lambda: connect_ray(args), holder=holder, gateway=c if args.gateway is not None else None,
        run_info={"policy": plan.policy, "concurrency": plan.concurrency, "client_order": plan.client_order,
                  "planned": plan.routing == "planned", "gateway": args.gateway}))
    report = RunReport(out, time.monotonic() - started, tuple(summaries))
    emit(args, report.as_json(), lambda _: report.text())
    failed = sum(s.summary["failed"] for s in summaries)
    if failed:
        hint = failed_records_hint([s.summary["errors"] for s in summaries], failed, plan.resume_command(out))
        print(f"fedpool: {hint}", file=sys.stderr)
        return EXIT_INCOMPLETE
    return EXIT_OK
