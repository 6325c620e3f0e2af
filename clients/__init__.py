"""Async evaluation clients: one benchmark run becomes a stream of requests and a stream of records."""

from fedpool.clients.eval_client import EvalProgress, EvalRun, EvalSummary, EvalTarget
from fedpool.clients.runner import run_evals

__all__ = ["EvalProgress", "EvalRun", "EvalSummary", "EvalTarget", "run_evals"]
