"""`fedpool eval run | resume | replay | rescore`: evaluations through the pool, and their artifacts."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from fedpool.cli_support import EXIT_OK, EXIT_USAGE, CliError, registry_client

EVAL_FILE = "eval.json"

def cmd_eval_run(args: argparse.Namespace) -> int:
    from fedpool.pipeline.artifact import write_json_atomic

    plan = {
        "specs": [str(p.resolve()) for p in args.spec], "model": args.model, "revision": args.revision,
        "policy": "planned" if args.planned else args.policy, "concurrency": args.concurrency, "limit": args.limit,
        "client_order": args.client_order, "planned": args.planned or args.policy == "planned",
    }
    out = args.out.resolve()
    if (out / EVAL_FILE).exists():
        raise CliError(f"{out} already holds a run; use `fedpool eval resume {out}` or another --out", EXIT_USAGE)
    specs = _load_eval_specs(plan)  # bad specs stop here, before anything is written
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / EVAL_FILE, plan)
    return _run_eval(args, out, plan, specs)


def cmd_eval_resume(args: argparse.Namespace) -> int:
    out = args.run_dir.resolve()
    try:
        plan = json.loads((out / EVAL_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(f"{out} has no {EVAL_FILE}: not a directory made by `fedpool eval run`", EXIT_USAGE) from None
    return _run_eval(args, out, plan, _load_eval_specs(plan))


def _load_eval_specs(plan: dict[str, Any]) -> list[Any]:
    from fedpool.demo import load_specs

    return load_specs(tuple(Path(p) for p in plan["specs"]), plan.get("limit"))


def cmd_eval_replay(args: argparse.Namespace) -> int:
    from fedpool.pipeline.artifact import write_json_atomic
    from fedpool.pipeline.errors import ArtifactError
    from fedpool.pipeline.reproduce import replay_specs

    source = args.artifact.resolve()
    try:
        saved = replay_specs(source)
        plan_file = source / EVAL_FILE
        before = json.loads(plan_file.read_text(encoding="utf-8")) if plan_file.exists() else {}
    except ArtifactError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    models = {(b.config.get("model"), b.config.get("revision")) for b in saved}
    if len(models) != 1:
        raise CliError(f"{source}: its benchmarks were run against different models {sorted(map(str, models))}",
                       EXIT_USAGE)
    (model, revision), = models
    out = args.out.resolve()
    if (out / EVAL_FILE).exists():
        raise CliError(f"{out} already holds a run; replay into a new --out", EXIT_USAGE)
    spec_dir = out / "replayed-specs"  # the specs as saved, so `fedpool eval resume` works on the replay too
    spec_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for b in saved:
        path = spec_dir / f"{b.spec.name}.json"
        write_json_atomic(path, b.spec.model_dump(mode="json"))
        paths.append(str(path))
    plan = {"specs": paths, "model": model, "revision": revision, "policy": before.get("policy", "capacity_weighted"),
            "concurrency": before.get("concurrency", 64), "limit": None, "replay_of": str(source),
            "client_order": before.get("client_order", "fair"), "planned": before.get("planned", False)}
    write_json_atomic(out / EVAL_FILE, plan)
    return _run_eval(args, out, plan, [b.spec for b in saved])


def cmd_eval_rescore(args: argparse.Namespace) -> int:
    from fedpool.pipeline import load_spec
    from fedpool.pipeline.errors import ArtifactError, SpecError
    from fedpool.pipeline.reproduce import benchmark_dirs, load_saved, rescoring_spec

    try:
        saved = [load_saved(d, check_data=False) for d in benchmark_dirs(args.artifact)]
        new_specs = {s.name: s for s in (load_spec(p) for p in args.spec)}
        unknown = sorted(set(new_specs) - {b.spec.name for b in saved})
        if unknown:
            raise CliError(f"--spec for {', '.join(unknown)}: not a benchmark of {args.artifact}", EXIT_USAGE)
        use = [rescoring_spec(b.spec, new_specs.get(b.spec.name)) for b in saved]
    except (ArtifactError, SpecError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    out = args.out.resolve()
    if any((out / spec.name).exists() for spec in use):
        raise CliError(f"{out} already holds a rescore of these benchmarks; use another --out", EXIT_USAGE)
    needs_judge = any(spec.verifier for spec in use)
    if needs_judge:
        from fedpool.deploy.localpool import init_local_ray

        init_local_ray()
    summaries = asyncio.run(_rescore_all(saved, use, out, args, needs_judge))
    if args.json:
        print(json.dumps({"out": str(out), "benchmarks": summaries}, indent=2, default=str))
    else:
        for summary in summaries:
            scores = ", ".join(f"{x['metric']} {x['value']:.1f}" for x in summary["scores"])
            print(f"{summary['benchmark']}: {summary['records']} records rescored ({summary['failed']} failed); "
                  f"{scores}; {out / summary['benchmark']}")
    return EXIT_OK


async def _rescore_all(saved: list[Any], use: list[Any], out: Path, args: argparse.Namespace,
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


def verifier_pool(args: argparse.Namespace) -> Any:
    from fedpool.deploy.models import ensure_gemma
    from fedpool.pipeline.verifier import VerifierConfig, VerifierPool

    model = args.verifier_model or ensure_gemma()
    try:
        return VerifierPool(VerifierConfig(model_path=str(model), actors=args.verifier_actors,
                                           threads=args.verifier_threads))
    except FileNotFoundError as exc:
        raise CliError(f"--verifier-model: {exc}", EXIT_USAGE) from None


def _run_eval(args: argparse.Namespace, out: Path, plan: dict[str, Any], specs: list[Any]) -> int:
    client = registry_client(args)
    summaries = asyncio.run(_eval_through_pool(client, out, plan, specs, args))
    rows = {s.benchmark: {**s.summary, "artifact_dir": str(s.artifact_dir), "written_now": s.written}
            for s in summaries}
    if args.json:
        print(json.dumps({"run_dir": str(out), "benchmarks": rows}, indent=2, default=str))
    else:
        for s in summaries:
            scores = ", ".join(f"{x['metric']} {x['value']:.1f}" for x in s.summary["scores"])
            print(f"{s.benchmark}: {s.summary['records']} records ({s.resumed} from before, {s.written} now, "
                  f"{s.summary['failed']} failed); {scores}; {s.artifact_dir}")
    return EXIT_OK


async def _eval_through_pool(
    client: Any, out: Path, plan: dict[str, Any], specs: list[Any], args: argparse.Namespace
) -> list[Any]:
    from fedpool.clients import EvalTarget, run_evals
    from fedpool.federation import DispatchConfig, PoolConnection
    from fedpool.pipeline.media import MediaPool
    from fedpool.progress import ProgressView

    verifier = verifier_pool(args) if any(s.verifier for s in specs) else None
    # Images, audio and video frames are read and encoded on Ray CPU actors, ahead of the requests.
    media = MediaPool(getattr(args, "media_actors", 2), num_cpus=0.5) if any(s.prompt.media for s in specs) else None
    try:
        await asyncio.gather(*(x.ready() for x in (verifier, media) if x is not None))
        dispatch = DispatchConfig(client_order=plan.get("client_order", "fair"))
        policy = "planned" if plan.get("planned") else plan["policy"]  # runs saved before `planned` was a policy
        async with PoolConnection(client, policy=policy, config=dispatch) as pool:
            view = ProgressView(pool.dispatcher, mode="quiet" if getattr(args, "quiet", False) else "auto")
            async with view:
                return await run_evals(
                    specs, pool.dispatcher, out, EvalTarget(model=plan["model"], revision=plan["revision"]),
                    concurrency=plan["concurrency"], verifier=verifier, media=media, on_progress=view.update,
                    run_info={"policy": plan["policy"], "concurrency": plan["concurrency"],
                              "client_order": dispatch.client_order, "planned": policy == "planned"})
    finally:
        for pool_of_actors in (verifier, media):
            if pool_of_actors is not None:
                pool_of_actors.shutdown()
