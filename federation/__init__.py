"""Routing, admission, retries and failover over the registry's snapshots."""

from fedpool.federation.dispatch_types import DispatchConfig, DispatcherStats, ServerStats
from fedpool.federation.dispatcher import Dispatcher
from fedpool.federation.errors import AttemptError, FailureKind, NoServerError, RequestFailed
from fedpool.federation.finish import EarliestFinish  # registers the `earliest_finish` policy
from fedpool.federation.planner import PlannedRouting  # registers the `planned` policy
from fedpool.federation.policies import (
    Candidate,
    Hold,
    Policy,
    ServerView,
    make_policy,
    policy_names,
    prepare_policy,
)
from fedpool.federation.pool import PoolConnection
from fedpool.federation.transport import HttpTransport, Timeouts, Transport, new_session, post_completion
from fedpool.federation.types import (
    Attempt,
    Completion,
    Endpoint,
    InferenceRequest,
    InferenceResult,
    SamplingParams,
)

__all__ = [
    "Attempt",
    "AttemptError",
    "Candidate",
    "Completion",
    "DispatchConfig",
    "Dispatcher",
    "DispatcherStats",
    "EarliestFinish",
    "Endpoint",
    "FailureKind",
    "Hold",
    "HttpTransport",
    "InferenceRequest",
    "InferenceResult",
    "NoServerError",
    "PlannedRouting",
    "Policy",
    "PoolConnection",
    "RequestFailed",
    "SamplingParams",
    "ServerStats",
    "ServerView",
    "Timeouts",
    "Transport",
    "make_policy",
    "new_session",
    "policy_names",
    "post_completion",
    "prepare_policy",
]
