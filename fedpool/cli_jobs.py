"""`fedpool jobs submit | list | show | cancel | logs`: evaluations as jobs on a `fedpool gateway --jobs`."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedpool.cli_support import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError, emit
from fedpool.options import JobOptions, JobsClientOptions, JobsSubmitOptions


def _jobs_client(args: JobsClientOptions) -> Any:
    from fedpool.clients.jobs.client import JobsClient

    token = args.jobs_token.get_secret_value() if args.jobs_token else None  # FEDPOOL_JOBS_TOKEN
    path = args.jobs_token_file or Path("~/.fedpool/jobs/jobs.token").expanduser()
    if args.jobs_token_file or not token:
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError:
            raise CliError(f"no jobs token: {path} is not readable; pass --jobs-token-file or set "
                           "FEDPOOL_JOBS_TOKEN", EXIT_USAGE) from None
    return JobsClient(args.url, token)


def _jobs_call(fn: Callable[[], Any], url: str) -> Any:
    from fedpool.clients.jobs.client import JobsApiError

    try:
        return fn()
    except JobsApiError as exc:
        code = EXIT_USAGE if exc.status == 400 else EXIT_FAILED
        raise CliError(f"jobs server: {exc.message}", code) from None
    except OSError as exc:
        raise CliError(f"cannot reach the jobs server at {url} ({exc}); start it with `fedpool jobs serve`",
                       EXIT_UNAVAILABLE) from None


def cmd_jobs_submit(args: JobsSubmitOptions) -> int:
    from fedpool.pipeline import load_spec

    specs = []
    for path in args.spec:
        spec = load_spec(path)  # a SpecError names file and field (exit code 2)
        raw = spec.model_dump(mode="json")
        raw["data"]["path"] = str(spec.data_path().resolve())  # the server has no spec file to resolve against
        specs.append(raw)
    client = _jobs_client(args)
    job = _jobs_call(lambda: client.submit(args.model, specs=specs, revision=args.revision,
                                           concurrency=args.concurrency, limit=args.limit, name=args.name), args.url)
    if args.wait:  # each change of state or progress on stderr (stdout: the job at the end)
        job = _jobs_call(lambda: client.wait(job["id"], on_progress=lambda j: print(
            f"fedpool: {_job_line(j)}", file=sys.stderr, flush=True)), args.url)
    emit(args, job, _job_text)
    return EXIT_OK if not args.wait or job["state"] == "done" else EXIT_FAILED


def cmd_jobs_list(args: JobsClientOptions) -> int:
    jobs = _jobs_call(_jobs_client(args).list, args.url)
    emit(args, {"jobs": jobs}, lambda _: "\n".join([JOBS_HEADER, *map(_job_line, jobs)]) if jobs else
         "(no jobs; submit one with `fedpool jobs submit`)")
    return EXIT_OK


def cmd_jobs_logs(args: JobOptions) -> int:
    text = _jobs_call(lambda: _jobs_client(args).logs(args.job_id), args.url)
    print(json.dumps({"id": args.job_id, "log": text}) if args.json_output else text,
          end="\n" if args.json_output else "")
    return EXIT_OK


def cmd_jobs_show(args: JobOptions) -> int:
    emit(args, _jobs_call(lambda: _jobs_client(args).get(args.job_id), args.url), _job_text)
    return EXIT_OK


def cmd_jobs_cancel(args: JobOptions) -> int:
    emit(args, _jobs_call(lambda: _jobs_client(args).cancel(args.job_id), args.url), _job_text)
    return EXIT_OK


JOBS_HEADER = f"{'ID':<12}  {'STATE':<9}  {'DONE/TOTAL':>11}  MODEL  NAME"


def _job_line(job: dict[str, Any]) -> str:
    done = sum(p.get("done", 0) for p in job["progress"].values())
    total = sum(p.get("total", 0) for p in job["progress"].values())
    progress = f"{done}/{total}" if total else "-"
    return f"{job['id']}  {job['state']:<9}  {progress:>11}  {job['model']}  {job.get('name') or ''}".rstrip()


def _job_text(job: dict[str, Any]) -> str:
    lines = [_job_line(job), f"  artifacts: {job['artifact_dir']}"]
    for bench, p in job["progress"].items():
        lines.append(f"  {bench}: {p.get('done')}/{p.get('total')} done, {p.get('failed')} failed")
    for bench, s in job["scores"].items():
        lines.append(f"  {bench}: " + ", ".join(f"{x['metric']} {x['value']:.1f} [{x['ci_low']:.1f}, "
                                                 f"{x['ci_high']:.1f}]" for x in s["scores"]))
    if job.get("error"):
        lines.append(f"  error: {job['error']}")
    return "\n".join(lines)
