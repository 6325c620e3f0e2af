"""Routing, admission, retries and failover over the registry's snapshots."""

from fedpool.federation.core.dispatcher import Dispatcher
from fedpool.federation.core.errors import AttemptError, FailureKind, NoServerError, RequestFailed
from fedpool.federation.core.policy import Candidate, Hold, Policy, ServerView
from fedpool.federation.core.types import (
    Attempt,
    Completion,
    DispatchConfig,
    DispatcherStats,
    Endpoint,
    InferenceRequest,
    InferenceResult,
    SamplingParams,
    ServerStats,
    Timeouts,
    Transport,
)
from fedpool.federation.gateway.pool import PoolConnection
from fedpool.federation.gateway.transport import HttpTransport, new_session, post_completion
from fedpool.federation.routing.finish import EarliestFinish  # registers the `earliest_finish` policy
from fedpool.federation.routing.planner import PlannedRouting  # registers the `planned` policy
from fedpool.federation.routing.policies import make_policy, policy_names, prepare_policy

# The registry's types in this room's interface: what `PoolConnection.snapshot` and `PoolConnection.holders` return.
from fedpool.registry import HolderView, PoolHolders, PoolSnapshot, ServerEntry

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
    "HolderView",
    "HttpTransport",
    "InferenceRequest",
    "InferenceResult",
    "NoServerError",
    "PlannedRouting",
    "Policy",
    "PoolConnection",
    "PoolHolders",
    "PoolSnapshot",
    "RequestFailed",
    "SamplingParams",
    "ServerEntry",
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
