"""fedpool's Ray-based registry of inference servers. Public names only; other rooms import these."""

from fedpool.registry.actor import NAMESPACE, REGISTRY_NAME, RegistryConfig
from fedpool.registry.adapters import EngineAdapter, MetricsParseError, adapter_for
from fedpool.registry.client import RegistryClient, SnapshotWatcher
from fedpool.registry.errors import AuthError, RegistrationError, RegistryError, UnknownServerError
from fedpool.registry.leases import (
    ClientDemand,
    DemandReport,
    Lease,
    LeaseBroker,
    LeaseServer,
    LeaseService,
    ModelDemand,
)
from fedpool.registry.records import Engine, ServerRecord
from fedpool.registry.snapshot import LoadSample, PoolSnapshot, ProbeResult, ServerEntry, ServerStatus
from fedpool.registry.weights import ACCELERATOR_ROOFLINE, ACCELERATOR_SPEED, accelerator_roofline, prior_weight

__all__ = [
    "ACCELERATOR_ROOFLINE",
    "ACCELERATOR_SPEED",
    "NAMESPACE",
    "REGISTRY_NAME",
    "AuthError",
    "ClientDemand",
    "DemandReport",
    "Engine",
    "EngineAdapter",
    "Lease",
    "LeaseBroker",
    "LeaseServer",
    "LeaseService",
    "LoadSample",
    "MetricsParseError",
    "ModelDemand",
    "PoolSnapshot",
    "ProbeResult",
    "RegistrationError",
    "RegistryClient",
    "RegistryConfig",
    "RegistryError",
    "ServerEntry",
    "ServerRecord",
    "ServerStatus",
    "SnapshotWatcher",
    "UnknownServerError",
    "accelerator_roofline",
    "adapter_for",
    "prior_weight",
]
