"""The jobs service: evaluation jobs submitted over HTTP (`api`), kept in SQLite (`store`), run over the pool's
dispatcher (`runner`), and its Python clients (`client`). It runs evals, so it sits beside the eval clients."""

from fedpool.clients.jobs.api import JobsApi, ensure_jobs_token, openapi_document
from fedpool.clients.jobs.client import AsyncJobsClient, JobsApiError, JobsClient
from fedpool.clients.jobs.runner import JobRunner, resolve_specs
from fedpool.clients.jobs.store import Job, JobRequest, JobStore

__all__ = ["AsyncJobsClient", "Job", "JobRequest", "JobRunner", "JobStore", "JobsApi", "JobsApiError", "JobsClient",
           "ensure_jobs_token", "openapi_document", "resolve_specs"]
