"""Routing, admission, retries and failover over the registry's snapshots."""

from federation.dispatch_types import DispatchConfig, DispatcherStats, ServerStats
from federation.dispatcher import Dispatcher
from federation.errors import AttemptError, FailureKind, NoServerError, RequestFailed
from federation.policies import Candidate, Policy, RouteContext, RouteDecision, make_policy, policy_names
from federation.pool import PoolConnection
from federation.transport import Timeouts, new_session, post_completion
from federation.types import Attempt, Completion, Endpoint, InferenceRequest, InferenceResult

__all__ = [
    "Attempt",
    "AttemptError",
    "Candidate",
    "Completion",
    "DispatchConfig",
    "Dispatcher",
    "DispatcherStats",
    "Endpoint",
    "FailureKind",
    "InferenceRequest",
    "InferenceResult",
    "NoServerError",
    "Policy",
    "PoolConnection",
    "RequestFailed",
    "RouteContext",
    "RouteDecision",
    "ServerStats",
    "Timeouts",
    "make_policy",
    "new_session",
    "policy_names",
    "post_completion",
]
