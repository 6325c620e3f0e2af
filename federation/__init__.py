"""Routing, admission, retries and failover over the registry's snapshots."""

from fedpool.federation.dispatch_types import DispatchConfig, DispatcherStats, ServerStats
from fedpool.federation.dispatcher import Dispatcher
from fedpool.federation.errors import AttemptError, FailureKind, NoServerError, RequestFailed
from fedpool.federation.policies import Candidate, Policy, RouteContext, RouteDecision, make_policy, policy_names
from fedpool.federation.pool import PoolConnection
from fedpool.federation.transport import Timeouts, new_session, post_completion
from fedpool.federation.types import Attempt, Completion, Endpoint, InferenceRequest, InferenceResult

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
