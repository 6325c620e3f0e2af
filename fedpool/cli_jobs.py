"""Work handed to the pool's service: `fedpool jobs submit | list | show | cancel | logs` (evaluations as jobs on a
`fedpool gateway --jobs-dir`) and `fedpool batch submit | list | show | cancel | download` (OpenAI Batch API batches
on a gateway's `--batches-dir`, `fedpool up`'s too)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpool import options as opt
from fedpool.cli_support import EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError, emit

if TYPE_CHECKING:
    from fedpool.clients.batchclient import BatchClient


def _jobs_client(args: opt.JobsClientOptions) -> Any:
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


def cmd_jobs_submit(args: opt.JobsSubmitOptions) -> int:
    from fedpool.clients.jobs.client import job_line
    from fedpool.pipeline import load_spec

    specs = []
    for path in args.spec:
        spec = load_spec(path)  # a SpecError names file and field (exit code 2)
        raw = spec.model_dump(mode="json")
        raw["data"]["path"] = str(spec.data_path().resolve())  # the server has no spec file to resolve against
        specs.append(raw)
    client = _jobs_client(args)
    job = client.submit(args.model, specs=specs, revision=args.revision, concurrency=args.concurrency,
                        limit=args.limit, name=args.name)  # refusals and a server not there: cli._exit_code
    if args.wait:  # each change of state or progress on stderr (stdout: the job at the end)
        job = client.wait(job["id"], on_progress=lambda j: print(f"fedpool: {job_line(j)}", file=sys.stderr,
                                                                 flush=True))
    _show(args, job)
    return EXIT_OK if not args.wait or job["state"] == "done" else EXIT_FAILED


def cmd_jobs_list(args: opt.JobsClientOptions) -> int:
    from fedpool.clients.jobs.client import jobs_text

    emit(args, {"jobs": _jobs_client(args).list()}, jobs_text)
    return EXIT_OK


def cmd_jobs_logs(args: opt.JobOptions) -> int:
    text = _jobs_client(args).logs(args.job_id)
    print(json.dumps({"id": args.job_id, "log": text}) if args.json_output else text,
          end="\n" if args.json_output else "")
    return EXIT_OK


def cmd_jobs_show(args: opt.JobOptions) -> int:
    return _show(args, _jobs_client(args).get(args.job_id))


def cmd_jobs_cancel(args: opt.JobOptions) -> int:
    return _show(args, _jobs_client(args).cancel(args.job_id))


def _show(args: opt.JobsClientOptions, job: dict[str, Any]) -> int:
    from fedpool.clients.jobs.client import job_text

    emit(args, job, job_text)
    return EXIT_OK


def _batch_client(args: opt.BatchClientOptions) -> BatchClient:
    """The gateway at --url, else the one the `fedpool up` of --state-dir serves; as the caller's key or name."""
    from fedpool.clients.batchclient import BatchClient
    from fedpool.deploy.updir import locate_pool

    url = args.url or locate_pool(args.state_dir, opt.RayOptions.model_fields["state_dir"].default,
                                  opt.UpOptions.model_fields["state_dir"].default).gateway_url
    if url is None:
        raise CliError(f"no gateway: no `fedpool up` is up from {args.state_dir}; pass --url (`fedpool up`'s base "
                       "URL, or a `fedpool gateway --batches-dir DIR`'s) or that pool's --state-dir", EXIT_UNAVAILABLE)
    return BatchClient(url, api_key=args.api_key.get_secret_value() if args.api_key else None, client_name=args.client)


def cmd_batch_submit(args: opt.BatchSubmitOptions) -> int:
    from fedpool.clients.batchclient import ProgressBar, key_values, outcome, submit_notes

    client = _batch_client(args)
    batch = client.submit(args.file, args.endpoint, args.completion_window, key_values(args.metadata))
    for note in submit_notes(batch, args.wait):
        print(f"fedpool: {note}", file=sys.stderr, flush=True)
    if args.wait:
        batch = client.wait(batch["id"], ProgressBar())
    _show_batch(args, batch)  # (with --wait, 0 only when every request was answered)
    return {"completed": EXIT_OK, "running": EXIT_OK, "incomplete": EXIT_INCOMPLETE}.get(outcome(batch), EXIT_FAILED)


def cmd_batch_list(args: opt.BatchClientOptions) -> int:
    from fedpool.clients.batchclient import list_text

    emit(args, {"batches": _batch_client(args).every()}, list_text)
    return EXIT_OK


def cmd_batch_show(args: opt.BatchOptions) -> int:
    return _show_batch(args, _batch_client(args).get(args.batch_id))


def cmd_batch_cancel(args: opt.BatchOptions) -> int:
    return _show_batch(args, _batch_client(args).cancel(args.batch_id))


def cmd_batch_download(args: opt.BatchDownloadOptions) -> int:
    written = _batch_client(args).download(args.batch_id, args.out.expanduser())
    emit(args, written, lambda w: "\n".join(f"{kind}: {path}" for kind, path in w.items()))
    return EXIT_OK


def _show_batch(args: opt.BatchClientOptions, batch: dict[str, Any]) -> int:
    from fedpool.clients.batchclient import batch_text

    emit(args, batch, batch_text)
    return EXIT_OK
